"""Algorithms composed in the config from transforms (``algorithm.client_transforms`` and
``algorithm.server_transforms``), against plain transcriptions, and the rules of the chain.

Each combination is a config only (no algorithm code of its own): SFL-V2 with FedProx's
proximal term, SFL-V1 with a FedAdam server step, SFL-V2 with SCAFFOLD's control variates,
SL with server momentum. It runs through the normal engine and is compared with a
transcription of the algorithm boxes written here: per-client loops over plain torch
modules, no stacked models, no executor.

Tolerances (``helpers.float_tolerance``): the engine runs in float32. Every transcription
runs twice from the same float32 inputs (data, initial model), once in float32 and once
in float64 (the modules converted with ``.to(float64)``); the float32 transcription's
distance from the float64 one measures how much float32 rounding this problem amplifies
over its rounds (ReLU kinks, FedAdam's division by sqrt(v) + tau, SCAFFOLD's division by
K eta). The engine, which rounds differently (batched kernels, float64 aggregation), must
land within 8 times that distance of the float64 result, plus a floor of
8 eps32 sqrt(terms) max|x| for a reference that happens to round better (terms: the
B-sample reduction of every gradient, over the K local steps). Each test also checks
that the plain algorithm (the transform left out) lies far outside that bound, so the
bound is tight enough to see the transform.

The transcriptions draw the same minibatches, cohorts and server orders as the engine by
replaying its named random streams (``participation``, ``batches``, ``order``) from the
run's seed, as tests/algorithms/test_split.py does.
"""

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import (assert_float_close, assert_same_run, bn_mlp, digits_config,
                     float_tolerance)

from splitfed.algorithms import ALGORITHMS, TRANSFORMS
from splitfed.engine.batches import batch_plan
from splitfed.engine.rounds import Round
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment
from splitfed.models import split
from splitfed.rng import RandomStreams

K, B, LR = 3, 8, 0.1
SPLIT = dict(model={"name": "mlp", "hidden": [32, 16], "cut": 1},
             partition={"scheme": "dirichlet", "num_clients": 5, "alpha": 1.0,
                        "min_partition_size": 5},
             train={"batch_size": B, "local_steps": K, "local_epochs": None, "lr": LR})
PARTIAL = {"mode": "uniform", "clients_per_round": 3}
TERMS = B * K
#: the combinations, as docs/transforms.md gives them (checked below)
SFLV2_PROX = {"name": "sflv2", "client_transforms": [{"name": "prox", "mu": 0.1}]}
SFLV1_FEDADAM = {"name": "sflv1", "server_transforms": [
    {"name": "fedopt", "server_optimizer": "adam", "server_lr": 0.05}]}
SFLV2_SCAFFOLD = {"name": "sflv2", "client_transforms": [{"name": "scaffold"}]}
SL_MOMENTUM = {"name": "sl", "server_transforms": [
    {"name": "momentum", "beta": 0.9, "server_lr": 1.0}]}
SFLV2_MOMENTUM = {"name": "sflv2", "server_transforms": [
    {"name": "momentum", "beta": 0.9, "server_lr": 1.0}]}


def final_state(cfg):
    return run_experiment(cfg, write=False).state


# ------------------------------------------------------------------ transcription tools


class Problem:
    """The run's data, partition, sampler and initial model (from ``build_environment``,
    float32), and fresh copies of its random streams; tensors converted to ``dtype``."""

    def __init__(self, env, dtype):
        self.env, self.dtype = env, dtype
        self.cfg = env.config
        client, server = split(copy.deepcopy(env.model), env.cut)
        self.client, self.server = client.to(dtype), server.to(dtype)
        self.x, self.y = env.data.train.x.to(dtype), env.data.train.y
        self.streams = RandomStreams(self.cfg.seed)
        self.a = env.data_sizes / env.data_sizes.sum()        # a_n = D_n / D

    def cohort(self):
        return self.env.sampler.sample(self.streams.numpy("participation"))

    def plan(self, cid):
        return batch_plan(self.env.client_indices[cid], K, B, self.streams.numpy("batches"))

    def state(self, *modules):
        return {k: v.detach().clone() for m in modules for k, v in m.state_dict().items()}


def module_with(template, state):
    """A copy of ``template`` holding its entries of ``state`` (a side of the cut)."""
    m = copy.deepcopy(template)
    m.load_state_dict({k: state[k] for k in template.state_dict()})
    return m


def server_pass(server, h, y, lr):
    """The server's step on one client's activations; returns the cut-layer gradient."""
    h = h.detach().requires_grad_(True)
    loss = F.cross_entropy(server(h), y)
    params = list(server.parameters())
    *grads, g_h = torch.autograd.grad(loss, params + [h])
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= lr * g
    return g_h


def client_grads(client, acts, g_h):
    """Named gradients of the client-side parameters from the cut-layer gradient."""
    names = [n for n, _ in client.named_parameters()]
    grads = torch.autograd.grad(acts, [p for _, p in client.named_parameters()], g_h)
    return dict(zip(names, grads))


def sgd(module, grads, lr):
    with torch.no_grad():
        for n, p in module.named_parameters():
            p -= lr * grads[n]


