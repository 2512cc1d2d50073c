"""Conformance: every registered algorithm passes these checks automatically.

It runs a few rounds on small real data (scikit-learn's digits), it learns, it is
deterministic for a seed, and it respects participation (clients that were not sampled
send and receive nothing).
"""

import numpy as np
import pytest
import torch

from splitfed.algorithms import ALGORITHMS
from splitfed.config import build_config
from splitfed.engine.loop import run_rounds
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger
from splitfed.transport import InProcessTransport

NAMES = sorted(ALGORITHMS)


def config(name, *, learn=False, **over):
    raw = {"name": name, "rounds": 6, "progress": False, "seed": 11,
           "algorithm": {"name": name},
           "data": {"name": "digits"},
           "partition": {"scheme": "dirichlet", "num_clients": 6, "alpha": 1.0,
                         "min_partition_size": 5},
           "model": {"name": "mlp", "hidden": [32]},
           "train": {"batch_size": 16, "local_steps": 8, "local_epochs": None, "lr": 0.1},
           "participation": {"mode": "uniform", "clients_per_round": 3}}
    if learn:
        for key, value in ALGORITHMS[name].conformance_overrides.items():
            raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    raw.update(over)
    return build_config(raw)


def run(cfg):
    env = build_environment(cfg)
    logger = MetricLogger(None)
    state, status = run_rounds(build_algorithm(cfg), env, logger)
    return env, logger.records, state, status


def flat(state):
    out = []
    for v in state.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out += flat(v)
        elif isinstance(v, torch.nn.Module):
            out += list(v.state_dict().values())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_learns(name):
    _, records, _, status = run(config(name, learn=True))
    assert status == "completed"
    assert records[-1]["test_acc"] > records[0]["test_acc"] + 0.3
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_a_seed(name):
    cfg = config(name, rounds=2)
    _, rec1, s1, _ = run(cfg)
    _, rec2, s2, _ = run(cfg)
    for a, b in zip(flat(s1), flat(s2)):
        assert torch.equal(a, b)
    def drop(rs):
        return [{k: v for k, v in r.items() if k != "round_time_s"} for r in rs]
    assert drop(rec1) == drop(rec2)


@pytest.mark.parametrize("name", [n for n in NAMES if ALGORITHMS[n].federated])
def test_non_sampled_clients_send_nothing(name):
    cfg = config(name, rounds=2)
    env = build_environment(cfg)
    algo = build_algorithm(cfg)
    state = algo.init_state(env)
    for t in (1, 2):
        env.ledger.round = t
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        state, _ = algo.round(env, state, t, cohort)
        sampled = np.zeros(env.num_clients, dtype=bool)
        sampled[cohort.ids] = True
        for (kind, direction) in [(k, d) for k in ("model", "activations", "labels",
                                                   "activation_grads", "scalars")
                                  for d in ("up", "down")]:
            per_client = env.ledger.per_client(t, kind, direction)
            assert (per_client[~sampled] == 0).all(), (kind, direction)
        assert env.ledger.round_totals(t)["bytes_up"] > 0


class CountingTransport(InProcessTransport):
    """Counts the bytes of every tensor it actually delivers, independently of the ledger."""

    def __init__(self, ledger):
        super().__init__(ledger)
        self.delivered = 0

    def send(self, kind, direction, client_ids, payload, *, per_client=True):
        tensors = [payload] if isinstance(payload, torch.Tensor) else list(payload.values())
        n = len(np.atleast_1d(client_ids))
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.delivered += size if per_client else size * n
        return super().send(kind, direction, client_ids, payload, per_client=per_client)


@pytest.mark.parametrize("name", [n for n in NAMES if ALGORITHMS[n].federated])
def test_ledger_matches_the_tensors_actually_moved(name):
    cfg = config(name, rounds=2)
    env = build_environment(cfg)
    env.transport = CountingTransport(env.ledger)
    logger = MetricLogger(None)
    run_rounds(build_algorithm(cfg), env, logger)
    ledgered = sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in logger.records)
    assert ledgered == env.transport.delivered == env.ledger.total() > 0


MODES = [{"mode": "full"}, {"mode": "with_replacement", "clients_per_round": 4},
         {"mode": "bernoulli", "q": 0.5}]


@pytest.mark.parametrize("participation", MODES, ids=[m["mode"] for m in MODES])
@pytest.mark.parametrize("name", [n for n in NAMES if ALGORITHMS[n].federated])
def test_every_participation_mode_and_local_epochs(name, participation):
    cfg = config(name, rounds=2, participation=participation,
                 train={"batch_size": 16, "local_steps": None, "local_epochs": 0.5,
                        "lr": 0.1})
    env, records, _, status = run(cfg)
    assert status == "completed"
    for r in records[1:]:
        assert r["participants"] >= 0
        if r["participants"]:
            assert np.isfinite(r["train_loss"]) and r["bytes_up"] > 0
