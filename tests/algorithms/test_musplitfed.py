"""The zeroth-order toolkit and MU-SplitFed (paper 001, Algorithm 1)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_float_close, bn_mlp, digits_config
from torch.func import functional_call

from splitfed.engine import zo
from splitfed.engine.batches import batch_plan
from splitfed.experiment import build_environment, run_experiment
from splitfed.engine.flops import forward_macs
from splitfed.models import output_shape, split
from splitfed.rng import RandomStreams, derive_seed


def quadratic(c=3, d=5, seed=0, scale=1.0):
    """c independent quadratics 0.5 x'A x + b'x in R^d (one per client; A = M M' / scale
    + I), a random point and the gradients there."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(c, d, d, generator=g, dtype=torch.float64)
    a = a @ a.transpose(1, 2) / scale + torch.eye(d, dtype=torch.float64)
    b = torch.randn(c, d, generator=g, dtype=torch.float64)
    x = torch.randn(c, d, generator=g, dtype=torch.float64)

    def f(params):
        (p,) = params
        return 0.5 * torch.einsum("ci,cij,cj->c", p, a, p) + (b * p).sum(1)
    return f, x, torch.einsum("cij,cj->ci", a, x) + b


@pytest.mark.parametrize("kind", ["sphere", "gaussian"])
def test_zo_estimate_converges_to_the_gradient_of_a_quadratic(kind):
    f, x, grad = quadratic()

    def error(q):
        seeds = [derive_seed(7, f"q{j}") for j in range(q)]
        (est,) = zo.zo_gradient(f, [x], 1e-4, seeds, kind)
        return float((est - grad).norm() / grad.norm())
    errors = [error(q) for q in (100, 1600, 25600)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.05


def _norms(u):
    return torch.sqrt(sum(t.flatten(1).pow(2).sum(1) for t in u))


def _sphere_norms(z, dtype):
    """The norms of the noise ``z`` [C, d] scaled onto the sphere of radius sqrt(d),
    computed in ``dtype``: the radius as float32 or float64 arithmetic gives it."""
    z = z.to(dtype)
    return _norms([z * (z.shape[1] ** 0.5 / z.norm(dim=1, keepdim=True))])


def test_sphere_directions_have_radius_sqrt_d_and_are_regenerated_from_the_seed():
    params = [torch.zeros(4, 3, 2), torch.zeros(4, 5)]
    u = zo.directions(123, params)
    z = torch.randn(4, 11, generator=torch.Generator().manual_seed(123))  # the seed's noise
    assert_float_close(_norms(u), _sphere_norms(z, torch.float32),
                       _sphere_norms(z, torch.float64), what="radius")
    again = zo.directions(123, params)
    assert all(torch.equal(a, b) for a, b in zip(u, again))
    other = zo.directions(124, params)
    assert not torch.equal(u[0], other[0])


def chunked_directions(seed, params, kind="sphere"):
    """The directions the in-place mode draws, materialised: u = scale x the seed's
    chunked noise (a shift of zeros by 1 x u)."""
    u = [torch.zeros_like(p) for p in params]
    zo.shift_(u, seed, 1.0, zo.direction_scale(seed, params, kind))
    return u


def test_in_place_directions_are_on_the_sphere_and_shifts_return_to_the_start(monkeypatch):
    monkeypatch.setattr(zo, "NOISE_CHUNK", 7)      # several chunks per parameter
    params = [torch.randn(3, 4, 5), torch.randn(3, 6)]
    u = chunked_directions(5, params)
    z = torch.cat([noise for _, noise in zo.noise_chunks(5, params)], dim=1)
    assert_float_close(_norms(u), _sphere_norms(z, torch.float32),
                       _sphere_norms(z, torch.float64), what="radius")
    start = [p.clone() for p in params]
    scale = zo.direction_scale(5, params)

    def shifted(alphas, dtype):
        """``start`` shifted by alpha u for each alpha in turn, in ``dtype``."""
        out = [q.to(dtype) for q in start]
        for a in map(torch.as_tensor, alphas):        # a number or one value per client
            out = [q + a.to(dtype).view(-1, *[1] * (q.dim() - 1)) * v.to(dtype)
                   for q, v in zip(out, u)]
        return out

    def check(alphas, what):
        for i, p in enumerate(params):
            assert_float_close(p, shifted(alphas, torch.float32)[i],
                               shifted(alphas, torch.float64)[i], what=f"{what} {i}")
    zo.shift_(params, 5, 0.01, scale)
    check([0.01], "shift")
    zo.shift_(params, 5, -0.01, scale)
    check([0.01, -0.01], "shift back")
    alpha = torch.tensor([1.0, -2.0, 0.5])
    zo.shift_(params, 5, alpha, scale)                # one coefficient per client
    check([0.01, -0.01, alpha], "per-client shift")


def test_in_place_zo_step_equals_the_materialised_estimate_and_step():
    f, x, _ = quadratic()
    seeds = [11, 12, 13]
    got = [x.clone()]
    zo.zo_step_(lambda: f(got), got, 1e-3, seeds, 0.1)
    dirs = [chunked_directions(s, [x])[0] for s in seeds]
    total = sum(zo.scale_directions(zo.central_difference(
        f([x + 1e-3 * u]), f([x - 1e-3 * u]), 1e-3), [u])[0] for u in dirs)
    # Both sides are float64 and differ in rounding only: the in-place path evaluates f
    # at x shifted and shifted back (a few ulp of x), and each difference of two f values
    # loses a few ulp of f, which the step multiplies by lr |u| / (2 mu).
    eps = torch.finfo(torch.float64).eps
    f_max = max(f([x + s * 1e-3 * u]).abs().max().item() for u in dirs for s in (1, -1))
    u_max = max(u.abs().max().item() for u in dirs)
    bound = 16 * eps * (x.abs().max().item() + 0.1 * f_max * u_max / 2e-3)
    assert (got[0] - (x - 0.1 * total / 3)).abs().max().item() <= bound


SETUP = dict(model={"name": "mlp", "hidden": [16, 8], "cut": 1},
             partition={"scheme": "iid", "num_clients": 4},
             participation={"mode": "uniform", "clients_per_round": 2},
             train={"batch_size": 8, "local_steps": 1, "local_epochs": None, "lr": 0.01})


def _reference(cfg, rounds, dtype=torch.float32, losses=None):
    """Paper 001 Algorithm 1 written as a plain per-client loop (same seeds and batches),
    computed in ``dtype`` (the random directions are the float32 ones the engine draws).
    ``directions`` q > 1 averages q estimates, each along a direction of
    ``direction_kind``; ``client_order: first`` replaces the
    client's estimate by its gradient through the updated server. ``losses``, when given,
    receives each round's train loss: the cohort's mean of the first server step's 2q
    evaluations."""
    o = cfg.algorithm.options
    tau, lam, q = o.get("tau", 2), 0.005, o.get("directions", 1)
    kind = o.get("direction_kind", "sphere")
    eta_s, eta_g = o.get("server_lr", 0.01), o.get("global_lr", 0.3)
    first_order = o.get("client_order", "zeroth") == "first"
    env = build_environment(cfg)
    streams = RandomStreams(cfg.seed)
    client, server = split(copy.deepcopy(env.model).to(dtype), env.cut)
    x_all, y_all = env.data.train.x.to(dtype), env.data.train.y
    for _ in range(rounds):
        cohort = env.sampler.sample(streams.numpy("participation"))
        base = int(streams.numpy("zo").integers(2**62))
        rng = streams.numpy("batches")
        rows = [batch_plan(env.client_indices[c], 1, 8, rng)[0] for c in cohort.ids]
        n = cohort.size
        cp = {k: v.detach() for k, v in client.named_parameters()}
        sp = {k: v.detach() for k, v in server.named_parameters()}
        stacked_c = [v.expand(n, *v.shape) for v in cp.values()]
        stacked_s = [v.expand(n, *v.shape) for v in sp.values()]
        def directions(name, stacked):
            u = zo.directions(derive_seed(base, name), [v.float() for v in stacked], kind)
            return [v.to(dtype) for v in u]
        u_c = [directions(f"client/0/{j}", stacked_c) for j in range(q)]
        new_c, new_s, first_losses = [], [], []
        for m in range(n):
            x, y = x_all[rows[m]], y_all[rows[m]]

            def client_out(p):
                return functional_call(client, p, (x,))

            def shifted(params, u, scale):
                return {k: v + scale * d[m] for (k, v), d in zip(params.items(), u)}

            def loss(params, h):
                return F.cross_entropy(functional_call(server, params, (h,)), y)
            h = client_out(cp)
            s = dict(sp)
            for i in range(tau):
                step, evals = {k: 0.0 for k in s}, []
                for u in (directions(f"server/{i}/{j}", stacked_s) for j in range(q)):
                    evals += [loss(shifted(s, u, lam), h), loss(shifted(s, u, -lam), h)]
                    coef = (evals[-2] - evals[-1]) / (2 * lam)
                    step = {k: step[k] + coef * d[m] for k, d in zip(s, u)}
                if i == 0:
                    first_losses.append(sum(evals) / len(evals))
                s = {k: v - eta_s * step[k] / q for k, v in s.items()}
            if first_order:
                p = {k: v.clone().requires_grad_() for k, v in cp.items()}
                g = torch.autograd.grad(loss(s, client_out(p)), list(p.values()))
                new_c.append({k: v - cfg.train.lr * gk for (k, v), gk in zip(cp.items(), g)})
            else:
                step = {k: 0.0 for k in cp}
                for u in u_c:
                    delta = (loss(s, client_out(shifted(cp, u, lam)))
                             - loss(s, client_out(shifted(cp, u, -lam))))
                    step = {k: step[k] + delta / (2 * lam) * d[m] for k, d in zip(cp, u)}
                new_c.append({k: v - cfg.train.lr * step[k] / q for k, v in cp.items()})
            new_s.append(s)
        if losses is not None:
            losses.append(sum(first_losses) / n)
        w = torch.tensor(cohort.weights, dtype=dtype)
        with torch.no_grad():
            for module, old, new in ((client, cp, new_c), (server, sp, new_s)):
                for k, p in module.named_parameters():
                    delta = sum(w[m] * (new[m][k] - old[k]) for m in range(n))
                    p.copy_(old[k] + eta_g * delta)
    return {**client.state_dict(), **server.state_dict()}


@pytest.mark.numerics
@pytest.mark.parametrize("tau", [1, 2, 3])
def test_musplitfed_matches_the_algorithm_box(tau):
    cfg = digits_config(algorithm={"name": "musplitfed", "tau": tau}, rounds=2, **SETUP)
    got = run_experiment(cfg, write=False).state["model"]
    want32, want64 = _reference(cfg, 2), _reference(cfg, 2, torch.float64)
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)


