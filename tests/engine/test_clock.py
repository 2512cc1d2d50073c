"""The virtual clock: hand-computed one-round timelines of FedAvg, SL, SFL-V1 and SFL-V2
with three clients at fixed, distinct speeds, with and without a deadline; determinism;
speeds change only the times; the profile generators and the trace loader."""

import math
import re

import numpy as np
import pytest
import torch
from helpers import assert_float_close, digits_config

from splitfed.algorithms import ALGORITHMS
from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.clock import CLIENT, SERVER_COPY, EventQueue, VirtualClock
from splitfed.engine.flops import forward_macs
from splitfed.engine.loop import run_rounds
from splitfed.engine.participation import Cohort
from splitfed.engine.profiles import Profiles, build_profiles, fixed, load_trace
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger
from splitfed.models import output_shape, split
from splitfed.rng import RandomStreams
from splitfed.study import time_to_target
from splitfed.transport import payload_bytes

#: simulated times are float64 sums and maxima of a handful of terms, added here in
#: another order than the clock adds them: a few eps64 (2.2e-16) of the total apart.
#: 1e-12 is thousands of those and far below any modelled duration left out or added
#: twice (each is over 1e-3 of a round here).
TIME_REL = 1e-12
B, K = 4, 2
COMP = [1e5, 2e5, 4e5]          # client MAC/s
UP = [1e4, 2e4, 5e3]            # bytes/s
DOWN = [4e4, 1e4, 2e4]
SERVER = 2e4                    # MAC/s: slow, so that SFL-V2's server lane queues
SPEEDS = {"client_compute": COMP, "uplink": UP, "downlink": DOWN, "server_compute": SERVER}


def config(algorithm, rounds=1, deadline=None, speeds=SPEEDS, profile="fixed", **over):
    return digits_config(algorithm={"name": algorithm}, rounds=rounds, eval_every=10,
                         model={"name": "mlp", "hidden": [32, 16], "cut": 1},
                         train={"batch_size": B, "local_steps": K, "local_epochs": None,
                                "lr": 0.1},
                         clock={"profile": profile, "deadline": deadline, **speeds}, **over)


def run(cfg):
    """(env, records, final state, model uploads {client: state}, start model)."""
    env = build_environment(cfg)
    start = {k: v.clone() for k, v in env.model.state_dict().items()}
    uploads: dict[int, dict] = {}
    upload = env.transport.upload

    def spy(kind, ids, payload):
        out = upload(kind, ids, payload)
        if kind == "model":
            for i, c in enumerate(np.atleast_1d(ids).tolist()):
                uploads[c] = {k: v[i].clone() for k, v in out.items()}
        return out
    env.transport.upload = spy
    logger = MetricLogger(None)
    state, _ = run_rounds(build_algorithm(cfg), env, logger)
    return env, logger.records, state, uploads, start


def sizes(env):
    """Forward MACs per sample (full, client side, server side) and bytes of one transfer
    (full model, client model, activations of a batch, labels of a batch)."""
    shape = tuple(env.data.input_shape)
    client, server = split(env.model, env.cut)
    cut = output_shape(client, shape)
    return dict(f=forward_macs(env.model, shape), fc=forward_macs(client, shape),
                fs=forward_macs(server, cut),
                M=payload_bytes(env.model.state_dict(), per_client=False),
                Mc=payload_bytes(client.state_dict(), per_client=False),
                A=B * math.prod(cut) * 4, L=B * 8)


def kept_average(start, uploads, weights, kept, keys, dtype=torch.float32):
    """start + the kept clients' renormalised weighted updates, in ``dtype``."""
    w = {c: weights[c] / sum(weights[k] for k in kept) for c in kept}
    return {k: start[k].to(dtype) + sum(w[c] * (uploads[c][k].to(dtype) - start[k].to(dtype))
                                        for c in kept) for k in keys}


def close(got, *average):
    """``got`` matches ``kept_average(*average)`` computed in float32 and in float64 within
    the rounding bound of tests/helpers.py."""
    want32 = kept_average(*average)
    want64 = kept_average(*average, dtype=torch.float64)
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)


def check_round(rec, times, deadline=None):
    """The round's record against per-client finishing times."""
    end = max(times)
    late = [c for c, t in enumerate(times) if deadline is not None and t > deadline]
    assert rec["sim_round_s"] == pytest.approx(min(end, deadline or end), rel=TIME_REL)
    assert rec["sim_time_s"] == pytest.approx(rec["sim_round_s"], rel=TIME_REL)
    assert rec["slowest_client"] == int(np.argmax(times))
    assert rec["dropped"] == len(late)
    return late


def between(times, i):
    """A deadline halfway between the i-th and (i+1)-th finishing times."""
    s = sorted(times)
    return (s[i] + s[i + 1]) / 2


