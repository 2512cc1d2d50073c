"""FedProx, FedOpt and SCAFFOLD against FedAvg and plain unbatched references (digits)."""


import numpy as np
import pytest
import torch
from helpers import assert_float_close, assert_same_run, bn_mlp, bounds_away, digits_config

from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.fedopt import AdaptiveStep, FedOpt
from splitfed.algorithms.scaffold import Scaffold
from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.experiment import build_environment, run_experiment
from splitfed.rng import RandomStreams


HETERO = dict(partition={"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5,
                         "min_partition_size": 5},
              participation={"mode": "uniform", "clients_per_round": 2},
              train={"batch_size": 8, "local_steps": None, "local_epochs": 0.1, "lr": 0.1})


def run(cfg):
    return run_experiment(cfg, write=False)


def close(got, want32, want64, what=""):
    """``got`` (a dict of float32 tensors) matches the reference run in float32 and in
    float64 within the rounding bound of tests/helpers.py."""
    assert got.keys() == want64.keys()
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=f"{what} {k}")


def _references(cfg, rounds, **kw):
    """:func:`_reference` computed in float32 and in float64."""
    return (_reference(cfg, rounds, **kw),
            _reference(cfg, rounds, dtype=torch.float64, **kw))


def _reference(cfg, rounds, mu=0.0, scaffold=False, dtype=torch.float32):
    """Plain unbatched FedAvg / FedProx / SCAFFOLD (option II), one client at a time,
    computed in ``dtype`` from the engine's float32 initial model and data.

    Same seed => same cohorts and batches as the engine (participation and batch
    streams, plans drawn in slot order). Returns the model and SCAFFOLD's controls.
    """
    env = build_environment(cfg)
    model, tr = env.model.to(dtype), cfg.train
    streams = RandomStreams(cfg.seed)
    part_rng, batch_rng = streams.numpy("participation"), streams.numpy("batches")
    x, y = env.data.train.x.to(dtype), env.data.train.y
    sizes = env.data_sizes
    a = sizes / sizes.sum()
    names = [n for n, _ in model.named_parameters()]
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    c = {n: torch.zeros_like(glob[n]) for n in names}
    ci = [{n: torch.zeros_like(glob[n]) for n in names} for _ in range(env.num_clients)]
    for _ in range(rounds):
        cohort = env.sampler.sample(part_rng)
        steps = local_step_counts(sizes[cohort.ids], tr.batch_size, tr.local_steps,
                                  tr.local_epochs)
        new = {k: v.clone() for k, v in glob.items()}
        # a client drawn in several slots trains each from the round's c_i; its control
        # moves by the mean of its slots' deltas, applied once (module doc of scaffold.py)
        dci_sum, slots_of = {}, {}
        for cid, k, w in zip(cohort.ids, steps, cohort.weights):
            plan = batch_plan(env.client_indices[cid], int(k), tr.batch_size, batch_rng)
            model.load_state_dict(glob)
            opt = torch.optim.SGD(model.parameters(), lr=tr.lr)
            for rows in torch.from_numpy(plan):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
                for n, p in model.named_parameters():
                    loss = loss + mu / 2 * ((p - glob[n]) ** 2).sum()
                loss.backward()
                if scaffold:
                    for n, p in model.named_parameters():
                        p.grad += c[n] - ci[cid][n]
                opt.step()
            trained = {n: v.detach().clone() for n, v in model.state_dict().items()}
            for n in new:
                new[n] += float(w) * (trained[n] - glob[n])
            slots_of[int(cid)] = slots_of.get(int(cid), 0) + 1
            acc = dci_sum.setdefault(int(cid), {n: 0.0 for n in names})
            for n in names:
                acc[n] = acc[n] + (glob[n] - trained[n]) / (int(k) * tr.lr) - c[n]
        dc_sum = {n: torch.zeros_like(v) for n, v in c.items()}
        for cid, count in slots_of.items():
            for n in names:
                dci = dci_sum[cid][n] / count
                ci[cid][n] = ci[cid][n] + dci
                dc_sum[n] += float(a[cid]) * dci
        glob = new
        c = {n: c[n] + dc_sum[n] for n in names}
    return glob, c, ci


# ----------------------------------------------------------------------------- FedProx


def test_fedprox_mu_zero_is_fedavg_bit_for_bit():
    avg = run(digits_config(**HETERO))
    prox = run(digits_config(algorithm={"name": "fedprox", "mu": 0.0}, **HETERO))
    assert_same_run(avg, prox)


