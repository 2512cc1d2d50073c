"""Hybrid FL (paper 004): CLG-SGD, FedCLG-C, FedCLG-S, SCAFFOLD+ and server-only against
FedAvg, hand computations and plain unbatched references (digits, tiny MLP)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_float_close, bn_mlp, bounds_away, digits_config

from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.fedclg import (AggregateCorrection, ClientCorrection, FedCLGC,
                                        FedCLGS)
from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment
from splitfed.rng import RandomStreams

HETERO = dict(partition={"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5,
                         "min_partition_size": 5},
              participation={"mode": "uniform", "clients_per_round": 2},
              train={"batch_size": 8, "local_steps": None, "local_epochs": 0.1, "lr": 0.1,
                     "lr_decay": 0.9})


def run(cfg):
    return run_experiment(cfg, write=False)


def close(got, reference, *args, **kw):
    """``got`` matches ``reference(*args, **kw)`` computed in float32 and in float64 (from
    the same float32 model and data) within the rounding bound of tests/helpers.py."""
    want32 = reference(*args, dtype=torch.float32, **kw)
    want64 = reference(*args, dtype=torch.float64, **kw)
    assert got.keys() == want64.keys()
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)
    return want32, want64


def no_time(records):
    return [{k: v for k, v in r.items() if k != "round_time_s"} for r in records]


def param_names(model):
    return [n for n, _ in model.named_parameters()]


def grad_at(model, state, x, y, rows):
    """Direct autograd: the gradient of the mean cross-entropy on ``rows`` at ``state``."""
    model.load_state_dict(state)
    model.train()
    loss = F.cross_entropy(model(x[rows]), y[rows])
    grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    return dict(zip(param_names(model), grads))


# ----------------------------------------------------------------------------- reference


def _reference(cfg, rounds, dtype=torch.float32):
    """Plain unbatched CLG-SGD / FedCLG-C / FedCLG-S / server-only, one client at a time,
    in ``dtype`` from the engine's float32 initial model and data.

    Same seed => same cohorts, client batches and server draws as the engine: the
    ``participation`` and ``batches`` streams as FedAvg's, and per round on the
    ``server_data`` stream: D_s^t, the batch of g_s (FedCLG), the server steps' plan.
    """
    env = build_environment(cfg)
    o = build_algorithm(cfg).options
    variant = cfg.algorithm.name
    model, tr, B = env.model.to(dtype), cfg.train, cfg.train.batch_size
    streams = RandomStreams(cfg.seed)
    part_rng, batch_rng = streams.numpy("participation"), streams.numpy("batches")
    server_rng = streams.numpy("server_data")
    x, y = env.data.train.x.to(dtype), env.data.train.y
    full = cfg.server_data.full_batch
    names = param_names(model)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    # the server's SGD and its momentum buffer live for the run (server_only.py module doc);
    # the clients here step without momentum
    assert tr.momentum == 0 or variant == "server_only"
    server_opt = torch.optim.SGD(model.parameters(), lr=tr.lr, momentum=tr.momentum)
    for t in range(1, rounds + 1):
        cohort = env.sampler.sample(part_rng)
        D = env.server_data.draw(server_rng)
        eta, gamma = env.lr(t), env.lr(t, o.server_lr)
        if variant.startswith("fedclg"):
            zs = D if full else batch_plan(D, 1, B, server_rng)[0]
            g_s = grad_at(model, glob, x, y, zs)
        if variant != "server_only":
            steps = local_step_counts(env.data_sizes[cohort.ids], B, tr.local_steps,
                                      tr.local_epochs)
            plans = [batch_plan(env.client_indices[c], int(k), B, batch_rng)
                     for c, k in zip(cohort.ids, steps)]
            new = {k: v.clone() for k, v in glob.items()}
            for c, k, w, plan in zip(cohort.ids, steps, cohort.weights, plans):
                if variant.startswith("fedclg"):
                    own = plan[0] if o.client_gradient == "first_batch" else env.client_indices[c]
                    g_i = grad_at(model, glob, x, y, own)
                model.load_state_dict(glob)
                opt = torch.optim.SGD(model.parameters(), lr=eta)
                for rows in torch.from_numpy(plan):
                    opt.zero_grad()
                    F.cross_entropy(model(x[rows]), y[rows]).backward()
                    if variant == "fedclg_c":               # eq. 10, every step
                        for n, p in model.named_parameters():
                            p.grad += g_s[n] - g_i[n]
                    opt.step()
                trained = {n: v.detach().clone() for n, v in model.state_dict().items()}
                for n in new:
                    new[n] += o.global_lr * float(w) * (trained[n] - glob[n])
                if variant == "fedclg_s":                   # eq. 11
                    for n in names:
                        new[n] -= o.global_lr * float(w) * int(k) * eta * (g_s[n] - g_i[n])
            glob = new
        E = (o.server_steps if o.server_steps is not None else
             0 if o.server_epochs == 0 else
             int(local_step_counts(np.array([len(D)]), len(D) if full else B, None,
                                   o.server_epochs)[0]))
        if E:                                               # eq. 5
            plan = np.tile(D, (E, 1)) if full else batch_plan(D, E, B, server_rng)
            model.load_state_dict(glob)          # in place: server_opt keeps its buffers
            server_opt.param_groups[0]["lr"] = gamma
            for rows in torch.from_numpy(plan):
                server_opt.zero_grad()
                F.cross_entropy(model(x[rows]), y[rows]).backward()
                server_opt.step()
            glob = {n: v.detach().clone() for n, v in model.state_dict().items()}
    return glob


SERVER = {"samples_per_round": 40}


@pytest.mark.parametrize("algorithm", [
    {"name": "fedclg_c", "server_lr": 0.05},
    {"name": "fedclg_s", "server_lr": 0.05, "global_lr": 0.8},
    {"name": "clgsgd", "server_epochs": 2, "global_lr": 0.8},
    {"name": "server_only", "server_steps": 3, "server_lr": 0.2},
], ids=lambda a: a["name"])
def test_matches_unbatched_reference_over_two_rounds(algorithm):
    cfg = digits_config(algorithm=algorithm, rounds=2, server_data=SERVER, **HETERO)
    got = run(cfg).state["model"]
    want32, want64 = close(got, _reference, cfg, 2)
    x0 = build_environment(cfg).model.state_dict()       # the model trained: far off x0
    assert bounds_away(x0, want32, want64) > 100


def test_fedclg_c_slots_across_chunks_and_repeated_clients_match_reference():
    """Every slot gets its own c_i, whichever chunk trains it (repeated ids, unequal K)."""
    cfg = digits_config(algorithm={"name": "fedclg_c"}, rounds=2, server_data=SERVER,
                        engine={"chunk_size": 2},
                        **{**HETERO, "participation": {"mode": "with_replacement",
                                                       "clients_per_round": 5}})
    close(run(cfg).state["model"], _reference, cfg, 2)


def test_fedclg_c_full_gradients_match_reference():
    """Option full batch: g_s on all of D_s^t (and full-batch server steps), g_i on all of
    the client's data (unequal client sizes; here each call holds one client, so the
    padding of several clients' rows in one pass is checked in test_hybrid_options)."""
    cfg = digits_config(algorithm={"name": "fedclg_c", "client_gradient": "full"},
                        server_data={**SERVER, "full_batch": True}, rounds=2, **HETERO)
    close(run(cfg).state["model"], _reference, cfg, 2)