# ------------------------------------------------------------------- FedAvg

def fedavg_times(z):
    return [z["M"] / DOWN[c] + K * 3 * B * z["f"] / COMP[c] + z["M"] / UP[c]
            for c in range(3)]


def test_fedavg_timeline():
    env, rec, *_ = run(config("fedavg"))
    times = fedavg_times(sizes(env))
    check_round(rec[1], times)


def test_fedavg_deadline_drops_the_late_client_and_renormalises():
    env = build_environment(config("fedavg"))
    times = fedavg_times(sizes(env))
    deadline = between(times, 1)
    env, rec, state, uploads, start = run(config("fedavg", deadline=deadline))
    late = check_round(rec[1], times, deadline)
    assert late == [int(np.argmax(times))]
    kept = [c for c in range(3) if c not in late]
    close(state["model"], start, uploads, env.data_sizes, kept, start)
    _, rec, *_ = run(config("fedavg", deadline=max(times) + 1))   # nobody is late
    check_round(rec[1], times, max(times) + 1)


def test_clgsgd_server_epochs_start_at_the_deadline_and_are_not_cut():
    """The server's own training starts once the latest upload is in, or at the deadline
    when a later one is dropped; the round lasts until that training ends."""
    over = {"server_data": {"samples_per_round": 40}}
    env = build_environment(config("clgsgd", **over))
    times = fedavg_times(sizes(env))
    _, rec, *_ = run(config("clgsgd", **over))
    server = rec[1]["server_macs"] / SERVER          # the server's own work, seconds
    assert server > 1.0                              # far longer than any client's
    assert rec[1]["sim_round_s"] == pytest.approx(max(times) + server, rel=TIME_REL)
    deadline = between(times, 1)
    _, rec, *_ = run(config("clgsgd", deadline=deadline, **over))
    assert rec[1]["dropped"] == 1
    assert rec[1]["sim_round_s"] == pytest.approx(deadline + server, rel=TIME_REL)


def test_fedclg_server_gradient_is_on_the_clock():
    """g^s_t (Algorithm 1 line 4) is computed on the server at the round's start: under
    FedCLG-C the clients wait for it (it comes with x_t, one more model-sized download);
    under FedCLG-S it overlaps the clients' work (each uploads g^i_t besides its model)."""
    over = {"server_data": {"samples_per_round": 40}}
    z = sizes(build_environment(config("fedavg")))
    times = fedavg_times(z)
    _, steps, *_ = run(config("clgsgd", **over))           # the same server steps
    steps_s = steps[1]["server_macs"] / SERVER
    _, rec, *_ = run(config("fedclg_c", **over))
    g_s = rec[1]["server_macs"] / SERVER - steps_s
    assert g_s > 1.0
    clients = max(times[c] + z["M"] / DOWN[c] for c in range(3))
    assert rec[1]["sim_round_s"] == pytest.approx(g_s + clients + steps_s, rel=TIME_REL)
    _, rec, *_ = run(config("fedclg_s", **over))
    clients = max(times[c] + z["M"] / UP[c] for c in range(3))
    assert clients > g_s
    assert rec[1]["sim_round_s"] == pytest.approx(clients + steps_s, rel=TIME_REL)
    for name in ("fedclg_c", "fedclg_s"):     # every client late: g^s, then the steps
        _, rec, *_ = run(config(name, deadline=0.25, **over))
        assert rec[1]["dropped"] == 3
        assert rec[1]["sim_round_s"] == pytest.approx(g_s + steps_s, rel=TIME_REL)


@pytest.mark.parametrize("name", ["clgsgd", "scaffold_plus"])
def test_hybrid_rounds_whose_every_client_is_late_last_the_deadline_and_server_work(
        name, monkeypatch):
    own = []
    compute = VirtualClock.compute

    def spy(self, role, ids, macs):
        if role == "server" and (ids is None or np.size(ids) == 0):
            own.append(float(np.sum(macs)) / SERVER)
        return compute(self, role, ids, macs)

    monkeypatch.setattr(VirtualClock, "compute", spy)
    deadline = 0.25                                  # before any client's upload
    _, rec, *_ = run(config(name, deadline=deadline,
                            server_data={"samples_per_round": 40}))
    assert rec[1]["dropped"] == 3 and sum(own) > 1.0
    assert rec[1]["sim_round_s"] == pytest.approx(deadline + sum(own), rel=TIME_REL)


# ------------------------------------------------------------------- SL