def test_fedprox_first_local_step_is_fedavg_then_proximal():
    one = dict(rounds=1, partition__num_clients=1, train__local_steps=1)
    avg = run(digits_config(**one)).state["model"]
    prox = run(digits_config(algorithm={"name": "fedprox", "mu": 0.5}, **one)).state["model"]
    for k, v in avg.items():          # x = x_t at the first step: the term is exactly 0
        assert torch.equal(prox[k], v), k
    two = dict(rounds=1, partition__num_clients=1, train__local_steps=2)
    cfg = digits_config(algorithm={"name": "fedprox", "mu": 0.5}, **two)
    got = run(cfg).state["model"]
    (want32, *_), (want64, *_) = _references(cfg, 1, mu=0.5)
    close(got, want32, want64)
    avg2 = run(digits_config(**two)).state["model"]     # no proximal term: far off
    assert bounds_away(avg2, want32, want64) > 100


def test_fedprox_default_mu_is_a_small_nonzero_pull():
    """Without options FedProx runs with the documented mu = 0.01: bit for bit the run
    with mu: 0.01 given, and not FedAvg (the term is on, however small)."""
    common = dict(rounds=1, partition__num_clients=1, train__local_steps=3)
    default = run(digits_config(algorithm={"name": "fedprox"}, **common))
    given = run(digits_config(algorithm={"name": "fedprox", "mu": 0.01}, **common))
    assert_same_run(default, given)
    avg = run(digits_config(**common)).state["model"]
    assert any(not torch.equal(default.state["model"][k], v) for k, v in avg.items())


def test_fedprox_matches_reference_with_partial_participation():
    cfg = digits_config(algorithm={"name": "fedprox", "mu": 0.3}, rounds=2, **HETERO)
    (want32, *_), (want64, *_) = _references(cfg, 2, mu=0.3)
    close(run(cfg).state["model"], want32, want64)


# ----------------------------------------------------------------------------- FedOpt


def _expected_fedopt(x0, delta, opt, lr, beta1, beta2, tau, v0):
    m = (1 - beta1) * delta
    d2 = delta * delta
    v = torch.full_like(delta, v0)
    if opt == "adagrad":
        v = v + d2
    elif opt == "yogi":
        v = v - (1 - beta2) * d2 * torch.sign(v - d2)
    else:
        v = beta2 * v + (1 - beta2) * d2
    return x0 + lr * m / (v.sqrt() + tau), m, v


def _assert_one_fedopt_round(options, variant, lr, beta1, beta2, tau, v0):
    """One round of fedopt with the algorithm ``options`` gives the model and the state
    (m, v) of Algorithm 2 with the given settings after FedAvg's round."""
    common = dict(rounds=1, **HETERO)
    cfg = digits_config(**common)
    x0 = build_environment(cfg).model.state_dict()
    res = run(digits_config(algorithm={"name": "fedopt", **options}, **common)).state
    # Algorithm 2 after FedAvg's round, both computed in float32 and in float64
    want = {}
    for dtype in (torch.float32, torch.float64):
        avg = _reference(cfg, 1, dtype=dtype)[0]
        want[dtype] = {k: _expected_fedopt(x0[k].to(dtype), avg[k] - x0[k].to(dtype),
                                           variant, lr, beta1, beta2, tau, v0)
                       for k in x0}
    for k in x0:
        for i, got in enumerate((res["model"][k], res["fedopt"]["m"][k],
                                 res["fedopt"]["v"][k])):
            assert_float_close(got, want[torch.float32][k][i], want[torch.float64][k][i],
                               what=f"{k} {('model', 'm', 'v')[i]}")


@pytest.mark.parametrize("variant", ["adam", "yogi", "adagrad"])
def test_fedopt_one_round_follows_algorithm_2(variant):
    opts = {"server_optimizer": variant, "server_lr": 0.05, "beta1": 0.9, "beta2": 0.99,
            "tau": 1e-3}
    _assert_one_fedopt_round(opts, variant, 0.05, 0.9, 0.99, 1e-3, 1e-6)


@pytest.mark.parametrize("v_init", [0.0, 1e-2])
def test_fedopt_v_init_is_the_second_moment_the_server_starts_from(v_init):
    """A given ``v_init`` is v_{-1} of Algorithm 2 in place of tau^2: 0 (below the
    paper's tau^2) and 1e-2 (far above every Delta^2 here, so the first step is small)."""
    opts = {"server_optimizer": "adam", "server_lr": 0.05, "tau": 1e-3, "v_init": v_init}
    _assert_one_fedopt_round(opts, "adam", 0.05, 0.9, 0.99, 1e-3, v_init)


