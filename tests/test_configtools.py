"""Tests of the typed-config machinery (splitfed.configtools)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from splitfed.configtools import (
    describe,
    dump_yaml,
    from_dict,
    load_yaml,
    merge,
    parse_overrides,
    to_dict,
    yaml_load,
    yaml_round_trip,
)
from splitfed.config import load_config, shipped_configs
from splitfed.errors import ConfigError


@dataclass
class Train:
    lr: float = field(default=0.1, metadata={"gt": 0, "help": "client learning rate"})
    momentum: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    steps: int = field(default=5, metadata={"ge": 1})
    optimizer: Literal["sgd", "adam"] = "sgd"
    nesterov: bool = False

    def __post_init__(self):
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0")


@dataclass
class Model:
    name: str = field(default="mlp", metadata={"choices": ("mlp", "cnn")})
    hidden: list[int] = field(default_factory=lambda: [64, 32], metadata={"ge": 1})
    shape: tuple[int, ...] = (1, 28, 28)
    pair: tuple[int, str] = (1, "a")


@dataclass(frozen=True)
class Stage:
    width: int = 8


@dataclass
class Run:
    seed: int
    train: Train = field(default_factory=Train)
    model: Model = field(default_factory=Model)
    alpha: Optional[float] = None  # noqa: UP045 (typing.Optional is tested on purpose)
    cut: int | str = 2
    stages: list[Stage] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    note: Any = None


def build(**data) -> Run:
    return from_dict(Run, {"seed": 0, **data})


def config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        from_dict(Run, {"seed": 0, **data})
    return str(info.value)


# ------------------------------------------------------------------ happy paths


def test_defaults_and_nested_values():
    run = build(train={"lr": 0.5}, model={"hidden": [8]}, stages=[{"width": 3}, {}])
    assert run.train == Train(lr=0.5)
    assert run.model.hidden == [8] and run.model.shape == (1, 28, 28)
    assert run.stages == [Stage(3), Stage(8)]


def test_round_trip_through_dict_and_yaml(tmp_path):
    run = build(alpha="inf", cut="layer3", model={"pair": [2, "b"]}, extra={"a": 1},
                note={"free": [1, 2]})
    data = to_dict(run)
    assert data["alpha"] == math.inf and data["model"]["shape"] == [1, 28, 28]
    assert list(data) == ["seed", "train", "model", "alpha", "cut", "stages", "extra", "note"]
    assert from_dict(Run, data) == run
    dump_yaml(run, tmp_path / "sub" / "run.yaml")
    assert from_dict(Run, load_yaml(tmp_path / "sub" / "run.yaml")) == run


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("inf", math.inf), ("-inf", -math.inf),
                                         (3, 3.0), (0.25, 0.25)])
def test_float_accepts_yaml_strings_and_ints(text, value):
    run = build(alpha=text)
    assert run.alpha == value and isinstance(run.alpha, float)


@pytest.mark.parametrize("text", ["1_0", "\u0661", " 1.5", "0x10", "1e", "", "nanx"])
def test_float_refuses_text_that_is_no_number_written_in_a_config(text):
    # Python's float() reads '1_0' as 10, an Arabic-Indic one as 1, ' 1.5' as 1.5
    with pytest.raises(ConfigError, match=r"^alpha: expected float \| None, got "):
        build(alpha=text)


def test_none_data_gives_defaults():
    assert from_dict(Stage, None) == Stage()


def test_union_tries_arms_in_order():
    assert build(cut=3).cut == 3
    assert build(cut="3").cut == "3"


def test_post_init_value_error_becomes_prefixed_config_error():
    msg = config_error({"train": {"nesterov": True}})
    assert msg.startswith("train: ") and "nesterov needs momentum" in msg


# ----------------------------------------------------------------- error paths


def test_unknown_key_of_a_class_without_keys_says_it_takes_none():
    @dataclass
    class Empty:
        pass

    with pytest.raises(ConfigError) as err:
        from_dict(Empty, {"x": 1}, path="algorithm.client_transforms[0]")
    assert str(err.value) == ("unknown key 'algorithm.client_transforms[0].x'; "
                              "algorithm.client_transforms[0] takes no keys (no options)")


def test_unknown_key_lists_allowed_and_suggests():
    msg = config_error({"train": {"lrr": 1}})
    assert "'train.lrr'" in msg and "lr, momentum, steps" in msg and "did you mean 'lr'" in msg


def test_unknown_top_level_key():
    msg = config_error({"sede": 1})
    assert "'sede'" in msg and "did you mean 'seed'" in msg


def test_missing_required_key():
    with pytest.raises(ConfigError, match="missing required key 'seed'"):
        from_dict(Run, {})


@pytest.mark.parametrize("data, key, expected", [
    ({"train": {"lr": "abc"}}, "train.lr", "expected a float, got 'abc' (str)"),
    ({"train": {"steps": 5.0}}, "train.steps", "expected an integer"),
    ({"train": {"steps": True}}, "train.steps", "expected an integer"),
    ({"train": {"steps": "5"}}, "train.steps", "expected an integer"),
    ({"train": {"nesterov": 1}}, "train.nesterov", "expected a boolean"),
    ({"train": {"nesterov": "yes"}}, "train.nesterov", "expected a boolean"),
    ({"train": {"lr": True}}, "train.lr", "expected a float"),
    ({"train": {"optimizer": "adm"}}, "train.optimizer", "'sgd', 'adam'"),
    ({"train": None}, "train", "expected a mapping"),
    ({"model": {"hidden": [1, "x"]}}, "model.hidden[1]", "expected an integer"),
    ({"model": {"hidden": 3}}, "model.hidden", "expected a list"),
    ({"model": {"pair": [1]}}, "model.pair", "2 items"),
    ({"model": {"pair": [1, 2]}}, "model.pair[1]", "expected a string"),
    ({"model": {"shape": [1, 2.5]}}, "model.shape[1]", "expected an integer"),
    ({"stages": [{}, {"widht": 1}]}, "stages[1].widht", "did you mean 'width'"),
    ({"extra": {"a": "b"}}, "extra.a", "expected a float"),
    ({"extra": [1]}, "extra", "expected a mapping"),
    ({"cut": 1.5}, "cut", "expected int | str"),
    ({"alpha": "x"}, "alpha", "expected float | None"),
    ({"seed": None}, "seed", "expected an integer"),
])
def test_type_errors_name_the_dotted_key(data, key, expected):
    msg = config_error(data)
    assert msg.startswith(f"{key}: ") or f"'{key}'" in msg
    assert expected in msg


@pytest.mark.parametrize("data, message", [
    ({"train": {"lr": -1}}, "train.lr: must be > 0, got -1"),
    ({"train": {"lr": 0}}, "train.lr: must be > 0"),
    ({"train": {"momentum": 1}}, "train.momentum: must be < 1"),
    ({"train": {"steps": 0}}, "train.steps: must be >= 1"),
    ({"model": {"hidden": [4, 0]}}, "model.hidden[1]: must be >= 1"),
    ({"model": {"name": "rnn"}}, "model.name: must be one of 'mlp', 'cnn'"),
])
def test_bounds_and_choices(data, message):
    assert message in config_error(data)


def test_top_level_must_be_mapping():
    with pytest.raises(ConfigError, match="expected a mapping"):
        from_dict(Run, [1, 2])


# ----------------------------------------------------------------- YAML files


def test_load_yaml_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_yaml(path)
    assert str(path) in str(info.value)


def test_load_yaml_parse_error_has_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 1\ntrain:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"cannot parse .*bad\.yaml: line \d+"):
        load_yaml(path)


@pytest.mark.parametrize("digits", ["9" * 5000, "0x" + "f" * 4000, "-" + "1" * 101])
def test_an_integer_too_long_to_print_is_refused_at_its_line(tmp_path, digits):
    """Python refuses to print an int of more than 4300 digits (and reads a hex one of
    any length): such a value would fail as a traceback in a later message."""
    path = tmp_path / "big.yaml"
    path.write_text(f"seed: 1\nrounds: {digits}\n")
    with pytest.raises(ConfigError, match=rf"big\.yaml: line 2, column 9: an integer of "
                                          rf"{len(digits)} characters; at most 100"):
        load_yaml(path)
    with pytest.raises(ConfigError, match=r"'rounds=9+\.\.\.': cannot parse value"):
        parse_overrides([f"rounds={digits}"] if digits[0] == "9" else ["rounds=" + "9" * 200])
    assert yaml_load("x: " + "9" * 100, "t") == {"x": int("9" * 100)}


@pytest.mark.parametrize("value, says", [
    ("!!int abc", "cannot read this value as int"),
    ("!!float x", "cannot read this value as float"),
    ("!!bool maybe", "cannot read this value as bool"),
    ("!!timestamp abc", "cannot read this value as timestamp"),
    ("2001-13-45", "cannot read this value as timestamp (ValueError: month must be"),
    ("!!map [1]", "expected a mapping for tag:yaml.org,2002:map, found a sequence"),
    ("!!set [1]", "expected a mapping for tag:yaml.org,2002:set, found a sequence"),
])
def test_a_value_its_tag_cannot_make_is_refused_at_its_line(tmp_path, value, says):
    path = tmp_path / "tag.yaml"
    path.write_text(f"seed: 1\nname: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    message = str(info.value)
    assert message.startswith(f"cannot parse {path}: line 2, column 7: ") and says in message
    with pytest.raises(ConfigError, match="cannot parse value: line 1, column 1: "):
        parse_overrides([f"name={value}"])


def test_load_yaml_top_level_not_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(path)


def test_load_yaml_empty_file_is_empty_mapping(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_yaml(path) == {}


# ------------------------------------------------------------------ overrides


def test_parse_overrides_nested_and_typed():
    out = parse_overrides(["train.lr=0.1", "partition.alpha=inf", "model.hidden=[64,32]",
                           "name=x", "train.steps=3", "empty=", "quoted=''", "eq=a=b"])
    assert out == {"train": {"lr": 0.1, "steps": 3}, "partition": {"alpha": "inf"},
                   "model": {"hidden": [64, 32]}, "name": "x", "empty": None, "quoted": "",
                   "eq": "a=b"}


@pytest.mark.parametrize("item", ["train.lr", "=3", ".lr=1", "train..lr=1", "a.=1", "x=[1,"])
def test_parse_overrides_rejects_bad_items(item):
    with pytest.raises(ConfigError) as info:
        parse_overrides([item])
    assert item in str(info.value)


def test_parse_overrides_conflict():
    with pytest.raises(ConfigError, match="'a.b=2'"):
        parse_overrides(["a=1", "a.b=2"])


def test_merge_is_deep_and_pure():
    base = {"train": {"lr": 0.1, "steps": 5}, "model": {"hidden": [64, 32]}, "seed": 1}
    override = {"train": {"lr": 0.5}, "model": {"hidden": [8]}, "new": {"deep": {"k": 1}}}
    snapshot = (repr(base), repr(override))
    out = merge(base, override)
    assert out == {"train": {"lr": 0.5, "steps": 5}, "model": {"hidden": [8]}, "seed": 1,
                   "new": {"deep": {"k": 1}}}
    assert (repr(base), repr(override)) == snapshot
    out["train"]["steps"] = 9
    out["new"]["deep"]["k"] = 2
    assert base["train"]["steps"] == 5 and override["new"]["deep"]["k"] == 1


def test_overrides_on_yaml_end_to_end(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\ntrain:\n  lr: 1e-3\nmodel:\n  hidden: [4, 4, 4]\n")
    data = merge(load_yaml(path), parse_overrides(["train.steps=7", "model.hidden=[2]"]))
    run = from_dict(Run, data)
    assert (run.seed, run.train.lr, run.train.steps, run.model.hidden) == (3, 1e-3, 7, [2])


def test_describe_mentions_every_key():
    text = describe(Run)
    for key in ["seed", "train.lr", "train.momentum", "train.steps", "train.optimizer",
                "train.nesterov", "model.name", "model.hidden", "model.shape", "model.pair",
                "alpha", "cut", "stages", "extra", "note"]:
        assert f"\n{key}: " in "\n" + text
    assert "client learning rate" in text and "> 0" in text and "required" in text


# ------------------------------------------------------------------ properties

# a config float is 0 or within float32's range (no float32 subnormals)
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6,
                   width=32, allow_subnormal=False)
names = st.text(st.characters(codec="utf-8", categories=["L", "N"]), min_size=1, max_size=8)

runs = st.builds(
    Run,
    seed=st.integers(-(2**40), 2**40),
    train=st.builds(Train, lr=st.floats(1e-6, 10),
                    momentum=st.floats(0, 0.75, width=32, allow_subnormal=False),
                    steps=st.integers(1, 1000), optimizer=st.sampled_from(["sgd", "adam"])),
    model=st.builds(Model, name=st.sampled_from(["mlp", "cnn"]),
                    hidden=st.lists(st.integers(1, 512), max_size=4),
                    shape=st.lists(st.integers(-5, 5), max_size=4).map(tuple),
                    pair=st.tuples(st.integers(), names)),
    alpha=st.none() | finite | st.just(math.inf),
    cut=st.integers(-9, 9) | names,
    stages=st.lists(st.builds(Stage, width=st.integers(0, 64)), max_size=3),
    extra=st.dictionaries(names, finite, max_size=3),
)


@given(runs)
def test_property_round_trip(run):
    assert from_dict(Run, to_dict(run)) == run
    assert from_dict(Run, yaml.safe_load(yaml.safe_dump(to_dict(run), sort_keys=False))) == run


junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                               max_size=3),
    max_leaves=6,
)
typed_keys = st.sampled_from([("train", "lr"), ("train", "steps"), ("train", "nesterov"),
                              ("train", "optimizer"), ("model", "hidden"), ("model", "pair"),
                              ("model", "shape"), ("model", "name"), (None, "alpha"),
                              (None, "cut"), (None, "stages"), (None, "extra"), (None, "seed")])


@given(typed_keys, junk)
def test_property_junk_gives_config_error_or_valid_config(where, value):
    section, key = where
    data = {"seed": 0}
    if section is None:
        data[key] = value
    else:
        data[section] = {key: value}
    try:
        run = from_dict(Run, data)
    except ConfigError as err:
        assert key in str(err)
    else:
        assert from_dict(Run, to_dict(run)) == run or _has_nan(to_dict(run))


@given(st.dictionaries(st.text(max_size=4), junk, max_size=4))
def test_property_junk_top_level_never_crashes(data):
    try:
        from_dict(Run, data)
    except ConfigError:
        pass


def _has_nan(data: Any) -> bool:
    if isinstance(data, dict):
        return any(_has_nan(v) for v in data.values())
    if isinstance(data, list):
        return any(_has_nan(v) for v in data)
    return isinstance(data, float) and math.isnan(data)


@dataclass
class Bounded:
    steps: int = field(default=1, metadata={"ge": 1, "le": 100})
    rate: float = field(default=0.5, metadata={"gt": 0, "lt": 1})
    floor: int = field(default=0, metadata={"ge": 0})


@pytest.mark.parametrize("data,message", [
    ({"steps": 101}, "steps: must be <= 100, got 101 (allowed: >= 1 and <= 100)"),
    ({"steps": 0}, "steps: must be >= 1, got 0 (allowed: >= 1 and <= 100)"),
    ({"steps": "1e18"}, "steps: expected an integer, got '1e18' (str) "
                        "(allowed: >= 1 and <= 100)"),
    ({"steps": 1e18}, "steps: expected an integer, got 1e+18 (float) "
                      "(allowed: >= 1 and <= 100)"),
    ({"rate": "inf"}, "rate: must be a finite number (> 0 and < 1), got inf"),
    ({"rate": "-inf"}, "rate: must be a finite number (> 0 and < 1), got -inf"),
    ({"floor": -1}, "floor: must be >= 0, got -1"),
])
def test_bound_messages_name_the_allowed_range(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(Bounded, data)
    assert str(err.value) == message


@pytest.mark.parametrize("item", ["a=[\n1", "a.b=\x00[", "x" * 500, "a=&x [*x]\n\n",
                                  "k=" + "[" * 100])
def test_override_errors_stay_on_one_line(item):
    with pytest.raises(ConfigError) as err:
        parse_overrides([item])
    assert "\n" not in str(err.value) and len(str(err.value)) < 300, str(err.value)


def test_tilde_override_deletes_a_key():
    from splitfed.configtools import DELETE
    base = {"partition": {"scheme": "dirichlet", "alpha": 0.5, "num_clients": 4}}
    over = parse_overrides(["~partition.alpha", "partition.scheme=pathological"])
    assert over == {"partition": {"alpha": DELETE, "scheme": "pathological"}}
    assert merge(base, over) == {"partition": {"scheme": "pathological", "num_clients": 4}}
    for absent in (["~a.b", "c=1"], ["~partition.alpah"], ["~partition.scheme.x"]):
        with pytest.raises(ConfigError, match="nothing to remove"):   # a typo: refused
            merge(base, parse_overrides(absent))
    assert merge(base, parse_overrides(["~partition"])) == {}
    # later items win: a deleted key set again, a set key deleted
    assert merge(base, parse_overrides(["~partition.alpha", "partition.alpha=0.1"])) == base | {
        "partition": {**base["partition"], "alpha": 0.1}}
    assert "alpha" not in merge(base, parse_overrides(["partition.alpha=2",
                                                       "~partition.alpha"]))["partition"]
    assert base["partition"]["alpha"] == 0.5                          # inputs untouched


@pytest.mark.parametrize("item", ["~", "~.a", "~a..b", "~a."])
def test_tilde_override_needs_a_key(item):
    with pytest.raises(ConfigError, match="must look like ~key.sub"):
        parse_overrides([item])


def test_tilde_override_through_the_command_line(tmp_path, capsys):
    from splitfed.cli import main
    args = ["run", "quick_digits", "rounds=1", "progress=false", f"out_dir={tmp_path}",
            "partition.scheme=pathological", "partition.num_classes_per_partition=2"]
    assert main(args) == 2                                   # alpha is not pathological's
    assert "partition.alpha" in capsys.readouterr().err and not any(tmp_path.iterdir())
    assert main(args + ["~partition.alpha", "~partition.min_partition_size"]) == 0


def test_yaml_refuses_a_repeated_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 2\ntrain: {lr: 0.1}\nrounds: 3\n")
    with pytest.raises(ConfigError, match="line 3.*'rounds' appears twice"):
        load_yaml(path)
    path.write_text("train:\n  lr: 0.1\n  batch_size: 4\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="'lr' appears twice"):
        load_yaml(path)
    path.write_text("a: {x: 1}\nb: {x: 1}\n")                # the same key in two maps
    assert load_yaml(path) == {"a": {"x": 1}, "b": {"x": 1}}


@pytest.mark.parametrize("text, value", [
    ("010", 10), ("-007", -7), ("+3", 3), ("0x1F", 31), ("0o17", 15),   # YAML 1.2 integers
    ("1:20", "1:20"), ("1:20.5", "1:20.5"), ("1_000", "1_000"),    # 1.1's base 60 and _
    ("0b101", "0b101"), ("1.5", 1.5), (".5", 0.5), ("1_0.5", 10.5), (".inf", math.inf),
])
def test_yaml_integers_are_yaml_1_2s(tmp_path, text, value):
    """YAML 1.1 (PyYAML's default) reads 010 as 8 and 1:20 as 80: a value changed without
    a word. Files and key=value overrides read integers as YAML 1.2 does."""
    path = tmp_path / "c.yaml"
    path.write_text(f"a: {text}\n")
    for got in (load_yaml(path)["a"], yaml_load(text, "x", exponents=True)):
        assert got == value and type(got) is type(value)


def test_an_old_style_integer_is_refused_by_an_integer_field(tmp_path, capsys):
    from splitfed.cli import main

    assert main(["run", "quick_digits", "--dry-run", "rounds=010",
                 f"out_dir={tmp_path}"]) == 0
    assert "rounds         10 (" in capsys.readouterr().out
    assert main(["run", "quick_digits", "--dry-run", "seed=1:20", f"out_dir={tmp_path}"]) == 2
    assert "seed: expected an integer, got '1:20'" in capsys.readouterr().err


@pytest.mark.parametrize("name", shipped_configs())
def test_the_fast_yaml_round_trip_gives_what_pyyaml_gives(name):
    # libyaml where installed: the same data as PyYAML's own parser and emitter

    data = to_dict(load_config(name))
    data["extra"] = ["1e-3", "yes", "null", "~", "0x10", "010", "1:20", float("inf"),
                     -0.0, 1e-300, 10**30, "ünï", "a: b", "", None, True, [[1, 2], {}]]
    expected = yaml.safe_load(yaml.safe_dump(data, sort_keys=False))
    got = yaml_round_trip(data)
    assert got == expected and list(got) == list(expected)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)


# strings that some YAML reading takes for another type: YAML 1.2 integers (our loader),
# exponent floats (an override value, config.yaml as `splitfed results` reads it), YAML
# 1.1 forms, booleans, null
_LOOKALIKES = ["0o17", "0x1F", "1e5", "-2E5", "1.5e3", ".5", "010", "1_000", "1:20", "yes",
               "off", "null", "~", "true", ".inf", "-.inf", ".nan", "+7", "-0", "12"]


@pytest.mark.parametrize("exponents", [False, True])
@given(value=st.sampled_from(_LOOKALIKES) | st.text(alphabet="0123456789oxeE.+-_:", max_size=6)
       | st.text(max_size=8))
def test_strings_written_by_dump_text_read_back_as_the_same_strings(exponents, value):
    """A string value (a run's name, an option) written to config.yaml is read back as
    the same string, whichever reading: otherwise `config show`, `--resume` and
    `splitfed results` see another value."""
    from splitfed.configtools import dump_text

    data = {"name": value, "nested": {"items": [value, 3, 0.5, None, True]}}
    assert yaml_load(dump_text(data, sort_keys=False), "t", exponents=exponents) == data


def test_a_run_name_that_looks_like_a_number_survives_the_config_file(tmp_path):
    cfg = load_config("quick_digits", ["name='0o17'", "data.data_dir='1e5'"])
    assert cfg.name == "0o17"
    dump_yaml(cfg, tmp_path / "c.yaml")
    back = load_config(tmp_path / "c.yaml")
    assert back == cfg and back.name == "0o17" and back.data.data_dir == "1e5"
