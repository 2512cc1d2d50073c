"""Over-selection (clock.over_select): sample ceil((1 + o) M) clients, keep the M that the
profiles predict to finish first, drop the others before they start."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import digits_config

from splitfed.engine.flops import forward_macs
from splitfed.engine.loop import client_work, run_rounds
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger
from splitfed.models import split
from splitfed.transport import payload_bytes

N, M = 6, 2
COMPUTE = [1e5, 8e5, 2e5, 6e5, 3e5, 4e5]     # MAC/s, all distinct
B, K = 4, 2


def _config(algorithm="fedavg", over=0.5, **over_cfg):
    sections = dict(
        participation={"mode": "uniform", "clients_per_round": M},
        clock={"profile": "fixed", "over_select": over, "client_compute": COMPUTE,
               "uplink": 1e5, "downlink": 1e5, "server_compute": 1e9})
    sections.update(over_cfg)
    return digits_config(algorithm={"name": algorithm}, rounds=3, eval_every=10,
                         partition={"scheme": "iid", "num_clients": N},
                         model={"name": "mlp", "hidden": [32, 16], "cut": 1},
                         train={"batch_size": B, "local_steps": K, "local_epochs": None,
                                "lr": 0.1}, **sections)


def _run(cfg):
    env = build_environment(cfg)
    sampled, trained = [], []
    sample = env.sampler.sample
    env.sampler.sample = lambda rng: sampled.append(sample(rng)) or sampled[-1]
    algo = build_algorithm(cfg)
    round_ = algo.round

    def spy(env_, state, t, cohort):
        trained.append(cohort)
        return round_(env_, state, t, cohort)
    algo.round = spy
    logger = MetricLogger(None)
    run_rounds(algo, env, logger)
    return env, sampled, trained, logger.records[1:]


@pytest.mark.parametrize("algorithm", ["fedavg", "sflv1"])
def test_keeps_the_predicted_fastest_and_renormalises(algorithm):
    env, sampled, trained, records = _run(_config(algorithm))
    speed = np.asarray(COMPUTE)
    for got, kept, rec in zip(sampled, trained, records):
        assert got.size == math.ceil(1.5 * M) == 3
        # equal work and links: the fastest computers finish first
        want = np.sort(got.ids[np.argsort(-speed[got.ids], kind="stable")[:M]])
        assert kept.ids.tolist() == want.tolist()
        sizes = env.data_sizes[kept.ids]
        np.testing.assert_allclose(kept.weights, sizes / sizes.sum())
        assert rec["participants"] == M and rec["dropped"] == 1
        assert rec["slowest_client"] == int(kept.ids[np.argmin(speed[kept.ids])])


def test_round_time_is_the_kept_clients():
    """FedAvg on fixed speeds: the round lasts as long as the slower kept client's model
    download, K local steps and upload; the over-selected slower client costs nothing."""
    env, sampled, trained, records = _run(_config("fedavg"))
    nbytes = payload_bytes(env.model.state_dict(), per_client=False)
    f = forward_macs(env.model, tuple(env.data.input_shape))
    for kept, rec in zip(trained, records):
        times = [nbytes / 1e5 + K * 3 * B * f / COMPUTE[c] + nbytes / 1e5 for c in kept.ids]
        # float64 sums of three terms in another order: a few eps64 apart; 1e-12 is far
        # above that and far below any duration left out
        assert rec["sim_round_s"] == pytest.approx(max(times), rel=1e-12)


def test_split_prediction_counts_the_cut_layer_traffic():
    """SFL-V1's prediction charges the model and the cut-layer traffic (activations and
    labels up, their gradients down per sample): with equal compute and distinct
    uplinks the kept clients are those with the fastest uplinks."""
    cfg = _config("sflv1")
    env = build_environment(cfg)
    macs, model, up, down, messages = client_work(build_algorithm(cfg), env, K)
    client, _ = split(env.model, env.cut)
    assert model == payload_bytes(client.state_dict(), per_client=False)
    assert down == K * B * 32 * 4                            # cut 1 of mlp [32, 16]
    assert up == K * B * (32 * 4 + env.data.train.y.element_size())
    assert macs == K * B * 3 * forward_macs(client, tuple(env.data.input_shape))
    uplink = [1e4, 9e4, 3e4, 7e4, 2e4, 5e4]
    cfg = _config("sflv1", clock={"profile": "fixed", "over_select": 0.5,
                                  "client_compute": 1e6, "uplink": uplink,
                                  "downlink": 1e5, "server_compute": 1e9})
    _, sampled, trained, _ = _run(cfg)
    rate = np.asarray(uplink)
    for got, kept in zip(sampled, trained):
        want = np.sort(got.ids[np.argsort(-rate[got.ids], kind="stable")[:M]])
        assert kept.ids.tolist() == want.tolist()


def test_off_by_default_and_identical_to_plain_uniform():
    """over_select = 0 is plain uniform sampling: the same cohorts and parameters."""
    cfg = _config("fedavg", over=0.0)
    _, sampled, trained, _ = _run(cfg)
    assert all(s.size == M and np.array_equal(s.ids, t.ids) for s, t in zip(sampled, trained))


def test_capped_at_the_number_of_clients():
    env = build_environment(_config(over=10.0))
    assert env.sampler.m == N


@pytest.mark.parametrize("participation", [
    {"mode": "full"}, {"mode": "bernoulli", "q": 0.5},
    {"mode": "with_replacement", "clients_per_round": 2}])
def test_needs_uniform_participation(participation):
    with pytest.raises(ConfigError, match="^clock.over_select: needs participation.mode uniform"):
        build_environment(_config(participation=participation))


def test_negative_is_refused():
    with pytest.raises(ConfigError, match="over_select"):
        _config(over=-0.1)


def test_deterministic():
    a = _run(_config("fedavg"))
    b = _run(_config("fedavg"))
    assert [t.ids.tolist() for t in a[2]] == [t.ids.tolist() for t in b[2]]
    assert [r["sim_time_s"] for r in a[3]] == [r["sim_time_s"] for r in b[3]]
    assert torch.equal(torch.tensor([r["train_loss"] for r in a[3]]),
                       torch.tensor([r["train_loss"] for r in b[3]]))


@pytest.mark.parametrize("client_gradient", ["fresh_batch", "full"])
@pytest.mark.parametrize("algorithm", ["fedclg_c", "fedclg_s"])
def test_fedclg_prediction_counts_the_client_gradient_pass(algorithm, client_gradient):
    """Two clients, one kept. Client 0 computes the K B = 8 samples of its local steps
    in 0.5 s over unlimited links; client 1 computes without limit and sends what a round
    uploads (the model, and g^i_t under FedCLG-S) in 0.6 s. FedCLG's own pass for g^i_t
    (B = 4 more samples with ``fresh_batch``: 0.75 s; all of client 0's with ``full``)
    makes client 0 the slower, as a round with both clients shows, and over-selection
    keeps client 1; a prediction without that pass would keep client 0."""
    def config(clock=None, **sections):
        return digits_config(algorithm={"name": algorithm, "client_gradient": client_gradient},
                             rounds=2, eval_every=10,
                             partition={"scheme": "iid", "num_clients": 2},
                             model={"name": "mlp", "hidden": [8]},
                             train={"batch_size": B, "local_steps": K, "local_epochs": None,
                                    "lr": 0.1}, **({"clock": clock} if clock else {}),
                             **sections)

    cfg = config()
    env = build_environment(cfg)
    whole = 3 * forward_macs(env.model, tuple(env.data.input_shape))
    up = payload_bytes(env.model.state_dict(), per_client=False) * (
        2 if algorithm == "fedclg_s" else 1)
    clock = {"profile": "fixed", "client_compute": [K * B * whole / 0.5, 3e38],
             "uplink": [3e38, up / 0.6], "downlink": 3e38, "server_compute": 3e38}
    extra = B if client_gradient == "fresh_batch" else env.data_sizes
    algo = build_algorithm(cfg)
    predicted = client_work(algo, env, K, ids=np.arange(2))[0]
    np.testing.assert_array_equal(predicted, (K * B + extra) * whole)
    _, _, _, both = _run(config(clock, participation={"mode": "full"}))
    assert [r["slowest_client"] for r in both] == [0, 0]
    _, sampled, trained, records = _run(config(
        {**clock, "over_select": 1.0},
        participation={"mode": "uniform", "clients_per_round": 1}))
    assert all(sorted(s.ids.tolist()) == [0, 1] for s in sampled)
    assert [t.ids.tolist() for t in trained] == [[1], [1]]
    assert all(r["dropped"] == 1 for r in records)