def test_fedopt_without_options_is_fedadam_with_the_documented_settings():
    """The defaults of docs/algorithms/fedopt.md: FedAdam, eta 0.01, beta1 0.9, beta2 0.99,
    tau 1e-3 and v_{-1} = tau^2."""
    _assert_one_fedopt_round({}, "adam", 0.01, 0.9, 0.99, 1e-3, 1e-3 ** 2)


@pytest.mark.numerics
def test_fedopt_adagrad_without_momentum_takes_sign_steps():
    """beta1 = 0, v_{-1} = 0, tiny tau: x_1 - x_0 = eta Delta / (|Delta| + tau) ~ eta sign."""
    common = dict(rounds=1, **HETERO)
    x0 = build_environment(digits_config(**common)).model.state_dict()
    avg = run(digits_config(**common)).state["model"]
    opts = {"server_optimizer": "adagrad", "server_lr": 0.01, "beta1": 0.0, "tau": 1e-9,
            "v_init": 0.0}
    got = run(digits_config(algorithm={"name": "fedopt", **opts}, **common)).state["model"]
    eps = torch.finfo(torch.float32).eps
    for k in x0:
        delta = (avg[k] - x0[k]).double()
        moved = delta.abs() > 1e-5
        assert moved.float().mean() > 0.5, k
        # Algorithm 2 with m = Delta, v = Delta^2: the step eta Delta / (|Delta| + tau) is
        # the sign step up to eta tau / (|Delta| + tau) <= 1e-6 where Delta moved
        want = 0.01 * delta / (delta.abs() + 1e-9)
        assert ((want - 0.01 * delta.sign())[moved].abs() <= 0.01 * 1e-9 / 1e-5).all(), k
        # the float32 model x_0 + step rounds to the spacing of |x|: a few eps of |x|
        step = got[k].double() - x0[k].double()
        bound = 8 * eps * (x0[k].double().abs() + got[k].double().abs())
        assert ((step - want)[moved].abs() <= bound[moved]).all(), k


def test_fedopt_state_persists_across_rounds_and_empty_rounds_keep_it():
    seen = []

    class SpyStep(AdaptiveStep):
        def update(self, ctx, model):
            seen.append({k: v.clone() for k, v in ctx.aggregate.delta().items()})
            return super().update(ctx, model)

    class Spy(FedOpt):
        def transforms(self):
            grads, (step,) = super().transforms()
            assert type(step) is AdaptiveStep and step.options.server_optimizer == "yogi"
            return grads, [SpyStep(step.options)]

    cfg = digits_config(algorithm={"name": "fedopt", "server_optimizer": "yogi"}, **HETERO)
    env = build_environment(cfg)
    algo = Spy(FedOpt.Options(server_optimizer="yogi"))
    state = algo.init_state(env)
    init = state
    # Algorithm 2 on the observed deltas, computed in float32 and in float64
    dtypes = (torch.float32, torch.float64)
    m = {dt: {k: torch.zeros_like(v, dtype=dt) for k, v in state["fedopt"]["m"].items()}
         for dt in dtypes}
    v = {dt: {k: torch.full_like(t, 1e-6) for k, t in m[dt].items()} for dt in dtypes}
    for t in (1, 2):
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        old = state
        state = algo.round(env, state, t, cohort).state
        for k in m[torch.float32]:
            want = {}
            for dt in dtypes:
                d, mk, vk = seen[-1][k].to(dt), m[dt], v[dt]
                mk[k] = 0.9 * mk[k] + 0.1 * d
                vk[k] = vk[k] - 0.01 * d * d * torch.sign(vk[k] - d * d)
                want[dt] = old["model"][k].to(dt) + 0.01 * mk[k] / (vk[k].sqrt() + 1e-3)
            assert_float_close(state["model"][k], *want.values(), what=f"round {t} {k}")
            assert_float_close(state["fedopt"]["m"][k], *(m[dt][k] for dt in dtypes),
                               what=f"round {t} m {k}")
    assert all(torch.equal(t, torch.zeros_like(t)) for t in init["fedopt"]["m"].values())
    empty = type(cohort)(np.zeros(0, dtype=np.int64), np.zeros(0))
    result = algo.round(env, state, 3, empty)
    kept = result.state
    assert result.record() == {}
    assert result.samples == 0 and result.server_samples is None
    assert len(seen) == 2                       # no server step in an empty round
    for part in ("model",):
        assert all(torch.equal(kept[part][k], state[part][k]) for k in state[part])
    for part in ("m", "v"):
        assert all(torch.equal(kept["fedopt"][part][k], state["fedopt"][part][k])
                   for k in state["fedopt"][part])