# ----------------------------------------------------------------------------- E = 0


def test_clgsgd_with_no_server_epochs_is_fedavg_exactly():
    common = dict(rounds=2, **HETERO)
    clg = run(digits_config(algorithm={"name": "clgsgd", "server_epochs": 0}, **common))
    avg = run(digits_config(server_data={"always": True}, **common))
    for k, v in avg.state["model"].items():
        assert torch.equal(clg.state["model"][k], v), k
    assert no_time(clg.records) == no_time(avg.records)


def test_scaffold_plus_with_no_server_epochs_is_scaffold_exactly():
    common = dict(rounds=2, **HETERO)
    plus = run(digits_config(algorithm={"name": "scaffold_plus", "server_epochs": 0},
                             **common)).state
    sca = run(digits_config(algorithm={"name": "scaffold"}, server_data={"always": True},
                            **common)).state
    for k, v in sca["model"].items():
        assert torch.equal(plus["model"][k], v), ("model", k)
    for part in ("control", "client_controls"):
        for k, v in sca["scaffold"][part].items():
            assert torch.equal(plus["scaffold"][part][k], v), (part, k)


def test_server_training_follows_fedavg_aggregation():
    """CLG-SGD's x_{t+1} differs from FedAvg's by E server steps (eqs. 4-5)."""
    common = dict(rounds=1, **HETERO)
    avg = run(digits_config(server_data={"always": True}, **common)).state["model"]
    clg = run(digits_config(algorithm={"name": "clgsgd", "server_steps": 1}, **common))
    assert any(not torch.allclose(clg.state["model"][k], v) for k, v in avg.items())
    rec = clg.records[-1]
    assert np.isfinite(rec["server_loss"])


