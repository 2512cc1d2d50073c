"""GAS with zeroth-order clients (paper 001's baseline; docs/design.md, "GAS baseline"):
the per-class running statistics and the activations generated from them, the order in
which the server serves uploads (simulated arrival times, hand-computed), the activation
buffer, and the bytes in the ledger."""

import math
import sys

import numpy as np
import pytest
import torch
from helpers import assert_float_close, digits_config

from splitfed.algorithms.gas import empty_stats, generate, update_stats
from splitfed.engine.flops import forward_macs
from splitfed.engine.loop import run_rounds
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger
from splitfed.models import output_shape, split
from splitfed.transport import payload_bytes


def batch(n, shift, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 2, 3, generator=g) * torch.arange(1.0, 7.0).view(2, 3) + shift
    y = torch.randint(0, 3, (n,), generator=g)
    return h, y


@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_one_update_keeps_the_class_mean_and_population_variance(covariance):
    h, y = batch(60, 0.0, 0)
    stats = empty_stats(4, 6, covariance)
    update_stats(stats, h, y, weight=5.0)
    for k in range(3):
        want = {}                                     # mean and variance, float32 and float64
        for dtype in (torch.float32, torch.float64):
            f = h.flatten(1)[y == k].to(dtype)
            c = f - f.mean(0)
            cov = c.T @ c / len(f)
            want[dtype] = f.mean(0), cov if covariance == "full" else cov.diagonal()
        (mean32, var32), (mean64, var64) = want.values()
        assert_float_close(stats["mean"][k], mean32, mean64, what=f"mean {k}")
        assert_float_close(stats["var"][k], var32, var64, what=f"var {k}")
        assert float(stats["weight"][k]) == 5.0 * len(f)
    assert float(stats["weight"][3]) == 0.0            # never seen


def test_newer_batches_weigh_more():
    """Two server steps with weights 1 and 2: the pooled statistics equal the weighted
    mean and variance of all samples, each weighted by its step."""
    (h1, y1), (h2, y2) = batch(50, 0.0, 1), batch(40, 3.0, 2)
    stats = empty_stats(3, 6)
    update_stats(stats, h1, y1, 1.0)
    update_stats(stats, h2, y2, 2.0)
    y = torch.cat([y1, y2])
    for k in range(3):
        want = {}                                     # mean and variance, float32 and float64
        for dtype in (torch.float32, torch.float64):
            h = torch.cat([h1, h2]).flatten(1).to(dtype)
            w = torch.cat([torch.full((50,), 1.0), torch.full((40,), 2.0)]).to(dtype)
            m, wk = y == k, w[y == k]
            mean = (wk[:, None] * h[m]).sum(0) / wk.sum()
            var = (wk[:, None] * (h[m] - mean) ** 2).sum(0) / wk.sum()
            want[dtype] = mean, var
        (mean32, var32), (mean, var) = want.values()
        assert_float_close(stats["mean"][k], mean32, mean, what=f"mean {k}")
        assert_float_close(stats["var"][k], var32, var, what=f"var {k}")
        # the newer batch pulls the mean more than an unweighted pooling would
        plain = h[m].mean(0)
        new = h[m][-int((y2 == k).sum()):].mean(0)
        assert ((mean - new).norm() < (plain - new).norm())