def references(cfg, transcribe, **kw):
    """The transcription in float32 and in float64 from the same float32 inputs."""
    env = build_environment(cfg)
    return (transcribe(Problem(env, torch.float32), **kw),
            transcribe(Problem(env, torch.float64), **kw))


def assert_matches(got, ref32, ref64, what, terms=TERMS):
    assert got.keys() == ref64.keys(), what
    for k in ref64:
        assert_float_close(got[k], ref32[k], ref64[k], terms=terms, what=f"{what} {k}")


def assert_far(other, ref32, ref64, what, terms=TERMS, factor=20.0):
    """``other`` (e.g. the plain algorithm) lies far outside the bound the test uses."""
    ratio = max((other[k].double() - ref64[k]).abs().max().item()
                / float_tolerance(ref32[k], ref64[k], terms=terms) for k in ref64)
    assert ratio > factor, f"{what}: only {ratio:.3g} bounds away from the reference"


# ------------------------------------------------------------------ a. SFL-V2 + prox


def sflv2_reference(p: Problem, rounds, mu=0.0, scaffold=False, momentum=None):
    """Paper 002 Appendix B Algorithm 2 (``order: iteration``), one client at a time,
    each client's step g + mu (x - x_c) (FedProx eq. 2, x_c the client-side model the
    client received) and/or g + c - c_i (SCAFFOLD option II on the client-side model);
    ``momentum`` (beta, eta): line 20's average replaced by server momentum on the
    client-side model, v = beta v + Delta, x_c = x_c + eta v (the server model keeps
    line 16)."""
    env, server = p.env, p.server
    glob = p.state(p.client)
    names = [n for n, _ in p.client.named_parameters()]
    c = {n: torch.zeros_like(glob[n]) for n in names}
    ci = [{n: torch.zeros_like(glob[n]) for n in names} for _ in range(env.num_clients)]
    v = {n: torch.zeros_like(glob[n]) for n in names}
    for t in range(1, rounds + 1):
        cohort = p.cohort()
        lr = env.lr(t)
        plans = [p.plan(cid) for cid in cohort.ids]
        clients = [module_with(p.client, glob) for _ in cohort.ids]
        order = p.streams.numpy("order")
        for k in range(K):
            acts = [clients[s](p.x[plans[s][k]]) for s in range(cohort.size)]
            g_h = [None] * cohort.size
            for s in order.permutation(cohort.size):       # line 12, in a random order
                g_h[s] = server_pass(server, acts[s], p.y[plans[s][k]], lr)
            for s, cid in enumerate(cohort.ids):
                grads = client_grads(clients[s], acts[s], g_h[s])
                for n, w in clients[s].named_parameters():
                    if mu:
                        grads[n] = grads[n] + mu * (w.detach() - glob[n])
                    if scaffold:
                        grads[n] = grads[n] + (c[n] - ci[cid][n])
                sgd(clients[s], grads, lr)
        trained = [p.state(m) for m in clients]
        new = {k: x + sum(float(w) * (y[k] - x) for w, y in zip(cohort.weights, trained))
               for k, x in glob.items()}                   # line 20
        if momentum is not None:
            beta, eta = momentum
            for n in names:
                v[n] = beta * v[n] + (new[n] - glob[n])
                new[n] = glob[n] + eta * v[n]
        if scaffold:                                        # option II, then c
            dc = {n: torch.zeros_like(c[n]) for n in names}
            for cid, y in zip(cohort.ids, trained):
                for n in names:
                    d = (glob[n] - y[n]) / (K * lr) - c[n]
                    ci[cid][n] = ci[cid][n] + d
                    dc[n] += float(p.a[cid]) * d
            c = {n: c[n] + dc[n] for n in names}
        glob = new
    out = {"model": {**glob, **p.state(server)}}
    if scaffold:
        out["control"] = c
        out["client_controls"] = {n: torch.stack([row[n] for row in ci]) for n in names}
    if momentum is not None:
        out["v"] = v
    return out


def test_sflv2_with_fedprox_proximal_term_matches_transcription():
    over = dict(SPLIT, rounds=2)
    cfg = digits_config(algorithm=SFLV2_PROX, **over)
    ref32, ref64 = references(cfg, sflv2_reference, rounds=2, mu=0.1)
    assert_matches(final_state(cfg)["model"], ref32["model"], ref64["model"], "sflv2+prox")
    plain = final_state(digits_config(algorithm={"name": "sflv2"}, **over))["model"]
    assert_far(plain, ref32["model"], ref64["model"], "plain sflv2")


# ------------------------------------------------------------------ b. SFL-V1 + FedAdam

#: the options of SFLV1_FEDADAM, defaults written out
ADAM = {"server_optimizer": "adam", "server_lr": 0.05, "beta1": 0.9, "beta2": 0.99,
        "tau": 1e-3}