@pytest.mark.numerics
@pytest.mark.parametrize("directions", [1, 2])
def test_gaussian_directions_are_used_on_both_sides(directions):
    """``direction_kind: gaussian``: the client's estimate (eqs. 4, 6) and the server
    copies' steps (eq. 5) both move along N(0, I) directions, as the per-client loop
    with the same seeds (the sphere's directions would give another model)."""
    cfg = digits_config(algorithm={"name": "musplitfed", "tau": 2, "directions": directions,
                                   "direction_kind": "gaussian"}, rounds=2, **SETUP)
    got = run_experiment(cfg, write=False).state["model"]
    want32, want64 = _reference(cfg, 2), _reference(cfg, 2, torch.float64)
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)


def test_ledger_three_activations_up_one_scalar_down_per_client():
    cfg = digits_config(algorithm={"name": "musplitfed"}, rounds=1, **SETUP)
    res = run_experiment(cfg, write=False)
    env = build_environment(cfg)
    rec = res.records[-1]
    per_client_acts = 8 * 16 * 4                       # B x cut width x float32
    assert rec["participants"] == 2
    assert rec["bytes_up/activations"] == 2 * 3 * per_client_acts
    assert rec["bytes_down/scalars"] == 2 * 4
    assert rec["bytes_up/labels"] == 2 * 8 * 8
    assert "bytes_down/activation_grads" not in rec
    client, _ = split(env.model, env.cut)
    client_bytes = sum(v.numel() * v.element_size() for v in client.state_dict().values())
    assert rec["bytes_down/model"] == rec["bytes_up/model"] == 2 * client_bytes