def sl_times(z, order):
    """Client i's turn starts when client i-1's model has reached the server; the server
    never queues (one client at a time)."""
    per_step = {c: (3 * B * z["fc"] / COMP[c] + (z["A"] + z["L"]) / UP[c]
                    + 3 * B * z["fs"] / SERVER + z["A"] / DOWN[c]) for c in range(3)}
    done, times = 0.0, [0.0] * 3
    for c in order:
        done = done + z["Mc"] / DOWN[c] + K * per_step[c] + z["Mc"] / UP[c]
        times[c] = done
    return times


def sl_order(cfg):
    return RandomStreams(cfg.seed).numpy("order").permutation(3)


def test_sl_timeline():
    cfg = config("sl")
    env, rec, *_ = run(cfg)
    check_round(rec[1], sl_times(sizes(env), sl_order(cfg)))


def test_sl_deadline_skips_late_turns_and_keeps_the_last_timely_hand_over():
    cfg = config("sl")
    order = sl_order(cfg)
    times = sl_times(sizes(build_environment(cfg)), order)
    deadline = between(times, 0)          # the 1st finishes, the 2nd is late, the 3rd waits
    cfg = config("sl", deadline=deadline)
    env, rec, state, uploads, start = run(cfg)
    assert rec[1]["sim_round_s"] == pytest.approx(deadline, rel=TIME_REL)
    assert rec[1]["dropped"] == 2
    assert set(uploads) == {int(order[0]), int(order[1])}
    assert env.ledger.per_client(1, "model", "down")[order[2]] == 0   # never started
    client_keys = list(split(env.model, env.cut)[0].state_dict())
    # global_lr 1: the start moved by the whole of the last timely client's update
    close(state["model"], start, uploads, env.data_sizes, [int(order[0])], client_keys)


# ------------------------------------------------------------------- SFL-V1

def sflv1_times(z):
    """Own server lane per client: no queueing, every client on its own."""
    return [z["Mc"] / DOWN[c] + z["Mc"] / UP[c]
            + K * (3 * B * z["fc"] / COMP[c] + (z["A"] + z["L"]) / UP[c]
                   + 3 * B * z["fs"] / SERVER + z["A"] / DOWN[c]) for c in range(3)]


def test_sflv1_timeline():
    env, rec, *_ = run(config("sflv1"))
    check_round(rec[1], sflv1_times(sizes(env)))


def test_sflv1_deadline_aggregates_the_kept_clients_on_both_sides():
    env = build_environment(config("sflv1"))
    times = sflv1_times(sizes(env))
    deadline = between(times, 0)          # two clients are late
    env, rec, state, _, start = run(config("sflv1", deadline=deadline))
    late = check_round(rec[1], times, deadline)
    assert len(late) == 2
    kept = [c for c in range(3) if c not in late]
    # SFL-V1 with tau_tilde = tau is FedAvg on the whole model: the kept clients' FedAvg
    # models, averaged over the kept clients only
    _, _, _, full, _ = run(config("fedavg"))
    close(state["model"], start, full, env.data_sizes, kept, start)


# ------------------------------------------------------------------- SFL-V2

def sflv2_times(z, seed):
    """One shared server lane, served in a fresh random order every iteration."""
    rng = RandomStreams(seed).numpy("order")
    t = [z["Mc"] / DOWN[c] for c in range(3)]
    lane = 0.0
    for _ in range(K):
        arrival = [t[c] + B * z["fc"] / COMP[c] + (z["A"] + z["L"]) / UP[c] for c in range(3)]
        reply = [0.0] * 3
        for c in rng.permutation(3):
            lane = max(lane, arrival[c]) + 3 * B * z["fs"] / SERVER
            reply[c] = lane
        t = [max(arrival[c], reply[c]) + z["A"] / DOWN[c] + 2 * B * z["fc"] / COMP[c]
             for c in range(3)]
    return [t[c] + z["Mc"] / UP[c] for c in range(3)]


def test_sflv2_timeline():
    cfg = config("sflv2")
    env, rec, *_ = run(cfg)
    z = sizes(env)
    times = sflv2_times(z, cfg.seed)
    check_round(rec[1], times)
    # the server queues: the round is longer than with a lane per client (SFL-V1)
    assert max(times) > max(sflv1_times(z)) + 1e-9


def test_sflv2_deadline_drops_client_models_but_keeps_server_updates():
    cfg = config("sflv2")
    env, _, free, *_ = run(cfg)
    times = sflv2_times(sizes(env), cfg.seed)
    deadline = between(times, 1)
    env, rec, state, uploads, start = run(config("sflv2", deadline=deadline))
    late = check_round(rec[1], times, deadline)
    kept = [c for c in range(3) if c not in late]
    client_keys, server_keys = (list(m.state_dict()) for m in split(env.model, env.cut))
    close(state["model"], start, uploads, env.data_sizes, kept, client_keys)
    for k in server_keys:
        assert torch.equal(state["model"][k], free["model"][k])


