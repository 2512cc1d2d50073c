"""SL, SFL-V1 and SFL-V2 against plain unbatched references, and what crosses the cut."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_float_close, bounds_away, digits_config

from splitfed.engine.batches import batch_plan
from splitfed.experiment import build_environment, run_experiment
from splitfed.models import split
from splitfed.rng import RandomStreams
from splitfed.transport import InProcessTransport, payload_bytes

SPLIT = dict(model={"name": "mlp", "hidden": [32, 16], "cut": 1},
             partition={"scheme": "dirichlet", "num_clients": 4, "alpha": 1.0,
                        "min_partition_size": 5},
             train={"batch_size": 8, "local_steps": 3, "local_epochs": None, "lr": 0.1})


def final(cfg):
    return run_experiment(cfg, write=False).state["model"]


def close(got, reference, *args, **kw):
    """``got`` matches ``reference(*args, **kw)`` run in float32 and in float64 (from the
    same float32 initial model and data) within the rounding bound of tests/helpers.py."""
    want32 = reference(*args, **kw)
    want64 = reference(*args, dtype=torch.float64, **kw)
    assert got.keys() == want64.keys()
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)
    return want32, want64


def same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


def test_sflv1_with_server_period_tau_equals_fedavg():
    """With tau_tilde = tau SFL-V1 computes exactly what FedAvg computes (docs/design.md)."""
    over = dict(SPLIT, participation={"mode": "uniform", "clients_per_round": 3}, rounds=3)
    same(final(digits_config(algorithm={"name": "sflv1"}, **over)),
         final(digits_config(algorithm={"name": "fedavg"}, **over)))


def test_sflv1_epochs_with_unequal_steps_equals_fedavg():
    over = dict(SPLIT, train={"batch_size": 8, "local_steps": None, "local_epochs": 0.3,
                              "lr": 0.1})
    same(final(digits_config(algorithm={"name": "sflv1"}, **over)),
         final(digits_config(algorithm={"name": "fedavg"}, **over)))


def _setup(cfg, dtype=torch.float32):
    """The environment, its model's client and server parts in ``dtype``, the streams and
    the training data in ``dtype``."""
    env = build_environment(cfg)
    client, server = split(copy.deepcopy(env.model).to(dtype), env.cut)
    streams = RandomStreams(cfg.seed)
    return env, client, server, streams, env.data.train.x.to(dtype), env.data.train.y


def _sgd_step(module, loss=None, lr=0.1):
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def _sequential_reference(cfg, rounds, dtype=torch.float32):
    """SL with global_lr 1 as sequential SGD on the whole model, in ``dtype``."""
    env, client, server, streams, x, y = _setup(cfg, dtype)
    full = torch.nn.Sequential(client, server)
    for _ in range(rounds):
        streams.numpy("participation")          # full participation draws nothing
        order = streams.numpy("order").permutation(env.num_clients)
        for cid in order:
            plan = batch_plan(env.client_indices[cid], 3, 8, streams.numpy("batches"))
            for rows in torch.from_numpy(plan):
                F.cross_entropy(full(x[rows]), y[rows]).backward()
                _sgd_step(full)
    return {**client.state_dict(), **server.state_dict()}


def test_sl_with_global_lr_one_equals_sequential_training():
    cfg = digits_config(algorithm={"name": "sl"}, rounds=2, **SPLIT)
    close(final(cfg), _sequential_reference, cfg, 2)


def test_sl_global_lr_scales_the_round_update():
    cfg1 = digits_config(algorithm={"name": "sl"}, rounds=1, **SPLIT)
    cfg_half = digits_config(algorithm={"name": "sl", "global_lr": 0.5}, rounds=1, **SPLIT)
    start = build_environment(cfg1).model.state_dict()
    one, half = final(cfg1), final(cfg_half)

    def scaled(dtype=torch.float32):
        return {k: start[k].to(dtype) + 0.5 * (one[k].to(dtype) - start[k].to(dtype))
                for k in start}
    close(half, scaled)


def _sl_reference(cfg, rounds, global_lr, dtype=torch.float32):
    """Paper 003 Algorithm 1 by hand: each round the clients in a random order train the
    whole model in turn (the server part carries over from client to client), then
    x^{r+1} = x^r + eta_g (x_last - x^r) on both sides (eq. 4). Returns the final model and
    each round's training loss: the mean over the clients of their mean step loss."""
    env, client, server, streams, x, y = _setup(cfg, dtype)
    full = torch.nn.Sequential(client, server)
    losses = []
    for _ in range(rounds):
        start = {k: v.clone() for k, v in full.state_dict().items()}
        streams.numpy("participation")          # full participation draws nothing
        per_client = []
        for cid in streams.numpy("order").permutation(env.num_clients):
            plan = batch_plan(env.client_indices[cid], 3, 8, streams.numpy("batches"))
            steps = []
            for rows in torch.from_numpy(plan):
                loss = F.cross_entropy(full(x[rows]), y[rows])
                loss.backward()
                steps.append(loss.detach())
                _sgd_step(full)
            per_client.append(torch.stack(steps).mean())
        losses.append(torch.stack(per_client).mean())
        end = full.state_dict()
        full.load_state_dict({k: start[k] + global_lr * (end[k] - start[k]) for k in start})
    return {**client.state_dict(), **server.state_dict()}, torch.stack(losses)