def test_small_lambda_many_directions_approach_the_first_order_client_update():
    setup = dict(SETUP, model={"name": "mlp", "hidden": [4, 8], "cut": 1},
                 participation={"mode": "full"}, partition={"scheme": "iid", "num_clients": 1})
    common = {"server_order": "first", "global_lr": 1.0, "smoothing": 1e-3}
    first = run_experiment(digits_config(
        algorithm={"name": "musplitfed", "client_order": "first", **common}, rounds=1,
        **setup), write=False).state["model"]
    zeroth = run_experiment(digits_config(
        algorithm={"name": "musplitfed", "directions": 3000, **common}, rounds=1,
        **setup), write=False).state["model"]
    start = build_environment(digits_config(**setup)).model.state_dict()
    key = "fc1.1.weight"
    d_first = (first[key] - start[key]).flatten()
    d_zeroth = (zeroth[key] - start[key]).flatten()
    cos = F.cosine_similarity(d_first, d_zeroth, dim=0)
    assert cos > 0.9, float(cos)
    assert float((d_zeroth - d_first).norm() / d_first.norm()) < 0.5
    for k in first:      # the server side takes the same first-order step in both
        if not k.startswith("fc1"):
            assert torch.equal(first[k], zeroth[k]), k


def test_zeroth_order_round_uses_no_autograd_graph():
    cfg = digits_config(algorithm={"name": "musplitfed"}, rounds=1, **SETUP)
    env = build_environment(cfg)
    from splitfed.experiment import build_algorithm
    algo = build_algorithm(cfg)
    state = algo.init_state(env)
    env.ledger.round = 1
    new = algo.round(env, state, 1,
                     env.sampler.sample(env.streams.numpy("participation"))).state
    assert all(not v.requires_grad for v in new["model"].values())
    assert not np.allclose(new["model"]["fc1.1.weight"].numpy(),
                           state["model"]["fc1.1.weight"].numpy())