# ------------------------------------------------------------------- determinism

def sim(records):
    return [(r["sim_round_s"], r["sim_time_s"], r["slowest_client"], r["dropped"])
            for r in records[1:]]


def test_same_seed_same_timeline_and_the_clock_stream_is_its_own():
    opts = {"mean": 1.0, "delay_mean": 0.01}
    a = run(config("sflv2", rounds=2, profile="exponential", speeds=opts))
    b = run(config("sflv2", rounds=2, profile="exponential", speeds=opts))
    assert sim(a[1]) == sim(b[1])
    assert sim(a[1])[0][0] != sim(a[1])[1][0]            # a fresh draw every round
    c = run(config("sflv2", rounds=2, profile="exponential", speeds=opts, seed=4))
    assert sim(c[1]) != sim(a[1])
    fixed = run(config("sflv2", rounds=2))
    for x, y in zip(a[2]["model"].values(), fixed[2]["model"].values()):
        assert torch.equal(x, y)                          # draws never touch the learning


@pytest.mark.parametrize("name", [n for n in sorted(ALGORITHMS)
                                  if not ALGORITHMS[n].asynchronous])
def test_speeds_change_only_the_times(name):
    slow = {**SPEEDS, "client_compute": [c / 3 for c in COMP], "uplink": 1e3,
            "server_compute": SERVER / 2}
    _, rec1, s1, *_ = run(config(name, rounds=2))
    _, rec2, s2, *_ = run(config(name, rounds=2, speeds=slow))
    m1, m2 = ({**s.get("model", {}), **(s["module"].state_dict() if "module" in s else {})}
              for s in (s1, s2))
    for k in m1:
        assert torch.equal(m1[k], m2[k])
    assert all(r2["sim_round_s"] > r1["sim_round_s"] for r1, r2 in zip(rec1[1:], rec2[1:]))
    drop = ("sim_round_s", "sim_time_s", "slowest_client", "round_time_s")
    assert ([{k: v for k, v in r.items() if k not in drop} for r in rec1]
            == [{k: v for k, v in r.items() if k not in drop} for r in rec2])


# ------------------------------------------------------------------- profiles

def test_generators_are_deterministic_for_a_seed():
    def draw(name, opts, seed):
        rng = np.random.default_rng(seed)
        p = build_profiles(name, opts, 5, rng)
        return np.concatenate([p.compute, p.uplink, p.downlink, *p.draw(rng)])
    for name, opts in [("exponential", {"mean": 2.0, "delay_mean": 0.5}),
                       ("exponential", {"per_round": False}), ("fedscale", {})]:
        assert np.array_equal(draw(name, opts, 1), draw(name, opts, 1))
        assert not np.array_equal(draw(name, opts, 1), draw(name, opts, 2))
    with pytest.raises(ConfigError, match="clock.speed"):
        build_profiles("fixed", {"speed": 1}, 3, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="3 .one per client"):
        build_profiles("fixed", {"uplink": [1, 2]}, 3, np.random.default_rng(0))


def test_exponential_once_per_client_divides_each_speed_by_its_draw():
    """``per_round: false``: a client's computation time is multiplied by one Exp(mean)
    draw for the whole run (module doc), i.e. its speed is divided by it; the links keep
    their rates and no per-round multiplier is left."""
    p = build_profiles("exponential", {"per_round": False, "mean": 2.0,
                                       "client_compute": [1e9, 2e9, 4e9]}, 3,
                       np.random.default_rng(7))
    draws = np.random.default_rng(7).exponential(2.0, 3)
    # one float64 division (or exp of one product) per value: a few eps64 at most
    np.testing.assert_allclose(p.compute, np.array([1e9, 2e9, 4e9]) / draws, rtol=1e-15)
    assert p.slowdown_mean is None
    scale, _ = p.draw(np.random.default_rng(0))
    assert scale.tolist() == [1.0, 1.0, 1.0]


def test_an_exponential_rounds_draw_is_the_slowdowns_then_the_start_delays():
    """``mean`` and ``delay_mean``: each round draws one Exp(mean) compute-time multiplier
    per client, then one Exp(delay_mean) start delay (seconds) per client."""
    p = build_profiles("exponential", {"mean": 2.0, "delay_mean": 0.5}, 4,
                       np.random.default_rng(7))
    scale, delay = p.draw(np.random.default_rng(3))
    rng = np.random.default_rng(3)
    assert np.array_equal(scale, rng.exponential(2.0, 4))
    assert np.array_equal(delay, rng.exponential(0.5, 4))
    assert (delay > 0).all()
    no_delay = build_profiles("exponential", {"mean": 2.0}, 4, np.random.default_rng(7))
    assert np.array_equal(no_delay.draw(np.random.default_rng(3))[1], np.zeros(4))