def test_sl_global_lr_over_rounds_and_its_training_loss():
    """Two rounds with eta_g = 0.5: both sides restart each round from the global model
    x^{r+1} of eq. (4) (not from where the last client left the server), and each round's
    train_loss is the mean over the clients of their mean step loss."""
    cfg = digits_config(algorithm={"name": "sl", "global_lr": 0.5}, rounds=2, **SPLIT)
    result = run_experiment(cfg, write=False)
    (model32, loss32), (model64, loss64) = (_sl_reference(cfg, 2, 0.5),
                                            _sl_reference(cfg, 2, 0.5, torch.float64))
    for k in model64:
        assert_float_close(result.state["model"][k], model32[k], model64[k], what=k)
    got = torch.tensor([r["train_loss"] for r in result.records if r["round"] > 0])
    assert_float_close(got, loss32, loss64, terms=12, what="train_loss")


def _sflv2_reference(cfg, rounds, order, dtype=torch.float32, q=None, server_lr=0.1):
    """Algorithm 2 of paper 002, one plain module per client, in ``dtype``; the clients
    step with 0.1, the server with ``server_lr``. With ``q`` (bernoulli probabilities per
    client) the round's cohort is the sampler's draw, the server steps with eta / q_n on
    client n's activations (line 12) and the client-side model moves by
    sum_n (a_n / q_n) (x_c,n - x_c) (line 20)."""
    env, client, server, streams, x, y = _setup(cfg, dtype)
    a = env.data_sizes / env.data_sizes.sum()
    q = [1.0] * env.num_clients if q is None else q
    for _ in range(rounds):
        ids = [int(c) for c in env.sampler.sample(streams.numpy("participation")).ids]
        n = len(ids)
        w = [float(a[c]) / q[c] for c in ids]
        plans = [batch_plan(env.client_indices[c], 3, 8, streams.numpy("batches"))
                 for c in ids]
        clients = [copy.deepcopy(client) for _ in range(n)]
        rng = streams.numpy("order")

        def serve(c, k):
            acts = clients[c](x[plans[c][k]])
            h = acts.detach().requires_grad_(True)
            F.cross_entropy(server(h), y[plans[c][k]]).backward()
            _sgd_step(server, lr=server_lr / q[ids[c]])
            return acts, h.grad

        if order == "iteration":
            for k in range(3):
                outs = {}
                for c in rng.permutation(n):
                    outs[c] = serve(c, k)
                for c in range(n):
                    acts, g = outs[c]
                    acts.backward(g)
                    _sgd_step(clients[c])
        else:
            for c in rng.permutation(n):
                for k in range(3):
                    acts, g = serve(c, k)
                    acts.backward(g)
                    _sgd_step(clients[c])
        start = client.state_dict()
        avg = {k: start[k] + sum(w[c] * (clients[c].state_dict()[k] - start[k])
                                 for c in range(n))
               for k in start}
        client.load_state_dict(avg)
    return {**client.state_dict(), **server.state_dict()}


@pytest.mark.parametrize("order", ["iteration", "per_client"])
def test_sflv2_matches_unbatched_reference(order):
    cfg = digits_config(algorithm={"name": "sflv2", "order": order}, rounds=2,
                        engine={"chunk_size": 3}, **SPLIT)
    close(final(cfg), _sflv2_reference, cfg, 2, order)