def sflv1_fedadam_reference(p: Problem, rounds):
    """Paper 002 Appendix B Algorithm 1 with tau_tilde = tau (one client-side and one
    server-side copy per client, both aggregated once per round), the aggregation
    replaced by Reddi et al. Algorithm 2 (FedAdam, lines 10-15, no bias correction) on
    the whole model's aggregated delta."""
    env = p.env
    glob = p.state(p.client, p.server)
    o = ADAM
    m = {k: torch.zeros_like(v) for k, v in glob.items()}
    v2 = {k: torch.full_like(v, o["tau"] ** 2) for k, v in glob.items()}   # v_{-1} = tau^2
    for t in range(1, rounds + 1):
        cohort = p.cohort()
        lr = env.lr(t)
        plans = [p.plan(cid) for cid in cohort.ids]
        delta = {k: torch.zeros_like(v) for k, v in glob.items()}
        for s, w in enumerate(cohort.weights):
            client, server = module_with(p.client, glob), module_with(p.server, glob)
            for k in range(K):
                rows = plans[s][k]
                acts = client(p.x[rows])
                g_h = server_pass(server, acts, p.y[rows], lr)
                sgd(client, client_grads(client, acts, g_h), lr)
            for key, val in p.state(client, server).items():
                delta[key] += float(w) * (val - glob[key])
        for key, d in delta.items():
            m[key] = o["beta1"] * m[key] + (1 - o["beta1"]) * d
            v2[key] = o["beta2"] * v2[key] + (1 - o["beta2"]) * d * d
            glob[key] = glob[key] + o["server_lr"] * m[key] / (v2[key].sqrt() + o["tau"])
    return {"model": glob, "m": m, "v": v2}


def test_sflv1_with_fedadam_server_step_matches_transcription_and_fedopt():
    over = dict(SPLIT, rounds=3, participation=PARTIAL)
    cfg = digits_config(algorithm=SFLV1_FEDADAM, **over)
    ref32, ref64 = references(cfg, sflv1_fedadam_reference, rounds=3)
    got = final_state(cfg)
    assert_matches(got["model"], ref32["model"], ref64["model"], "sflv1+fedopt(adam)")
    for part in ("m", "v"):          # the step's state covers both sides of the cut
        assert_matches(got["fedopt"][part], ref32[part], ref64[part], f"fedopt {part}")
    plain = final_state(digits_config(algorithm={"name": "sflv1"}, **over))["model"]
    assert_far(plain, ref32["model"], ref64["model"], "plain sflv1")
    # server_period unset (tau_tilde = tau): SFL-V1 is FedAvg on the whole model, so
    # SFL-V1 + the fedopt step is the fedopt algorithm (FedAdam, same options) to float
    # tolerance: both lie within the bound of the same float64 result, so within twice
    # the bound of each other
    opt = final_state(digits_config(
        algorithm={"name": "fedopt", **ADAM}, **over))
    for key in ref64["model"]:
        bound = 2 * float_tolerance(ref32["model"][key], ref64["model"][key], terms=TERMS)
        dev = (got["model"][key].double() - opt["model"][key].double()).abs().max().item()
        assert dev <= bound, (key, dev, bound)
    for part in ("m", "v"):
        for key in ref64[part]:
            bound = 2 * float_tolerance(ref32[part][key], ref64[part][key], terms=TERMS)
            dev = (got["fedopt"][part][key].double()
                   - opt["fedopt"][part][key].double()).abs().max().item()
            assert dev <= bound, (part, key, dev, bound)


# ------------------------------------------------------------------ c. SFL-V2 + SCAFFOLD


def test_sflv2_with_scaffold_controls_matches_transcription():
    over = dict(SPLIT, rounds=3, participation=PARTIAL)
    cfg = digits_config(algorithm=SFLV2_SCAFFOLD, **over)
    ref32, ref64 = references(cfg, sflv2_reference, rounds=3, scaffold=True)
    got = final_state(cfg)
    assert_matches(got["model"], ref32["model"], ref64["model"], "sflv2+scaffold")
    assert_matches(got["scaffold"]["control"], ref32["control"], ref64["control"], "c")
    assert_matches(got["scaffold"]["client_controls"], ref32["client_controls"],
                   ref64["client_controls"], "c_i")
    # the controls live on the client-side model only, and they are not zero
    client, _ = split(build_environment(cfg).model, 1)
    assert set(got["scaffold"]["control"]) == {n for n, _ in client.named_parameters()}
    assert all(c.abs().max() > 1e-2 for c in ref64["control"].values())
    plain = final_state(digits_config(algorithm={"name": "sflv2"}, **over))["model"]
    assert_far(plain, ref32["model"], ref64["model"], "plain sflv2")


def test_sflv2_server_momentum_moves_the_client_side_model_only():
    """SFL-V2's server steps act on the client-side aggregate; the server-side model is
    the one the server trained (line 16), with no momentum of its own."""
    over = dict(SPLIT, rounds=3)
    cfg = digits_config(algorithm=SFLV2_MOMENTUM, **over)
    ref32, ref64 = references(cfg, sflv2_reference, rounds=3, momentum=(0.9, 1.0))
    got = final_state(cfg)
    assert_matches(got["model"], ref32["model"], ref64["model"], "sflv2+momentum")
    assert_matches(got["momentum"]["v"], ref32["v"], ref64["v"], "momentum v")
    plain = final_state(digits_config(algorithm={"name": "sflv2"}, **over))["model"]
    assert_far(plain, ref32["model"], ref64["model"], "plain sflv2")


