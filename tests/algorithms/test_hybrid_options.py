"""Paper 004 options of the hybrid algorithms: E counted in server steps (eq. 5) or in
epochs, and FedCLG's server gradient g_s on a minibatch or on all of D_s^t (eqs. 10-11).

Steps are counted on a hand-checkable case (m_s = 40 server samples, B_s = 8: one epoch
is 5 steps); the full-batch g_s is compared with a direct autograd gradient on all of
D_s^t in float64 (tolerances: ``helpers.float_tolerance``), and one whole round with it is
compared with a hand computation.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_float_close, assert_same_run, bounds_away, digits_config

from splitfed.algorithms import fedclg
from splitfed.algorithms.fedclg import CLGCorrection, stacked_gradients
from splitfed.algorithms.server_only import ServerTrain
from splitfed.engine.batches import batch_plan
from splitfed.engine.stacked import StackedModel
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment
from splitfed.rng import RandomStreams

M_S, B = 40, 8                                  # one server epoch = ceil(40 / 8) = 5 steps
SERVER = {"samples_per_round": M_S}
TRAIN = {"batch_size": B, "local_steps": 1, "local_epochs": None, "lr": 0.1}


def run(cfg):
    return run_experiment(cfg, write=False)


# ----------------------------------------------------------------------------- E (eq. 5)


@pytest.mark.parametrize("options,server_data,steps,rows", [
    ({"server_steps": 1}, {}, 1, B),
    ({"server_steps": 3}, {}, 3, B),
    ({"server_steps": 7}, {}, 7, B),                          # more than an epoch
    ({"server_epochs": 1}, {}, 5, B),                         # ceil(40 / 8)
    ({"server_epochs": 0.5}, {}, 3, B),                       # ceil(5 * 0.5)
    ({"server_epochs": 2, "server_batch_size": 16}, {}, 6, 16),   # ceil(40 / 16) * 2
    ({"server_steps": 3}, {"full_batch": True}, 3, M_S),      # E steps on all of D_s^t
    ({"server_epochs": 2}, {"full_batch": True}, 2, M_S),     # one step per epoch
], ids=lambda v: str(v))
def test_server_steps_per_round(monkeypatch, options, server_data, steps, rows):
    """Server-only (no client step to confuse the count), two rounds: E optimizer steps a
    round, each on ``rows`` samples of D_s^t."""
    plans, calls = [], []
    batches, step = ServerTrain.batches, StackedModel.step

    def spy_batches(self, env, rows_, steps_):
        plan = batches(self, env, rows_, steps_)
        plans.append(plan.shape)
        return plan

    def spy_step(self, *a, **kw):
        calls.append(1)
        return step(self, *a, **kw)

    monkeypatch.setattr(ServerTrain, "batches", spy_batches)
    monkeypatch.setattr(StackedModel, "step", spy_step)
    cfg = digits_config(algorithm={"name": "server_only", **options}, rounds=2,
                        server_data={**SERVER, **server_data}, train=TRAIN)
    run(cfg)
    assert len(calls) == 2 * steps
    assert plans == ([] if steps == 0 else [(steps, rows)] * 2)


@pytest.mark.parametrize("steps,epochs", [(5, 1.0), (3, 0.5), (10, 2.0)])
def test_steps_equal_epochs_when_the_counts_match(steps, epochs):
    """server_steps = ceil(m_s / B_s) * E gives the run of server_epochs = E bit for bit
    (the same stream of shuffled passes over D_s^t)."""
    common = dict(rounds=2, server_data=SERVER, train={**TRAIN, "local_steps": 2},
                  partition={"scheme": "iid", "num_clients": 4},
                  participation={"mode": "uniform", "clients_per_round": 2})
    by_steps = run(digits_config(algorithm={"name": "clgsgd", "server_steps": steps},
                                 **common))
    by_epochs = run(digits_config(algorithm={"name": "clgsgd", "server_epochs": epochs},
                                  **common))
    assert_same_run(by_steps, by_epochs)


def test_steps_and_epochs_together_are_refused():
    cfg = digits_config(algorithm={"name": "fedclg_c", "server_steps": 1,
                                   "server_epochs": 1})
    with pytest.raises(ConfigError, match="server_steps.*server_epochs"):
        build_algorithm(cfg)


# ----------------------------------------------------------------------------- g_s


def gradient(model, state, x, y, rows, dtype):
    """Direct autograd in ``dtype``: the gradient of the mean cross-entropy on ``rows``."""
    m = copy.deepcopy(model).to(dtype)
    m.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                       for k, v in state.items()})
    m.train()
    loss = F.cross_entropy(m(x[rows].to(dtype)), y[rows])
    names = [n for n, _ in m.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, [p for _, p in m.named_parameters()])))


def d_s(cfg, env):
    """D_s^t of round 1: the first draw of the ``server_data`` stream."""
    return env.server_data.draw(RandomStreams(cfg.seed).numpy("server_data"))


@pytest.fixture
def spy_g_s(monkeypatch):
    """Every (batch, g_s) the corrections compute."""
    seen = []
    original = CLGCorrection.server_gradient

    def spy(self, env, x_t, batch):
        g = original(self, env, x_t, batch)
        seen.append((np.array(batch), {n: v.clone() for n, v in g.items()}))
        return g

    monkeypatch.setattr(CLGCorrection, "server_gradient", spy)
    return seen


@pytest.mark.parametrize("name", ["fedclg_c", "fedclg_s"])
def test_full_server_gradient_is_the_gradient_on_all_of_d_s(spy_g_s, name):
    cfg = digits_config(algorithm={"name": name, "server_gradient": "full",
                                   "server_steps": 1}, rounds=1, server_data=SERVER,
                        train=TRAIN)
    env = build_environment(cfg)
    x0 = {k: v.clone() for k, v in env.model.state_dict().items()}
    run(cfg)
    (batch, g_s), = spy_g_s
    rows = d_s(cfg, env)
    assert len(rows) == M_S
    assert np.array_equal(batch, rows)
    x, y = env.data.train.x, env.data.train.y
    ref32 = gradient(env.model, x0, x, y, torch.from_numpy(rows), torch.float32)
    ref64 = gradient(env.model, x0, x, y, torch.from_numpy(rows), torch.float64)
    assert g_s.keys() == ref64.keys()
    for n in ref64:
        assert_float_close(g_s[n], ref32[n], ref64[n], terms=M_S, what=n)
    # not the gradient of a minibatch: the 8 first rows give another one
    part = gradient(env.model, x0, x, y, torch.from_numpy(rows[:B]), torch.float64)
    assert bounds_away(part, ref32, ref64, terms=M_S) > 100


@pytest.mark.parametrize("name, size", [("fedclg_c", None), ("fedclg_c", 16),
                                        ("fedclg_s", 16)])
def test_the_server_gradient_is_one_minibatch_of_d_s_of_server_batch_size(spy_g_s, name,
                                                                         size):
    """g_s is one minibatch of D_s^t, drawn from the ``server_data`` stream right after
    D_s^t, of ``server_batch_size`` B_s = 16 (not train.batch_size = 8) where given, as
    the server steps' B_s, else of train.batch_size."""
    given = {} if size is None else {"server_batch_size": size}
    cfg = digits_config(algorithm={"name": name, "server_steps": 1, **given}, rounds=1,
                        server_data=SERVER, train=TRAIN)
    run(cfg)
    env = build_environment(cfg)
    rng = RandomStreams(cfg.seed).numpy("server_data")
    rows = env.server_data.draw(rng)
    (batch, _), = spy_g_s
    assert len(batch) == (size or B)
    assert np.array_equal(batch, batch_plan(rows, 1, size or B, rng)[0])