def test_sflv2_bernoulli_server_steps_with_eta_over_q():
    """Under bernoulli participation the server's step on client n's activations is
    eta / q_n (paper 002, Algorithm 2 line 12) and the client-side aggregate weighs
    a_n / q_n (line 20; eq. 3): unbiased for full participation's update."""
    q = [0.5, 0.8, 0.6, 0.9]
    cfg = digits_config(algorithm={"name": "sflv2", "order": "per_client"}, rounds=1,
                        participation={"mode": "bernoulli", "q": q}, **SPLIT)
    env = build_environment(cfg)
    cohort = env.sampler.sample(RandomStreams(cfg.seed).numpy("participation"))
    assert 1 < cohort.size < 4 and min(q[c] for c in cohort.ids) < 1   # a real sample
    close(final(cfg), _sflv2_reference, cfg, 1, "per_client", q=q)


def test_sflv2_server_steps_with_server_lr_and_clients_with_train_lr():
    """``algorithm.server_lr`` is the server's eta in line 12 of Algorithm 2 (paper 002);
    the clients keep ``train.lr`` (sflv2.py module doc)."""
    cfg = digits_config(algorithm={"name": "sflv2", "server_lr": 0.05}, rounds=1, **SPLIT)
    close(final(cfg), _sflv2_reference, cfg, 1, "iteration", server_lr=0.05)


def _sflv1_period_reference(cfg, period, momentum=0.0, weight_decay=0.0, restart=False,
                            dtype=torch.float32, server_lr=0.1):
    """One round of Algorithm 1 (paper 002) with tau = 4, tau_tilde = ``period``: plain
    per-client modules, one torch SGD per client and per server copy living for the round
    (docs/design.md, SFL-V1: a copy keeps its momentum across mid-round averages), in
    ``dtype``; the clients step with 0.1, the server copies with ``server_lr``."""
    env, client, server, streams, x, y = _setup(cfg, dtype)
    n = env.num_clients
    w = env.data_sizes / env.data_sizes.sum()
    plans = [batch_plan(env.client_indices[c], 4, 8, streams.numpy("batches"))
             for c in range(n)]
    clients = [copy.deepcopy(client) for _ in range(n)]
    servers = [copy.deepcopy(server) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1 if i < n else server_lr,
                            momentum=momentum, weight_decay=weight_decay)
            for i, m in enumerate(clients + servers)]
    for k in range(4):
        for c in range(n):
            acts = clients[c](x[plans[c][k]])
            h = acts.detach().requires_grad_(True)
            F.cross_entropy(servers[c](h), y[plans[c][k]]).backward()
            opts[n + c].step()
            opts[n + c].zero_grad(set_to_none=True)
            acts.backward(h.grad)
            opts[c].step()
            opts[c].zero_grad(set_to_none=True)
        if (k + 1) % period == 0:
            mean = {key: sum(float(w[c]) * servers[c].state_dict()[key] for c in range(n))
                    for key in server.state_dict()}
            for c, s in enumerate(servers):  # in place: the copy's optimizer keeps its buffers
                s.load_state_dict(mean)
                if restart:
                    opts[n + c].state.clear()
    avg = {key: sum(float(w[c]) * clients[c].state_dict()[key] for c in range(n))
           for key in client.state_dict()}
    return {**avg, **servers[0].state_dict()}


def test_sflv1_server_period_averages_server_copies_mid_round():
    over = dict(SPLIT, train={"batch_size": 8, "local_steps": 4, "local_epochs": None,
                              "lr": 0.1})
    cfg = digits_config(algorithm={"name": "sflv1", "server_period": 2}, rounds=1, **over)
    got = final(cfg)
    want32, want64 = close(got, _sflv1_period_reference, cfg, 2)
    # without the mid-round average: far outside the rounding bound used above
    default = final(digits_config(algorithm={"name": "sflv1"}, rounds=1, **over))
    assert bounds_away(default, want32, want64) > 100


