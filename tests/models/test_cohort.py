"""cohort_forward equals a per-client functional_call: outputs, gradients, BN statistics."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from splitfed.models import build_model, cohort_forward, output_shape, split, stack_states
from splitfed.models.cohort import CohortStateError

from helpers import assert_float_close

pytestmark = pytest.mark.numerics

C, B = 3, 4
DTYPES = (torch.float32, torch.float64)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny kernels: one thread avoids OpenMP contention on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CASES = [
    ("lenet5", (1, 28, 28), {}),
    ("alexnet", (3, 32, 32), {"width": 0.125}),
    ("vgg11", (3, 32, 32), {"width": 0.125, "batch_norm": True}),
    ("resnet18", (3, 32, 32), {"width": 4}),
    ("mobilenetv2", (3, 32, 32), {"width_mult": 0.25}),
    ("mlp", (60,), {"hidden": (16, 8)}),
]


def _client_states(module, n=C, seed=1):
    """n different per-client states: parameters and running statistics perturbed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        sd = {}
        for k, v in module.state_dict().items():
            noise = torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else 0
            sd[k] = (v + 0.1 * noise).abs() if k.endswith("running_var") else v + 0.1 * noise
        out.append(sd)
    return out


def _reference(module, states, x, y, training):
    """Per-client functional_call: outputs, parameter grads, input grads, final buffers."""
    module.train(training)
    names = [n for n, _ in module.named_parameters()]
    outs, grads, xgrads, buffers = [], [], [], []
    for c, sd in enumerate(states):
        sd = {k: v.clone().requires_grad_(k in names) for k, v in sd.items()}
        xc = x[c].clone().requires_grad_()
        out = functional_call(module, sd, (xc,))
        g = torch.autograd.grad(F.cross_entropy(out, y[c]), [sd[n] for n in names] + [xc])
        outs.append(out.detach())
        grads.append(g[:-1])
        xgrads.append(g[-1])
        buffers.append({k: v for k, v in sd.items() if k not in names})
    return torch.stack(outs), grads, torch.stack(xgrads), buffers


def _cohort(module, states, x, y, training):
    names = [n for n, _ in module.named_parameters()]
    state = stack_states(states)
    params = [state[n].requires_grad_() for n in names]
    x = x.clone().requires_grad_()
    out = cohort_forward(module, state, x, training=training)
    loss = sum(F.cross_entropy(out[c], y[c]) for c in range(C))
    g = torch.autograd.grad(loss, params + [x])
    return out.detach(), g[:-1], g[-1], state


