"""Values of ``key=value`` overrides and of component options keep their types.

A number written with an exponent but without a dot (``1e-9``, ``1e300``, ``-2E5``) is a
float in an override, as in YAML 1.2 (YAML 1.1 reads a string), unless it is quoted. The
options of partition schemes and clock profiles are checked against the types their
parameters declare (:func:`splitfed.configtools.typed_options`): a boolean option given
anything but ``true``/``false`` is refused naming the key, and a float option given a
string must be a number. Refusals are one ``splitfed: error:`` line, before a run
directory exists."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import dry_run as run
from splitfed.configtools import parse_overrides
from splitfed.data.partition import partition
from splitfed.engine.profiles import build_profiles
from splitfed.errors import ConfigError
from splitfed.configtools import typed_options

SHARD = ["partition.scheme=shard", "~partition.alpha", "~partition.min_partition_size",
         "partition.num_shards_per_partition=2"]


@pytest.mark.parametrize("text, value", [
    ("1e-9", 1e-9), ("1e300", 1e300), ("-2E5", -2e5), ("+1e3", 1e3), ("1.5e3", 1500.0),
    ("1.0e+18", 1e18), (".5e1", 5.0), ("[1e9, 2e9]", [1e9, 2e9]), ("{a: 1e-3}", {"a": 1e-3}),
    ("12", 12), ("0.5", 0.5),
])
def test_exponent_numbers_are_floats_in_overrides(text, value):
    assert parse_overrides([f"k={text}"]) == {"k": value}


@pytest.mark.parametrize("text, value", [
    ("'1e-9'", "1e-9"), ('"1e300"', "1e300"), ("1e", "1e"), ("e5", "e5"), ("1e5x", "1e5x"),
    ("inf", "inf"), ("maybe", "maybe"), ("[1e5x]", ["1e5x"]),
])
def test_strings_stay_strings_in_overrides(text, value):
    assert parse_overrides([f"k={text}"]) == {"k": value}


@pytest.mark.parametrize("overrides", [
    ["~model.hidden", "model.name=alexnet", "model.width=1e-9"],
    ["clock.profile=exponential", "clock.mean=1e30"],
    ["clock.profile=exponential", "clock.mean=2E-1", "clock.per_round=false"],
    ["clock.profile=fixed", "clock.client_compute=2e9", "clock.server_compute=1e11"],
    [*SHARD, "partition.keep_incomplete_shard=true"],
], ids=" ".join)
def test_exponent_numbers_reach_the_components_as_numbers(tmp_path, capsys, overrides):
    code, err = run(tmp_path, capsys, overrides)
    assert code == 0, err


@pytest.mark.parametrize("overrides, key, expected", [
    (["clock.profile=exponential", "clock.per_round=maybe"], "clock.per_round",
     "a boolean (true/false), got 'maybe' (str)"),
    (["partition.self_balancing=maybe"], "partition.self_balancing",
     "a boolean (true/false), got 'maybe' (str)"),
    ([*SHARD, "partition.keep_incomplete_shard=maybe"], "partition.keep_incomplete_shard",
     "a boolean (true/false), got 'maybe' (str)"),
    ([*SHARD, "partition.keep_incomplete_shard=1"], "partition.keep_incomplete_shard",
     "a boolean (true/false), got 1 (int)"),
    (["clock.profile=exponential", "clock.mean=abc"], "clock.mean",
     "a float, got 'abc' (str)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_option_values_of_the_wrong_type_are_refused(tmp_path, capsys, overrides, key,
                                                     expected):
    code, err = run(tmp_path, capsys, overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == f"splitfed: error: {key}: expected {expected}"


def test_numeric_strings_of_a_config_file_become_floats_for_float_options():
    rng = np.random.default_rng(0)
    profiles = build_profiles("exponential", {"mean": "1e30", "per_round": True}, 4, rng)
    assert profiles.slowdown_mean == 1e30
    with pytest.raises(ConfigError, match=r"^clock.per_round: expected a boolean"):
        build_profiles("exponential", {"per_round": "false"}, 4, rng)


def test_partition_refuses_a_non_boolean_flag():
    labels = np.repeat(np.arange(4), 10)
    with pytest.raises(ConfigError, match=r"^partition.keep_incomplete_shard: expected a "
                                          r"boolean \(true/false\), got 'maybe'"):
        partition(labels, 4, "shard", np.random.default_rng(0), num_shards_per_partition=2,
                  keep_incomplete_shard="maybe")


def plugin_profile(num_clients, rng, *, flag=False, rate: float = 1.0, speeds=1e9,
                   label: str = "x"):
    """A component as a plugin writes it: an unannotated flag, typed numbers."""


def test_typed_options_follow_the_signature():
    out = typed_options(plugin_profile, {"flag": True, "rate": "1e-3", "speeds": [1e9, 2e9],
                                         "label": "1e5", "other": "kept"}, "clock")
    assert out == {"flag": True, "rate": 1e-3, "speeds": [1e9, 2e9], "label": "1e5",
                   "other": "kept"}
    assert typed_options(plugin_profile, {"rate": 2}, "clock") == {"rate": 2}
    with pytest.raises(ConfigError, match=r"^clock.flag: expected a boolean \(true/false\), "
                                          r"got 'yes' \(str\)$"):
        typed_options(plugin_profile, {"flag": "yes"}, "clock")
    with pytest.raises(ConfigError, match=r"^clock.rate: expected a float, got 'fast'"):
        typed_options(plugin_profile, {"rate": "fast"}, "clock")