def _round_by_hand(cfg, env, dtype, global_lr):
    """One round of FedCLG with K = 1, full participation and g_s on all of D_s^t, then
    two minibatch server steps (eq. 5): every client's corrected step is x_t - eta g_s
    (FedCLG-C, eq. 10 with g_i the first batch's gradient), and eq. 11 with K = 1 gives
    x_t - eta_g eta g_s (FedCLG-S); the server steps' batches come from the
    ``server_data`` stream right after the draw of D_s^t (g_s draws nothing)."""
    rng = RandomStreams(cfg.seed).numpy("server_data")
    rows = env.server_data.draw(rng)
    x, y = env.data.train.x, env.data.train.y
    state = {k: v.to(dtype) for k, v in env.model.state_dict().items()}
    g_s = gradient(env.model, state, x, y, torch.from_numpy(rows), dtype)
    eta = cfg.train.lr
    state = {n: v - global_lr * eta * g_s[n] for n, v in state.items()}
    model = copy.deepcopy(env.model).to(dtype)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=eta)
    for batch in torch.from_numpy(batch_plan(rows, 2, B, rng)):
        opt.zero_grad()
        F.cross_entropy(model(x[batch].to(dtype)), y[batch]).backward()
        opt.step()
    return {n: v.detach() for n, v in model.state_dict().items()}