def _as(states, dtype):
    return [{k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
            for sd in states]


def _check(module, in_shape, training, num_classes=10, dtype=torch.float32, kink_free=False):
    """The cohort in ``dtype`` against the per-client reference; the bounds come from the
    reference computed in float32 and in float64 on the same inputs (tests/helpers.py).
    ``kink_free``: BatchNorm affine parameters from :func:`_away_from_kinks`."""
    module = module.float()
    states = _client_states(module)
    if kink_free:
        states = _away_from_kinks(module, states)
    torch.manual_seed(0)
    x = torch.randn(C, B, *in_shape)
    y = torch.randint(0, num_classes, (C, B))
    module64 = copy.deepcopy(module).double()
    ref32 = _reference(module, states, x, y, training)
    ref64 = _reference(module64, _as(states, torch.float64), x.double(), y, training)
    if kink_free:
        # thousands of float32 epsilons: no rounding difference reaches a kink
        margin, size = _kink_margin(module64, _as(states, torch.float64), x.double(), training)
        assert margin > 1e-3 * size, f"a ReLU6 input is {margin:.3g} from a kink (size {size:.3g})"
    tested = module if dtype == torch.float32 else module64
    out, grads, xg, state = _cohort(tested, _as(states, dtype), x.to(dtype), y, training)
    assert out.dtype == dtype and out.shape == ref64[0].shape
    assert_float_close(out, ref32[0], ref64[0], what="outputs")
    # gradients: reductions over the batch, the positions and the channels, chained from
    # the input to the loss (terms: the client's input size); those that are zero in exact
    # arithmetic (a conv bias before BatchNorm) are float noise: magnitudes are those of
    # the largest gradient of the model
    terms = x[0].numel()
    for c in range(C):
        scale = max(g.abs().max().item() for g in [*ref64[1][c], ref64[2][c]])
        assert_float_close(xg[c], ref32[2][c], ref64[2][c], magnitude=scale, terms=terms,
                           what=f"client {c} input grad")
        for i, g in enumerate(grads):
            assert_float_close(g[c], ref32[1][c][i], ref64[1][c][i], magnitude=scale,
                               terms=terms, what=f"client {c} grad {i}")
    positions = B * (x[0, 0, 0].numel() if x.dim() > 3 else 1)
    for c in range(C):  # BatchNorm statistics: means over the batch and the positions
        for k, v in ref64[3][c].items():
            if v.is_floating_point():
                assert_float_close(state[k][c], ref32[3][c][k], v, terms=positions,
                                   what=f"client {c} {k}")
            else:
                assert torch.equal(state[k][c], v), (c, k)


def _away_from_kinks(module, states, seed=2):
    """``states`` with every BatchNorm's weight in [0.15, 0.25] and its bias at -3 or 3
    (+-0.25) per channel: the normalised values stay within a few units of 0, so the ReLU6
    after each BatchNorm sees inputs either all below 0 or all inside (0, 6), none near a
    kink. A float32 rounding difference then cannot switch an activation's derivative
    between 0 and 1, which in a deep net of millions of activations would otherwise happen
    somewhere (an O(1) change of a gradient, not a rounding error). No channel saturates
    at 6: a depthwise convolution of a constant channel is constant but for its border, and
    the sums of its BatchNorm statistics over such nearly equal values round coherently,
    beyond the sqrt(n) growth the bounds assume."""
    g = torch.Generator().manual_seed(seed)
    bns = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    out = []
    for sd in states:
        sd = dict(sd)
        for n in bns:
            w, b = sd[f"{n}.weight"], sd[f"{n}.bias"]
            sd[f"{n}.weight"] = 0.15 + 0.1 * torch.rand(w.shape, generator=g)
            region = torch.randint(0, 2, b.shape, generator=g) * 6.0 - 3.0
            sd[f"{n}.bias"] = region + 0.5 * torch.rand(b.shape, generator=g) - 0.25
        out.append(sd)
    return out


def _kink_margin(module, states, x, training):
    """The smallest distance of any ReLU6 input from 0 or 6 over the clients' forwards, and
    the largest ReLU6 input (in absolute value)."""
    margins, sizes = [], []

    def hook(_, args):
        z = args[0].detach()
        margins.append(torch.minimum(z.abs(), (z - 6).abs()).min().item())
        sizes.append(z.abs().max().item())

    hooks = [m.register_forward_pre_hook(hook) for m in module.modules()
             if isinstance(m, nn.ReLU6)]
    module.train(training)
    try:
        for c, sd in enumerate(states):
            functional_call(module, sd, (x[c],))
    finally:
        for h in hooks:
            h.remove()
    return min(margins), max(sizes)


def _parts(name, shape, opts):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **opts)
    client, server = split(model)
    return (client, shape), (server, output_shape(client, shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name,shape,opts", CASES, ids=[c[0] for c in CASES])
def test_cohort_matches_per_client(name, shape, opts, training, dtype):
    """float64 shows the batched algebra is exact; float32 exercises the fast kernels."""
    # MobileNetV2 trained in float32: rounding would move some of its millions of
    # activations across a ReLU6 kink, so its BatchNorms keep every activation away from one
    kink_free = (name, training, dtype) == ("mobilenetv2", True, torch.float32)
    (client, in_c), (server, in_s) = _parts(name, shape, opts)
    # the client part's output is not a loss input: train it through a fixed random head
    head = torch.randn(*output_shape(client, shape), 10)
    _check(_HeadOn(client, head), in_c, training, dtype=dtype, kink_free=kink_free)
    _check(server, in_s, training, dtype=dtype, kink_free=kink_free)


class _HeadOn(nn.Module):
    """client part followed by a fixed linear map to 10 logits (so a loss is defined)."""

    def __init__(self, part, head):
        super().__init__()
        self.part = part
        self.register_buffer("head", head.reshape(-1, 10), persistent=False)

    def forward(self, x):
        return self.part(x).flatten(1) @ self.head

    def forward_cohort(self, ctx, x):
        h = ctx.run(self.part, x)
        h = h if h.dim() == 3 else h.reshape(h.shape[0], ctx.n, -1).transpose(0, 1)
        return h @ self.head


class _Custom(nn.Module):
    """An unknown module type (custom forward): exercised through the vmap fallback."""

    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x * 2)


class _Custom2d(nn.Module):
    """Unknown module on images, with BatchNorm inside (fallback on the folded layout)."""

    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x):
        return x * 2 + self.bn(self.conv(x))