# ----------------------------------------------------------------------------- FedCLG


class SpyCorrection:
    """A FedCLG correction that records the server's g_s batch, the round's corrections
    and every client's trained model (as the transform collects it, before upload)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches, self.states, self.corrections = [], [], []

    def server_gradient(self, env, x_t, batch):
        self.batches.append(np.array(batch))
        return super().server_gradient(env, x_t, batch)

    def correction(self, env, t, cohort, g_s, g_i, round_):
        out = super().correction(env, t, cohort, g_s, g_i, round_)
        # FedCLG-C: the per-slot c_i; FedCLG-S: the uploaded g_i
        self.corrections.append(out.corrections if isinstance(self, ClientCorrection)
                                else out.g_i)
        collect = out.collect

        def spy_collect(slots, final):
            collect(slots, final)
            for j, slot in enumerate(slots):
                self.states.append((int(slot), {k: v[j].clone() for k, v in final.items()}))
        out.collect = spy_collect
        return out


class SpyClientCorrection(SpyCorrection, ClientCorrection):
    pass


class SpyAggregateCorrection(SpyCorrection, AggregateCorrection):
    pass


class Spy:
    """The algorithm with its FedCLG correction replaced by the spying one."""

    Correction: type                # the spying subclass of the algorithm's correction

    def transforms(self):
        (correction, *grads), steps = super().transforms()
        assert type(correction) in self.Correction.__bases__
        return [self.Correction(correction.options), *grads], steps

    @property
    def spy(self):
        return self.gradient_transforms[0]

    batches = property(lambda self: self.spy.batches)
    states = property(lambda self: self.spy.states)
    corrections = property(lambda self: self.spy.corrections)


class SpyC(Spy, FedCLGC):
    Correction = SpyClientCorrection


class SpyS(Spy, FedCLGS):
    Correction = SpyAggregateCorrection


def _one_round(algo, cfg, env=None):
    env = env or build_environment(cfg)
    x0 = {k: v.clone() for k, v in env.model.state_dict().items()}
    state = algo.init_state(env)
    cohort = env.sampler.sample(env.streams.numpy("participation"))
    plans_rng = copy.deepcopy(env.streams.numpy("batches"))
    plans = [batch_plan(env.client_indices[c], int(k), cfg.train.batch_size, plans_rng)
             for c, k in zip(cohort.ids, env.local_steps(cohort.ids))]
    result = algo.round(env, state, 1, cohort)
    return env, x0, cohort, plans, result.state, result.record()


def _in(dtype, model, x, state):
    """A copy of ``model``, the data ``x`` and the state dict ``state`` in ``dtype``."""
    return (copy.deepcopy(model).to(dtype), x.to(dtype),
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})


ONE_STEP = dict(rounds=1, train={"batch_size": 8, "local_steps": 1, "local_epochs": None,
                                 "lr": 0.1})


def test_fedclg_c_first_step_is_a_server_gradient_step():
    """c_i = g_s - g_i cancels g_i at x_t: with K = 1 every client ends at x_t - eta g_s."""
    cfg = digits_config(algorithm={"name": "fedclg_c", "server_epochs": 0}, **ONE_STEP)
    algo = SpyC(FedCLGC.Options(server_epochs=0))
    env, x0, cohort, _, new, _ = _one_round(algo, cfg)
    rows = torch.from_numpy(algo.batches[0])

    def server_step(dtype):
        model, x, x0_ = _in(dtype, env.model, env.data.train.x, x0)
        g_s = grad_at(model, x0_, x, env.data.train.y, rows)
        return {n: x0_[n] - 0.1 * g_s[n] for n in param_names(model)}
    want = server_step(torch.float32)
    assert len(algo.states) == cohort.size == 3
    for _, state in algo.states:
        close({n: state[n] for n in want}, server_step)
    want32, want64 = close({n: new["model"][n] for n in want}, server_step)
    avg = _one_round(FedAvg(), cfg)[4]["model"]           # FedAvg's step: far off
    assert bounds_away(avg, want32, want64) > 100


def test_fedclg_s_aggregate_is_eq_11_by_hand():
    """2 clients, K = 1: x^s = x_t + eta_g sum_i w_i (Delta_i - K eta (g_s - g_i))."""
    cfg = digits_config(algorithm={"name": "fedclg_s", "server_epochs": 0, "global_lr": 0.7},
                        partition={"scheme": "iid", "num_clients": 2}, **ONE_STEP)
    algo = SpyS(FedCLGS.Options(server_epochs=0, global_lr=0.7))
    env, x0, cohort, plans, new, _ = _one_round(algo, cfg)
    y, eta, eta_g = env.data.train.y, 0.1, 0.7
    names = param_names(env.model)

    def eq_11(dtype):
        m, x, x0_ = _in(dtype, env.model, env.data.train.x, x0)
        g_s = grad_at(m, x0_, x, y, torch.from_numpy(algo.batches[0]))
        want = {n: x0_[n].clone() for n in names}
        for w, plan in zip(cohort.weights, plans):
            g_i = grad_at(m, x0_, x, y, torch.from_numpy(plan[0]))   # at x_t, first batch
            delta = {n: -eta * g_i[n] for n in want}                 # one SGD step (K = 1)
            for n in want:
                want[n] += eta_g * w * (delta[n] - 1 * eta * (g_s[n] - g_i[n]))
        return want

    def server_step(dtype):
        # K = 1 collapses eq. 11 to a server-gradient step: x_t - eta_g eta g_s
        m, x, x0_ = _in(dtype, env.model, env.data.train.x, x0)
        g_s = grad_at(m, x0_, x, y, torch.from_numpy(algo.batches[0]))
        return {n: x0_[n] - eta_g * eta * g_s[n] for n in names}
    got = {n: new["model"][n] for n in names}
    close(got, eq_11)
    close(got, server_step)


@pytest.mark.parametrize("cls,steps", [(SpyC, 1), (SpyS, 3)], ids=["fedclg_c", "fedclg_s"])
def test_batchnorm_buffers_are_never_corrected(cls, steps):
    """K = 1 (FedCLG-C) or plain local steps (FedCLG-S): the buffers after a round are
    FedAvg's bit for bit, the parameters are not; corrections hold parameters only."""
    train = {"batch_size": 8, "local_steps": steps, "local_epochs": None, "lr": 0.1}
    cfg = digits_config(algorithm={"name": cls.name, "server_epochs": 0}, rounds=1,
                        train=train)

    def bn_env():
        env = build_environment(cfg)
        env.model = bn_mlp()
        return env

    algo = cls(cls.Options(server_epochs=0))
    env, x0, _, _, new, _ = _one_round(algo, cfg, bn_env())
    avg = _one_round(FedAvg(), cfg, bn_env())[4]["model"]
    params, buffers = set(param_names(env.model)), {n for n, _ in env.model.named_buffers()}
    assert len(buffers) == 3
    corrections = algo.corrections[0]          # FedCLG-C: c_i; FedCLG-S: the uploaded g_i
    assert set(corrections) == params
    for b in buffers:
        assert not torch.equal(avg[b], x0[b]), b
        assert torch.equal(new["model"][b], avg[b]), b
    assert any(not torch.allclose(new["model"][p], avg[p], atol=1e-5) for p in params)


