"""The engine's pieces against plain references: stacked SGD, aggregation, executor."""


import numpy as np
import pytest
import torch
from torch.func import functional_call

from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.engine.executor import ClientExecutor
from splitfed.engine.optim import StackedSGD
from splitfed.models import build_model

from helpers import assert_clients_match_loop, assert_float_close


def test_local_step_counts_epochs_and_steps():
    sizes = np.array([100, 32, 5])
    assert local_step_counts(sizes, 32, 7, None).tolist() == [7, 7, 7]
    # K = ceil(D_n / B) * E (paper 002 Sec. 4.1)
    assert local_step_counts(sizes, 32, None, 2).tolist() == [8, 2, 2]


def test_batch_plan_covers_each_epoch_once():
    idx = np.arange(10, 20)
    plan = batch_plan(idx, steps=5, batch_size=4, rng=np.random.default_rng(0))
    assert plan.shape == (5, 4)
    flat = plan.reshape(-1)
    assert sorted(flat[:10]) == list(range(10, 20))      # first epoch: each sample once
    assert sorted(flat[10:20]) == list(range(10, 20))    # second epoch: again


def test_every_epoch_of_the_stream_is_freshly_shuffled():
    """batches.py module doc: a client's samples form a stream of FRESHLY shuffled epochs
    (each pass its own permutation, drawn in turn from the batches stream), not one
    order repeated; batches then differ from epoch to epoch, as SGD's reshuffling
    assumes."""
    idx = np.arange(10, 20)
    plan = batch_plan(idx, steps=15, batch_size=2, rng=np.random.default_rng(0))
    g = np.random.default_rng(0)
    want = idx[np.concatenate([g.permutation(10) for _ in range(3)])]
    assert plan.reshape(-1).tolist() == want.tolist()
    epochs = plan.reshape(3, 10)
    assert all(sorted(e) == list(range(10, 20)) for e in epochs.tolist())
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


def _torch_sgd(p0, grads, momentum, wd, dtype):
    """Per-client torch.optim.SGD in ``dtype``: the reference."""
    ref = [p0[c].to(dtype, copy=True).requires_grad_() for c in range(len(p0))]
    opts = [torch.optim.SGD([r], lr=0.1, momentum=momentum, weight_decay=wd) for r in ref]
    for gr in grads:
        for c, r in enumerate(ref):
            r.grad = gr[c].to(dtype)
            opts[c].step()
    return torch.stack([r.detach() for r in ref])


@pytest.mark.numerics
@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3)])
def test_stacked_sgd_matches_torch_sgd(momentum, wd):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(3, 4, generator=g)
    grads = [torch.randn(3, 4, generator=g) for _ in range(3)]
    stacked = p0.clone()
    opt = StackedSGD(momentum, wd)
    for gr in grads:
        opt.step([stacked], [gr], 0.1)
    ref32, ref64 = (_torch_sgd(p0, grads, momentum, wd, t) for t in (torch.float32,
                                                                     torch.float64))
    # each step adds a few terms per element (gradient, momentum, weight decay)
    assert_float_close(stacked, ref32, ref64, terms=3 * len(grads))


def test_delta_accumulator_hand_case():
    ref = {"w": torch.tensor([1.0, 2.0])}
    acc = DeltaAccumulator(ref)
    acc.add(torch.tensor([0.25, 0.75]), {"w": torch.tensor([[3.0, 2.0], [1.0, 6.0]])})
    # x + sum w (x_s - x) = [1 + .25*2 + 0, 2 + 0 + .75*4] = [1.5, 5]
    assert torch.allclose(acc.result()["w"], torch.tensor([1.5, 5.0]))
    # global learning rate scales the step
    assert torch.allclose(acc.result(0.5)["w"], torch.tensor([1.25, 3.5]))
    assert torch.equal(DeltaAccumulator(ref).result()["w"], ref["w"])   # empty: keep


# ResNet-18 in float64: in float32 a pre-activation within rounding error of zero can flip
# sides of the ReLU between channels_last and NCHW kernels, and SGD amplifies it.
@pytest.mark.numerics
@pytest.mark.parametrize("name,shape,dtype", [("lenet5", (1, 28, 28), torch.float32),
                                              ("mlp", (1, 8, 8), torch.float32),
                                              ("resnet18", (3, 32, 32), torch.float64)])