# ------------------------------------------------------------------ d. SL + momentum


def sl_reference(p: Problem, rounds, beta=0.0, server_lr=1.0, mu=0.0):
    """Paper 003 Algorithm 1 (sequential SL: clients in a random order, each from the
    client-side model its predecessor left, the server model continuing), then instead
    of eq. (4): v = beta v + (x_last - x_t), x_{t+1} = x_t + server_lr v (FedAvgM;
    beta 0 and server_lr 1 is eq. (4) with eta_g = 1). ``mu``: each client's steps add
    FedProx's mu (x - x_r), x_r the client-side model that client received."""
    env = p.env
    glob = p.state(p.client, p.server)
    v = {k: torch.zeros_like(val) for k, val in glob.items()}
    for t in range(1, rounds + 1):
        cohort = p.cohort()
        lr = env.lr(t)
        client, server = module_with(p.client, glob), module_with(p.server, glob)
        for slot in p.streams.numpy("order").permutation(cohort.size):
            received = p.state(client)
            for rows in p.plan(cohort.ids[slot]):
                acts = client(p.x[rows])
                g_h = server_pass(server, acts, p.y[rows], lr)
                grads = client_grads(client, acts, g_h)
                for n, w in client.named_parameters():
                    grads[n] = grads[n] + mu * (w.detach() - received[n])
                sgd(client, grads, lr)
        last = p.state(client, server)
        for k in glob:
            v[k] = beta * v[k] + (last[k] - glob[k])
            glob[k] = glob[k] + server_lr * v[k]
    return {"model": glob, "v": v}


def test_sl_with_server_momentum_matches_transcription():
    over = dict(SPLIT, rounds=3)
    cfg = digits_config(algorithm=SL_MOMENTUM, **over)
    ref32, ref64 = references(cfg, sl_reference, rounds=3, beta=0.9, server_lr=1.0)
    got = final_state(cfg)
    assert_matches(got["model"], ref32["model"], ref64["model"], "sl+momentum")
    assert_matches(got["momentum"]["v"], ref32["v"], ref64["v"], "momentum v")
    plain = final_state(digits_config(algorithm={"name": "sl"}, **over))["model"]
    assert_far(plain, ref32["model"], ref64["model"], "plain sl")


def test_sl_with_prox_anchors_each_client_at_the_model_it_received():
    """In SL the anchor of a gradient transform is the client-side model the client
    received: the one its predecessor handed over, not the round's x_t."""
    over = dict(SPLIT, rounds=2)
    cfg = digits_config(algorithm={"name": "sl", "client_transforms": [
        {"name": "prox", "mu": 0.1}]}, **over)
    ref32, ref64 = references(cfg, sl_reference, rounds=2, mu=0.1)
    assert_matches(final_state(cfg)["model"], ref32["model"], ref64["model"], "sl+prox")
    plain = final_state(digits_config(algorithm={"name": "sl"}, **over))["model"]
    assert_far(plain, ref32["model"], ref64["model"], "plain sl")


def test_sl_with_scaffold_learns_controls():
    over = dict(SPLIT, rounds=2)
    got = final_state(digits_config(algorithm={"name": "sl", "client_transforms": [
        {"name": "scaffold"}]}, **over))
    assert all(c.abs().max() > 1e-3 for c in got["scaffold"]["control"].values())


# ------------------------------------------------------------------ chains and identities


def test_two_gradient_transforms_add_their_corrections():
    """fedavg + [prox, scaffold]: the chained hook is g + mu (x - x_t) + (c - c_i), and
    equals the sum of the two single-transform hooks' corrections."""
    mu = 0.1
    over = dict(participation=PARTIAL, partition={"scheme": "iid", "num_clients": 5})

    def opened(transforms, controls=None):
        cfg = digits_config(algorithm={"name": "fedavg", "client_transforms": transforms},
                            **over)
        env, algo = build_environment(cfg), build_algorithm(cfg)
        state = algo.init_state(env)
        if controls is not None:
            state["scaffold"] = controls
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        rnd = Round(algo, env, state, 1, cohort)
        start = rnd.send(algo.client_part(env, state["model"]))
        return env, cohort, rnd.hook, start, state

    zeros = opened([{"name": "scaffold"}])[4]["scaffold"]      # c = c_i = 0 at round 0
    gen = torch.Generator().manual_seed(0)                     # nonzero controls instead
    controls = {"control": {n: torch.randn(v.shape, generator=gen)
                            for n, v in zeros["control"].items()},
                "client_controls": {n: torch.randn(v.shape, generator=gen)
                                    for n, v in zeros["client_controls"].items()}}
    _, cohort, hook, start, _ = opened([{"name": "prox", "mu": mu}, {"name": "scaffold"}],
                                       controls)
    names = list(controls["control"])
    slots = np.arange(cohort.size)
    params = [start[n].unsqueeze(0) + 0.1 * torch.randn(cohort.size, *start[n].shape,
                                                        generator=gen) for n in names]
    grads = [torch.randn(cohort.size, *start[n].shape, generator=gen) for n in names]
    both = hook(names, params, [g.clone() for g in grads], slots)
    _, _, prox_hook, _, _ = opened([{"name": "prox", "mu": mu}])
    _, _, sca_hook, _, _ = opened([{"name": "scaffold"}], controls)
    prox = prox_hook(names, params, [g.clone() for g in grads], slots)
    sca = sca_hook(names, params, [g.clone() for g in grads], slots)
    rows = torch.from_numpy(cohort.ids.copy())
    for i, n in enumerate(names):
        hand = (grads[i] + mu * (params[i] - start[n])
                + (controls["control"][n] - controls["client_controls"][n][rows]))
        summed = grads[i] + (prox[i] - grads[i]) + (sca[i] - grads[i])
        # three float32 additions of O(1) terms, in another order: a few ulps of the result
        tol = 8 * torch.finfo(torch.float32).eps * hand.abs().max().item()
        assert (both[i] - hand).abs().max().item() <= tol, n
        assert (both[i] - summed).abs().max().item() <= tol, n
        assert (prox[i] - grads[i]).abs().max() > 1e-3 and (sca[i] - grads[i]).abs().max() > 0.1