@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_generated_activations_have_the_buffered_mean_and_variance(covariance):
    h, y = batch(300, 1.0, 3)
    stats = empty_stats(4, 6, covariance)
    update_stats(stats, h, y, 1.0)
    real = torch.tensor([0, 0, 1])                   # two real samples of 0, one of 1
    n = 20000
    g, labels = generate(stats, real, n, torch.Generator().manual_seed(0))
    counts = torch.bincount(labels, minlength=4)
    assert counts.tolist() == [n - 2, n - 1, n, 0]  # tops up to n; class 3 has no stats
    for k in range(3):
        s = g[labels == k].double()
        var = stats["var"][k].double()
        sd = (var if covariance == "diagonal" else var.diagonal()).sqrt()
        tol = 5 * sd / math.sqrt(len(s))             # 5 standard errors of the mean
        assert ((s.mean(0) - stats["mean"][k].double()).abs() < tol).all()
        c = s - s.mean(0)
        cov = c.T @ c / len(s)
        got = cov if covariance == "full" else cov.diagonal()
        # 5 standard errors of the sample covariance of n Gaussian samples:
        # Var(S_ij) = (S_ii S_jj + S_ij^2) / n (2 S_ii^2 / n on the diagonal)
        full = var if covariance == "full" else torch.diag(var)
        se = ((sd[:, None] ** 2 * sd[None, :] ** 2 + full ** 2) / len(s)).sqrt()
        assert ((got - var).abs() <= 5 * (se if covariance == "full" else se.diagonal())).all()


def test_a_full_run_whose_activations_overflow_ends_diverged():
    # an overflowed covariance has no Cholesky factor: the generated activations are NaN
    # and the run ends diverged, as with diagonal statistics (it raised ValueError)
    from splitfed.experiment import run_experiment

    cfg = digits_config(algorithm={"name": "gas", "covariance": "full"}, rounds=3,
                        model={"name": "mlp", "hidden": [64, 32], "cut": 2},
                        train={"batch_size": 8, "local_steps": 2, "local_epochs": None,
                               "lr": 1e6})
    assert run_experiment(cfg, write=False).status == "diverged"
    stats = empty_stats(2, 3, "full")
    update_stats(stats, torch.tensor([[1e30, 0, 0], [-1e30, 0, 0]]), torch.tensor([0, 0]), 1)
    assert torch.isinf(stats["var"][0]).any()
    h, _ = generate(stats, torch.tensor([1]), 2, torch.Generator().manual_seed(0))
    assert torch.isnan(h).all()


def test_unknown_covariance_is_refused_naming_the_option():
    cfg = digits_config(algorithm={"name": "gas", "covariance": "banana"}, **SETUP)
    with pytest.raises(ConfigError, match="covariance.*diagonal"):
        build_algorithm(cfg)


# ------------------------------------------------------------------ the round

B, K = 4, 2
COMP = [1e4, 2e5, 4e5]          # client 0 is a straggler
UP = [1e4, 2e4, 5e4]
DOWN = [4e4, 1e4, 2e4]
SETUP = dict(model={"name": "mlp", "hidden": [16, 8], "cut": 1},
             partition={"scheme": "iid", "num_clients": 3},
             participation={"mode": "full"},
             train={"batch_size": B, "local_steps": K, "local_epochs": None, "lr": 0.01})


def gas_config(rounds=1, **algo):
    return digits_config(algorithm={"name": "gas", **algo}, rounds=rounds, eval_every=10,
                         clock={"profile": "fixed", "client_compute": COMP, "uplink": UP,
                                "downlink": DOWN, "server_compute": 1e15}, **SETUP)


def run_spied(cfg):
    """Run; returns (env, records, state, served) where served lists (client, time of the
    upload being answered) at every scalar download, in order."""
    env = build_environment(cfg)
    served = []
    download = env.transport.download

    def spy(kind, ids, payload):
        if kind == "scalars":
            c = int(np.atleast_1d(ids)[0])
            served.append((c, float(env.clock.arrival_time([c])[0])))
        return download(kind, ids, payload)
    env.transport.download = spy
    logger = MetricLogger(None)
    state, _ = run_rounds(build_algorithm(cfg), env, logger)
    return env, logger.records, state, served


def sizes(env):
    shape = tuple(env.data.input_shape)
    client, _ = split(env.model, env.cut)
    cut = output_shape(client, shape)
    return dict(fc=forward_macs(client, shape),
                Mc=payload_bytes(client.state_dict(), per_client=False),
                A=B * math.prod(cut) * 4, L=B * 8)


