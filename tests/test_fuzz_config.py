"""Fuzzing the config path: whatever a user writes in a YAML file or on the command line,
loading and building a run either succeeds or raises one of splitfed's own errors
(``SplitfedError``: ConfigError, DataError) whose message names the offending key."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import string
import time

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import numpy as np

from splitfed.algorithms import ALGORITHMS
from splitfed.cli import main
from splitfed.config import (
    MAX_BATCH_SIZE,
    MAX_CLIENTS,
    MAX_LOCAL_EPOCHS,
    MAX_LOCAL_STEPS,
    MAX_OVER_SELECT,
    MAX_ROUNDS,
    MAX_SAMPLES,
    RunConfig,
    build_config,
    load_config,
)
from splitfed.configtools import MAX_YAML_BYTES, from_dict, parse_overrides, to_dict
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


# ------------------------------------------ through the command line: refused at once

CONFIG_YAML = """name: fuzz
rounds: 2
progress: false
data: {name: digits, limit_train: 300, limit_test: 50}
partition: {scheme: iid, num_clients: 4}
model: {name: mlp, hidden: [16]}
train: {batch_size: 8, local_steps: 1, lr: 0.1}
participation: {mode: full}
"""


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "base.yaml"
    path.write_text(CONFIG_YAML)
    return str(path)


def cli_refuses(config, overrides, out, capsys=None) -> str:
    """``splitfed run config overrides``: exit 2, one ``splitfed: error:`` line, nothing
    written under ``out``; returns the line."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", config, f"out_dir={out}", *overrides])
    err = stderr.getvalue().strip()
    assert code == 2, (overrides, err)
    assert len(err.splitlines()) == 1 and err.startswith("splitfed: error: "), err
    assert not os.path.exists(out), f"{overrides}: wrote {os.listdir(out)}"
    return err


# key, its upper bound, and overrides the key needs to be read
BOUNDED = [
    ("rounds", MAX_ROUNDS, []), ("eval_every", MAX_ROUNDS, []),
    ("checkpoint_every", MAX_ROUNDS, []),
    ("train.batch_size", MAX_BATCH_SIZE, []), ("train.local_steps", MAX_LOCAL_STEPS, []),
    ("train.local_epochs", MAX_LOCAL_EPOCHS, ["train.local_steps=null"]),
    ("partition.num_clients", MAX_CLIENTS, []),
    ("participation.clients_per_round", MAX_CLIENTS, ["participation.mode=uniform"]),
    ("engine.chunk_size", MAX_CLIENTS, []), ("engine.eval_batch_size", MAX_BATCH_SIZE, []),
    ("data.limit_train", MAX_SAMPLES, []), ("data.limit_test", MAX_SAMPLES, []),
    ("server_data.samples_per_round", MAX_SAMPLES, []),
    ("server_data.min_per_class", MAX_SAMPLES, []),
    ("clock.over_select", MAX_OVER_SELECT, ["participation.mode=uniform",
                                            "participation.clients_per_round=2"]),
    ("algorithm.tau", 10**4, ["algorithm.name=musplitfed"]),
    ("algorithm.max_tau", 10**4, ["algorithm.name=musplitfed"]),
    ("algorithm.directions", 10**4, ["algorithm.name=gas"]),
    ("algorithm.buffer_size", 10**6, ["algorithm.name=gas"]),
    ("algorithm.period", 10**6, ["algorithm.name=csefsl"]),
    ("algorithm.aux_hidden", 10**5, ["algorithm.name=csefsl"]),
    ("algorithm.server_period", 10**6, ["algorithm.name=sflv1"]),
    ("algorithm.server_steps", 10**6, ["algorithm.name=server_only"]),
    ("algorithm.server_batch_size", 10**6, ["algorithm.name=server_only"]),
    ("algorithm.server_epochs", 10**4, ["algorithm.name=server_only"]),
    ("algorithm.rank", 10**4, ["algorithm.name=fedlora"]),
]


@st.composite
def huge_values(draw, bound):
    """A number above ``bound`` in one of the forms a user may type."""
    k = draw(st.integers(len(str(int(bound))), 40))
    n = draw(st.integers(int(bound) + 1, max(int(bound) + 1, 10**k)))
    return draw(st.sampled_from([str(n), f"1e{k}", f"1.0e+{k}", f"{n}.0", "inf", ".inf",
                                 f"{float(n):e}", f"0x{n:x}"]))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_numbers_beyond_their_bound_are_refused_at_once(config_file, tmp_path, data):
    key, bound, needs = data.draw(st.sampled_from(BOUNDED))
    value = data.draw(huge_values(bound))
    t0 = time.process_time()
    line = cli_refuses(config_file, [*needs, f"{key}={value}"], tmp_path / "runs")
    assert time.process_time() - t0 < 1.0
    assert key in line and f"<= {bound}" in line, line


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_clients=st.integers(301, 10**6), batch=st.integers(301, 10**6),
       which=st.sampled_from(["partition.num_clients", "train.batch_size"]))