@pytest.mark.parametrize("name", ["fedavg", "sl", "sflv1", "sflv2"])
def test_rate_with_global_lr_one_is_the_plain_algorithm_bit_for_bit(name):
    over = dict(SPLIT, rounds=2, participation=PARTIAL)
    plain = run_experiment(digits_config(algorithm={"name": name}, **over), write=False)
    rate = run_experiment(digits_config(algorithm={
        "name": name, "server_transforms": [{"name": "rate", "global_lr": 1.0}]}, **over),
        write=False)
    assert plain.state.keys() == rate.state.keys()
    assert_same_run(plain, rate)



@pytest.mark.parametrize("name,half", [
    ("fedavg", {"global_lr": 0.5}),
    ("sflv1", {"server_transforms": [{"name": "rate", "global_lr": 0.5}]})])
def test_global_lr_scales_the_round_step(name, half):
    """Rate (paper 003 Algorithm 1): x_1 = x_0 + eta_g sum_n w_n (x_n - x_0). The clients
    of round 1 train from x_0 whatever eta_g, so with eta_g = 0.5 the model moves half as
    far as with eta_g = 1 (one rounding of x_0 + step each: a few float32 ulps)."""
    over = dict(SPLIT, rounds=1)
    x0 = build_environment(digits_config(algorithm={"name": name}, **over)).model.state_dict()
    full = final_state(digits_config(algorithm={"name": name}, **over))["model"]
    half = final_state(digits_config(algorithm={"name": name, **half}, **over))["model"]
    for k, v in x0.items():
        want = v + 0.5 * (full[k] - v)
        tol = 4 * torch.finfo(torch.float32).eps * (v.abs() + full[k].abs()).max().item()
        assert (half[k] - want).abs().max().item() <= tol, k
        assert (full[k] - v).abs().max().item() > 100 * tol, k

def test_momentum_with_beta_zero_and_rate_one_is_fedavg():
    """beta 0, server_lr 1: x_{t+1} = x_t + Delta_t, FedAvg's step, round after round
    (the v of the previous round must not enter). Both algorithms are fed the same x_t
    every round; they differ only in rounding: FedAvg rounds x_t + Delta once from the
    float64 sum, momentum rounds Delta to float32 first, then x_t + Delta, so
    |momentum - fedavg| <= eps32 (|Delta| + |x_{t+1}|) elementwise (two half-ulp
    roundings and the one of FedAvg; factor 2 for the slack)."""
    over = dict(rounds=3, participation=PARTIAL, partition={"scheme": "iid", "num_clients": 5})
    avg_cfg = digits_config(algorithm={"name": "fedavg"}, **over)
    mom_cfg = digits_config(algorithm={"name": "fedavg", "server_transforms": [
        {"name": "momentum", "beta": 0.0, "server_lr": 1.0}]}, **over)
    runs = []
    for cfg in (avg_cfg, mom_cfg):
        env, algo = build_environment(cfg), build_algorithm(cfg)
        runs.append((env, algo, algo.init_state(env)))
    (env_a, avg, state), (env_m, mom, mom_state) = runs
    eps = torch.finfo(torch.float32).eps
    for t in range(1, 4):
        results = []
        for env, algo, s in ((env_a, avg, state),
                             (env_m, mom, {**state, "momentum": mom_state["momentum"]})):
            env.ledger.round = t
            cohort = env.clock.begin_round(env.sampler.sample(env.streams.numpy("participation")))
            results.append(algo.round(env, s, t, cohort).state)
            env.clock.end_round()
        a, m = results
        for k, x_t in state["model"].items():
            delta = a["model"][k] - x_t
            bound = 2 * eps * (delta.abs() + a["model"][k].abs())
            assert ((m["model"][k] - a["model"][k]).abs() <= bound).all(), (t, k)
            assert delta.abs().max() > 1e-3, (t, k)
        for k, v in m["momentum"]["v"].items():      # v_t = Delta_t (beta = 0)
            delta = a["model"][k] - state["model"][k]
            assert ((v - delta).abs() <= 2 * eps * (delta.abs() + a["model"][k].abs())).all()
        state, mom_state = a, m


