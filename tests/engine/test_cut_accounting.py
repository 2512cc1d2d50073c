"""What a split algorithm's round costs, as predicted and as recorded.

Over-selection ranks the sampled clients by :func:`splitfed.engine.loop.client_work`, whose
cut traffic is the algorithm's ``cut_bytes``: it must be what the algorithm's round sends
through the transport (the ledger), client by client; whose compute is the algorithm's
``client_macs``: it must be what the clients' passes charged the clock, client by client.
The record's ``server_macs`` and ``client_macs`` must be what the server's and the
clients' passes charged the clock."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import digits_config

from splitfed.engine.clock import CLIENT, SERVER, SERVER_COPY
from splitfed.engine.flops import forward_macs
from splitfed.engine.loop import client_work, local_steps_of, run_rounds
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger
from splitfed.models import output_shape, split

B, K, N = 8, 2, 3
UP_KINDS = ("activations", "labels")
DOWN_KINDS = ("activation_grads", "scalars")


def _config(algorithm: dict, rounds: int = 2, **over):
    sections = dict(partition={"scheme": "iid", "num_clients": N},
                    participation={"mode": "full"},
                    model={"name": "mlp", "hidden": [32, 16], "cut": 1},
                    train={"batch_size": B, "local_steps": K, "local_epochs": None,
                           "lr": 0.05})
    sections.update(over)
    return digits_config(algorithm=algorithm, rounds=rounds, eval_every=100, **sections)


def _run(cfg):
    """Run ``cfg``; returns (algorithm, env, records of rounds 1.., server MACs the clock
    was charged in each round, client MACs it was charged in each round: an array with
    one entry per client)."""
    env = build_environment(cfg)
    algorithm = build_algorithm(cfg)
    charged: dict[int, int] = {}
    clients: dict[int, np.ndarray] = {}
    compute, replay = env.clock.compute, env.clock.replay_one

    def client(c, macs):
        per = clients.setdefault(env.ledger.round, np.zeros(env.num_clients, np.int64))
        np.add.at(per, c, macs)

    def tally(role, ids, macs):
        n = np.atleast_1d(np.asarray(ids)).size
        if role in (SERVER, SERVER_COPY):
            total = int(np.sum(np.broadcast_to(np.asarray(macs), (n,)))) if n else int(
                np.sum(macs))
            charged[env.ledger.round] = charged.get(env.ledger.round, 0) + total
        elif role == CLIENT:
            client(np.atleast_1d(np.asarray(ids)), np.broadcast_to(np.asarray(macs), (n,)))
        return compute(role, ids, macs)

    def tally_replay(c, events):
        events = list(events)
        for event in events:
            if event[0] == SERVER:
                charged[env.ledger.round] = charged.get(env.ledger.round, 0) + int(event[1])
            elif event[0] == CLIENT:
                client(np.array([c]), np.array([int(event[1])]))
        return replay(c, events)
    env.clock.compute, env.clock.replay_one = tally, tally_replay
    logger = MetricLogger(None)
    run_rounds(algorithm, env, logger)
    return algorithm, env, logger.records[1:], charged, clients


def _kept_over_three_rounds(algo: dict, clock: dict, common: dict) -> list[dict]:
    """Run three rounds of ``algo`` whose over-selection keeps one client, and check it
    keeps client 1 each round; returns the records of rounds 1.."""
    cfg = _config(algo, rounds=3, clock={**clock, "over_select": 1},
                  participation={"mode": "uniform", "clients_per_round": 1}, **common)
    env = build_environment(cfg)
    algorithm, kept = build_algorithm(cfg), []
    round_ = algorithm.round

    def spy(env_, state, t, cohort):
        kept.append(cohort.ids.tolist())
        return round_(env_, state, t, cohort)
    algorithm.round = spy
    logger = MetricLogger(None)
    run_rounds(algorithm, env, logger)
    assert kept == [[1], [1], [1]]
    return logger.records[1:]


def _recorded(env, t: int, kinds) -> np.ndarray:
    direction = "up" if kinds is UP_KINDS else "down"
    return sum(env.ledger.per_client(t, k, direction) for k in kinds)


# the split algorithms, with the options that change what crosses the cut
CASES = {
    "sl": {"name": "sl"},
    "sflv1": {"name": "sflv1"},
    "sflv2": {"name": "sflv2"},
    "csefsl": {"name": "csefsl"},
    "csefsl_period2_no_feedback": {"name": "csefsl", "period": 2, "server_feedback": False},
    "musplitfed": {"name": "musplitfed"},
    "musplitfed_q2": {"name": "musplitfed", "directions": 2},
    "musplitfed_first_order_client": {"name": "musplitfed", "client_order": "first"},
    "musplitfed_q3_in_place": {"name": "musplitfed", "directions": 3, "in_place": True},
    "gas": {"name": "gas"},
    "gas_q2": {"name": "gas", "directions": 2},
    "gas_q2_first_order_server": {"name": "gas", "directions": 2, "server_order": "first"},
    "csefsl_mlp_head_period2": {"name": "csefsl", "period": 2, "aux": "mlp",
                                "aux_hidden": 8},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_predicted_cut_bytes_are_the_ledgers(case):
    """Round by round and client by client, the cut bytes that over-selection predicts
    are those the ledger recorded (activations and labels up; activation gradients and
    scalars down). With the mlp [32, 16] cut after its first layer, one sample's
    activation is A = 32 float32 = 128 bytes and its label L = 8 bytes (int64):
    SL / SFL-V1 / SFL-V2: K B (A + L) up and K B A down; MU-SplitFed (one step) and GAS
    (K steps): per step B ((2 q + 1) A + L) up and q float32 scalars down; a first-order
    MU-SplitFed client: B (A + L) up, B A down; CSE-FSL: B (A + L) up and B A down (none
    without server feedback) in its upload rounds t = 1 + l, 1 + 2 l, ..., nothing in
    the others."""
    rounds = 5 if case.startswith("csefsl") else 2
    algorithm, env, _, _, _ = _run(_config(CASES[case], rounds=rounds))
    ids = np.arange(N)
    steps = local_steps_of(algorithm, env, ids)
    a, lab = 32 * 4, 8
    for t in range(1, rounds + 1):
        _, _, up, down, _ = client_work(algorithm, env, steps, t)
        np.testing.assert_array_equal(np.broadcast_to(up, (N,)), _recorded(env, t, UP_KINDS))
        np.testing.assert_array_equal(np.broadcast_to(down, (N,)),
                                      _recorded(env, t, DOWN_KINDS))
    opts = CASES[case]
    q = opts.get("directions", 1)
    k = int(steps[0])
    if opts["name"] in ("sl", "sflv1", "sflv2") or opts.get("client_order") == "first":
        want = (k * B * (a + lab), k * B * a)
    elif opts["name"] in ("musplitfed", "gas"):
        want = (k * B * ((2 * q + 1) * a + lab), k * q * 4)
    else:                       # CSE-FSL: the average round over the run's 5 rounds
        period, feedback = opts.get("period", 1), opts.get("server_feedback", True)
        share = ((rounds - 1) // period) / rounds       # l = 1: 4 of 5; l = 2: 2 of 5
        want = (share * B * (a + lab), share * B * a * feedback)
        total_up = sum(_recorded(env, t, UP_KINDS) for t in range(1, rounds + 1))
        total_down = sum(_recorded(env, t, DOWN_KINDS) for t in range(1, rounds + 1))
        _, _, up, down, _ = client_work(algorithm, env, steps)
        # byte counts are integers (exact in float64); the average divides once: the two
        # sides agree to the rounding of one division, eps64 / 2 ~ 1.1e-16 relative
        np.testing.assert_allclose(up, total_up / rounds, rtol=1e-15)
        np.testing.assert_allclose(down, total_down / rounds, rtol=1e-15)
    _, _, up, down, _ = client_work(algorithm, env, steps)
    np.testing.assert_allclose(np.broadcast_to(up, (N,)), want[0], rtol=1e-15)
    np.testing.assert_allclose(np.broadcast_to(down, (N,)), want[1], rtol=1e-15)


def _client_forward_macs(env) -> int:
    client, _ = split(env.model, env.cut)
    return forward_macs(client, tuple(env.data.input_shape))


@pytest.mark.parametrize("case", sorted(CASES))
def test_predicted_client_macs_are_what_the_clock_charged(case):
    """Round by round and client by client, the client MACs that over-selection predicts
    are those the clients' passes charged the clock, and the record's ``client_macs`` is
    their total. With the mlp [32, 16] cut after its first layer, one sample's forward
    pass through the client part is f_c = 64 x 32 MACs and through CSE-FSL's head f_a =
    32 x 10 (linear) or 32 x 8 + 8 x 10 (mlp, 8 hidden units): SL / SFL-V1 / SFL-V2: K B
    3 f_c (a forward and a backward pass); MU-SplitFed (one step) and GAS (K steps): per
    step B (2 q + 1) f_c (h and h+- of each direction, forward only); a first-order
    MU-SplitFed client: B (1 + 3) f_c (h, then a forward and a backward pass for its
    gradient); CSE-FSL: K B 3 (f_c + f_a), less the head's backward pass B 2 f_a on the
    first step of an upload round with server feedback (t = 1 + l, 1 + 2 l, ...)."""
    rounds = 5 if case.startswith("csefsl") else 2
    algorithm, env, records, _, clients = _run(_config(CASES[case], rounds=rounds))
    ids = np.arange(N)
    steps = local_steps_of(algorithm, env, ids)
    for t, rec in enumerate(records, 1):
        macs = client_work(algorithm, env, steps, t)[0]
        np.testing.assert_array_equal(np.broadcast_to(macs, (N,)), clients[t])
        assert rec["client_macs"] == int(clients[t].sum()) > 0
    opts = CASES[case]
    q, k, fc = opts.get("directions", 1), int(steps[0]), _client_forward_macs(env)
    if opts["name"] in ("sl", "sflv1", "sflv2"):
        want = [k * B * 3 * fc] * rounds
    elif opts.get("client_order") == "first":
        want = [k * B * 4 * fc] * rounds
    elif opts["name"] in ("musplitfed", "gas"):
        want = [k * B * (2 * q + 1) * fc] * rounds
    else:
        fa = 32 * 8 + 8 * 10 if opts.get("aux") == "mlp" else 32 * 10
        period, feedback = opts.get("period", 1), opts.get("server_feedback", True)
        want = [k * B * 3 * (fc + fa)
                - feedback * (t > 1 and (t - 1) % period == 0) * B * 2 * fa
                for t in range(1, rounds + 1)]
    assert [int(c[0]) for _, c in sorted(clients.items())] == want
    # the average round (the plan's), here over the run's rounds; integer MAC counts,
    # exact in float64, divided once: equal to the rounding of one division (~1.1e-16)
    np.testing.assert_allclose(np.broadcast_to(client_work(algorithm, env, steps)[0], (N,)),
                               sum(clients.values()) / rounds, rtol=1e-15)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "scaffold", "fedopt", "fedlora"])
def test_fl_client_macs_are_one_forward_and_backward_pass_per_sample(name):
    """An FL client's round is K B forward and backward passes of the model it trains,
    predicted, charged and recorded alike."""
    over = {} if name != "fedlora" else {"model": {"name": "mlp", "hidden": [32, 16]}}
    algorithm, env, records, _, clients = _run(_config({"name": name}, rounds=2, **over))
    steps = local_steps_of(algorithm, env, np.arange(N))
    whole = 3 * forward_macs(env.model, tuple(env.data.input_shape))
    for t, rec in enumerate(records, 1):
        macs = client_work(algorithm, env, steps, t)[0]
        np.testing.assert_array_equal(macs, steps * B * whole)
        np.testing.assert_array_equal(macs, clients[t])
        assert rec["client_macs"] == N * K * B * whole


def test_over_selection_keeps_the_client_whose_zeroth_order_compute_is_faster():
    """Two clients, one kept, MU-SplitFed with q = 4: each computes 2 q + 1 = 9 forward
    passes of its batch, 9 x 16 x 4,096 = 589,824 MACs. Client 0 computes 393,216 MACs/s
    over unlimited links (1.5 s); client 1 computes without limit and sends its model
    part and 9 activation tensors and the labels, 53,632 bytes, at 53,632 B/s (1 s).
    Priced as one forward and one backward pass (196,608 MACs, 0.5 s) client 0 would
    look faster."""
    common = dict(model={"name": "mlp", "hidden": [64], "cut": 1},
                  partition={"scheme": "iid", "num_clients": 2},
                  train={"batch_size": 16, "local_steps": 1, "local_epochs": None,
                         "lr": 0.05})
    clock = {"profile": "fixed", "client_compute": [393216.0, 3e38],
             "uplink": [3e38, 53632.0], "downlink": 3e38, "server_compute": 3e38}
    algo = {"name": "musplitfed", "directions": 4}
    _, env, both, _, clients = _run(_config(algo, rounds=2, clock=clock,
                                            participation={"mode": "full"}, **common))
    assert {r["slowest_client"] for r in both} == {0}
    assert clients[1].tolist() == [9 * 16 * 4096] * 2
    _kept_over_three_rounds(algo, clock, common)


def test_over_selection_keeps_the_client_whose_musplitfed_round_is_faster():
    """Two clients, one kept. Client 0 has an uplink of 1.3e5 B/s and an unlimited
    downlink, client 1 the reverse with a downlink of 1e5 B/s. A MU-SplitFed client
    sends three activation tensors and the labels up and receives one 4-byte scalar,
    so client 1 (model part down at 1e5) is faster than client 0 (model part and
    3 x 4,096 + 128 bytes up at 1.3e5); priced as first-order SFL (one activation
    tensor up, its gradient down) client 0 would look faster."""
    common = dict(model={"name": "mlp", "hidden": [64], "cut": 1},
                  partition={"scheme": "iid", "num_clients": 2},
                  train={"batch_size": 16, "local_steps": 1, "local_epochs": None,
                         "lr": 0.05})
    clock = {"profile": "fixed", "uplink": [1.3e5, 3e38], "downlink": [3e38, 1e5]}
    algo = {"name": "musplitfed"}
    # both clients: the round's slowest is the one whose own round is slower
    _, _, both, _, _ = _run(_config(algo, rounds=2, clock=clock,
                                 participation={"mode": "full"}, **common))
    assert {r["slowest_client"] for r in both} == {0}
    records = _kept_over_three_rounds(algo, clock, common)
    assert all(r["dropped"] == 1 for r in records)


def _server_forward_macs(env) -> int:
    client, server = split(env.model, env.cut)
    return forward_macs(server, output_shape(client, tuple(env.data.input_shape)))


@pytest.mark.parametrize("adaptive", [False, True])
def test_musplitfed_server_macs_are_what_the_clock_charged(adaptive):
    """A MU-SplitFed server copy takes tau zeroth-order steps of 2 forward passes each
    and 2 more passes for the client's scalar: 2 tau + 2 forward passes per sample (q =
    1), with the adaptive tau the round's own, all charged to the clock."""
    algo = {"name": "musplitfed", "tau": 2}
    clock = None
    if adaptive:               # slow clients, a fast server: tau well above 2
        algo = {"name": "musplitfed", "adaptive_tau": True, "max_tau": 6}
        clock = {"profile": "fixed", "client_compute": 1e6, "server_compute": 1e9,
                 "uplink": 1e6, "downlink": 1e6}
    over = {} if clock is None else {"clock": clock}
    _, env, records, charged, _ = _run(_config(algo, rounds=2, **over))
    fs = _server_forward_macs(env)
    for t, rec in enumerate(records, 1):
        tau = rec["tau"]
        assert tau == (6 if adaptive else 2)
        assert rec["server_macs"] == charged[t] == N * B * (2 * tau + 2) * fs


def test_gas_server_macs_are_what_the_clock_charged():
    """GAS's server answers every upload (2 passes over its B samples) and steps on the
    buffered and generated activations (2 passes); the record counts both."""
    _, env, records, charged, _ = _run(_config({"name": "gas"}, rounds=2))
    for t, rec in enumerate(records, 1):
        assert rec["server_macs"] == charged[t] > 0
    fs = _server_forward_macs(env)
    assert records[0]["server_macs"] > 2 * N * K * B * fs       # answers and steps


@pytest.mark.parametrize("case", ["sl", "sflv1", "sflv2", "csefsl"])
def test_first_order_server_macs_are_what_the_clock_charged(case):
    """SL, SFL-V1, SFL-V2 and CSE-FSL (in its upload rounds) run a forward and a backward
    pass of the server side per uploaded sample, as the record counts them."""
    _, env, records, charged, _ = _run(_config(CASES[case], rounds=2))
    fs = _server_forward_macs(env)
    for t, rec in enumerate(records, 1):
        samples = N * K * B if case != "csefsl" else (N * B if t == 2 else 0)
        assert rec["server_macs"] == charged.get(t, 0) == 3 * samples * fs