def test_numbers_beyond_the_data_are_refused(config_file, tmp_path, num_clients, batch,
                                             which):
    value = num_clients if which == "partition.num_clients" else batch
    line = cli_refuses(config_file, [f"{which}={value}"], tmp_path / "runs")
    assert which in line and "1..300" in line, line


# ------------------------------------------------------- YAML: aliases, depth, size

@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(anchored=st.sampled_from(["train", "model", "partition", "data"]),
       style=st.sampled_from(["value", "merge", "list", "laughs"]))
def test_yaml_aliases_are_refused(config_file, tmp_path, anchored, style):
    base = yaml.safe_load(CONFIG_YAML)
    body = yaml.safe_dump({k: v for k, v in base.items() if k != anchored}, sort_keys=False)
    section = yaml.safe_dump({anchored: base[anchored]}, default_flow_style=True).strip()
    section = section.replace(f"{anchored}: ", f"{anchored}: &a ", 1)
    extra = {"value": "copy: *a", "merge": "other:\n  <<: *a",
             "list": "lists: [*a, *a]",
             "laughs": "l1: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                       "l2: [*b, *b, *b, *b, *b, *b, *b, *b, *b]"}[style]
    path = tmp_path / "alias.yaml"
    path.write_text(f"{body}{section}\n{extra}\n")
    with pytest.raises(ConfigError, match="aliases") as err:
        load_config(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    line = cli_refuses(str(path), [], tmp_path / "runs")
    assert "aliases" in line


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(65, 20000), flow=st.booleans(), where=st.sampled_from(
    ["file", "override"]))
def test_deep_nesting_is_refused(config_file, tmp_path, depth, flow, where):
    if flow:
        text = "[" * depth + "]" * depth
    else:
        text = "".join(f"\n{'  ' * i}k{i}:" for i in range(min(depth, 600))) + " 1"
    t0 = time.process_time()
    if where == "file":
        path = tmp_path / "deep.yaml"
        path.write_text(f"model:\n  options:\n    deep: {text}\n" if flow else
                        f"data:{text}\n")
        line = cli_refuses(str(path), [], tmp_path / "runs")
    else:
        line = cli_refuses(config_file, [f"model.deep={text}"], tmp_path / "runs")
    assert time.process_time() - t0 < 1.0
    assert "nested" in line, line


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(MAX_YAML_BYTES + 1, 4 * MAX_YAML_BYTES),
       kind=st.sampled_from(["comment", "string", "list", "override"]))
def test_huge_yaml_texts_are_refused(config_file, tmp_path, size, kind):
    filler = {"comment": "#" + "x" * size, "string": "name: " + "x" * size,
              "list": "model: {hidden: [" + "1," * (size // 2) + "1]}",
              "override": None}[kind]
    t0 = time.process_time()
    if filler is None:
        line = cli_refuses(config_file, ["name=" + "x" * size], tmp_path / "runs")
    else:
        path = tmp_path / "huge.yaml"
        path.write_text(CONFIG_YAML + filler + "\n")
        line = cli_refuses(str(path), [], tmp_path / "runs")
    assert time.process_time() - t0 < 1.0
    assert str(MAX_YAML_BYTES) in line, line


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS),
                                st.sampled_from(["&a [*a]", "*a", "&x 1", "[&y 1, *y]",
                                                 "{a: &z 2, b: *z}", "!!python/object:os.system",
                                                 "!!binary aGk=", "!!set {a, b}",
                                                 "1e18", "-1e18", "1e999", ".nan"])),
                      min_size=1, max_size=3))
def test_hostile_overrides_raise_one_line(config_file, tmp_path, items):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            cfg = build_config(yaml.safe_load(CONFIG_YAML), items)
        except ConfigError as err:
            assert "\n" not in str(err)
            cli_refuses(config_file, items, tmp_path / "runs")
            return
    assert isinstance(cfg, RunConfig)


# ------------------------------------------------- partitions and participation

@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scheme=st.sampled_from(["iid", "dirichlet", "pathological", "shard"]),
       num_clients=st.sampled_from([1, 2, 5, 20, 60, 150, 299, 300]),
       alpha=st.sampled_from([1e-3, 0.05, 0.5, 10.0]), min_size=st.integers(0, 3),
       classes=st.integers(1, 3), shards=st.integers(1, 3),
       mode=st.sampled_from(["deterministic", "first-deterministic", "random"]),
       seed=st.integers(0, 3))
def test_partitions_with_empty_clients_are_refused(scheme, num_clients, alpha, min_size,
                                                   classes, shards, mode, seed):
    options = {"iid": {}, "dirichlet": {"alpha": alpha, "min_partition_size": min_size},
               "pathological": {"num_classes_per_partition": classes,
                                "class_assignment_mode": mode},
               "shard": {"num_shards_per_partition": shards}}[scheme]
    raw = set_key(BASE, "partition", {"scheme": scheme, "num_clients": num_clients,
                                      **options})
    raw["seed"] = seed
    try:
        cfg = build_config(raw)
        env = build_environment(cfg)
    except ConfigError as err:
        assert "\n" not in str(err)
        if "no samples" in str(err):
            assert "partition.scheme" in str(err) and scheme in str(err)
            assert "num_clients" in str(err)
        return
    assert all(len(i) > 0 for i in env.client_indices)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["full", "uniform", "with_replacement", "bernoulli"]),
       m=st.one_of(st.none(), st.integers(-1, 12)),
       q=st.one_of(st.none(), st.sampled_from([0, 0.0, -0.5, 1e-9, 0.5, 1, 1.5, [0] * 6,
                                               [0.5] * 6, [1] * 5, "half"])),
       over=st.sampled_from([0, 0.5, 3.0]), n=st.sampled_from([1, 3, 6]))