def test_uploads_are_served_in_order_of_their_simulated_arrival():
    env, records, _, served = run_spied(gas_config())
    z = sizes(env)
    step = [3 * B * z["fc"] / COMP[c] + (3 * z["A"] + z["L"]) / UP[c] for c in range(3)]
    want = []
    for c in range(3):                   # the server is (almost) free: 1e15 MAC/s
        first = z["Mc"] / DOWN[c] + step[c]
        want += [(first, c), (first + 4 / DOWN[c] + step[c], c)]
    want.sort()
    assert [c for c, _ in served] == [c for _, c in want]
    # want leaves out the server's time: an upload's arrival can be delayed by at most all
    # of the server's work in the round (its MACs at 1e15 MAC/s, ~1e-9 s); the float64
    # sums of a few terms round by a few eps64 of t
    slack = sum(r.get("server_macs", 0) for r in records) / 1e15
    eps = sys.float_info.epsilon
    assert all(abs(t - w) <= slack + 8 * eps * w for (_, t), (w, _) in zip(served, want))
    # asynchronous: the fast clients' second steps come before the straggler's first
    assert [c for c, _ in served][-2:] == [0, 0]


def test_ledger_has_the_bytes_that_were_sent():
    env, rec, _, _ = run_spied(gas_config())
    z = sizes(env)
    t = 1
    for c in range(3):
        assert env.ledger.per_client(t, "activations", "up")[c] == K * 3 * z["A"]
        assert env.ledger.per_client(t, "labels", "up")[c] == K * z["L"]
        assert env.ledger.per_client(t, "scalars", "down")[c] == K * 4
        assert env.ledger.per_client(t, "model", "down")[c] == z["Mc"]
        assert env.ledger.per_client(t, "model", "up")[c] == z["Mc"]
    assert env.ledger.per_client(t, "activation_grads", "down").sum() == 0
    assert rec[-1]["bytes_up"] == 3 * (K * (3 * z["A"] + z["L"]) + z["Mc"])


def test_the_buffer_steps_every_buffer_size_uploads_and_keeps_the_rest():
    _, rec, state, _ = run_spied(gas_config())         # 6 uploads, buffer of 3 clients
    assert rec[1]["server_steps"] == 2 and state["buffer"] is None
    _, rec, state, _ = run_spied(gas_config(rounds=2, buffer_size=4))
    assert rec[1]["server_steps"] == 1                  # 6 uploads: one step, 2 kept
    assert rec[2]["server_steps"] == 2                  # 2 + 6 uploads: two steps
    assert state["buffer"] is None and state["server_steps"] == 3
    _, _, state, _ = run_spied(gas_config(buffer_size=5))
    assert state["buffer"]["h"].shape[0] == 1


def test_server_batch_is_topped_up_to_the_batch_size_per_class():
    # one step per round of 6 uploads x 4 real samples; every seen class is topped to 4
    env, rec, state, _ = run_spied(gas_config(buffer_size=6))
    counts = state["stats"]["weight"].long()            # step 1 weighs 1: n_k per class
    assert counts.sum() == 24
    topped = sum(max(0, B - int(n)) for n in counts if n > 0)
    assert topped > 0
    _, rec_off, _, _ = run_spied(gas_config(buffer_size=6, generate=False))
    # the record's server MACs are the server's passes: 2 (h+ and h-) over each of the 6
    # uploads' B samples to answer them, and 2 (a ZO step) over the step's samples
    _, server = split(env.model, env.cut)
    fs = forward_macs(server, output_shape(split(env.model, env.cut)[0],
                                           tuple(env.data.input_shape)))
    assert rec_off[1]["server_macs"] == (2 * 6 * B + 2 * 24) * fs
    assert rec[1]["server_macs"] == (2 * 6 * B + 2 * (24 + topped)) * fs