def test_server_gradient_pass_leaves_global_buffers_alone():
    cfg = digits_config(algorithm={"name": "fedclg_c", "server_epochs": 0}, **ONE_STEP)
    env = build_environment(cfg)
    env.model = bn_mlp()
    x0 = {k: v.clone() for k, v in env.model.state_dict().items()}
    algo = FedCLGC(FedCLGC.Options(server_epochs=0))
    algo.gradient_transforms[0].server_gradient(env, x0, env.server_data.pool[:8])
    for k, v in x0.items():
        assert torch.equal(env.model.state_dict()[k], v), k


# ----------------------------------------------------------------------------- communication


def test_communication_of_each_variant():
    common = dict(rounds=1, **HETERO)
    rec = {name: run(digits_config(algorithm={"name": name}, server_data={"always": True},
                                   **common)).records[-1]
           for name in ("fedavg", "clgsgd", "fedclg_c", "fedclg_s")}
    up, down = rec["fedavg"]["bytes_up/model"], rec["fedavg"]["bytes_down/model"]
    assert up > 0 and down > 0
    assert (rec["clgsgd"]["bytes_up/model"], rec["clgsgd"]["bytes_down/model"]) == (up, down)
    assert (rec["fedclg_c"]["bytes_up/model"], rec["fedclg_c"]["bytes_down/model"]) == (
        up, 2 * down)
    assert (rec["fedclg_s"]["bytes_up/model"], rec["fedclg_s"]["bytes_down/model"]) == (
        2 * up, down)


