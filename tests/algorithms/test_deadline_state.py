"""A round deadline drops a late client from everything it would have changed: SCAFFOLD's
control variates and FedCLG-S's correction term, not only the model average."""

from __future__ import annotations

import copy

import numpy as np
import torch
from helpers import assert_float_close, digits_config
from tests.algorithms.test_hybrid import SpyS, grad_at, param_names

from splitfed.engine.loop import run_rounds
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger

# client 2 computes 1000x slower than the others: about 650 simulated seconds of local
# work against about 3 s for the others, so a 100 s deadline drops exactly client 2
SPEEDS = {"client_compute": [1e5, 1e5, 1e2], "uplink": 1e4, "downlink": 4e4,
          "server_compute": 1e7}
LATE = 2


def _config(name, deadline, **over):
    train = over.pop("train", {"batch_size": 4, "local_steps": 2, "local_epochs": None,
                               "lr": 0.1})
    return digits_config(algorithm={"name": name, **over.pop("algorithm", {})}, rounds=1,
                         eval_every=10, model={"name": "mlp", "hidden": [32, 16]},
                         train=train,
                         clock={"profile": "fixed", "deadline": deadline, **SPEEDS}, **over)


def _run(cfg):
    env = build_environment(cfg)
    logger = MetricLogger(None)
    state, _ = run_rounds(build_algorithm(cfg), env, logger)
    return env, logger.records[-1], state


def test_scaffold_deadline_leaves_the_late_clients_controls_alone():
    env, rec, state = _run(_config("scaffold", deadline=100.0))
    assert rec["dropped"] == 1
    a = env.data_sizes / env.data_sizes.sum()
    ci, c = state["scaffold"]["client_controls"], state["scaffold"]["control"]
    for name in c:
        assert torch.count_nonzero(ci[name][LATE]) == 0, name           # still c_2 = 0
        for k in (0, 1):
            assert torch.count_nonzero(ci[name][k]) > 0, name
        # c started at 0 and every c_i at 0: c = sum over the kept clients of a_i c_i
        want32, want64 = (sum(float(a[k]) * ci[name][k].to(dtype) for k in (0, 1))
                          for dtype in (torch.float32, torch.float64))
        assert_float_close(c[name], want32, want64, what=name)
    # without a deadline every client's control moves
    _, rec, state = _run(_config("scaffold", deadline=None))
    assert rec["dropped"] == 0
    assert all(torch.count_nonzero(v[LATE]) > 0
               for v in state["scaffold"]["client_controls"].values())


def test_fedclg_s_deadline_drops_the_late_clients_correction():
    """K = 1: each kept client's Delta_i = -eta g_i cancels its correction term, so eq. 11
    over the kept clients (weights renormalised like their deltas) is x_t - eta_g eta g_s.
    A correction summed over every sampled client would not cancel the late one's g_i."""
    eta, eta_g = 0.1, 0.7
    cfg = _config("fedclg_s", deadline=100.0,
                  algorithm={"server_epochs": 0, "global_lr": eta_g},
                  train={"batch_size": 4, "local_steps": 1, "local_epochs": None, "lr": eta})
    env = build_environment(cfg)
    x0 = {k: v.clone() for k, v in env.model.state_dict().items()}
    algo = SpyS(SpyS.Options(server_epochs=0, global_lr=eta_g))
    logger = MetricLogger(None)
    state, _ = run_rounds(algo, env, logger)
    assert logger.records[-1]["dropped"] == 1
    rows = torch.from_numpy(np.asarray(algo.batches[0]))
    want = {}                                   # the server-gradient step, float32 and float64
    for dtype in (torch.float32, torch.float64):
        model, x = copy.deepcopy(env.model).to(dtype), env.data.train.x.to(dtype)
        start = {k: v.to(dtype) for k, v in x0.items()}
        g_s = grad_at(model, start, x, env.data.train.y, rows)
        want[dtype] = {n: start[n] - eta_g * eta * g_s[n] for n in param_names(model)}
    for n in param_names(env.model):
        assert_float_close(state["model"][n], want[torch.float32][n], want[torch.float64][n],
                           what=n)