def test_executor_matches_per_client_loop(name, shape, dtype):
    torch.manual_seed(0)
    opts = {"width": 8} if name == "resnet18" else {}
    model = build_model(name, shape, 10, **opts).to(dtype)
    n = 60
    x = torch.randn(n, *shape, dtype=dtype)
    y = torch.randint(0, 10, (n,))
    parts = [np.arange(0, 20), np.arange(20, 35), np.arange(35, 60)]
    ex = ClientExecutor(model, x, y, parts, batch_size=4, chunk_size=2)
    ids = np.array([2, 0, 1])
    steps = np.array([3, 5, 2])          # unequal K exercises the prefix logic
    start = model.state_dict()
    plans = ex.plans(ids, steps, np.random.default_rng(1))
    results = list(ex.train(start, ids, steps, lr=0.05, rng=np.random.default_rng(1)))
    got = {}
    for r in results:
        for j, s in enumerate(r.slots):
            got[int(s)] = {k: v[j] for k, v in r.state.items()}
    assert_clients_match_loop(got, model, x, y, plans, 0.05, name)


def _mean_step_losses(model, x, y, plan, lr, dtype):
    """The mean over ``plan``'s steps of the minibatch loss before each plain SGD step,
    computed in ``dtype``."""
    import copy

    model, x = copy.deepcopy(model).to(dtype), x.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for rows in torch.from_numpy(plan):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def test_executor_loss_is_each_clients_mean_over_its_own_steps():
    """With unequal K in one chunk, a slot's training loss is the mean of its own K
    minibatch losses, not a sum over the chunk's longest run of steps."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    x, y = torch.randn(60, 1, 8, 8), torch.randint(0, 10, (60,))
    parts = [np.arange(0, 20), np.arange(20, 35), np.arange(35, 60)]
    ex = ClientExecutor(model, x, y, parts, batch_size=4, chunk_size=3)
    ids, steps = np.array([2, 0, 1]), np.array([3, 5, 2])
    plans = ex.plans(ids, steps, np.random.default_rng(1))
    (chunk,) = ex.train(model.state_dict(), ids, steps, lr=0.05,
                        rng=np.random.default_rng(1))
    for j, s in enumerate(chunk.slots):
        want = [_mean_step_losses(model, x, y, plans[s], 0.05, dt)
                for dt in (torch.float32, torch.float64)]
        assert_float_close(chunk.loss[j], *want, terms=4 * 64, what=f"slot {s}")


def test_executor_functional_call_forward_unchanged():
    # the executor never touches the template's own parameters
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    ex = ClientExecutor(model, x, y, [np.arange(20)], batch_size=5)
    list(ex.train(model.state_dict(), np.array([0]), np.array([2]), lr=0.1,
                  rng=np.random.default_rng(0)))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    out = functional_call(model, before, (x,))
    assert out.shape == (20, 10)


def test_forward_macs_of_lenet5_by_hand():
    from splitfed.engine.flops import forward_macs
    model = build_model("lenet5", (1, 28, 28), 10)
    conv1 = 6 * 28 * 28 * (1 * 5 * 5)
    conv2 = 16 * 10 * 10 * (6 * 5 * 5)
    fc = 400 * 120 + 120 * 84 + 84 * 10
    assert forward_macs(model, (1, 28, 28)) == conv1 + conv2 + fc


def test_forward_macs_of_grouped_and_rectangular_convolutions_and_token_rows():
    """Module doc: a convolution costs out_elements * in_channels / groups * kh * kw, a
    linear layer in_features * out_features per output row (every token of a sequence)."""
    from torch import nn

    from splitfed.engine.flops import forward_macs
    depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
    assert forward_macs(depthwise, (4, 8, 8)) == 4 * 8 * 8 * (1 * 3 * 3)
    grouped = nn.Conv2d(4, 6, (3, 5), groups=2)            # 6 x 6 x 4 outputs
    assert forward_macs(grouped, (4, 8, 8)) == 6 * 6 * 4 * (2 * 3 * 5)
    tokens = nn.Linear(6, 5)
    assert forward_macs(tokens, (7, 6)) == 7 * 5 * 6


class _FreeClock:
    """A clock that charges nothing (the arithmetic alone is under test)."""

    def charge(self, *args, **kwargs):
        return 0


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.Linear(3, 2))


def test_forward_copies_update_batchnorm_statistics_only_when_asked():
    """ForwardCopies: buffers change only in a pass with ``update_stats`` (the
    unperturbed client pass), and then as each copy's own training-mode forward would."""
    from splitfed.engine.stacked import ForwardCopies

    model = _bn_net()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    copies = ForwardCopies(model, start, 2, clock=_FreeClock(), role="client", ids=[0, 1])
    x = torch.randn(2, 8, 4)
    copies.forward(x)
    assert torch.equal(copies.state["1.running_mean"], start["1.running_mean"].expand(2, 3))
    assert (copies.state["1.num_batches_tracked"] == 0).all()
    copies.forward(x, update_stats=True)
    model.train()
    for c in range(2):
        ref = {k: v.clone() for k, v in start.items()}
        functional_call(model, ref, (x[c],))
        ref64 = {k: v.double() if v.is_floating_point() else v.clone()
                 for k, v in start.items()}
        functional_call(model.double(), ref64, (x[c].double(),))
        model.float()
        assert torch.equal(copies.state["1.num_batches_tracked"][c],
                           ref["1.num_batches_tracked"])
        for k in ("1.running_mean", "1.running_var"):      # a mean over the batch of 8
            assert_float_close(copies.state[k][c], ref[k], ref64[k], terms=8, what=(c, k))