def test_sflv1_server_copies_keep_their_momentum_across_mid_round_averages():
    """With momentum, each server copy's optimizer lives for the round: a mid-round
    average resets the copies' weights, not their momentum buffers."""
    over = dict(SPLIT, train={"batch_size": 8, "local_steps": 4, "local_epochs": None,
                              "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4})
    cfg = digits_config(algorithm={"name": "sflv1", "server_period": 1}, rounds=1, **over)
    got = final(cfg)
    want32, want64 = close(got, _sflv1_period_reference, cfg, 1, momentum=0.9,
                           weight_decay=5e-4)
    # the alternative (buffers restarted at every average) gives other numbers: farther
    # from the float64 reference than 100 times the rounding bound the comparison above
    # allows (the lost momentum moves some weights by O(1e-2) here, the bound is
    # O(1e-6)), so that comparison tells the two apart
    restarted = _sflv1_period_reference(cfg, 1, momentum=0.9, weight_decay=5e-4,
                                        restart=True)
    assert bounds_away(restarted, want32, want64) > 100


def test_sflv1_server_copies_step_with_server_lr():
    """``algorithm.server_lr`` is the server copies' step size; the clients keep
    ``train.lr`` (sflv1.py module doc; paper 002 Algorithm 1 with a server-side eta)."""
    over = dict(SPLIT, train={"batch_size": 8, "local_steps": 4, "local_epochs": None,
                              "lr": 0.1})
    cfg = digits_config(algorithm={"name": "sflv1", "server_lr": 0.05}, rounds=1, **over)
    close(final(cfg), _sflv1_period_reference, cfg, 4, server_lr=0.05)


def test_sflv1_server_period_must_divide_local_steps():
    cfg = digits_config(algorithm={"name": "sflv1", "server_period": 2}, rounds=1, **SPLIT)
    with pytest.raises(Exception, match="server_period"):
        run_experiment(cfg, write=False)


class RecordingTransport(InProcessTransport):
    def __init__(self, ledger):
        super().__init__(ledger)
        self.sent = []

    def _deliver(self, kind, direction, ids, payload):
        tensors = [payload] if isinstance(payload, torch.Tensor) else list(payload.values())
        self.sent.append((kind, direction, [t.detach().clone() for t in tensors]))
        return super()._deliver(kind, direction, ids, payload)


@pytest.mark.parametrize("name", ["fedavg", "sl", "sflv1", "sflv2"])
def test_raw_inputs_never_cross_the_transport(name):
    cfg = digits_config(algorithm={"name": name}, rounds=1, **SPLIT)
    env = build_environment(cfg)
    env.transport = RecordingTransport(env.ledger)
    from splitfed.experiment import build_algorithm
    algo = build_algorithm(cfg)
    state = algo.init_state(env)
    env.ledger.round = 1
    algo.round(env, state, 1, env.sampler.sample(env.streams.numpy("participation")))
    kinds = {k for k, _, _ in env.transport.sent}
    allowed = {"model"} if name == "fedavg" else {"model", "activations", "labels",
                                                  "activation_grads"}
    assert kinds == allowed
    raw = env.data.train.x.flatten(1)
    for _, _, tensors in env.transport.sent:
        for t in tensors:
            assert tuple(t.shape[-3:]) != tuple(env.data.input_shape)
            if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == raw.shape[1]:
                rows = t.reshape(-1, raw.shape[1])
                assert not any((raw == r).all(1).any() for r in rows)


def test_communication_matches_paper_002_table_4():
    """Per client and round: FL 2|W|; SL, SFL-V1, SFL-V2 (2 D_n) v + 2 r|W| (+ labels)."""
    base = dict(model={"name": "mlp", "hidden": [32, 16], "cut": 1},
                data={"name": "digits", "limit_train": 256},
                partition={"scheme": "iid", "num_clients": 4},
                train={"batch_size": 16, "local_steps": None, "local_epochs": 1, "lr": 0.1})
    env = build_environment(digits_config(**base))
    client, _ = split(env.model, env.cut)
    w_bytes = payload_bytes(env.model.state_dict(), per_client=False)
    wc_bytes = payload_bytes(client.state_dict(), per_client=False)       # r|W|
    v = 32 * 4                                   # cut activation: 32 float32 per sample
    d_n = 64                                     # 256 samples over 4 clients, 1 epoch
    for name in ("fedavg", "sl", "sflv1", "sflv2"):
        rec = run_experiment(digits_config(algorithm={"name": name}, rounds=1, **base),
                             write=False).records[-1]
        if name == "fedavg":
            assert rec["bytes_up/model"] == rec["bytes_down/model"] == 4 * w_bytes
            assert rec["bytes_up"] + rec["bytes_down"] == 4 * 2 * w_bytes
            continue
        assert rec["bytes_up/activations"] == 4 * d_n * v, name
        assert rec["bytes_down/activation_grads"] == 4 * d_n * v, name
        assert rec["bytes_up/model"] == rec["bytes_down/model"] == 4 * wc_bytes, name
        assert rec["bytes_up/labels"] == 4 * d_n * 8, name
        table4 = 2 * d_n * v + 2 * wc_bytes
        assert rec["bytes_up"] + rec["bytes_down"] - rec["bytes_up/labels"] == 4 * table4