def test_fedscale_draws_compute_then_uplink_then_downlink_with_their_own_sigmas():
    """Log-normal speeds around the medians: compute with ``compute_sigma``, both links
    with ``bandwidth_sigma``, one standard normal draw per client each, in that order."""
    opts = {"compute_median": 1e9, "compute_sigma": 0.3, "uplink_median": 1e6,
            "downlink_median": 4e6, "bandwidth_sigma": 1.1}
    p = build_profiles("fedscale", opts, 4, np.random.default_rng(5))
    z = np.random.default_rng(5).standard_normal((3, 4))
    # float64 exp of one product times the median: a few eps64 at most
    np.testing.assert_allclose(p.compute, 1e9 * np.exp(0.3 * z[0]), rtol=1e-15)
    np.testing.assert_allclose(p.uplink, 1e6 * np.exp(1.1 * z[1]), rtol=1e-15)
    np.testing.assert_allclose(p.downlink, 4e6 * np.exp(1.1 * z[2]), rtol=1e-15)


def test_an_availability_window_includes_its_start_and_excludes_its_end():
    """``available_from <= start < available_until`` (module doc)."""
    p = Profiles(np.ones(2), np.ones(2), np.ones(2), 1.0,
                 available_from=np.array([1.0, 0.0]), available_until=np.array([3.0, 1.0]))
    ids = np.arange(2)
    assert p.available(ids, 0.0).tolist() == [False, True]
    assert p.available(ids, 1.0).tolist() == [True, False]
    assert p.available(ids, 2.5).tolist() == [True, False]
    assert p.available(ids, 3.0).tolist() == [False, False]


@pytest.mark.parametrize("name, options, says", [
    ("fixed", {"client_compute": [1e6, True, 1e6]}, "clock.client_compute: expected one "
     "positive number or a list of 3 (one per client), got [1000000.0, True, 1000000.0]"),
    ("fixed", {"uplink": [1e6, "abc", 1e6]}, "clock.uplink: expected one positive"),
    ("fixed", {"downlink": {"a": 1}}, "clock.downlink: expected one positive"),
    ("fixed", {"client_compute": [1e6, [1], 1e6]}, "clock.client_compute: expected one"),
    ("exponential", {"client_compute": True}, "clock.client_compute: expected one"),
    ("fedscale", {"uplink_median": "1_0"}, "clock.uplink_median: expected a float, got "
     "'1_0' (str)"),
    ("fixed", {"client_compute": 0}, "clock.client_compute: speeds must be positive "
     "numbers from 1.2e-38 to 3.4e+38"),
    ("fixed", {"uplink": 10**400}, "clock.uplink: speeds must be positive numbers"),
    ("trace", {"path": 1}, "clock.path: expected a string, got 1 (int)"),
    ("trace", {"path": None}, "clock.path: expected a string, got None"),
])
def test_bad_speeds_and_paths_are_refused_naming_the_key(name, options, says):
    with pytest.raises(ConfigError) as err:
        build_profiles(name, options, 3, np.random.default_rng(0))
    assert str(err.value).startswith(says)


def test_speeds_a_yaml_file_reads_as_text_are_numbers():
    # YAML 1.1 reads 1e6 (no dot) as a string
    p = build_profiles("fixed", {"client_compute": ["1e6", 2e6, "4e6"], "uplink": "1e4"}, 3,
                       np.random.default_rng(0))
    assert p.compute.tolist() == [1e6, 2e6, 4e6] and p.uplink.tolist() == [1e4] * 3


TRACE = ("client_id,compute_macs_per_s,uplink_bytes_per_s,downlink_bytes_per_s,"
         "available_from,available_until\n"
         "0,1e5,1e4,4e4,,\n1,2e5,2e4,1e4,1e9,\n2,4e5,5e3,2e4,0,\n")


@pytest.mark.parametrize("sizes, windows, says", [
    ((3, 4, 4), (), "compute: 3 values, but uplink and downlink have 4;"),
    ((4, 4, 5), (), "downlink: 5 values, but compute and uplink have 4;"),
    ((4, 4, 4), (3,), "available_from: 3 values, but compute, uplink and downlink have 4;"),
    ((4, 4, 4), (3, 3), "available_from and available_until: 3 and 3 values, but compute, "
                        "uplink and downlink have 4;"),
    ((2, 3, 4), (), "compute, uplink and downlink: 2, 3 and 4 values;"),
], ids=["compute", "downlink", "one_window", "both_windows", "no_majority"])
def test_profiles_name_the_field_whose_number_of_clients_differs(sizes, windows, says):
    """Profiles know no number of clients of their own: a field with more or fewer values
    than the others is named, not the field after it."""
    speeds = [np.ones(k) for k in sizes]
    available = dict(zip(("available_from", "available_until"),
                         [np.zeros(k) for k in windows]))
    with pytest.raises(ValueError, match=re.escape(says) + " expected one value per client "
                                                           "in each$"):
        Profiles(*speeds, 1e10, **available)