def test_participation_is_met_or_refused(mode, m, q, over, n):
    raw = set_key(BASE, "participation", {"mode": mode, "clients_per_round": m, "q": q})
    raw = set_key(raw, "partition.num_clients", n)
    raw = set_key(raw, "clock", {"over_select": over})
    try:
        cfg = build_config(raw)
        env = build_environment(cfg)
    except ConfigError as err:
        assert "\n" not in str(err)
        assert "participation" in str(err) or "clock.over_select" in str(err), str(err)
        return
    rng = np.random.default_rng(0)
    cohorts = [env.sampler.sample(rng) for _ in range(20)]
    if mode == "bernoulli":   # someone can join (a tiny q may still leave every round
        qs = np.broadcast_to(np.asarray(cfg.participation.q, dtype=float), (n,))
        assert (qs > 0).any()  # empty: such a run ends no_client_trained, not completed)
    else:
        assert all(c.size >= 1 for c in cohorts)


# --------------------------------------------- random small runs: refused or finished

ALGORITHM_NAMES = sorted(ALGORITHMS)


@st.composite
def small_runs(draw):
    """Overrides of a small synthetic run, many of them incompatible on purpose."""
    alg = draw(st.sampled_from(ALGORITHM_NAMES))
    o = ["data.name=synthetic", "model.name=mlp", "model.hidden=[8]", "rounds=2",
         f"algorithm.name={alg}", "progress=false",
         f"data.num_devices={draw(st.sampled_from([1, 2, 5, 10]))}",
         f"data.num_classes={draw(st.sampled_from([2, 3, 10]))}"]
    if alg == "fedlora":
        o.append("model.hidden=[8, 8]")
    if draw(st.booleans()):
        o.append(f"data.limit_train={draw(st.sampled_from([1, 5, 20, 200]))}")
    scheme = draw(st.sampled_from(["iid", "dirichlet", "pathological", "shard", "natural"]))
    o += [f"partition.scheme={scheme}",
          f"partition.num_clients={draw(st.sampled_from([1, 2, 5, 10, 100, 1000]))}"]
    o += {"iid": [], "natural": [],
          "dirichlet": [f"partition.alpha={draw(st.sampled_from([0.01, 1.0]))}",
                        f"partition.min_partition_size={draw(st.integers(0, 2))}"],
          "pathological": [f"partition.num_classes_per_partition={draw(st.integers(1, 2))}"],
          "shard": [f"partition.num_shards_per_partition={draw(st.integers(1, 2))}"]}[scheme]
    mode = draw(st.sampled_from(["full", "uniform", "with_replacement", "bernoulli"]))
    o.append(f"participation.mode={mode}")
    if mode in ("uniform", "with_replacement"):
        o.append(f"participation.clients_per_round={draw(st.sampled_from([1, 3, 50]))}")
    if mode == "bernoulli":
        o.append(f"participation.q={draw(st.sampled_from([0.01, 0.5, 1.0]))}")
    o.append(f"train.batch_size={draw(st.sampled_from([1, 4, 64, 5000]))}")
    o.append(draw(st.sampled_from(["train.local_steps=1", "train.local_steps=2",
                                   "train.local_steps=null train.local_epochs=0.5"])))
    if draw(st.booleans()):
        o.append(f"clock.profile={draw(st.sampled_from(['fixed', 'exponential']))}")
        o.append(f"clock.deadline={draw(st.sampled_from([1e-9, 0.01, 1e9]))}")
    if draw(st.booleans()):
        o.append(f"server_data.fraction={draw(st.sampled_from([0.05, 0.5, 0.9]))}")
        o.append(f"server_data.min_per_class={draw(st.sampled_from([0, 1]))}")
    return " ".join(o).split()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(overrides=small_runs())
def test_random_small_runs_are_refused_or_finish(tmp_path_factory, overrides):
    folder = tmp_path_factory.mktemp("runs")
    base = folder / "small.yaml"
    base.write_text("name: small\nmodel: {name: mlp}\n")
    out = folder / "out"
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = main(["run", str(base), f"out_dir={out}", *overrides])
    event("refused" if code == 2 else "ran")
    if code == 2:
        err = stderr.getvalue().strip()
        assert len(err.splitlines()) == 1 and err.startswith("splitfed: error: "), err
        assert not out.exists()
        return
    assert code in (0, 3), (overrides, stderr.getvalue()[-2000:])
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] in ("completed", "diverged", "no_client_trained")
    assert (code == 0) == (summary["status"] == "completed")
    assert f"status {summary['status']}" in stdout.getvalue()