def test_forward_copies_first_order_grads_are_each_copys_own_loss_gradient():
    """first_order_grads on labels: the gradient of the summed per-copy losses, i.e. for
    every copy the gradient of its own mean cross-entropy (not divided by the copies)."""
    import torch.nn.functional as F

    from splitfed.engine.stacked import ForwardCopies

    model = _bn_net()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    copies = ForwardCopies(model, start, 2, clock=_FreeClock(), role="client", ids=[0, 1])
    x, y = torch.randn(2, 8, 4), torch.randint(0, 2, (2, 8))
    grads = copies.first_order_grads(x, y)
    names = [n for n, _ in model.named_parameters()]
    model.train()
    def own_grads(c, dtype):
        net = model.to(dtype)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v.clone()).requires_grad_(
            k in names) for k, v in start.items()}
        loss = F.cross_entropy(functional_call(net, sd, (x[c].to(dtype),)), y[c])
        return torch.autograd.grad(loss, [sd[n] for n in names])

    for c in range(2):
        want32, want64 = own_grads(c, torch.float32), own_grads(c, torch.float64)
        model.float()
        # the bias before BatchNorm has a zero gradient in exact arithmetic: its rounding
        # is measured against the size of the model's gradients
        scale = max(w.abs().max().item() for w in want64)
        for n, g, w32, w64 in zip(names, grads, want32, want64):
            # a weight gradient sums over the batch of 8 and up to 4 inputs
            assert_float_close(g[c], w32, w64, magnitude=scale, terms=8 * 4, what=(c, n))


@pytest.mark.parametrize("momentum,wd,nesterov", [(0.9, 0.0, False), (0.0, 0.01, False),
                                                  (0.9, 0.0, True), (0.0, 0.0, False)])
def test_sgd_step_is_torch_sgds_step(momentum, wd, nesterov):
    """split.sgd_step: plain SGD takes the fused p - lr g; any optimizer state (momentum
    alone, weight decay alone, nesterov) is torch.optim.SGD's own step, over three steps."""
    from splitfed.engine.split import sgd_step

    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, generator=g)
    grads = [torch.randn(5, generator=g) for _ in range(3)]
    mine, ref = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    kw = dict(momentum=momentum, weight_decay=wd, nesterov=nesterov)
    opt, ref_opt = torch.optim.SGD([mine], lr=0.1, **kw), torch.optim.SGD([ref], lr=0.1, **kw)
    for gr in grads:
        sgd_step(opt, [mine], [gr.clone()], 0.1)
        ref.grad = gr.clone()
        ref_opt.step()
    assert torch.equal(mine, ref)           # the same operations in the same order


def test_learning_rate_schedule_decays_to_the_floor():
    from helpers import digits_config

    from splitfed.experiment import build_environment
    env = build_environment(digits_config(train={"local_steps": 1, "local_epochs": None,
                                                 "lr": 0.1, "lr_decay": 0.5,
                                                 "lr_min": 0.02}))
    assert [env.lr(t) for t in (1, 2, 3, 4)] == [0.1, 0.05, 0.025, 0.02]
    assert env.lr(2, 0.4) == 0.2
    assert env.lr(9, 0.01) == 0.01        # a base below the floor is not raised