def test_trace_profile_speeds_and_availability(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    rows = load_trace(path, 3)
    assert rows["compute_macs_per_s"].tolist() == COMP
    assert rows["available_from"][1] == 1e9 and rows["available_until"][0] == np.inf
    assert rows["available_from"][0] == -np.inf         # an empty cell is unbounded
    env, rec, *_ = run(config("fedavg", profile="trace",
                              speeds={"path": str(path), "server_compute": SERVER}))
    assert [r["dropped"] for r in rec[1:]] == [1] and rec[1]["participants"] == 2
    assert env.ledger.per_client(1, "model", "down")[1] == 0  # client 1 is never there
    times = fedavg_times(sizes(env))
    assert rec[1]["sim_round_s"] == pytest.approx(max(times[0], times[2]), rel=TIME_REL)


def test_a_trace_offline_client_is_dropped_and_the_others_weights_renormalised(tmp_path):
    """docs/clock.md (trace profile): the clock takes the clients a trace makes
    unavailable out of the sampled cohort and renormalises the others' weights, so FedAvg
    averages the available clients' models, x + sum_{n avail} a_n / sum a (x_n - x), with
    no silent shrink of the step."""
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)                       # client 1 comes online at 1e9 s
    env, rec, state, uploads, start = run(config(
        "fedavg", profile="trace", speeds={"path": str(path), "server_compute": SERVER}))
    assert rec[1]["participants"] == 2 and sorted(uploads) == [0, 2]
    close(state["model"], start, uploads, env.data_sizes, [0, 2], start)


def test_a_round_with_no_client_online_waits_for_the_next_window(tmp_path):
    probe = build_environment(config("fedavg"))
    times = fedavg_times(sizes(probe))
    t1 = max(times[0], times[1])                 # round 1: clients 0 and 1
    path = tmp_path / "trace.csv"
    path.write_text(TRACE.splitlines()[0] + "\n" + "".join(
        f"{c},{COMP[c]},{UP[c]},{DOWN[c]},{lo},{hi}\n"
        for c, (lo, hi) in enumerate([("", t1 / 2), ("", t1 / 2), (100.0, "")])))
    _, rec, *_ = run(config("fedavg", rounds=3, profile="trace",
                            speeds={"path": str(path), "server_compute": SERVER}))
    assert [r["participants"] for r in rec[1:]] == [2, 1, 1]
    assert rec[1]["sim_time_s"] == pytest.approx(t1, rel=TIME_REL)
    # round 2 finds nobody online at t1 and starts at 100, when client 2 comes online
    assert rec[2]["sim_time_s"] == pytest.approx(100.0 + times[2], rel=TIME_REL)
    assert rec[2]["sim_round_s"] == pytest.approx(100.0 + times[2] - t1, rel=TIME_REL)
    assert rec[3]["sim_round_s"] == pytest.approx(times[2], rel=TIME_REL)


@pytest.mark.parametrize("name", ["server_only", "centralized", "fedavg"])
def test_a_round_that_samples_nobody_waits_for_no_client(tmp_path, name):
    """The server alone trains (or a bernoulli draw sampled nobody): no client needs to
    be online, so a trace whose clients all come later adds no wait to the round."""
    over = {"server_data": {"fraction": 0.2}} if name == "server_only" else {}
    if name == "fedavg":
        over["participation"] = {"mode": "bernoulli", "clients_per_round": None, "q": 1e-9}
    times = {}
    for start in ("100.0", ""):                 # clients online at 100 s, or from the start
        path = tmp_path / f"trace{start}.csv"
        path.write_text(TRACE.splitlines()[0] + "\n" + "".join(
            f"{c},{COMP[c]},{UP[c]},{DOWN[c]},{start},\n" for c in range(3)))
        _, rec, *_ = run(config(name, rounds=2, profile="trace",
                                speeds={"path": str(path), "server_compute": SERVER}, **over))
        assert [r["participants"] for r in rec[1:]] == [0, 0]
        times[start] = [r["sim_round_s"] for r in rec[1:]]
    assert times["100.0"] == times[""], times