@pytest.mark.parametrize("directions", [1, 3])
def test_only_the_unperturbed_client_pass_updates_batchnorm_statistics(directions):
    """The client's running statistics move by exactly one pass a round, the unperturbed
    h (module doc): after a round the counter is 1, not 2 q + 1, and the running mean is
    the momentum update with each participant's batch, averaged over the cohort."""
    cfg = digits_config(algorithm={"name": "musplitfed", "directions": directions,
                                   "global_lr": 1.0},
                        rounds=1, **{**SETUP, "participation": {"mode": "full"}})
    env = build_environment(cfg)
    env.model = bn_mlp()
    from splitfed.experiment import build_algorithm
    algo = build_algorithm(cfg)
    state = algo.init_state(env)
    env.ledger.round = 1
    cohort = env.sampler.sample(env.streams.numpy("participation"))
    streams = RandomStreams(cfg.seed)
    streams.numpy("participation")
    rows = [batch_plan(env.client_indices[c], 1, 8, streams.numpy("batches"))[0]
            for c in cohort.ids]
    new = algo.round(env, state, 1, cohort).state["model"]
    assert int(new["fc1.2.num_batches_tracked"]) == 1
    # by hand, in float64: the pre-BatchNorm activations of each participant's batch
    lin = {k: state["model"][f"fc1.1.{k}"].double() for k in ("weight", "bias")}
    w = torch.tensor(cohort.weights, dtype=torch.float64)
    start = state["model"]["fc1.2.running_mean"].double()
    want = sum(wm * (0.9 * start + 0.1 * (env.data.train.x[r].flatten(1).double()
                                          @ lin["weight"].T + lin["bias"]).mean(0))
               for wm, r in zip(w, rows))
    got = new["fc1.2.running_mean"].double()
    assert not torch.allclose(got, start)
    # float32 sums of 64 products per activation against float64
    bound = 64 * torch.finfo(torch.float32).eps * (1 + float(want.abs().max()))
    assert float((got - want).abs().max()) <= bound


