"""Options of components keep their declared types, and no value is silently ignored.

:func:`splitfed.configtools.typed_options` checks the options of models, data sets,
partitioners and clock profiles against their parameters' annotations: a boolean is not a
number (``model.dropout=true`` on a float option), an integer option takes neither a
float nor a string, and a list of integers is checked element by element. Data sets'
options are checked the same way. A YAML merge key (``<<``) is refused, as aliases and
repeated keys are. Values that a run would ignore are refused: a ``server_data`` section
for an algorithm that trains on no server data, zero server epochs or steps for
server-only training, a server batch larger than the server's data. Every refusal is one
``splitfed: error:`` line naming the key, before a run directory exists."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

from splitfed.cli import main
from tests.helpers import dry_run as run
from splitfed.configtools import load_yaml, parse_overrides, typed_options
from splitfed.data import load_dataset
from splitfed.errors import ConfigError


def refused_line(tmp_path, capsys, overrides) -> str:
    code, err = run(tmp_path, capsys, overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ typed_options


def component(num_clients, rng, *, rate: float = 1.0, floor: float | None = None,
              count: int = 3, cap: int | None = None, widths: list[int] = (8,),
              shape: tuple[int, ...] = (1,), sizes: Sequence[int] = (2,),
              scales: list[float] = (1.0,), flags: tuple[bool, ...] = (True,),
              flag=False, free=None, label: str = "x"):
    """A component with options of every annotation typed_options checks."""


@pytest.mark.parametrize("options, message", [
    ({"rate": True}, "c.rate: expected a float, got True (bool)"),
    ({"rate": [1.0]}, "c.rate: expected a float, got [1.0] (list)"),
    ({"floor": False}, "c.floor: expected a float, got False (bool)"),
    ({"floor": "abc"}, "c.floor: expected a float, got 'abc' (str)"),
    ({"count": True}, "c.count: expected an integer, got True (bool)"),
    ({"count": 1.5}, "c.count: expected an integer, got 1.5 (float)"),
    ({"count": "abc"}, "c.count: expected an integer, got 'abc' (str)"),
    ({"count": "3"}, "c.count: expected an integer, got '3' (str)"),
    ({"cap": 2.0}, "c.cap: expected an integer, got 2.0 (float)"),
    ({"cap": False}, "c.cap: expected an integer, got False (bool)"),
    ({"widths": "abc"}, "c.widths: expected a list (list[int]), got 'abc' (str)"),
    ({"widths": 8}, "c.widths: expected a list (list[int]), got 8 (int)"),
    ({"widths": [8, 1.5]}, "c.widths[1]: expected an integer, got 1.5 (float)"),
    ({"shape": [True]}, "c.shape[0]: expected an integer, got True (bool)"),
    ({"sizes": [1, "x"]}, "c.sizes[1]: expected an integer, got 'x' (str)"),
    ({"scales": [1.0, True]}, "c.scales[1]: expected a float, got True (bool)"),
    ({"flags": [1]}, "c.flags[0]: expected a boolean (true/false), got 1 (int)"),
    ({"flag": "maybe"}, "c.flag: expected a boolean (true/false), got 'maybe' (str)"),
])
def test_typed_options_refuse_values_of_another_type(options, message):
    with pytest.raises(ConfigError) as err:
        typed_options(component, options, "c")
    assert str(err.value) == message


def test_typed_options_keep_what_they_accepted():
    given = {"rate": "1e-3", "floor": None, "count": 4, "cap": None, "widths": [16, 8],
             "shape": (1, 28), "sizes": [], "scales": [0.5, 2], "flags": [False],
             "flag": True, "free": "anything", "label": "1e5", "unknown": object}
    out = typed_options(component, given, "c")
    assert out == {**given, "rate": 1e-3}
    assert typed_options(component, {"rate": 2, "floor": 0}, "c") == {"rate": 2, "floor": 0}


@pytest.mark.parametrize("overrides, line", [
    (["~model.hidden", "model.name=alexnet", "model.dropout=true"],
     "model.dropout: expected a float, got True (bool)"),
    (["~model.hidden", "model.name=resnet18", "model.width=true"],
     "model.width: expected an integer, got True (bool)"),
    (["~model.hidden", "model.name=resnet18", "model.width=abc"],
     "model.width: expected an integer, got 'abc' (str)"),
    (["clock.profile=exponential", "clock.mean=true"],
     "clock.mean: expected a float, got True (bool)"),
    (["clock.server_compute=false"], "clock.server_compute: expected a float, got False (bool)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_components_refuse_a_boolean_or_a_word_for_a_number(tmp_path, capsys, overrides,
                                                             line):
    assert refused_line(tmp_path, capsys, overrides) == f"splitfed: error: {line}"


# ---------------------------------------------------------------------- data sets

SYNTHETIC = ["data.name=synthetic", "partition.scheme=natural", "~partition.alpha",
             "~partition.min_partition_size", "partition.num_clients=30"]


@pytest.mark.parametrize("options, message", [
    ({"iid": "maybe"}, "data.iid: expected a boolean (true/false), got 'maybe' (str)"),
    ({"alpha": "abc"}, "data.alpha: expected a float, got 'abc' (str)"),
    ({"beta": True}, "data.beta: expected a float, got True (bool)"),
    ({"num_devices": 2.5}, "data.num_devices: expected an integer, got 2.5 (float)"),
    ({"dim": "60"}, "data.dim: expected an integer, got '60' (str)"),
])
def test_data_set_options_are_typed(options, message):
    with pytest.raises(ConfigError) as err:
        load_dataset("synthetic", **options)
    assert str(err.value) == message


def test_data_set_options_are_typed_through_the_cli(tmp_path, capsys):
    line = refused_line(tmp_path, capsys, [*SYNTHETIC, "data.iid=maybe"])
    assert line == "splitfed: error: data.iid: expected a boolean (true/false), got 'maybe' (str)"
    code, err = run(tmp_path, capsys, [*SYNTHETIC, "data.alpha=1e-3", "data.iid=false"])
    assert code == 0, err


# -------------------------------------------------------------------- YAML merge key


@pytest.mark.parametrize("text", [
    "<<: {rounds: 99}\nrounds: 1\n",
    "train:\n  <<: {lr: 0.5}\n  batch_size: 8\n",
    "base: &b {rounds: 2}\nother:\n  <<: *b\n",
])
def test_a_merge_key_is_refused_in_one_line(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "merge keys (<<) are not allowed" in message or "aliases" in message


def test_a_merge_key_is_refused_in_an_override_and_a_quoted_one_is_a_plain_key(tmp_path):
    with pytest.raises(ConfigError, match=r"merge keys \(<<\) are not allowed"):
        parse_overrides(["train={<<: {lr: 0.5}, lr: 0.1}"])
    path = tmp_path / "run.yaml"
    path.write_text("'<<': 1\n")
    assert load_yaml(path) == {"<<": 1}


def test_a_merge_key_in_a_config_file_is_refused_by_the_cli(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("<<: {rounds: 99}\nrounds: 1\ndata: {name: digits}\n")
    out = tmp_path / "runs"
    code = main(["run", str(path), f"out_dir={out}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "<<" in err, err
    assert not out.exists()


# ---------------------------------------------------------- values a run would ignore


def test_server_data_for_an_algorithm_without_server_data_is_refused(tmp_path, capsys):
    line = refused_line(tmp_path, capsys, ["algorithm.name=fedavg", "server_data.fraction=0.5"])
    assert line.startswith("splitfed: error: server_data: fedavg trains on no server data, "
                           "so server_data.fraction=0.5 would be ignored; the algorithms "
                           "that do: clgsgd, fedclg_c, fedclg_s, scaffold_plus, server_only")
    assert "server_data.always=true" in line


@pytest.mark.parametrize("overrides", [
    ["server_data.fraction=0.5", "server_data.always=true"],       # the pool is built
    ["algorithm.name=clgsgd", "server_data.fraction=0.5"],
    ["server_data.fraction=0.01"],                                 # the default: no change
    ["algorithm.server_transforms=[{name: server_train}]", "server_data.fraction=0.2"],
], ids=" ".join)
def test_server_data_that_is_used_is_accepted(tmp_path, capsys, overrides):
    code, err = run(tmp_path, capsys, overrides)
    assert code == 0, err


@pytest.mark.parametrize("key", ["server_epochs", "server_steps"])
def test_server_only_refuses_zero_server_training(tmp_path, capsys, key):
    line = refused_line(tmp_path, capsys, ["algorithm.name=server_only", f"algorithm.{key}=0"])
    assert line.startswith(f"splitfed: error: algorithm: {key}=0 would train nothing"), line
    code, err = run(tmp_path, capsys, ["algorithm.name=clgsgd", f"algorithm.{key}=0"])
    assert code == 0, err                     # a hybrid algorithm still trains its clients


@pytest.mark.parametrize("overrides, key", [
    (["algorithm.name=server_only", "algorithm.server_batch_size=1000000"],
     "algorithm.server_batch_size"),
    (["algorithm.name=server_only", "algorithm.server_batch_size=101"],
     "algorithm.server_batch_size"),
    (["algorithm.name=clgsgd", "algorithm.server_batch_size=40",
      "server_data.samples_per_round=30"], "algorithm.server_batch_size"),
    (["algorithm.server_transforms=[{name: server_train, server_batch_size: 1000}]"],
     "algorithm.server_transforms[0].server_batch_size"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_server_batch_larger_than_the_servers_data_is_refused(tmp_path, capsys, overrides,
                                                               key):
    line = refused_line(tmp_path, capsys, overrides)
    assert line.startswith(f"splitfed: error: {key}: "), line
    assert "samples of the server's D_s^t" in line and "allowed: 1.." in line


@pytest.mark.parametrize("overrides", [
    ["algorithm.name=server_only", "algorithm.server_batch_size=100"],    # the 100 of digits
    ["algorithm.name=server_only", "train.batch_size=500"],   # B_s = B, batches repeat
], ids=" ".join)
def test_a_server_batch_within_the_servers_data_is_accepted(tmp_path, capsys, overrides):
    code, err = run(tmp_path, capsys, overrides)
    assert code == 0, err


def test_an_option_type_a_config_cannot_give_is_a_plugin_error_naming_it():
    import dataclasses

    from splitfed.configtools import from_dict
    from splitfed.errors import PluginError

    @dataclasses.dataclass
    class Odd:
        obj: object = None

    assert from_dict(Odd, {}, path="algorithm") == Odd()
    with pytest.raises(PluginError, match=r"^algorithm.obj: its declared type <class 'object'> "
                                          r"is not one a config value can have"):
        from_dict(Odd, {"obj": 5}, path="algorithm")


def _builder(input_shape, num_classes, *, thing: object = None, t: torch.Tensor = None,
             m: Mapping = None, d: dict = None, free=None):
    """A model builder as a plugin writes it (its annotations resolve in this module)."""


def test_a_component_option_of_a_type_a_config_cannot_give_is_a_plugin_error():
    from splitfed.errors import PluginError

    builder = _builder
    assert typed_options(builder, {}, "model") == {}
    assert typed_options(builder, {"m": {"a": 1}, "d": {}, "free": [1]}, "model") == {
        "m": {"a": 1}, "d": {}, "free": [1]}
    for key, tp in (("thing", "<class 'object'>"), ("t", "<class 'torch.Tensor'>")):
        with pytest.raises(PluginError, match=rf"^model\.{key}: its declared type {tp} is "
                                              r"not one a config value can have"):
            typed_options(builder, {key: 3}, "model")