# ------------------------------------------------------------------ config rules


def build(**algorithm):
    return build_algorithm(digits_config(algorithm=algorithm))


def test_unknown_transform_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"client_transforms\[0\]\.name: unknown transform "
                                          r"'nope'; available: .*momentum.*prox"):
        build(name="fedavg", client_transforms=[{"name": "nope"}])


@pytest.mark.parametrize("section,name,match", [
    ("client_transforms", "fedopt", r"'fedopt' is a server step; list it under "
                                     r"algorithm\.server_transforms"),
    ("client_transforms", "momentum", r"'momentum' is a server step"),
    ("server_transforms", "prox", r"'prox' is a gradient transform; list it under "
                                  r"algorithm\.client_transforms"),
    ("server_transforms", "scaffold", r"'scaffold' is a gradient transform")])
def test_a_transform_under_the_wrong_list_is_refused(section, name, match):
    with pytest.raises(ConfigError, match=match):
        build(name="sflv2", **{section: [{"name": name}]})


@pytest.mark.parametrize("steps", [
    [{"name": "momentum"}, {"name": "fedopt"}],           # two aggregating steps
    [{"name": "rate"}, {"name": "momentum"}],
    [{"name": "server_train"}, {"name": "momentum"}],      # aggregating step not first
])
def test_one_aggregating_server_step_and_it_comes_first(steps):
    with pytest.raises(ConfigError, match="at most one aggregating step .* and it comes first"):
        build(name="fedavg", server_transforms=steps)


def test_a_server_step_cannot_replace_an_algorithms_own():
    with pytest.raises(ConfigError, match=r"algorithm\.server_transforms: fedopt .*own step "
                                          r"'fedopt'"):
        build(name="fedopt", server_transforms=[{"name": "fedopt"}])
    for name in ("fedavg", "sl"):          # a global rate other than 1 is the algorithm's
        with pytest.raises(ConfigError, match=r"global_lr=0\.5 .*'momentum'"):
            build(name=name, global_lr=0.5, server_transforms=[{"name": "momentum"}])


def test_fedclg_s_is_refused_where_another_step_than_rate_aggregates():
    """Eq. 11 scales its correction by the plain aggregation's global rate eta_g; under
    momentum or FedOpt it would be added at rate 1, after the step (twice as large as
    global_lr=0.5 gives for momentum at beta 0 and rate 0.5)."""
    for name, given in [("fedclg_s", {"server_transforms": [{"name": "momentum"}]}),
                        ("fedopt", {"client_transforms": [{"name": "fedclg_s"}]}),
                        ("fedavg", {"client_transforms": [{"name": "fedclg_s"}],
                                    "server_transforms": [{"name": "fedopt"}]})]:
        with pytest.raises(ConfigError, match=r"'fedclg_s' corrects the aggregate at the "
                                              r"global rate of the plain aggregation"):
            build(name=name, **given)
    build(name="fedclg_s", global_lr=0.5)
    build(name="fedavg", client_transforms=[{"name": "fedclg_s"}],
          server_transforms=[{"name": "server_train"}])
    build(name="fedclg_c", server_transforms=[{"name": "momentum"}])   # per step: fine


def test_a_transform_the_algorithm_already_has_is_refused():
    with pytest.raises(ConfigError, match=r"'prox' would be applied twice"):
        build(name="fedprox", client_transforms=[{"name": "prox"}])


@pytest.mark.parametrize("name", ["centralized", "gas", "musplitfed", "server_only"])
def test_algorithms_without_transforms_refuse_them(name):
    with pytest.raises(ConfigError, match=f"'{name}' takes no transforms"):
        build(name=name, client_transforms=[{"name": "prox"}])
    with pytest.raises(ConfigError, match=f"'{name}' takes no transforms"):
        build(name=name, server_transforms=[{"name": "momentum"}])


def test_which_algorithms_take_transforms():
    takes = sorted(n for n, cls in ALGORITHMS.items() if cls.uses_transforms)
    assert takes == ["clgsgd", "csefsl", "fedavg", "fedclg_c", "fedclg_s", "fedlora",
                     "fedopt", "fedprox", "scaffold", "scaffold_plus", "sflv1", "sflv2",
                     "sl"]
    # docs/transforms.md has a row for each
    assert sorted(TRANSFORMS) == ["fedclg_c", "fedclg_s", "fedopt", "momentum", "prox",
                                  "rate", "scaffold", "server_train"]


def test_the_chain_config_transforms_join():
    """Client transforms come after the algorithm's own; a given aggregating step
    replaces the plain rate and keeps the algorithm's later steps; steps that train
    further run after the aggregation."""
    def chain(**algorithm):
        algo = build(**algorithm)
        return ([t.name for t in algo.gradient_transforms],
                [s.name for s in algo.server_steps])

    assert chain(name="fedprox", client_transforms=[{"name": "scaffold"}]) == (
        ["prox", "scaffold"], ["rate"])
    assert chain(name="clgsgd", server_transforms=[{"name": "momentum"}]) == (
        [], ["momentum", "server_train"])
    assert chain(name="sflv2", server_transforms=[{"name": "fedopt"},
                                                  {"name": "server_train"}]) == (
        [], ["fedopt", "server_train"])
    assert chain(name="sl", server_transforms=[{"name": "server_train"}]) == (
        [], ["rate", "server_train"])


