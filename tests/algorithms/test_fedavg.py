"""FedAvg and the centralized reference end to end on small real data (digits)."""

import numpy as np
import pytest
import torch
from helpers import assert_float_close, digits_config

from splitfed.config import build_config
from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.experiment import build_environment, run_experiment
from splitfed.rng import RandomStreams
from splitfed.transport import payload_bytes


def final_params(result):
    state = result.state
    if "model" in state:
        return state["model"]
    return state["module"].state_dict()


def test_fedavg_one_client_one_step_equals_centralized_sgd_step():
    common = dict(rounds=1, partition__num_clients=1, train__local_steps=1)
    fed = run_experiment(digits_config(**common), write=False)
    cen = run_experiment(digits_config(algorithm={"name": "centralized"}, **common),
                         write=False)
    cfg = digits_config(**common)
    want32, want64 = _reference_fedavg(cfg, 1), _reference_fedavg(cfg, 1, torch.float64)
    for name, got in (("fedavg", final_params(fed)), ("centralized", final_params(cen))):
        for k in want64:
            # weight gradients sum over the batch and the input features
            assert_float_close(got[k], want32[k], want64[k], terms=8 * 64, what=f"{name} {k}")
    assert fed.records[-1]["test_acc"] == cen.records[-1]["test_acc"]


def _reference_fedavg(cfg, rounds, dtype=torch.float32):
    """Plain unbatched FedAvg, one client at a time, on the same batches, in ``dtype``."""
    env = build_environment(cfg)
    model = env.model.to(dtype)
    streams = RandomStreams(cfg.seed)
    rng = streams.numpy("batches")
    sizes = env.data_sizes
    w = sizes / sizes.sum()
    x, y = env.data.train.x.to(dtype), env.data.train.y
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(rounds):
        steps = local_step_counts(sizes, cfg.train.batch_size, cfg.train.local_steps,
                                  cfg.train.local_epochs)
        new = {k: torch.zeros_like(v) for k, v in glob.items()}
        for c in range(env.num_clients):
            plan = batch_plan(env.client_indices[c], int(steps[c]), cfg.train.batch_size, rng)
            model.load_state_dict(glob)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr,      # new per round
                                  momentum=cfg.train.momentum,
                                  weight_decay=cfg.train.weight_decay)
            for rows in torch.from_numpy(plan):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
                opt.step()
            for k, v in model.state_dict().items():
                new[k] += float(w[c]) * v
        glob = new
    return glob


@pytest.mark.numerics
def test_fedavg_matches_unbatched_reference_over_rounds():
    cfg = digits_config(rounds=3, partition={"scheme": "dirichlet", "num_clients": 4,
                                             "alpha": 1.0, "min_partition_size": 5},
                        train={"batch_size": 8, "local_steps": None, "local_epochs": 0.2,
                               "lr": 0.1})
    got = final_params(run_experiment(cfg, write=False))
    want32, want64 = _reference_fedavg(cfg, 3), _reference_fedavg(cfg, 3, torch.float64)
    for k in want64:
        # weight gradients sum over the batch and the input features
        assert_float_close(got[k], want32[k], want64[k], terms=8 * 64, what=k)


def test_fedavg_is_deterministic_for_a_seed():
    cfg = digits_config(participation={"mode": "uniform", "clients_per_round": 2})
    r1, r2 = run_experiment(cfg, write=False), run_experiment(cfg, write=False)
    for k, v in final_params(r1).items():
        assert torch.equal(v, final_params(r2)[k])
    strip = [{k: v for k, v in r.items() if k != "round_time_s"} for r in r1.records]
    assert strip == [{k: v for k, v in r.items() if k != "round_time_s"} for r in r2.records]
    r3 = run_experiment(build_config({**_raw(cfg), "seed": 4}), write=False)
    assert any(not torch.equal(v, final_params(r1)[k]) for k, v in final_params(r3).items())


def _raw(cfg):
    from splitfed.configtools import to_dict
    return to_dict(cfg)


def test_ledger_counts_models_of_sampled_clients_only():
    cfg = digits_config(rounds=1, partition={"scheme": "iid", "num_clients": 5},
                        participation={"mode": "uniform", "clients_per_round": 2})
    result = run_experiment(cfg, write=False)
    env = build_environment(cfg)
    env_model_bytes = payload_bytes(env.model.state_dict(), per_client=False)
    rec = result.records[-1]
    assert rec["participants"] == 2
    assert rec["bytes_down/model"] == 2 * env_model_bytes
    assert rec["bytes_up/model"] == 2 * env_model_bytes
    assert rec["bytes_up"] == rec["bytes_up/model"]
    assert set(k for k in rec if k.startswith("bytes_")) == {
        "bytes_up", "bytes_down", "bytes_up/model", "bytes_down/model"}


def test_fedavg_learns_on_digits():
    cfg = digits_config(rounds=8, partition={"scheme": "iid", "num_clients": 4},
                        train={"batch_size": 16, "local_steps": 10, "local_epochs": None,
                               "lr": 0.1})
    res = run_experiment(cfg, write=False)
    first = res.records[0]["test_acc"]
    last = res.records[-1]["test_acc"]
    assert res.records[1]["train_loss"] > res.records[-1]["train_loss"]
    assert first < 0.3 and last > 0.85, (first, last)


def test_bernoulli_empty_round_keeps_model():
    cfg = digits_config(rounds=1, partition={"scheme": "iid", "num_clients": 3},
                        participation={"mode": "bernoulli", "q": 0.001})
    res = run_experiment(cfg, write=False)
    env = build_environment(cfg)
    assert res.records[-1]["participants"] == 0
    for k, v in env.model.state_dict().items():
        assert torch.equal(final_params(res)[k], v)
    assert np.isclose(res.records[-1]["test_acc"], res.records[0]["test_acc"])


@pytest.mark.parametrize("algorithm", [{"name": "centralized"},
                                       {"name": "server_only", "server_steps": 2}])
def test_a_server_alone_run_samples_no_client(algorithm):
    """Centralized training and server-only have no clients: their records count no
    participant whatever the participation section and the clock's deadline say, and
    those settings change nothing in the training."""
    common = dict(algorithm=algorithm, rounds=2, partition__num_clients=4,
                  server_data={"fraction": 0.2, "samples_per_round": 40})
    if algorithm["name"] == "centralized":
        del common["server_data"]
    plain = run_experiment(digits_config(**common), write=False)
    other = run_experiment(digits_config(
        **common, participation={"mode": "uniform", "clients_per_round": 2},
        clock={"deadline": 1e-9, "profile": "exponential"}), write=False)
    for result in (plain, other):
        for r in result.records[1:]:
            assert (r["participants"], r["clients_used"], r["dropped"]) == (0, 0, 0), r
            assert r["bytes_up"] == r["bytes_down"] == 0
        assert result.status == "completed"
    a, b = final_params(plain), final_params(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train_loss"] for r in plain.records[1:]] == \
        [r["train_loss"] for r in other.records[1:]]
