"""Fuzzing the config path: whatever a user writes in a YAML file or on the command line,
loading and building a run either succeeds or raises one of splitfed's own errors
(``SplitfedError``: ConfigError, DataError) whose message names the offending key."""

from __future__ import annotations

import copy
import math
import os
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitfed.config import RunConfig, build_config, load_config
from splitfed.configtools import from_dict, parse_overrides, to_dict
from splitfed.errors import ConfigError, SplitfedError
from splitfed.experiment import build_algorithm, build_environment

# SPLITFED_FUZZ_EXAMPLES=1000 fuzzes longer (default: a quick pass).
EXAMPLES = int(os.environ.get("SPLITFED_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

BASE = {"name": "fuzz", "rounds": 1, "progress": False, "seed": 0,
        "algorithm": {"name": "fedavg"},
        "data": {"name": "digits", "limit_train": 300, "limit_test": 50},
        "partition": {"scheme": "iid", "num_clients": 4},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"batch_size": 8, "local_steps": 1, "local_epochs": None, "lr": 0.1},
        "participation": {"mode": "full"}}

# Every typed key of the config plus options of the chosen components (and a few unknown
# ones); the fuzzers set them to arbitrary values.
KEYS = [
    "name", "seed", "rounds", "eval_every", "out_dir", "progress",
    "algorithm", "algorithm.name", "algorithm.global_lr", "algorithm.mu", "algorithm.options",
    "data", "data.name", "data.data_dir", "data.limit_train", "data.limit_test",
    "data.options", "data.colour",
    "partition", "partition.scheme", "partition.num_clients", "partition.alpha",
    "partition.min_partition_size", "partition.num_classes_per_partition",
    "partition.class_assignment_mode", "partition.num_shards_per_partition",
    "partition.shard_size", "partition.options",
    "model", "model.name", "model.cut", "model.hidden", "model.width", "model.options",
    "train", "train.batch_size", "train.local_steps", "train.local_epochs", "train.lr",
    "train.momentum", "train.weight_decay", "train.lr_decay", "train.lr_min",
    "participation", "participation.mode", "participation.clients_per_round",
    "participation.q", "participation.weighting",
    "engine", "engine.device", "engine.chunk_size", "engine.eval_batch_size",
    "server_data", "server_data.fraction", "server_data.samples_per_round",
    "server_data.shift_cosine", "server_data.always",
    "clock", "clock.profile", "clock.deadline", "clock.mean", "clock.client_compute",
    "clock.options", "bogus", "train.bogus",
]

# Values that fit no field and values that fit some; small numbers only where a
# plausible key (model.hidden, model.width) would allocate that much memory.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40),
    st.sampled_from([0, -1, 2**63, -(2**70), 10**30]),
    st.sampled_from([0.0, -0.5, 0.5, 1.0, 1.5, 1e-300, 1e300, math.inf, -math.inf, math.nan]),
    st.text(string.printable, max_size=8),
    st.sampled_from(["inf", "nan", "1e-3", "full", "iid", "cpu", "cuda", "meta", "mlp",
                     "sflv2", "bernoulli", "uniform", "dirichlet", "shard", "natural",
                     "pathological", "exponential", "trace", "fashion_mnist", "synthetic",
                     "\x00", "a.b", "../x"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(["name", "options", "alpha", "q"]),
                              st.text(max_size=4), st.integers(0, 3)), inner, max_size=3)),
    max_leaves=6)
SMALL_MODEL_VALUES = st.one_of(st.integers(-2, 64), st.lists(st.integers(-2, 64), max_size=3),
                               SCALARS.filter(lambda v: not isinstance(v, int)
                                              or isinstance(v, bool)))