def test_trace_errors_name_the_line_of_the_row(tmp_path):
    """Blank lines and a quoted cell over two lines count as lines, as an editor shows
    them."""
    path = tmp_path / "bad.csv"
    head, *rows = TRACE.splitlines()
    path.write_text("\n".join([head, "", rows[0], "", "", '1,"2e5",2e4,1e4,"1e9",\n',
                                "2,4e5,5e3,x,0,"]) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.csv, line 8, column 'downlink_bytes_per_s'"):
        load_trace(path, 3)


def test_a_trace_is_checked_row_by_row_in_memory_near_its_size(tmp_path):
    """A bad first row stops the read: a file of millions of short lines is not split
    into millions of strings first."""
    import tracemalloc

    path = tmp_path / "big.csv"
    path.write_text(TRACE.splitlines()[0] + "\n" + "ab\n" * 4_000_000)   # 12 MB
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"line 2, column 'client_id'"):
            load_trace(path, 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * path.stat().st_size, peak


@pytest.mark.parametrize("text,column", [
    ("client_id,compute_macs_per_s,uplink_bytes_per_s\n0,1,1\n", "downlink_bytes_per_s"),
    (TRACE.replace("2e5", "fast"), "compute_macs_per_s"),
    (TRACE.replace("5e3", "-5"), "uplink_bytes_per_s"),
    (TRACE.replace("\n2,", "\n1,"), "client_id"),
    (TRACE.replace("\n2,4e5,5e3,2e4,0,\n", "\n"), "client_id"),
    (TRACE.replace("available_until", "until"), "until"),
    (TRACE.replace(",1e9,", ",x,"), "available_from"),
    (TRACE.replace("0,1e5,1e4,4e4,,", "0,1e5,1e4,4e4,5,5"), "available_until"),  # empty
    (TRACE.replace("2e5", "2_0e4"), "compute_macs_per_s"),      # float() takes these
    (TRACE.replace("2e5", "nan"), "compute_macs_per_s"),
    (TRACE.replace("2e5", "\u0662e5"), "compute_macs_per_s"),   # an Arabic-Indic digit
    (TRACE.replace("\n2,", "\n\u00b2,"), "client_id"),           # a superscript two
    (TRACE.replace("available_until\n", "available_until,compute_macs_per_s\n"),
     "compute_macs_per_s"),                                     # a column given twice
])
def test_trace_loader_refuses_malformed_files(tmp_path, text, column):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_trace(path, 3)
    assert str(path) in str(err.value) and repr(column) in str(err.value)


def test_a_trace_row_with_more_cells_than_columns_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(TRACE.replace("\n2,4e5,5e3,2e4,0,\n", "\n2,4e5,5e3,2e4,0,,7\n"))
    with pytest.raises(ConfigError, match=r"line 4: 7 cells, more than the header's 6 "):
        load_trace(path, 3)


def test_a_trace_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    (tmp_path / "plain.csv").write_text(TRACE)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + TRACE.encode())
    plain, bom = load_trace(tmp_path / "plain.csv", 3), load_trace(tmp_path / "bom.csv", 3)
    assert all(np.array_equal(plain[k], bom[k]) for k in plain) and plain.keys() == bom.keys()


@pytest.mark.parametrize("text, says", [
    (TRACE + "x" * 200_000 + "\n", "line 5: not a CSV row (field larger than field limit"),
    ("x" * 200_000 + TRACE, "line 1: not a CSV row (field larger than field limit"),
])
def test_trace_rows_the_csv_reader_cannot_read_are_one_error(tmp_path, text, says):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_trace(path, 4)
    assert str(err.value).startswith(f"clock trace {path}, {says}")


# ------------------------------------------------------------------- the rest

def test_event_queue_orders_by_time_then_insertion():
    q = EventQueue()
    for t, item in [(2.0, "b"), (1.0, "a"), (2.0, "c")]:
        q.push(t, item)
    assert q.peek_time() == 1.0 and len(q) == 3
    assert [q.pop()[1] for _ in range(3)] == ["a", "b", "c"]


def test_time_to_target_reads_the_cumulative_simulated_time():
    records = [{"round": 0, "test_acc": 0.1}, {"round": 1, "sim_time_s": 2.0},
               {"round": 2, "sim_time_s": 5.0, "test_acc": 0.6}]
    assert time_to_target(records, 0.5) == 5.0 and time_to_target(records, 0.9) is None


def test_a_repeated_client_runs_its_slots_one_after_the_other():
    rng = np.random.default_rng(0)
    clock = VirtualClock(fixed(2, rng, client_compute=10.0, uplink=1.0, downlink=2.0,
                               server_compute=5.0), rng)
    clock.begin_round(Cohort([0, 0, 1], [0.25, 0.25, 0.5]))
    clock.compute(CLIENT, [0, 0, 1], 10)                  # 1 s per slot
    clock.transfer("activations", "up", [0, 0, 1], 3)     # 3 s per slot
    assert clock.arrival_time([0, 1]).tolist() == [8.0, 4.0]
    clock.compute(SERVER_COPY, [0, 0, 1], 10)             # 2 s per slot, own lanes
    clock.transfer("activation_grads", "down", [0, 0, 1], 2)
    assert clock.client_time([0, 1]).tolist() == [14.0, 7.0]
    rec = clock.end_round()
    assert (rec["sim_round_s"], rec["slowest_client"], rec["dropped"]) == (14.0, 0, 0)


