"""Every float of a config fits float32, and simulated times stay finite.

The models, optimizers and transforms compute in float32, so a float of the config is 0
or has a magnitude between float32's smallest normal (about 1.2e-38) and its largest
(about 3.4e38): ``train.lr=1e308`` would overflow in the optimizer and ``train.lr=1e-320``
would be 0. This holds for the fields of the config's sections, the options of the
algorithms and transforms (their options dataclasses) and the options of the model, data
set, partitioner and clock profile (:func:`splitfed.configtools.typed_options`), and for
the numbers of a clock trace. A value outside is refused with one ``splitfed: error:``
line naming the key, before a run directory exists. The clock refuses to close a round
whose end is not finite, instead of writing an infinite or NaN time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from splitfed.algorithms.fedopt import FedOptOptions
from tests.helpers import dry_run as run
from splitfed.configtools import FLOAT32_MAX, FLOAT32_TINY, from_dict, typed_options
from splitfed.data import load_dataset
from splitfed.engine.clock import CLIENT, SimulatedTimeError, VirtualClock
from splitfed.engine.participation import Cohort
from splitfed.engine.profiles import Profiles, build_profiles, load_trace
from splitfed.errors import ConfigError

RANGE = "is outside float32's range (0 or 1.2e-38 .. 3.4e38 in magnitude)"
SYNTHETIC = ["data.name=synthetic", "partition.scheme=natural", "~partition.alpha",
             "~partition.min_partition_size", "partition.num_clients=30"]


REFUSED = [
    (["train.lr=1e308"], "train.lr: 1e+308"),
    (["train.weight_decay=1e308"], "train.weight_decay: 1e+308"),
    (["train.lr=1e-320"], "train.lr: 1e-320"),
    (["train.lr_min=1e-39"], "train.lr_min: 1e-39"),
    (["algorithm.name=fedprox", "algorithm.mu=1e300"], "algorithm.mu: 1e+300"),
    (["algorithm.client_transforms=[{name: prox, mu: 1e300}]"],
     "algorithm.client_transforms[0].mu: 1e+300"),
    (["algorithm.name=fedopt", "algorithm.v_init=1e300"], "algorithm.v_init: 1e+300"),
    (["algorithm.name=fedopt", "algorithm.tau=1e300"], "algorithm.tau: 1e+300"),
    (["algorithm.name=musplitfed", "algorithm.smoothing=1e300"],
     "algorithm.smoothing: 1e+300"),
    (["algorithm.name=sflv2", "algorithm.server_lr=1e300"], "algorithm.server_lr: 1e+300"),
    (["clock.client_compute=5e-324"], "clock.client_compute: 5e-324"),
    (["clock.uplink=1e-310"], "clock.uplink: 1e-310"),
    (["clock.downlink=[1e6, 1e6, 1e6, 1e6, 1e6, 1e6, 1e6, 1e39]"], "clock.downlink[7]: 1e+39"),
    (["clock.server_compute=1e39"], "clock.server_compute: 1e+39"),
    (["clock.profile=exponential", "clock.mean=1e308"], "clock.mean: 1e+308"),
    (["clock.profile=exponential", "clock.delay_mean=1e308"], "clock.delay_mean: 1e+308"),
    (["clock.profile=fedscale", "clock.compute_median=1e-308", "clock.compute_sigma=10"],
     "clock.compute_median: 1e-308"),
    (["participation.mode=bernoulli", "~participation.clients_per_round",
      "participation.q=1e-320"], "participation.q: 1e-320"),
    ([*SYNTHETIC, "data.beta=1e300"], "data.beta: 1e+300"),
    (["~model.hidden", "model.name=alexnet", "model.width=1e-300"], "model.width: 1e-300"),
]


@pytest.mark.parametrize("overrides, start", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_floats_outside_float32_are_refused_before_anything_is_written(tmp_path, capsys,
                                                                        overrides, start):
    code, err = run(tmp_path, capsys, overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == f"splitfed: error: {start} {RANGE}"


@pytest.mark.parametrize("overrides", [
    ["train.lr=3.4e38"],
    ["train.lr=1.2e-38"],
    ["train.weight_decay=0"],
    ["train.lr_min=0.0"],
    ["clock.client_compute=1.2e-38", "clock.uplink=3.4e38"],
    ["clock.profile=exponential", "clock.mean=3e38", "clock.delay_mean=3e38"],
    ["algorithm.name=fedopt", "algorithm.tau=1e19"],
    ["algorithm.name=fedopt", "algorithm.tau=1e30", "algorithm.v_init=1.0"],
], ids=" ".join)
def test_floats_within_float32_are_accepted(tmp_path, capsys, overrides):
    code, err = run(tmp_path, capsys, overrides)
    assert code == 0, err


# ------------------------------------------------------------------- configtools


@dataclass
class Section:
    rate: float = field(default=0.1, metadata={"gt": 0})
    share: float = field(default=0.5, metadata={"ge": 0, "le": 1})
    free: float | None = None
    rates: list[float] = field(default_factory=list)
    named: dict[str, float] = field(default_factory=dict)
    any_value: object = None


@pytest.mark.parametrize("data, message", [
    ({"rate": 1e39}, "rate: 1e+39"),
    ({"rate": 1e-261}, "rate: 1e-261"),
    ({"free": -5e-324}, "free: -5e-324"),
    ({"free": 10**39}, "free: 1e+39"),
    ({"rates": [1.0, 1e-40]}, "rates[1]: 1e-40"),
    ({"named": {"a": 1.0, "b": 1e300}}, "named.b: 1e+300"),
])
def test_from_dict_refuses_floats_outside_float32(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(Section, data)
    assert str(err.value) == f"{message} {RANGE}"


def test_the_edges_of_float32_and_zero_are_accepted():
    got = from_dict(Section, {"rate": FLOAT32_MAX, "share": FLOAT32_TINY, "free": -FLOAT32_MAX,
                              "rates": [0.0, -FLOAT32_TINY], "named": {"a": 0.0}})
    assert got.rate == FLOAT32_MAX and got.share == FLOAT32_TINY
    assert np.float32(FLOAT32_MAX) == FLOAT32_MAX and np.float32(FLOAT32_TINY) == FLOAT32_TINY
    assert np.finfo(np.float32).tiny == FLOAT32_TINY and np.finfo(np.float32).max == FLOAT32_MAX


def test_a_bound_is_reported_before_the_range_and_infinity_as_before():
    with pytest.raises(ConfigError, match=r"^share: must be <= 1, got 1e\+300"):
        from_dict(Section, {"share": 1e300})
    with pytest.raises(ConfigError, match=r"^rate: must be a finite number \(> 0\), got inf"):
        from_dict(Section, {"rate": "inf"})
    assert from_dict(Section, {"free": "inf"}).free == math.inf     # unbounded: kept


def test_component_options_are_range_checked_with_or_without_an_annotation():
    def profile(num_clients, rng, *, rate: float = 1.0, speeds=1e9, label: str = "x"):
        """A component as a plugin writes it."""

    assert typed_options(profile, {"rate": 3e38, "speeds": [1e9, 1.2e-38]}, "clock") == {
        "rate": 3e38, "speeds": [1e9, 1.2e-38]}
    for options, message in [({"rate": "1e-39"}, "clock.rate: 1e-39"),
                             ({"rate": 10**400}, "clock.rate: 1000000"),
                             ({"speeds": [1e9, 5e-324]}, "clock.speeds[1]: 5e-324"),
                             ({"speeds": {"a": [1e300]}}, "clock.speeds.a[0]: 1e+300")]:
        with pytest.raises(ConfigError) as err:
            typed_options(profile, options, "clock")
        assert str(err.value).startswith(message) and "float32's range" in str(err.value)


# ------------------------------------------------------------------------- fedopt


def test_fedopt_refuses_a_tau_whose_square_overflows_float32():
    with pytest.raises(ConfigError, match=r"tau=1e\+30 gives v_\{-1\} = tau\^2"):
        FedOptOptions(tau=1e30)
    FedOptOptions(tau=1e30, v_init=1.0)
    FedOptOptions(tau=1.8e19)


def test_fedopt_says_what_to_do_with_a_second_server_step(tmp_path, capsys):
    code, err = run(tmp_path, capsys, ["algorithm.name=fedopt",
                                        "algorithm.server_transforms=[{name: fedopt}]"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "[fedopt] or [fedopt]" not in err
    assert "fedopt already has its own step 'fedopt'; remove it from server_transforms" in err
    code, err = run(tmp_path, capsys, ["algorithm.name=fedopt",
                                        "algorithm.server_transforms=[{name: momentum}]"])
    assert code == 2 and "use fedavg with server_transforms [momentum]" in err, err


# ------------------------------------------------------------------------ the data


def test_synthetic_refuses_a_beta_whose_features_overflow_float32(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^data\.beta: 3e\+38 draws features of magnitude"):
        load_dataset("synthetic", beta=3e38)
    bundle = load_dataset("synthetic", beta=1e30)
    assert bool(np.isfinite(bundle.train.x.numpy()).all())
    code, err = run(tmp_path, capsys, [*SYNTHETIC, "data.beta=3e38"])
    assert code == 2 and "data.beta" in err and "float32" in err, err


# ----------------------------------------------------------------------- the clock


def trace_file(tmp_path, last: str) -> str:
    path = tmp_path / "trace.csv"
    rows = ["client_id,compute_macs_per_s,uplink_bytes_per_s,downlink_bytes_per_s,"
            "available_from,available_until", "0,1e9,1.25e6,5e6,,", f"1,{last}"]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize("last, column", [
    ("5e-324,1.25e6,5e6,,", "compute_macs_per_s"),
    ("1e9,1e39,5e6,,", "uplink_bytes_per_s"),
    ("1e9,1.25e6,5e6,1e-320,", "available_from"),
    ("1e9,1.25e6,5e6,0,1e300", "available_until"),
])
def test_a_trace_number_outside_float32_is_refused_naming_line_and_column(tmp_path, last,
                                                                           column):
    with pytest.raises(ConfigError) as err:
        load_trace(trace_file(tmp_path, last), 2)
    assert str(err.value).startswith(f"clock trace {tmp_path / 'trace.csv'}, line 3, column "
                                     f"{column!r}: ")
    assert "float32's range" in str(err.value)
    ok = load_trace(trace_file(tmp_path, "1.2e-38,3.4e38,5e6,0,3e38"), 2)
    assert ok["compute_macs_per_s"][1] == 1.2e-38


def test_a_trace_with_a_subnormal_speed_is_refused_by_the_cli(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    lines = ["client_id,compute_macs_per_s,uplink_bytes_per_s,downlink_bytes_per_s"]
    lines += [f"{i},{'5e-324' if i == 7 else '1e9'},1.25e6,5e6" for i in range(8)]
    path.write_text("\n".join(lines) + "\n")
    code, err = run(tmp_path, capsys, ["clock.profile=trace", f"clock.path={path}"])
    assert code == 2 and "line 9, column 'compute_macs_per_s': '5e-324'" in err, err


def test_extreme_accepted_speeds_give_finite_times():
    """The most extreme speeds the options accept keep float64 times finite."""
    profiles = build_profiles("exponential", {"mean": 3e38, "delay_mean": 3e38,
                                              "client_compute": 1.2e-38, "uplink": 1.2e-38},
                              3, np.random.default_rng(0))
    clock = VirtualClock(profiles, np.random.default_rng(1))
    for _ in range(3):
        clock.begin_round(Cohort(np.arange(3), np.full(3, 1 / 3)))
        clock.compute(CLIENT, np.arange(3), 10**12)
        clock.transfer("model", "up", np.arange(3), 10**9)
        out = clock.end_round()
        assert math.isfinite(out["sim_time_s"]) and math.isfinite(out["sim_round_s"])


def test_the_clock_refuses_to_close_a_round_with_an_infinite_time():
    """Profiles built directly (not from the config's options) can hold a speed that makes
    a time infinite: the round is refused when it closes, and ``now`` keeps its value."""
    profiles = Profiles(np.array([1e9, 5e-324]), np.full(2, 1e6), np.full(2, 1e6), 1e11)
    clock = VirtualClock(profiles, np.random.default_rng(0))
    clock.begin_round(Cohort(np.array([0]), np.ones(1)))
    clock.compute(CLIENT, np.array([0]), 10**9)
    clock.transfer("model", "up", np.array([0]), 0)
    assert clock.end_round()["sim_time_s"] == 1.0
    clock.begin_round(Cohort(np.arange(2), np.full(2, 0.5)))
    with np.errstate(over="ignore"):
        clock.compute(CLIENT, np.arange(2), 10**9)
    clock.transfer("model", "up", np.arange(2), 0)
    with pytest.raises(SimulatedTimeError) as err:
        clock.end_round()
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    assert str(err.value).startswith("clock: the simulated time of a round starting at 1.0 s "
                                     "became inf")
    assert clock.now == 1.0