# ----------------------------------------------------------------------------- options


def test_server_steps_and_epochs_are_exclusive():
    cfg = digits_config(algorithm={"name": "clgsgd", "server_steps": 2, "server_epochs": 1})
    with pytest.raises(ConfigError, match="server_steps"):
        build_algorithm(cfg)


def test_server_momentum_buffer_carries_into_the_next_round():
    """With ``train.momentum`` the server's momentum buffer of eq. 5's steps persists
    across rounds (server_only.py module doc; docs/design.md): round 2's first step is
    x - gamma (mu b_1 + g), as one torch SGD kept over both rounds computes it."""
    cfg = digits_config(algorithm={"name": "server_only", "server_steps": 2}, rounds=2,
                        server_data=SERVER,
                        train={"batch_size": 8, "local_steps": 1, "local_epochs": None,
                               "lr": 0.1, "lr_decay": 0.9, "momentum": 0.9})
    close(run(cfg).state["model"], _reference, cfg, 2)


def test_server_momentum_persists_across_rounds():
    cfg = digits_config(algorithm={"name": "server_only"}, rounds=2,
                        train={"batch_size": 8, "local_steps": 1, "local_epochs": None,
                               "lr": 0.1, "momentum": 0.9})
    state = run(cfg).state
    env = build_environment(cfg)
    assert set(state["server_momentum"]) == set(param_names(env.model))
    assert all(v.abs().max() > 0 for v in state["server_momentum"].values())