def test_a_single_clients_compute_is_multiplied_by_its_round_slowdown():
    """docs/clock.md, ``exponential`` profile: each client's computation time is
    multiplied by an Exp(mean) draw, fresh every round. One client's work (SL's turns, the
    scalar path, and a replayed turn) costs macs * scale_c / compute_c, the same float64
    value as the array path for several clients."""
    def clock():
        rng = np.random.default_rng(0)
        p = fixed(3, rng, client_compute=[10.0, 20.0, 40.0])
        p.slowdown_mean = 2.0                       # exponential with per_round: true
        c = VirtualClock(p, rng)
        c.begin_round(Cohort([0, 1, 2], [0.2, 0.3, 0.5]))
        return c

    scale = np.random.default_rng(0).exponential(2.0, 3)    # the round's one draw
    assert np.all(np.abs(scale - 1.0) > 0.05)
    want = [7 * scale[c] / [10.0, 20.0, 40.0][c] for c in range(3)]
    many = clock()
    many.compute(CLIENT, [0, 1, 2], 7)
    assert many.client_time([0, 1, 2]).tolist() == want
    for c in range(3):
        one, arr, replay = clock(), clock(), clock()
        one.compute(CLIENT, c, 7)                       # an int id and int MACs
        arr.compute(CLIENT, np.array([c]), 7)           # one id in an array
        replay.replay_one(c, [(CLIENT, 7)])             # a settled SL turn
        for k in (one, arr, replay):
            assert k.client_time([c]).tolist() == [want[c]], c


def test_dropped_slots_renormalise_except_under_bernoulli():
    ref = {"w": torch.zeros(2)}
    new = {"w": torch.tensor([[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]])}
    for renormalise, want in [(True, 2.0), (False, 1.0)]:
        acc = DeltaAccumulator(ref, renormalise=renormalise)
        acc.add(torch.tensor([0.25, 0.25, 0.5]), new, keep=np.array([True, True, False]))
        assert torch.allclose(acc.result()["w"], torch.full((2,), want))


@pytest.mark.parametrize("profile, options, match", [
    ("exponential", {"mean": math.inf}, r"^clock\.mean: must be a finite number > 0"),
    ("exponential", {"mean": -1.0}, r"^clock\.mean: must be a finite number > 0"),
    ("exponential", {"delay_mean": math.inf}, r"^clock\.delay_mean: must be a finite number >= 0"),
    ("exponential", {"mean": math.nan}, r"^clock\.mean: must be a finite"),
    ("fedscale", {"compute_sigma": 1000.0}, r"^clock\.compute_sigma: must be in \[0, 10.0\]"),
    ("fedscale", {"bandwidth_sigma": -0.1}, r"^clock\.bandwidth_sigma: must be in \[0, 10.0\]"),
])
def test_clock_profiles_refuse_infinite_means_and_huge_spreads(profile, options, match):
    """An infinite mean slowdown or delay would make every simulated time infinite (and
    the records' times not JSON); a log-normal spread of 1000 overflows the speeds."""
    with pytest.raises(ConfigError, match=match):
        build_profiles(profile, options, 4, np.random.default_rng(0))


def test_a_dropped_client_does_not_cut_the_kept_clients_later_messages():
    """SCAFFOLD sends each client's control delta after its model. With a deadline between
    the kept clients' model uploads and their control deltas, a dropped slow client does
    not end the round at the deadline: the round waits for the kept clients' deltas (the
    server uses them), so it lasts as long as the same round without the slow client."""
    from splitfed.experiment import run_experiment

    def round_record(speeds, deadline=None):
        cfg = digits_config(algorithm={"name": "scaffold"}, rounds=1,
                            partition={"scheme": "iid", "num_clients": 4},
                            clock={"profile": "fixed", "client_compute": speeds,
                                   "deadline": deadline})
        return run_experiment(cfg, write=False).records[1]

    fast = [1e9] * 4
    natural = round_record(fast)["sim_round_s"]
    deadline = 0.8 * natural          # after the model uploads, before the control deltas
    on_time = round_record(fast, deadline)
    assert on_time["dropped"] == 0 and on_time["sim_round_s"] == natural
    slow = round_record(fast[:3] + [1e4], deadline)
    assert slow["dropped"] == 1 and slow["clients_used"] == 3
    assert slow["sim_round_s"] == pytest.approx(natural, rel=TIME_REL)
    assert slow["sim_round_s"] > deadline