def set_key(raw: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(raw)
    *parents, leaf = dotted.split(".")
    node = out
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value
    return out


def build(raw: dict):
    """Everything ``run_experiment`` validates before it creates the run directory."""
    cfg = build_config(raw)
    build_algorithm(cfg)
    build_environment(cfg)
    return cfg


def assert_names(err: Exception, dotted: str) -> None:
    """The message names the key, its leaf, its section or the value's own sub-key."""
    msg = str(err)
    parts = dotted.split(".")
    words = {dotted, parts[0], parts[-1]}
    assert any(w in msg for w in words), f"{dotted}: message names no key: {msg!r}"


@st.composite
def mutations(draw, max_changes=3):
    changes = []
    for _ in range(draw(st.integers(1, max_changes))):
        key = draw(st.sampled_from(KEYS))
        small = key.startswith("model.") and key != "model.name"
        changes.append((key, draw(SMALL_MODEL_VALUES if small else VALUES)))
    return changes


@FUZZ
@given(change=mutations(max_changes=1))
def test_one_bad_key_is_named(change):
    (key, value), = change
    raw = set_key(BASE, key, value)
    try:
        build(raw)
    except SplitfedError as err:
        assert_names(err, key)


@FUZZ
@given(changes=mutations())
def test_several_bad_keys_raise_only_splitfed_errors(changes):
    raw = BASE
    for key, value in changes:
        raw = set_key(raw, key, value)
    try:
        build(raw)
    except SplitfedError:
        pass


@FUZZ
@given(data=st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), VALUES,
                            max_size=6))
def test_random_top_level_dicts(data):
    """from_dict over arbitrary trees: a RunConfig or a ConfigError, nothing else."""
    try:
        cfg = build_config(data)
    except ConfigError:
        return
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


OVERRIDE_TEXT = st.one_of(
    st.text(max_size=20),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS),
              st.one_of(st.text(max_size=10),
                        st.sampled_from(["[1, 2", "{a: 1}", "!!python/object:os.system",
                                         "&a [*a]", "null", "", "'", "1e999", "-.inf",
                                         "2020-01-01", "0x10", "[[]]", "{}", "~"]))),
)


@FUZZ
@given(items=st.lists(OVERRIDE_TEXT, max_size=4))
def test_random_overrides(items):
    try:
        cfg = build_config(BASE, items)
    except ConfigError:
        return
    assert isinstance(cfg, RunConfig)


@FUZZ
@given(text=st.one_of(
    st.text(max_size=60),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
    st.builds(yaml.safe_dump, st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))))
def test_random_yaml_files(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("yaml") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        load_config(str(path))
    except ConfigError as err:
        try:
            keys = list(yaml.safe_load(text) or {})
        except Exception:  # noqa: BLE001 - unparsable: the message names the file
            keys = []
        named = [str(k) for k in keys if str(k) in str(err)]
        assert str(path) in str(err) or named, str(err)


def test_non_utf8_yaml_names_the_file(tmp_path):
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="latin.yaml"):
        load_config(str(path))


def test_override_keys_that_are_not_strings_in_options():
    with pytest.raises(ConfigError, match="data.options"):
        build_config({"data": {"options": [1, 2]}})
    with pytest.raises(ConfigError, match="model.options"):
        build_config({"model": {"options": "wide"}})


# ------------------------------------------------------- incompatible options, by table