# ------------------------------------------------------------------ adaptive tau (eq. 12)

def _adaptive_config(ratio_target, **algo):
    """Two clients at fixed, distinct speeds; the server speed is chosen so that
    t_straggler / t_server is ``ratio_target`` (t_server: one ZO step of one copy, 2 q
    forward passes of its batch)."""
    setup = dict(SETUP, partition={"scheme": "iid", "num_clients": 2},
                 participation={"mode": "full"})
    env = build_environment(digits_config(**setup))
    client, server = split(env.model, env.cut)
    shape = tuple(env.data.input_shape)
    cut = output_shape(client, shape)
    fc, fs = forward_macs(client, shape), forward_macs(server, cut)
    mc = sum(v.numel() * v.element_size() for v in client.state_dict().values())
    b, acts, labels = 8, 8 * 16 * 4, 8 * 8
    passes = 2 * algo.get("directions", 1) + 1  # h and h+- per direction (eq. 4)
    comp, up, down = [1e5, 4e4], [2e4, 1e4], [5e4, 5e4]
    arrival = [mc / down[c] + passes * b * fc / comp[c] + (passes * acts + labels) / up[c]
               for c in range(2)]
    t_straggler = max(arrival)                  # client 1, by hand
    server_compute = ratio_target * (passes - 1) * b * fs / t_straggler
    clock = {"profile": "fixed", "client_compute": comp, "uplink": up, "downlink": down,
             "server_compute": server_compute}
    return digits_config(algorithm={"name": "musplitfed", "adaptive_tau": True, **algo},
                         rounds=2, clock=clock, **setup), setup


@pytest.mark.parametrize("ratio,cap,want", [(3.5, 8, 3), (3.5, 2, 2), (0.4, 8, 1),
                                            (5.2, 8, 5)])
def test_adaptive_tau_is_straggler_time_over_server_step_time(ratio, cap, want):
    cfg, setup = _adaptive_config(ratio, max_tau=cap)
    res = run_experiment(cfg, write=False)
    assert [r["tau"] for r in res.records[1:]] == [want, want]
    fixed = run_experiment(digits_config(algorithm={"name": "musplitfed", "tau": want},
                                         rounds=2, **setup), write=False)
    for k, v in fixed.state["model"].items():
        assert torch.equal(res.state["model"][k], v), k


def test_adaptive_tau_counts_every_directions_server_passes():
    """With q = 2 directions one server step is 4 forward passes (2 q), the client sends
    5 activation tensors: eq. (12) with those times gives tau = floor(2.5) = 2."""
    cfg, _ = _adaptive_config(2.5, directions=2)
    res = run_experiment(cfg, write=False)
    assert [r["tau"] for r in res.records[1:]] == [2, 2]


@pytest.mark.parametrize("client_order", ["zeroth", "first"])
def test_in_place_mode_runs_the_same_algorithm(monkeypatch, client_order):
    """With the default mode drawing the in-place mode's directions, both give the same
    models and train losses: the in-place mode changes memory, not the algorithm. Both
    modes land on the per-client loop (computed in float32 and float64) within rounding:
    shifting the parameters by +lambda u, -2 lambda u, +lambda u rounds differently from
    evaluating at perturbed copies."""
    monkeypatch.setattr(zo, "directions", chunked_directions)
    configs = [digits_config(
        algorithm={"name": "musplitfed", "tau": 2, "directions": 2, "in_place": mode,
                   "client_order": client_order}, rounds=3, **SETUP) for mode in (False, True)]
    loss32, loss64 = [], []
    want32 = _reference(configs[0], 3, losses=loss32)
    want64 = _reference(configs[0], 3, torch.float64, losses=loss64)
    loss32, loss64 = torch.stack(loss32), torch.stack(loss64)
    for mode, cfg in zip(("default", "in_place"), configs):
        res = run_experiment(cfg, write=False)
        for k in want64:
            assert_float_close(res.state["model"][k], want32[k], want64[k], what=f"{mode} {k}")
        got = torch.tensor([r["train_loss"] for r in res.records[1:]], dtype=torch.float32)
        assert_float_close(got, loss32, loss64, what=f"{mode} train_loss")