def test_a_run_weighs_the_s_th_server_steps_activations_by_s():
    """docs/design.md ("newer weighted more") and gas.py's module doc: the activations of
    the s-th server step weigh s in the per-class running statistics, so after a run
    weight_k = sum_s s n_{s,k} and mean / var are the s-weighted pooled mean and
    population variance of every activation the server stepped on. buffer_size 1: server
    step s is the s-th upload served (3 clients x 2 steps); each upload's h and labels
    are taken from the transport."""
    cfg = gas_config(buffer_size=1)
    env = build_environment(cfg)
    sent, since, served = {}, [], []      # per client: its (h, y) uploads, in order
    upload, download = env.transport.upload, env.transport.download

    def spy_up(kind, ids, payload):
        out = upload(kind, ids, payload)
        if kind == "activations":
            since.append(out)
        elif kind == "labels":           # the last upload of a step: h was its first
            sent.setdefault(int(np.atleast_1d(ids)[0]), []).append((since[0][0], out[0]))
            since.clear()
        return out

    def spy_down(kind, ids, payload):
        if kind == "scalars":
            served.append(int(np.atleast_1d(ids)[0]))
        return download(kind, ids, payload)
    env.transport.upload, env.transport.download = spy_up, spy_down
    state, _ = run_rounds(build_algorithm(cfg), env, MetricLogger(None))
    assert len(served) == 3 * K and state["server_steps"] == 3 * K
    h, y, w = [], [], []
    for s, c in enumerate(served, start=1):
        h_s, y_s = sent[c].pop(0)
        h.append(h_s.flatten(1))
        y.append(y_s)
        w.append(torch.full((len(y_s),), float(s)))
    h, y, w = torch.cat(h), torch.cat(y), torch.cat(w)
    stats = state["stats"]
    for k in range(10):
        m = y == k
        assert float(stats["weight"][k]) == float(w[m].sum()), k      # integers: exact
        if not m.any():
            continue
        want = {}
        for dtype in (torch.float32, torch.float64):
            f, wk = h[m].to(dtype), w[m].to(dtype)
            mean = (wk[:, None] * f).sum(0) / wk.sum()
            want[dtype] = mean, (wk[:, None] * (f - mean) ** 2).sum(0) / wk.sum()
        (mean32, var32), (mean64, var64) = want.values()
        assert_float_close(stats["mean"][k], mean32, mean64, what=f"mean {k}")
        assert_float_close(stats["var"][k], var32, var64, what=f"var {k}")


def test_full_covariance_beyond_the_memory_bound_is_refused_before_writing(tmp_path, capsys):
    """A split transformer's cut activation has sequence length x (hidden + 1) values:
    full class covariances of that size would be allocated once the run directory
    exists. The check says so first; the same option at an image model's cut runs."""
    from splitfed.algorithms import gas
    from splitfed.cli import main

    config = tmp_path / "text.yaml"
    config.write_text(
        "name: t\nrounds: 1\nalgorithm: {name: gas, covariance: full}\n"
        "data: {name: synthetic_text, vocab_size: 64, seq_len: 64, num_train: 32, "
        "num_test: 8}\npartition: {scheme: iid, num_clients: 2}\n"
        "model: {name: opt, vocab_size: 64, hidden_size: 256, num_heads: 4, ffn_dim: 32, "
        "num_layers: 2, cut: 1}\ntrain: {batch_size: 4, local_steps: 1, local_epochs: null}\n")
    text = [str(config), f"out_dir={tmp_path / 'runs'}"]
    assert main(["run", *text, "--dry-run"]) == 2
    assert main(["run", *text]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    dim = 64 * 257
    assert len(lines) == 2 and all(line.startswith(
        f"splitfed: error: algorithm.covariance: full keeps a {dim} x {dim} covariance "
        "per class at the cut") for line in lines), lines
    assert not (tmp_path / "runs").exists()
    cfg = digits_config(algorithm={"name": "gas", "covariance": "full"})
    build_algorithm(cfg).check(build_environment(cfg))          # a small cut: accepted
    assert gas.MAX_COVARIANCE_BYTES == 2 << 30