@pytest.mark.parametrize("name,global_lr", [("fedclg_c", 1.0), ("fedclg_s", 0.7)])
def test_round_with_full_server_gradient_by_hand(name, global_lr):
    """The full-batch g_s changes g_s only: the server steps keep their B_s-minibatches."""
    cfg = digits_config(algorithm={"name": name, "server_gradient": "full",
                                   "server_steps": 2, "global_lr": global_lr},
                        rounds=1, server_data=SERVER, train=TRAIN)
    env = build_environment(cfg)
    got = run(cfg).state["model"]
    ref32 = _round_by_hand(cfg, env, torch.float32, global_lr)
    ref64 = _round_by_hand(cfg, env, torch.float64, global_lr)
    for n in ref64:
        assert_float_close(got[n], ref32[n], ref64[n], terms=M_S, what=n)


def test_full_batch_server_data_still_gives_a_full_server_gradient(spy_g_s):
    """server_data.full_batch (g_s and the server steps on all of D_s^t) is unchanged:
    with it, the default server_gradient gives the same run as server_gradient: full."""
    common = dict(rounds=2, server_data={**SERVER, "full_batch": True}, train=TRAIN)
    a = run(digits_config(algorithm={"name": "fedclg_c", "server_steps": 1}, **common))
    b = run(digits_config(algorithm={"name": "fedclg_c", "server_steps": 1,
                                     "server_gradient": "full"}, **common))
    assert_same_run(a, b)
    assert all(len(batch) == M_S for batch, _ in spy_g_s)


def test_bad_server_gradient_names_the_field_and_the_values():
    cfg = digits_config(algorithm={"name": "fedclg_s", "server_gradient": "minibatch"})
    with pytest.raises(ConfigError) as e:
        build_algorithm(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "server_gradient" in msg
    assert "batch" in msg and "full" in msg


# ----------------------------------------------------------------------------- g_i


def test_fresh_batch_client_gradient_draws_its_own_minibatch(monkeypatch):
    """``client_gradient: fresh_batch``: g^i_t is computed on one B-minibatch of each
    client per cohort slot, drawn in slot order from the ``client_gradients`` stream, not
    the first local batch (which comes from ``batches``)."""
    calls = []

    def spy(module, start, x, y, rows, chunk_size):
        calls.append([np.array(r) for r in rows])
        return stacked_gradients(module, start, x, y, rows, chunk_size)

    monkeypatch.setattr(fedclg, "stacked_gradients", spy)
    cfg = digits_config(algorithm={"name": "fedclg_c", "client_gradient": "fresh_batch",
                                   "server_steps": 1}, rounds=1, server_data=SERVER,
                        train=TRAIN)
    run(cfg)
    env = build_environment(cfg)
    streams = RandomStreams(cfg.seed)
    ids = env.sampler.sample(streams.numpy("participation")).ids
    assert len(ids) == 3
    _, client_rows = calls                        # g^s_t first (Algorithm 1 line 4), then g^i_t
    fresh, first = streams.numpy("client_gradients"), streams.numpy("batches")
    for c, got in zip(ids, client_rows, strict=True):
        assert np.array_equal(got, batch_plan(env.client_indices[c], 1, B, fresh)[0])
        assert not np.array_equal(got, batch_plan(env.client_indices[c], 1, B, first)[0])


def test_gradients_of_row_sets_of_unequal_length_are_each_sets_own():
    """:func:`stacked_gradients` on row sets of 5, 11 and 8 samples in one batched pass
    (padded by cycling, the padding weighted 0) gives each set's own mean-loss gradient,
    as a direct autograd pass in float32 and float64 (``client_gradient: full`` with
    unequal client data, several clients per chunk)."""
    cfg = digits_config(rounds=1)
    env = build_environment(cfg)
    x, y = env.data.train.x, env.data.train.y
    state = {k: v.clone() for k, v in env.model.state_dict().items()}
    rows = [np.arange(0, 5), np.arange(20, 31), np.arange(40, 48)]
    got = stacked_gradients(env.model, state, x, y, rows, chunk_size=3)
    for s, r in enumerate(rows):
        ref32 = gradient(env.model, state, x, y, torch.from_numpy(r), torch.float32)
        ref64 = gradient(env.model, state, x, y, torch.from_numpy(r), torch.float64)
        for n in ref64:
            assert_float_close(got[n][s], ref32[n], ref64[n], terms=len(r), what=f"{s} {n}")