def test_server_rate_over_tau_takes_steps_of_eta_s_over_tau():
    """``server_lr_over_tau``: tau server steps of eta_s / tau, i.e. the run with the rate
    divided by tau (and a different run from the unscaled one)."""
    def final(**algo):
        cfg = digits_config(algorithm={"name": "musplitfed", "tau": 3, **algo}, rounds=2,
                            **SETUP)
        return run_experiment(cfg, write=False).state["model"]
    scaled = final(server_lr=0.03, server_lr_over_tau=True)
    divided = final(server_lr=0.01)
    plain = final(server_lr=0.03)
    assert all(torch.equal(scaled[k], divided[k]) for k in scaled)
    assert not all(torch.equal(scaled[k], plain[k]) for k in scaled)


def test_adaptive_tau_does_not_count_the_wait_for_a_client_to_come_online(tmp_path):
    """eq. (12)'s t_straggler runs from the round's start: when a trace makes the server
    wait for the next client to come online, the wait is not straggler time. Identical
    clients, one online at a time with gaps between them, give every round the tau of
    the same clients always online."""
    header = ("client_id,compute_macs_per_s,uplink_bytes_per_s,downlink_bytes_per_s,"
              "available_from,available_until\n")
    windows = header + "".join(f"{c},1e9,1.25e6,5e6,{a},{b}\n" for c, (a, b) in enumerate(
        [("0", "0.004"), ("0.02", "0.03"), ("0.1", ""), ("", "0")]))
    always = header + "".join(f"{c},1e9,1.25e6,5e6,,\n" for c in range(4))
    taus = {}
    for name, text in (("windows", windows), ("always", always)):
        (tmp_path / f"{name}.csv").write_text(text)
        cfg = digits_config(algorithm={"name": "musplitfed", "adaptive_tau": True,
                                       "max_tau": 10000},
                            partition={"scheme": "iid", "num_clients": 4}, rounds=3,
                            clock={"profile": "trace", "path": str(tmp_path / f"{name}.csv"),
                                   "server_compute": 1e7})
        res = run_experiment(cfg, write=False)
        taus[name] = [r["tau"] for r in res.records[1:]]
        if name == "windows":       # the server waited before rounds 2 and 3
            assert [r["participants"] for r in res.records[1:]] == [1, 1, 1]
            first = res.records[1]["sim_round_s"]
            assert all(r["sim_round_s"] > first * (1 + 1e-9) for r in res.records[2:])
    assert taus["windows"] == taus["always"] == [taus["always"][0]] * 3


@pytest.mark.parametrize("algorithm", [
    {"name": "musplitfed"}, {"name": "musplitfed", "client_order": "first",
                             "server_order": "first"},
    {"name": "gas"}, {"name": "gas", "server_order": "first"}])
@pytest.mark.parametrize("key", ["momentum", "weight_decay"])
def test_an_optimizer_key_of_an_algorithm_with_plain_steps_is_refused(tmp_path, capsys,
                                                                      algorithm, key):
    """MU-SplitFed and GAS step with x - eta G on both sides (also first-order): a
    momentum or a weight decay would be ignored, so it is refused, naming the key, before
    anything is written (--dry-run too); 0 is what they do."""
    from splitfed.cli import main

    sets = [f"algorithm.{k}={v}" for k, v in algorithm.items()]
    for dry in (["--dry-run"], []):
        code = main(["run", "quick_digits", "rounds=1", f"out_dir={tmp_path}", *sets,
                     f"train.{key}=0.5", *dry])
        err = capsys.readouterr().err
        assert code == 2 and err == (
            f"splitfed: error: train.{key}: {algorithm['name']} steps with plain "
            f"x <- x - lr G and no optimizer, so train.{key}=0.5 would be ignored; set "
            f"train.{key}=0 for its runs\n")
        assert not tmp_path.exists() or not any(tmp_path.iterdir())
    assert main(["run", "quick_digits", "rounds=1", f"out_dir={tmp_path}", *sets,
                 f"train.{key}=0", "--dry-run"]) == 0