INCOMPATIBLE = [
    ({"model": {"name": "mlp", "hidden": [16], "cut": 5}, "algorithm": {"name": "sflv2"}},
     "cut"),
    ({"model": {"name": "mlp", "hidden": [16], "cut": 0}, "algorithm": {"name": "sflv2"}},
     "cut"),
    ({"model": {"name": "mlp", "hidden": [16], "cut": "nope"}, "algorithm": {"name": "sl"}},
     "cut"),
    ({"participation": {"mode": "bernoulli", "q": 1.5}}, "participation.q"),
    ({"participation": {"mode": "bernoulli", "q": 0}}, "participation.q"),
    ({"participation": {"mode": "bernoulli", "q": -0.1}}, "participation.q"),
    ({"participation": {"mode": "bernoulli", "q": [0.5, 0.5]}}, "participation.q"),
    ({"participation": {"mode": "bernoulli"}}, "participation.q"),
    ({"participation": {"mode": "uniform", "clients_per_round": 5}},
     "participation.clients_per_round"),
    ({"participation": {"mode": "uniform"}}, "participation.clients_per_round"),
    ({"participation": {"mode": "full", "clients_per_round": 2}},
     "participation.clients_per_round"),
    ({"partition": {"scheme": "iid", "num_clients": 301}}, "num_clients"),
    ({"partition": {"scheme": "natural", "num_clients": 4}}, "partition.scheme"),
    ({"partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 0}}, "alpha"),
    ({"partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5,
                    "min_partition_size": 100}}, "min_partition_size"),
    ({"partition": {"scheme": "pathological", "num_clients": 4,
                    "num_classes_per_partition": 11}}, "num_classes_per_partition"),
    ({"partition": {"scheme": "shard", "num_clients": 4, "num_shards_per_partition": 2,
                    "shard_size": 1000}}, "shard_size"),
    ({"data": {"name": "digits", "limit_train": 5000}}, "data.limit_train"),
    ({"data": {"name": "digits", "limit_test": 0}}, "data.limit_test"),
    ({"data": {"name": "imagenet"}}, "data.name"),
    ({"data": {"name": "digits", "colour": True}}, "colour"),
    ({"data": {"name": "synthetic", "alpha": "lots"}, "model": {"name": "mlp"}}, "alpha"),
    ({"data": {"name": "synthetic", "num_devices": 4.5}, "model": {"name": "mlp"}},
     "num_devices"),
    ({"data": {"name": "cifar100", "label_mode": "medium", "data_dir": "/nonexistent"}},
     "label_mode"),
    ({"model": {"name": "lenet5"}, "data": {"name": "digits"}}, "lenet5"),
    ({"model": {"name": "mlp", "hidden": "wide"}}, "hidden"),
    ({"model": {"name": "nope"}}, "model.name"),
    ({"train": {"local_steps": 2, "local_epochs": 1.0}}, "local_epochs"),
    ({"train": {"lr": 0}}, "train.lr"),
    ({"train": {"momentum": 1.0}}, "train.momentum"),
    ({"engine": {"device": "cuda:abc"}}, "engine.device"),
    ({"engine": {"device": "tpu"}}, "engine.device"),
    ({"algorithm": {"name": "fedavg", "global_lr": "fast"}}, "global_lr"),
    ({"algorithm": {"name": "fedclg_c"}, "server_data": {"fraction": 0.999}},
     "server_data.fraction"),
    ({"algorithm": {"name": "fedclg_c"}, "server_data": {"samples_per_round": 10**6}},
     "server_data.samples_per_round"),
    ({"clock": {"profile": "sundial"}}, "clock.profile"),
    ({"clock": {"profile": "trace"}}, "clock.path"),
    ({"clock": {"profile": "exponential", "colour": 1}}, "clock.colour"),
    ({"out_dir": ""}, "out_dir"),
    ({"name": "a\x00b"}, "name"),
    ({"name": ""}, "name"),
]


@pytest.mark.parametrize("change,key", INCOMPATIBLE, ids=[k for _, k in INCOMPATIBLE])
def test_incompatible_options_name_the_key(change, key):
    raw = copy.deepcopy(BASE)
    for section, value in change.items():
        if isinstance(value, dict) and isinstance(raw.get(section), dict) and "name" not in value:
            raw[section] = {**raw[section], **value}
        else:
            raw[section] = value
    if raw["partition"].get("num_clients") is None:
        raw["partition"]["num_clients"] = 4
    with pytest.raises(SplitfedError) as info:
        build(raw)
    assert key in str(info.value), str(info.value)


def test_overrides_parse_errors_name_the_item():
    for item, word in [("train.lr", "train.lr"), ("=1", "=1"), ("a..b=1", "a..b"),
                       ("train.lr=[1,", "train.lr"), ("rounds=1", None)]:
        if word is None:
            assert parse_overrides([item]) == {"rounds": 1}
            continue
        with pytest.raises(ConfigError, match=word.replace(".", r"\.").replace("[", r"\[")):
            parse_overrides([item])