@pytest.mark.parametrize("name", sorted(n for n, cls in ALGORITHMS.items()   # (fedclg_s:
                                        if cls.uses_transforms                 # rate only)
                                        and n not in ("fedopt", "fedclg_s")))
def test_what_the_server_steps_act_on(name):
    """The state of a server step covers the whole model (FL, SL, SFL-V1), the trained
    part (FedLoRA) or the client-side model (SFL-V2, CSE-FSL)."""
    cfg = digits_config(algorithm={"name": name, "server_transforms": [{"name": "momentum"}]},
                        **SPLIT)
    env, algo = build_environment(cfg), build_algorithm(cfg)
    v = algo.init_state(env)["momentum"]["v"]
    params = [n for n, q in env.model.named_parameters()]
    if name in ("sflv2", "csefsl"):
        client, _ = split(env.model, env.cut)
        want = [n for n, _ in client.named_parameters()]
    elif name == "fedlora":
        want = [n for n, q in env.model.named_parameters() if q.requires_grad]
        assert len(want) < len(params)
    else:
        want = params
    assert sorted(v) == sorted(want)


@pytest.mark.parametrize("section,spec,match", [
    ("client_transforms", {"name": "prox", "mu": -1},
     r"algorithm\.client_transforms\[0\]\.mu: must be >= 0"),
    ("server_transforms", {"name": "momentum", "beta": 1.0},
     r"algorithm\.server_transforms\[0\]\.beta: must be < 1"),
    ("server_transforms", {"name": "fedopt", "server_lr": 0},
     r"algorithm\.server_transforms\[0\]\.server_lr: must be > 0"),
    ("client_transforms", {"name": "prox", "muu": 0.1},
     r"unknown key 'algorithm\.client_transforms\[0\]\.muu'.*did you mean 'mu'"),
    ("client_transforms", "prox", r"algorithm\.client_transforms\[0\]: expected a mapping"),
])
def test_transform_options_are_validated_with_their_path(section, spec, match):
    with pytest.raises(ConfigError, match=match):
        build(name="sflv2", **{section: [spec]})


# ------------------------------------------------------------------ what docs/transforms.md says


def test_which_chain_each_algorithm_has_of_its_own():
    chains = {name: build(name=name) for name, cls in ALGORITHMS.items() if cls.uses_transforms}
    got = {name: ([t.name for t in a.gradient_transforms], [s.name for s in a.server_steps])
           for name, a in chains.items()}
    plain = ([], ["rate"])
    hybrid = ["rate", "server_train"]
    assert got == {"fedavg": plain, "fedlora": plain, "sl": plain, "sflv1": plain,
                   "sflv2": plain, "csefsl": plain, "fedprox": (["prox"], ["rate"]),
                   "scaffold": (["scaffold"], ["rate"]), "fedopt": ([], ["fedopt"]),
                   "clgsgd": ([], hybrid), "fedclg_c": (["fedclg_c"], hybrid),
                   "fedclg_s": (["fedclg_s"], hybrid), "scaffold_plus": (["scaffold"], hybrid)}


@pytest.mark.parametrize("name", sorted(n for n, cls in ALGORITHMS.items()
                                        if cls.uses_transforms))
def test_what_the_gradient_transforms_act_on(name):
    """SCAFFOLD's controls have the shape of the part each client trains: the whole
    model (FL), the trained part (FedLoRA), the client-side model (split learning)."""
    extra = [] if name in ("scaffold", "scaffold_plus") else [{"name": "scaffold"}]
    cfg = digits_config(algorithm={"name": name, "client_transforms": extra}, **SPLIT)
    env, algo = build_environment(cfg), build_algorithm(cfg)
    control = algo.init_state(env)["scaffold"]["control"]
    if algo.split:
        client, _ = split(env.model, env.cut)
        want = [n for n, _ in client.named_parameters()]
    else:
        want = [n for n, q in env.model.named_parameters() if q.requires_grad]
    assert sorted(control) == sorted(want)


def test_prox_with_mu_zero_adds_nothing():
    over = dict(SPLIT, rounds=2, participation=PARTIAL)
    plain = final_state(digits_config(algorithm={"name": "sflv2"}, **over))
    zero = final_state(digits_config(algorithm={
        "name": "sflv2", "client_transforms": [{"name": "prox", "mu": 0.0}]}, **over))
    for k, v in plain["model"].items():
        assert torch.equal(zero["model"][k], v), k