def _bn_environment():
    """Digits with a small MLP that has BatchNorm buffers (running stats, counter)."""
    env = build_environment(digits_config(partition={"scheme": "iid", "num_clients": 3}))
    env.model = bn_mlp()
    return env


def _one_round(algo):
    env = _bn_environment()
    state = algo.init_state(env)
    cohort = env.sampler.sample(env.streams.numpy("participation"))
    return env, algo.round(env, state, 1, cohort).state


def test_fedopt_and_scaffold_leave_batchnorm_buffers_to_fedavg():
    env, avg = _one_round(FedAvg())
    _, opt = _one_round(FedOpt())
    _, sca = _one_round(Scaffold())
    params = {n for n, _ in env.model.named_parameters()}
    buffers = {n for n, _ in env.model.named_buffers()}
    assert len(buffers) == 3
    assert set(opt["fedopt"]["v"]) == params == set(sca["scaffold"]["control"])
    for b in buffers:
        assert not torch.equal(avg["model"][b], env.model.state_dict()[b]), b
        assert torch.equal(opt["model"][b], avg["model"][b]), b
        assert torch.equal(sca["model"][b], avg["model"][b]), b


# ----------------------------------------------------------------------------- SCAFFOLD


def _scaffold_matches_its_reference(cfg, rounds: int) -> dict:
    """Run ``cfg`` (SCAFFOLD) and compare its model, server control and client controls
    with the unbatched float32 / float64 references; the run's final state."""
    got = run(cfg).state
    (model32, c32, ci32), (model64, c64, ci64) = _references(cfg, rounds, scaffold=True)
    close(got["model"], model32, model64, "model")
    close(got["scaffold"]["control"], c32, c64, "control")
    for n in c64:
        close({n: got["scaffold"]["client_controls"][n]},
              {n: torch.stack([row[n] for row in ci32])},
              {n: torch.stack([row[n] for row in ci64])}, "client control")
    return got


def test_scaffold_matches_unbatched_reference_over_rounds():
    cfg = digits_config(algorithm={"name": "scaffold"}, rounds=3, **HETERO)
    got = _scaffold_matches_its_reference(cfg, 3)
    assert any(c.abs().max() > 1e-3 for c in got["scaffold"]["control"].values())


def test_scaffold_with_replacement_averages_a_clients_slot_deltas():
    """A client drawn in several slots of a round (``with_replacement``) trains once per
    slot from the same c_i, and c_i moves by the MEAN of its slots' option-II deltas
    (x - y_s) / (K eta_l) - c, applied once; c <- c + sum_i a_i Delta c_i (Karimireddy et
    al. 2020, Algorithm 1 lines 12-17; the repeated-slot rule of scaffold.py's module doc).
    Two rounds, so the second round's corrections use the first round's controls."""
    cfg = digits_config(algorithm={"name": "scaffold"}, rounds=2,
                        partition={"scheme": "iid", "num_clients": 2},
                        participation={"mode": "with_replacement", "clients_per_round": 5},
                        train={"batch_size": 8, "local_steps": 2, "local_epochs": None,
                               "lr": 0.1})
    _scaffold_matches_its_reference(cfg, 2)


def test_scaffold_doubles_model_communication():
    common = dict(rounds=1, **HETERO)
    avg = run(digits_config(**common)).records[-1]
    sca = run(digits_config(algorithm={"name": "scaffold"}, **common)).records[-1]
    assert sca["bytes_up/model"] == 2 * avg["bytes_up/model"] > 0
    assert sca["bytes_down/model"] == 2 * avg["bytes_down/model"] > 0


@pytest.mark.parametrize("participation", [
    {"mode": "with_replacement", "clients_per_round": 5},
    {"mode": "bernoulli", "q": 0.5}])
def test_scaffold_server_control_is_weighted_mean_of_client_controls(participation):
    """c = sum_n a_n c_n holds under repeated slots (averaged per client) and bernoulli."""
    cfg = digits_config(algorithm={"name": "scaffold"}, rounds=3,
                        partition={"scheme": "dirichlet", "num_clients": 3, "alpha": 0.5,
                                   "min_partition_size": 5},
                        participation=participation)
    res = run(cfg)
    assert any(r.get("participants", 0) > 0 for r in res.records)
    env = build_environment(cfg)
    a = torch.from_numpy(env.data_sizes / env.data_sizes.sum())
    for n, c in res.state["scaffold"]["control"].items():
        ci = res.state["scaffold"]["client_controls"][n]
        want32 = torch.tensordot(a.float(), ci, dims=1)
        want64 = torch.tensordot(a, ci.double(), dims=1)
        assert_float_close(c, want32, want64, what=n)