def _misc_model():
    """Layers outside the model zoo: GroupNorm, LayerNorm, BatchNorm1d, reflect padding,
    bias-free conv, average pooling, GELU, Dropout(p=0), and two fallback modules."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect", bias=False),
        nn.GroupNorm(2, 4),
        nn.GELU(),
        _Custom2d(4),
        nn.AvgPool2d(2),
        nn.Dropout(0.0),
        nn.Flatten(),
        nn.Linear(16, 8),
        nn.LayerNorm(8),
        nn.BatchNorm1d(8),
        _Custom(8),
        nn.ReLU(),
        nn.Linear(8, 5),
    )


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_misc_layers_and_vmap_fallback(training):
    torch.manual_seed(0)
    for dtype in DTYPES:
        _check(_misc_model(), (3, 4, 4), training, num_classes=5, dtype=dtype)


def test_fallback_for_other_input_ranks():
    torch.manual_seed(0)
    module = nn.Sequential(_Custom(6), nn.Linear(6, 3))  # per-client input [B, T, F]
    states = _client_states(module)
    x = torch.randn(C, B, 5, 6)
    out = cohort_forward(module, stack_states(states), x, training=True)
    module64 = copy.deepcopy(module).double()
    for c, sd in enumerate(states):
        ref32 = functional_call(module, sd, (x[c],))
        ref64 = functional_call(module64, _as([sd], torch.float64)[0], (x[c].double(),))
        assert_float_close(out[c], ref32, ref64, what=f"client {c}")


def test_dropout_masks_differ_per_client_and_sample():
    torch.manual_seed(0)
    model = build_model("alexnet", (1, 28, 28), 10, width=0.125, dropout=0.5)
    state = stack_states([model.state_dict()] * C)
    x = torch.randn(1, 1, 1, 28, 28).expand(C, B, 1, 28, 28)
    out = cohort_forward(model, state, x, training=True)
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[0, 0], out[0, 1])
    out = cohort_forward(model, state, x, training=False)
    assert torch.equal(out[0], out[1]) and torch.equal(out[0, 0], out[0, 1])
    fallback = nn.Sequential(_Custom(4), nn.Dropout(0.5))
    state = stack_states([fallback.state_dict()] * C)
    out = cohort_forward(
        nn.Sequential(fallback[0], _Wrap(fallback[1])), state, torch.ones(C, B, 4), training=True
    )
    assert not torch.equal(out[0], out[1])


class _Wrap(nn.Module):
    """Hides a Dropout behind a custom forward, so it runs under vmap."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_bad_state_is_reported():
    model = build_model("lenet5", (1, 28, 28), 10)
    state = stack_states([model.state_dict()] * C)
    x = torch.zeros(C, B, 1, 28, 28)
    missing = {k: v for k, v in state.items() if k != "fc1.1.bias"}
    with pytest.raises(CohortStateError, match=r"missing keys: \['fc1.1.bias'\]"):
        cohort_forward(model, missing, x, training=False)
    wrong = dict(state, **{"conv1.0.weight": state["conv1.0.weight"][:, :3]})
    with pytest.raises(ValueError, match=r"conv1.0.weight: \(3, 3, 1, 5, 5\) .*\(3, 6, 1, 5, 5\)"):
        cohort_forward(model, wrong, x, training=False)
    with pytest.raises(CohortStateError, match="C=2 clients"):
        cohort_forward(model, state, x[:2], training=False)
    with pytest.raises(CohortStateError, match="keys"):
        stack_states([model.state_dict(), missing])