@pytest.mark.parametrize("step", [{"name": "momentum"}, {"name": "fedopt"}])
def test_server_steps_give_batchnorm_buffers_the_plain_aggregate(step):
    """The steps' state covers parameters; buffers (running statistics and the integer
    counter) take FedAvg's aggregate."""
    def one_round(algorithm):
        cfg = digits_config(algorithm=algorithm, partition={"scheme": "iid", "num_clients": 3})
        env, algo = build_environment(cfg), build_algorithm(cfg)
        env.model = bn_mlp()
        state = algo.init_state(env)
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        return env, algo.round(env, state, 1, cohort).state

    env, avg = one_round({"name": "fedavg"})
    _, got = one_round({"name": "fedavg", "server_transforms": [step]})
    params = {n for n, _ in env.model.named_parameters()}
    buffers = {n for n, _ in env.model.named_buffers()}
    assert len(buffers) == 3 and set(got[step["name"]]["v"]) == params
    for b in buffers:
        assert not torch.equal(avg["model"][b], env.model.state_dict()[b]), b
        assert torch.equal(got["model"][b], avg["model"][b]), b


def test_the_yaml_of_the_page_builds_and_is_what_is_tested():
    text = (Path(__file__).resolve().parents[2] / "docs" / "transforms.md").read_text()
    blocks = [yaml.safe_load(b)["algorithm"]
              for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    for algorithm in blocks:
        build(**algorithm)
    for tested in (SFLV2_PROX, SFLV1_FEDADAM, SFLV2_SCAFFOLD, SL_MOMENTUM, SFLV2_MOMENTUM):
        assert tested in blocks, tested


# ------------------------------------------------------------------ state keys, MACs, inputs

class _NamedNothing:
    """A gradient transform that changes nothing, under a chosen name."""

    @staticmethod
    def make(name):
        from splitfed.engine.transforms import GradientTransform

        return type("Nothing", (GradientTransform,), {
            "name": name, "start": lambda self, *a: None})


@pytest.mark.parametrize("algorithm,key", [("fedavg", "model"), ("sflv2", "server_opt"),
                                           ("sl", "server_opt"), ("csefsl", "aux")])
def test_a_transform_named_like_the_algorithm_state_is_refused(algorithm, key):
    cls = ALGORITHMS[algorithm]
    with pytest.raises(ConfigError, match=f"state key.*{key}.*clash"):
        cls(cls.Options(), client_transforms=[_NamedNothing.make(key)()])


@pytest.mark.parametrize("name", sorted(n for n, c in ALGORITHMS.items() if c.uses_transforms))
def test_declared_state_keys_cover_the_algorithm_state(name):
    """``state_keys`` lists the algorithm's own state, so the clash check above is real."""
    cfg = digits_config(algorithm={"name": name}, **SPLIT)
    env, algo = build_environment(cfg), build_algorithm(cfg)
    own = set(algo.init_state(env)) - set(algo.transform_keys())
    assert own <= set(algo.state_keys), own - set(algo.state_keys)


def test_whole_model_transforms_are_refused_where_clients_train_a_part():
    for name in ("sflv2", "fedlora"):
        cls = ALGORITHMS[name]
        with pytest.raises(ConfigError, match="whole model"):
            cls(cls.Options(), client_transforms=[TRANSFORMS["fedclg_c"]()])


@pytest.mark.parametrize("name", ["sl", "sflv2", "csefsl"])
def test_a_round_leaves_the_given_state_unchanged(name):
    cfg = digits_config(algorithm={"name": name}, rounds=2, **{
        **SPLIT, "train": {**SPLIT["train"], "momentum": 0.9}})
    env, algo = build_environment(cfg), build_algorithm(cfg)
    state = algo.init_state(env)
    for t in (1, 2):
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        before = copy.deepcopy(state)
        new = algo.round(env, state, t, cohort).state
        flat_before, flat_now = _tensors(before), _tensors(state)
        assert len(flat_before) == len(flat_now)
        assert all(torch.equal(a, b) for a, b in zip(flat_before, flat_now))
        state = new


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_server_training_is_priced_at_the_whole_model():
    """SFL-V2 + server_train: the server-side part's MACs for the clients' samples, plus
    the whole model's MACs for the server's own steps; CLG-SGD's server steps count too."""
    from splitfed.engine.flops import TRAIN_FACTOR, forward_macs
    from splitfed.engine.loop import macs_per_sample

    steps = 2
    cfg = digits_config(algorithm={"name": "sflv2", "server_transforms": [
        {"name": "server_train", "server_steps": steps}]}, rounds=1, **SPLIT)
    res = run_experiment(cfg, write=False)
    env, algo = build_environment(cfg), build_algorithm(cfg)
    client, server = macs_per_sample(algo, env)
    whole = TRAIN_FACTOR * forward_macs(env.model, tuple(env.data.input_shape))
    rec = res.records[1]
    samples = rec["client_macs"] // client
    assert rec["server_macs"] == samples * server + steps * B * whole
    hybrid = run_experiment(digits_config(algorithm={"name": "clgsgd", "server_steps": steps},
                                          rounds=1), write=False)
    assert hybrid.records[1]["server_macs"] > 0


def test_a_transform_name_must_be_a_string():
    with pytest.raises(ConfigError, match=r"client_transforms\[0\]\.name: expected a transform"):
        build_algorithm(digits_config(algorithm={"name": "fedavg",
                                                 "client_transforms": [{"name": 3}]}))