def test_state_extra_keys_ignored_and_template_untouched():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 10, width=4)
    client, _ = split(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = stack_states(_client_states(model))  # full-model state serves the client part
    out = cohort_forward(client, state, torch.randn(C, B, 3, 32, 32), training=True)
    assert out.shape == (C, B, 8, 16, 16)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert (state["stage1.bn.num_batches_tracked"] == 1).all()


@pytest.mark.parametrize("clients", [1, 3])
@pytest.mark.parametrize("cin,stride,padding", [(4, 2, 0), (2, 3, 0), (6, 2, 1), (16, 2, 0)])
def test_strided_1x1_convolutions_train_right(clients, cin, stride, padding):
    """A 1x1 convolution of stride > 1 (ResNet's shortcut) trained in a cohort: outputs and
    gradients as per client, at several batch sizes, each a few times. (oneDNN's
    channels_last weight gradient of this convolution came out wrong, off by whole units,
    on an AVX2 AMD EPYC for one group of 2, 4 or 6 input channels, in some calls and not
    in others, and at times wrote past its buffer; the cohort takes the strided samples
    first.)"""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(cin, 8, 1, stride=stride, padding=padding, bias=False),
                           nn.Flatten(), nn.LazyLinear(10))
    module(torch.zeros(1, cin, 8, 8))
    module64 = copy.deepcopy(module).double()
    names = [n for n, _ in module.named_parameters()]
    states = _client_states(module, n=clients)
    for batch in (2, 8, 32, 2, 8, 32):
        x = torch.randn(clients, batch, cin, 8, 8)
        y = torch.randint(0, 10, (clients, batch))
        state = stack_states(states)
        params = [state[n].requires_grad_() for n in names]
        xs = x.clone().requires_grad_()
        out = cohort_forward(module, state, xs, training=True)
        got = torch.autograd.grad(sum(F.cross_entropy(out[c], y[c]) for c in range(clients)),
                                  params + [xs])
        ref32 = _reference(module, states, x, y, True)
        ref = _reference(module64, _as(states, torch.float64), x.double(), y, True)
        for c in range(clients):  # bounds as in _check
            what = f"batch {batch} client {c}"
            assert_float_close(out[c], ref32[0][c], ref[0][c], what=f"{what} outputs")
            scale = max(g.abs().max().item() for g in [*ref[1][c], ref[2][c]])
            assert_float_close(got[-1][c], ref32[2][c], ref[2][c], magnitude=scale,
                               terms=x[c].numel(), what=f"{what} input grad")
            for i, g in enumerate(got[:-1]):
                assert_float_close(g[c], ref32[1][c][i], ref[1][c][i], magnitude=scale,
                                   terms=x[c].numel(), what=f"{what} grad {i}")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batchnorm_cumulative_average_and_batch_statistics_only(training):
    """BatchNorm with momentum=None (running statistics as a cumulative average, 1 /
    num_batches_tracked) and without running statistics (batch statistics in eval as in
    training) match the per-client computation, buffers included."""
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 8),
        nn.BatchNorm1d(8, track_running_stats=False),
        nn.Linear(8, 5),
    )
    for dtype in DTYPES:
        _check(module, (3, 4, 4), training, num_classes=5, dtype=dtype)


def test_dropout2d_drops_whole_channels_per_client_and_sample():
    """Dropout2d in a cohort zeroes whole channels of one sample of one client (each kept
    channel scaled by 1 / (1 - p)), with masks drawn per client and sample."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 6, 1), nn.Dropout2d(0.5))
    state = stack_states([{"0.weight": torch.ones(6, 2, 1, 1), "0.bias": torch.zeros(6)}] * C)
    x = torch.ones(C, B, 2, 5, 5)
    out = cohort_forward(module, state, x, training=True)      # every kept value is 2 * 2
    flat = out.reshape(C, B, 6, -1)
    kept = (flat == 4.0).all(-1)
    assert ((flat == 0).all(-1) | kept).all()                  # a channel is all or nothing
    assert kept.any() and not kept.all()
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[0, 0], kept[0, 1])


def test_alpha_dropout_keeps_its_affine_values_in_a_cohort():
    """AlphaDropout sets a dropped unit to the SELU saturation value and rescales (not to
    zero): a cohort's outputs on a constant input take the two values a per-client pass
    takes."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 64), nn.AlphaDropout(0.5))
    sd = {"0.weight": torch.zeros(64, 4), "0.bias": torch.ones(64)}
    out = cohort_forward(module, stack_states([sd] * C), torch.ones(C, B, 4), training=True)
    ref = functional_call(module.train(), sd, (torch.ones(256, 4),))
    values = torch.unique(ref)
    assert values.numel() == 2 and 0 not in values
    assert torch.isclose(out.reshape(-1, 1), values).any(1).all()
    assert all(torch.isclose(out, v).any() for v in values)
