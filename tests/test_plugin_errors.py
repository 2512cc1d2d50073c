"""A plugin author's mistakes: each is refused with one line naming the component (its
kind, name and plugin module) and what was expected, as early as the engine can tell.

The components are registered in this process (undone after each test) or written as
small modules into a temporary directory; the runs are the few-round digits runs of
``splitfed.testing`` (scikit-learn's bundled data), in memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections import OrderedDict

import numpy as np
import pytest
from helpers import ModeOptions, digits_config, plugin_run
import torch
from torch import nn

import splitfed
from splitfed import registry
from splitfed.algorithms.fedavg import FedAvg
from splitfed.cli import main
from splitfed.configtools import dump_yaml
from splitfed.data.partition import partition
from splitfed.engine.rounds import Round, RoundResult
from splitfed.engine.transforms import GradientRound, GradientTransform
from splitfed.errors import ConfigError, PluginError
from splitfed.models import BlockModel, build_model
from splitfed.testing import check_algorithm

HERE = __name__


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the command line; it must fail with exit status 2 and one line on stderr."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("splitfed: error: ")
    return lines[0]




# ------------------------------------------------------------------- partitioners


@pytest.fixture
def bad_partitioner(scratch):
    @splitfed.register_partitioner("zz_part")
    def part(labels, num_clients, rng, mode: str = "ok"):
        n = len(labels)
        parts = np.array_split(np.arange(n), num_clients)
        return {"count": lambda: parts[:-1],
                "range": lambda: [p + n for p in parts],
                "negative": lambda: [p - 1 for p in parts],
                "float": lambda: [p.astype(float) for p in parts],
                "bool": lambda: [np.ones(n, dtype=bool)] * num_clients,
                "notlist": lambda: 5,
                "nested": lambda: [[p] for p in parts],
                "overlap": lambda: [np.arange(n // 2)] * num_clients,
                "twice": lambda: [np.concatenate([parts[0], parts[0][:1]]), *parts[1:]],
                "matrix": lambda: np.arange(n - n % num_clients).reshape(num_clients, -1),
                "lists": lambda: [[int(i) for i in p] for p in parts],
                "ok": lambda: parts}[mode]()


@pytest.mark.parametrize("mode, what", [
    ("count", "returned 2 parts for num_clients 3"),
    ("range", "returned index 30 for client 0, outside the 30 samples"),
    ("negative", "returned index -1 for client 0, outside the 30 samples"),
    ("float", "returned float64 indices for client 0"),
    ("bool", "returned bool indices for client 0"),
    ("notlist", "returned int"),
    ("nested", "returned list of shape (1, 10) for client 0"),
    ("overlap", "gave sample 0 to clients 0 and 1"),
    ("twice", "gave sample 0 to client 0 twice"),
])
def test_a_partitioners_result_is_checked(bad_partitioner, mode, what):
    labels = np.zeros(30, dtype=np.int64)
    with pytest.raises(PluginError) as info:
        partition(labels, 3, "zz_part", np.random.default_rng(0), mode=mode)
    message = str(info.value)
    assert message.startswith(f"partition.scheme: partitioner 'zz_part' (plugin {HERE}) "
                              f"{what}; it must return a list of 3 integer index arrays")
    assert "\n" not in message


def test_a_partitioners_valid_results_are_kept(bad_partitioner):
    labels = np.zeros(30, dtype=np.int64)
    for mode in ("ok", "matrix", "lists"):
        parts = partition(labels, 3, "zz_part", np.random.default_rng(0), mode=mode)
        assert [p.dtype for p in parts] == [np.int64] * 3
        assert np.array_equal(np.concatenate(parts), np.arange(30))
    iid = partition(np.arange(50) % 5, 4, "iid", np.random.default_rng(3))
    assert sorted(np.concatenate(iid).tolist()) == list(range(50))


def test_a_bad_partition_stops_the_dry_run_with_one_line(bad_partitioner, capsys):
    line = one_line_error(capsys, ["run", "quick_digits", "--dry-run",
                                   "partition.scheme=zz_part", "partition.mode=count",
                                   "~partition.alpha", "~partition.min_partition_size"])
    assert f"partitioner 'zz_part' (plugin {HERE}) returned 7 parts for num_clients 8" in line


# ------------------------------------------------------------------- model builders


@pytest.fixture
def bad_model(scratch):
    @splitfed.register_model("zz_model")
    def builder(input_shape, num_classes, *, mode: str = "ok"):
        d = math.prod(input_shape)
        if mode == "raise":
            raise RuntimeError("boom in builder")
        if mode == "bug":
            return len(5)                       # the builder's own TypeError
        if mode == "sequential":
            return nn.Sequential(nn.Flatten(), nn.Linear(d, num_classes))
        if mode == "badcut":
            return BlockModel(OrderedDict(flat=nn.Flatten(), fc=nn.Linear(d, num_classes)),
                              name="zz_model", cut_descriptions={5: "x"}, default_cut=5)
        return BlockModel(OrderedDict(flat=nn.Flatten(), fc=nn.Linear(d, num_classes)),
                          name="zz_model", cut_descriptions={1: "after flat"}, default_cut=1)


@pytest.mark.parametrize("mode, what", [
    ("raise", "failed (options {'mode': 'raise'}): RuntimeError: boom in builder"),
    ("bug", "failed (options {'mode': 'bug'}): TypeError: object of type 'int' has no len()"),
    ("badcut", "failed (options {'mode': 'badcut'}): ValueError: zz_model: cuts [5] are "
               "not 1..1 (the model has 2 blocks)"),
])
def test_a_failing_builder_is_named_as_failing(bad_model, mode, what):
    with pytest.raises(ConfigError) as info:
        build_model("zz_model", (1, 8, 8), 10, mode=mode)
    expected = f"model.name: the builder of model 'zz_model' (plugin {HERE}) {what}"
    assert re.fullmatch(re.escape(expected) + r" \(at .*test_plugin_errors\.py:\d+\)",
                        str(info.value)), str(info.value)        # where in the builder


def test_a_builder_must_return_a_block_model(bad_model, capsys):
    with pytest.raises(PluginError, match=re.escape(
            f"model.name: the builder of model 'zz_model' (plugin {HERE}) returned "
            "Sequential, expected a splitfed.models.BlockModel")):
        build_model("zz_model", (1, 8, 8), 10, mode="sequential")
    line = one_line_error(capsys, ["run", "quick_digits", "--dry-run", "model.name=zz_model",
                                   "~model.hidden", "model.mode=sequential"])
    assert "returned Sequential, expected a splitfed.models.BlockModel" in line
    assert isinstance(build_model("zz_model", (1, 8, 8), 10), BlockModel)


def test_an_input_too_small_for_a_model_is_still_reported_as_such():
    with pytest.raises(ConfigError, match=r"^model.name: input_shape \(1, 16, 16\) of the "
                                          r"data does not fit vgg11: "):
        build_model("vgg11", (1, 16, 16), 10)
    # the options are named too: one of them (a width of 0 in a plugin's model) may be
    # what does not fit
    with pytest.raises(ConfigError, match=r"^model.name: input_shape \(1, 16, 16\) of the "
                                          r"data does not fit vgg11 with the options "
                                          r"\{'width': 0.5\}: "):
        build_model("vgg11", (1, 16, 16), 10, width=0.5)


# ------------------------------------------------------------------- registration


@pytest.fixture
def plugin_files(tmp_path, monkeypatch):
    """``write({"pkg/__init__.py": source, "mod.py": source})``: plugin modules in a
    directory on ``sys.path``, imported afresh by the test and forgotten after it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            names.append(name)
            sys.modules.pop(name, None)
    yield write
    for name in names:
        sys.modules.pop(name, None)


def test_a_duplicate_names_the_first_module_and_the_second(scratch, plugin_files):
    plugin_files({
        "zz_first_lab.py": "from splitfed import register_model\n"
                           "@register_model('zz_dup')\n"
                           "def f(input_shape, num_classes): ...\n",
        "zz_second_lab.py": "from splitfed import register_model\n"
                            "import zz_first_lab  # registers zz_dup\n"
                            "@register_model('zz_dup')\n"
                            "def g(input_shape, num_classes): ...\n"})
    with pytest.raises(PluginError) as info:
        registry.load_plugins(["zz_second_lab"])
    assert str(info.value).startswith(
        "plugin zz_second_lab: model 'zz_dup' is already registered (plugin zz_first_lab) "
        "and zz_second_lab registers it again; choose another name")
    assert registry.origin("model", "zz_dup") == "zz_first_lab"


def test_a_plugin_that_registers_nothing_is_named_in_a_warning(scratch, plugin_files,
                                                                  monkeypatch, capsys):
    plugin_files({"zz_hollow_lab/__init__.py": "",                  # forgot the import
                  "zz_hollow_lab/models.py": "from splitfed import register_model\n"
                                             "@register_model('zz_hollow')\n"
                                             "def f(input_shape, num_classes): ...\n"})
    from splitfed.origins import LOADED_PLUGINS

    saved = list(LOADED_PLUGINS)
    try:
        _hollow_plugin_is_warned_about_once(capsys)
    finally:
        LOADED_PLUGINS[:] = saved


def _hollow_plugin_is_warned_about_once(capsys):
    assert registry.load_plugins(["zz_hollow_lab"]) == ["zz_hollow_lab"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["splitfed: warning: plugin zz_hollow_lab registered nothing while imported "
                   "(no register_* call ran; a module holding them that it does not import "
                   "is not read)"]
    registry.load_plugins(["zz_hollow_lab"])                  # once per process
    registry.load_plugins(["zz_hollow_lab.models"])           # this one registers
    assert capsys.readouterr().err == ""
    assert registry.origin("model", "zz_hollow") == "zz_hollow_lab.models"



@pytest.mark.parametrize("name", ["zz bad", "zz/evil", "zz:x", "zz\n", "-zz", ".zz", "+zz"])
def test_a_name_outside_the_allowed_characters_is_refused(scratch, name):
    """A name is letters, digits, '_', '.', '+', '-', not starting with '.', '+', '-'
    (a config names it; a dash first would read as a command-line option)."""
    def builder(input_shape, num_classes): ...

    with pytest.raises(PluginError, match="register_model: the name must be a non-empty "
                                          "string of letters, digits"):
        splitfed.register_model(name, builder)
    assert name not in registry.registry("model")


def test_the_leading_parameters_must_be_positional_and_the_options_named(scratch):
    """splitfed passes the leading parameters by position and checks the options by
    name: keyword-only leading parameters or a ``*args`` are refused when registered."""
    def builder(*, input_shape, num_classes): ...

    def profile(num_clients, *, rng): ...

    with pytest.raises(PluginError, match=r"must take \(input_shape, num_classes, \.\.\.\) "
                                          r"as its first positional parameters"):
        splitfed.register_model("zz_kw", builder)
    with pytest.raises(PluginError, match=r"must take \(num_clients, rng, \.\.\.\)"):
        splitfed.register_clock_profile("zz_kw", profile)
    with pytest.raises(PluginError, match=r"must name its options \(no \*args or \*\*kwargs\)"):
        splitfed.register_partitioner("zz_kw", lambda labels, num_clients, rng, *sizes: None)
    assert not any("zz_kw" in registry.registry(k) for k in registry._REGISTRIES)


def test_a_component_a_plugins_own_module_registers_comes_from_the_plugin(scratch,
                                                                         plugin_files):
    """A plugin package whose submodule registers: the component is the plugin's (as the
    config names it); a package the plugin imports that registers its own components
    is named itself."""
    from splitfed.origins import LOADED_PLUGINS

    plugin_files({"zz_pkg_lab/__init__.py": "import zz_other_lib\nfrom zz_pkg_lab import models\n",
                  "zz_pkg_lab/models.py": "from splitfed import register_model\n"
                                          "@register_model('zz_pkg')\n"
                                          "def f(input_shape, num_classes): ...\n",
                  "zz_other_lib.py": "from splitfed import register_model\n"
                                     "@register_model('zz_other')\n"
                                     "def g(input_shape, num_classes): ...\n"})
    saved = list(LOADED_PLUGINS)
    try:
        registry.load_plugins(["zz_pkg_lab"])
        assert registry.origin("model", "zz_pkg") == "zz_pkg_lab"
        assert registry.origin("model", "zz_other") == "zz_other_lib"
    finally:
        LOADED_PLUGINS[:] = saved


def test_a_plugin_given_twice_is_imported_once_and_recorded_each_time(scratch, plugin_files,
                                                                      capsys):
    """load_plugins returns every plugin given (the config's ``plugins``, which a resumed
    run imports again), also one this process has imported; the process records it
    once. A plugin that another plugin imported before is not warned about."""
    from splitfed.origins import LOADED_PLUGINS

    plugin_files({"zz_base_lab.py": "from splitfed import register_model\n"
                                    "@register_model('zz_base')\n"
                                    "def f(input_shape, num_classes): ...\n",
                  "zz_top_lab.py": "import zz_base_lab\n"
                                   "from splitfed import register_model\n"
                                   "@register_model('zz_top')\n"
                                   "def g(input_shape, num_classes): ...\n"})
    saved = list(LOADED_PLUGINS)
    try:
        assert registry.load_plugins(["zz_top_lab", "zz_top_lab", " zz_base_lab"]) == [
            "zz_top_lab", "zz_top_lab", "zz_base_lab"]
        assert registry.load_plugins(["zz_top_lab"]) == ["zz_top_lab"]
        loaded = registry.loaded_plugins()
        assert loaded.count("zz_top_lab") == 1 and loaded.count("zz_base_lab") == 1
        assert capsys.readouterr().err == ""
    finally:
        LOADED_PLUGINS[:] = saved


def test_an_entry_point_naming_a_function_is_called_once(scratch, plugin_files, tmp_path,
                                                         monkeypatch):
    """An entry point ``module:function`` imports the module and calls the function
    (which registers), once per process; the module counts as a loaded plugin."""
    from splitfed.origins import LOADED_PLUGINS

    plugin_files({"zz_ep_lab.py": "from splitfed import register_model\n"
                                  "def f(input_shape, num_classes): ...\n"
                                  "def register():\n"
                                  "    register_model('zz_ep', f)\n"})
    dist = tmp_path / "zz_ep_lab-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zz-ep-lab\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[splitfed.plugins]\nzz = zz_ep_lab:register\n")
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
    saved = list(LOADED_PLUGINS)
    try:
        assert registry.load_entry_points() == ["zz"]
        assert registry.origin("model", "zz_ep") == "zz_ep_lab:register"
        assert registry.loaded_plugins()[-1] == "zz_ep_lab"
        assert registry.load_entry_points() == []             # once per process
    finally:
        LOADED_PLUGINS[:] = saved



def test_a_module_in_the_working_directory_is_a_plugin_only_if_pythonpath_names_it(
        scratch, tmp_path, monkeypatch):
    """``python -m splitfed`` puts the working directory on sys.path (as its absolute
    path, or ''): a plugin named by a shared config is not taken from there, unless
    PYTHONPATH names that directory."""
    from splitfed.origins import LOADED_PLUGINS

    (tmp_path / "zz_beside_lab.py").write_text("from splitfed import register_model\n"
                                               "@register_model('zz_beside')\n"
                                               "def f(input_shape, num_classes): ...\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.delitem(sys.modules, "zz_beside_lab", raising=False)
    saved = list(LOADED_PLUGINS)
    try:
        with pytest.raises(PluginError, match="plugin 'zz_beside_lab' cannot be imported: "
                                              "ModuleNotFoundError"):
            registry.load_plugins(["zz_beside_lab"])
        assert str(tmp_path) in sys.path                     # put back afterwards
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
        registry.load_plugins(["zz_beside_lab"])
        assert registry.origin("model", "zz_beside") == "zz_beside_lab"
    finally:
        LOADED_PLUGINS[:] = saved
        sys.modules.pop("zz_beside_lab", None)


# ------------------------------------------------------------------- the command line


def test_partition_and_config_show_take_overrides_after_options(scratch, tmp_path,
                                                                monkeypatch, capsys):
    (tmp_path / "zz_noop_lab.py").write_text("# a plugin that registers nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["partition", "quick_digits", "--plugin", "zz_noop_lab",
                 "partition.num_clients=3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +2 ", out, re.M) and not re.search(r"^ +3 ", out, re.M)
    assert main(["config", "show", "quick_digits", "--plugin", "zz_noop_lab",
                 "train.lr=0.05", "~model.hidden"]) == 0
    shown = capsys.readouterr().out
    assert "  lr: 0.05\n" in shown and "hidden" not in shown
    assert "- zz_noop_lab" in shown
    line = one_line_error(capsys, ["config", "show", "quick_digits", "train.lr=0.05",
                                   "--bogus"])
    assert "unrecognized arguments: --bogus" in line


# ------------------------------------------------------------------- an algorithm's round


@dataclasses.dataclass
class BadOptions:
    mode: str = "ok"


class BadRounds(FedAvg):
    """FedAvg whose result is spoiled as ``mode`` says."""

    name = "zz_rounds"
    Options = BadOptions

    def round(self, env, state, t, cohort):
        m = self.options.mode
        if m == "dict":
            return {"model": state["model"]}
        if m == "none":
            return None
        if m == "nosend":
            return Round(self, env, state, t, cohort).finish()
        res = super().round(env, state, t, cohort)
        key = next(iter(res.state["model"]))
        return {
            "nomodel": lambda: dataclasses.replace(res, state={}),
            "newkey": lambda: dataclasses.replace(res, state={**res.state, "extra": 1}),
            "notdict": lambda: dataclasses.replace(res, state=list(res.state.items())),
            "shape": lambda: dataclasses.replace(res, state={**res.state, "model": {
                **res.state["model"], key: torch.zeros(3)}}),
            "dtype": lambda: dataclasses.replace(res, state={**res.state, "model": {
                **res.state["model"], key: res.state["model"][key].double()}}),
            "loss": lambda: dataclasses.replace(res, train_loss="high"),
            "tensorloss": lambda: dataclasses.replace(res, train_loss=torch.tensor(0.5)),
            "metric": lambda: dataclasses.replace(res, metrics={"foo": "bar"}),
            "reserved": lambda: dataclasses.replace(res, metrics={"round": 7}),
            "testacc": lambda: dataclasses.replace(res, metrics={"test_acc": 0.99}),
            "simtime": lambda: dataclasses.replace(res, metrics={"sim_time_s": -5.0}),
            "bytes": lambda: dataclasses.replace(res, metrics={"bytes_up/extra": 8}),
            "wire": lambda: dataclasses.replace(res, metrics={"wire_down": 8}),
            "huge": lambda: dataclasses.replace(res, metrics={"norm_sq": 10**400}),
            "samples": lambda: dataclasses.replace(res, samples=1.5),
            "clientmacs": lambda: dataclasses.replace(res, client_macs=-1),
            "nan": lambda: dataclasses.replace(res, train_loss=float("nan")),
            "numpy": lambda: dataclasses.replace(res, train_loss=np.float32(0.5), metrics={
                "norm": np.float64(2.0), "steps": np.int64(3), "none": None}),
        }.get(m, lambda: res)()


@pytest.fixture
def bad_rounds(scratch):
    splitfed.register_algorithm("zz_rounds", BadRounds)


@pytest.mark.parametrize("mode, what", [
    ("dict", "returned dict; round must return a splitfed.engine.rounds.RoundResult"),
    ("none", "returned NoneType; round must return a splitfed.engine.rounds.RoundResult"),
    ("nomodel", "returned a state without the keys ('model') that init_state declared"),
    ("newkey", "returned state keys that init_state did not declare ('extra'); declare "
               "every key of the state in init_state"),
    ("notdict", "returned a state of type list"),
    ("shape", "returned state['model']['fc1.1.weight'] of shape (3,) and torch.float32; the "
              "model's is a tensor of shape (32, 64) and torch.float32"),
    ("dtype", "returned state['model']['fc1.1.weight'] of shape (32, 64) and torch.float64; "
              "the model's is a tensor of shape (32, 64) and torch.float32"),
    ("loss", "returned train_loss 'high' (str); expected None or a real number"),
    ("tensorloss", "returned train_loss tensor(0.5000) (Tensor); expected None or a real"),
    ("metric", "returned the metric 'foo' = 'bar' (str); a metric is a real number or None"),
    ("reserved", "returned the metric name 'round'"),
    # fields the loop writes after the metrics: they would shadow or be shadowed
    ("testacc", "returned the metric name 'test_acc'; a metric is named by a string other "
                "than the record's own fields"),
    ("simtime", "returned the metric name 'sim_time_s'"),
    ("bytes", "returned the metric name 'bytes_up/extra'"),
    ("wire", "returned the metric name 'wire_down'"),
    ("huge", "returned the metric 'norm_sq' = 1000000000000000000000000000000000000000, "
             "beyond the range of a float"),
    ("samples", "returned samples 1.5; expected a whole number >= 0"),
    ("clientmacs", "returned client_macs -1; expected a whole number >= 0"),
    ("nosend", "Round.finish() was called in round 1 for a cohort of 3 client(s) before "
               "Round.send()"),
])
def test_a_rounds_result_is_checked_in_the_first_round(bad_rounds, mode, what):
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"name": "zz_rounds", "mode": mode})
    message = str(info.value)
    assert message.startswith(f"algorithm.name: algorithm 'zz_rounds' (plugin {HERE}): ")
    assert what in message and "round 1" in message and "\n" not in message


def test_valid_results_pass_unchanged(bad_rounds):
    ok = plugin_run(algorithm={"name": "zz_rounds"})
    plain = plugin_run(algorithm={"name": "fedavg"})
    assert ok.status == plain.status == "completed"
    drop = {"round_time_s"}
    assert ([{k: v for k, v in r.items() if k not in drop} for r in ok.records]
            == [{k: v for k, v in r.items() if k not in drop} for r in plain.records])
    nan = plugin_run(algorithm={"name": "zz_rounds", "mode": "nan"})
    assert nan.status == "diverged"             # a non-finite loss: divergence, no error
    numpy = plugin_run(algorithm={"name": "zz_rounds", "mode": "numpy"})
    assert numpy.status == "completed"
    assert numpy.records[1]["norm"] == 2.0 and numpy.records[1]["steps"] == 3


def test_the_conformance_checks_report_a_bad_round(scratch):
    class Undeclared(FedAvg):
        name = "zz_undeclared"

        def round(self, env, state, t, cohort):
            res = super().round(env, state, t, cohort)
            return dataclasses.replace(res, state={**res.state, "extra": torch.ones(2)})

    with pytest.raises(AssertionError) as info:
        check_algorithm(Undeclared, checks=["deterministic"])
    message = str(info.value)
    assert "fails 1 of 1 conformance checks (deterministic)" in message
    assert "round 1 returned state keys that init_state did not declare ('extra')" in message


# ------------------------------------------------------------------- gradient transforms



class BadTransform(GradientTransform):
    name = "zz_t"
    Options = ModeOptions

    def start(self, env, state, t, cohort, round_):
        return {"drop": lambda names, params, grads, slots: grads[:-1],
                "shape": lambda names, params, grads, slots: [g[:1] for g in grads],
                "none": lambda names, params, grads, slots: None,
                "obj": 42,
                "tuple": lambda names, params, grads, slots: tuple(grads),
                "int": lambda names, params, grads, slots: [g.to(torch.int64) for g in grads],
                "meta": lambda names, params, grads, slots: [
                    torch.empty(g.shape, dtype=g.dtype, device="meta") for g in grads],
                "ok": lambda names, params, grads, slots: grads}[self.options.mode]


@pytest.fixture
def bad_transform(scratch):
    splitfed.register_transform("zz_t", BadTransform)


@pytest.mark.parametrize("mode, what", [
    ("drop", "the update of transform 'zz_t' (plugin {}) returned 3 gradients for 4 "
             "parameters; it must return a list of 4 tensors"),
    ("shape", "the update of transform 'zz_t' (plugin {}) returned shape (1, 32, 64) for "
              "fc1.1.weight, whose gradient has shape (3, 32, 64)"),
    ("none", "the update of transform 'zz_t' (plugin {}) returned NoneType"),
    ("int", "the update of transform 'zz_t' (plugin {}) returned torch.int64 for "
            "fc1.1.weight, whose gradient is torch.float32"),
    ("meta", "the update of transform 'zz_t' (plugin {}) returned a tensor on meta for "
             "fc1.1.weight, whose gradient is on cpu; it must return a list of 4 tensors, "
             "each of the shape, dtype and device"),
    ("obj", "start of transform 'zz_t' (plugin {}) returned int; it must return a "
            "GradientRound, a function"),
])
def test_a_transforms_output_is_checked(bad_transform, mode, what):
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"client_transforms": [{"name": "zz_t", "mode": mode}]})
    assert str(info.value).startswith("algorithm.client_transforms: " + what.format(HERE))


class _FailingRound(GradientRound):
    def __init__(self, mode):
        self.mode = mode

    def update(self, names, params, grads, slots):
        return grads

    def finish(self):
        if self.mode == "finish":
            raise RuntimeError("finish failed")
        return None


class RaisingTransform(GradientTransform):
    name = "zz_tr"
    Options = ModeOptions

    def init(self, env, params):
        if self.options.mode == "init":
            raise RuntimeError("init failed")
        return None

    def start(self, env, state, t, cohort, round_):
        return _FailingRound(self.options.mode)

    def message_bytes(self, env, part_bytes):
        if self.options.mode == "message_bytes":
            raise RuntimeError("no byte count")
        return 0, 0

    def client_samples(self, env, ids):
        if self.options.mode == "client_samples":
            raise RuntimeError("no sample count")
        return 0


@pytest.mark.parametrize("mode, what", [("init", "RuntimeError: init failed"),
                                        ("finish", "RuntimeError: finish failed")])
def test_a_transform_failing_on_a_built_in_algorithm_is_one_line(scratch, mode, what):
    """A plugin transform's init and its round's finish fail in one line naming the
    transform, also on a built-in algorithm (whose own failures keep their traceback)."""
    splitfed.register_transform("zz_tr", RaisingTransform)
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"client_transforms": [{"name": "zz_tr", "mode": mode}]})
    message = str(info.value)
    assert message.startswith(f"algorithm.client_transforms: transform 'zz_tr' (plugin "
                              f"{HERE}) failed: {what}"), message


@pytest.mark.parametrize("mode, what", [("message_bytes", "no byte count"),
                                        ("client_samples", "no sample count")])
@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_a_transforms_failing_count_is_one_line_before_anything_is_written(
        scratch, tmp_path, capsys, mode, what, dry):
    """A plugin transform whose message_bytes or client_samples raises stops the run in
    one line naming it before the run writes anything, with and without over-selection
    (whose prediction calls them in each round), and --dry-run too."""
    splitfed.register_transform("zz_tr", RaisingTransform)
    for over in ("clock.over_select=0", "clock.over_select=0.5"):
        code = main(["run", "quick_digits", "rounds=1", f"out_dir={tmp_path}", over,
                     "participation.mode=uniform", "participation.clients_per_round=4",
                     f"algorithm.client_transforms=[{{name: zz_tr, mode: {mode}}}]", *dry])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"splitfed: error: algorithm.client_transforms: transform "
                              f"'zz_tr' (plugin {HERE}) failed: RuntimeError: {what}"), err
        assert not any(tmp_path.iterdir())


def test_a_transform_of_the_right_shapes_changes_nothing(bad_transform):
    plain = plugin_run()
    for mode in ("ok", "tuple"):
        same = plugin_run(algorithm={"client_transforms": [{"name": "zz_t", "mode": mode}]})
        assert [r["train_loss"] for r in same.records[1:]] == \
            [r["train_loss"] for r in plain.records[1:]]
        assert same.records[-1]["test_acc"] == plain.records[-1]["test_acc"]


def test_round_result_is_where_the_docs_say():
    from splitfed.engine import rounds

    assert rounds.RoundResult is RoundResult
    assert [f.name for f in dataclasses.fields(RoundResult)] == [
        "state", "train_loss", "samples", "server_samples", "metrics",
        "server_model_samples", "server_macs", "client_macs"]


class Failing(FedAvg):
    """FedAvg whose method ``mode`` names raises (or returns what it must not)."""

    name = "zz_failing"
    Options = BadOptions

    def __init__(self, options=None, **kwargs):
        if getattr(options, "mode", None) == "init":
            raise ValueError("bad options")
        super().__init__(options, **kwargs)

    def check(self, env):
        if self.options.mode == "check":
            raise ValueError("cannot run this")

    def init_state(self, env):
        if self.options.mode == "state":
            raise RuntimeError("no state")
        return None if self.options.mode == "nostate" else super().init_state(env)

    def round(self, env, state, t, cohort):
        if self.options.mode == "round" and t == 2:
            raise ValueError("my algorithm has a bug")
        return super().round(env, state, t, cohort)

    def eval_model(self, env, state):
        if self.options.mode == "evaldict":
            return {"not": "a model"}
        return super().eval_model(env, state)

    def server_copies(self, env, cohort):
        if self.options.mode == "copies":
            raise ValueError("cannot count")
        return super().server_copies(env, cohort)

    def checkpoint_template(self, env, template, saved):
        if self.options.mode == "template":
            raise ValueError("no template")
        return super().checkpoint_template(env, template, saved)


@pytest.mark.parametrize("mode, what", [
    ("init", "failed in its constructor: ValueError: bad options"),
    ("check", "failed in check: ValueError: cannot run this"),
    ("state", "failed in init_state: RuntimeError: no state"),
    ("nostate", ": init_state returned NoneType; it must return the algorithm's state, a "
                "dict"),
    ("round", "failed in round 2: ValueError: my algorithm has a bug"),
    ("evaldict", ": eval_model returned dict; it must return the model to evaluate"),
    ("copies", "failed in server_copies: ValueError: cannot count"),
    ("template", "failed in checkpoint_template: ValueError: no template"),
])
def test_a_plugin_algorithms_failure_is_one_line_naming_it(scratch, capsys, tmp_path, mode,
                                                           what):
    """Every hook of a plugin algorithm, like every other component, fails in one line
    naming it and its plugin, not with a traceback through splitfed (the exception stays
    the error's cause)."""
    splitfed.register_algorithm("zz_failing", Failing)
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"name": "zz_failing", "mode": mode}, rounds=2)
    message = str(info.value)
    assert message.startswith(f"algorithm.name: algorithm 'zz_failing' (plugin {HERE})")
    assert what in message and "\n" not in message, message
    if mode == "round":                         # where in the plugin's code it happened
        line = next(i for i, text in enumerate(open(__file__), 1)
                    if 'raise ValueError("my algorithm has a bug")' in text)
        assert message.endswith(f"(at {__file__}:{line})"), message
    if mode in ("init", "check", "state", "nostate"):   # the dry run checks them too,
        cfg = tmp_path / "c.yaml"                       # and a run before its directory
        dump_yaml(digits_config(algorithm={"name": "zz_failing", "mode": mode},
                                out_dir=str(tmp_path / "runs")), cfg)
        line = one_line_error(capsys, ["run", str(cfg), "--dry-run"])
        assert what in line
        line = one_line_error(capsys, ["run", str(cfg)])
        assert what in line
        assert not (tmp_path / "runs").exists()


def _refused_algorithm(cls, mode: str) -> str:
    """Register ``cls`` under its name, run it in ``mode``: the one-line PluginError
    naming it, returned."""
    splitfed.register_algorithm(cls.name, cls)
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"name": cls.name, "mode": mode}, rounds=2)
    message = str(info.value)
    assert message.startswith(f"algorithm.name: algorithm '{cls.name}' (plugin {HERE})")
    assert "\n" not in message, message
    return message


class Drifting(FedAvg):
    """FedAvg with a state entry whose kind or shape drifts from init_state's (``mode``):
    a run of it writes checkpoints that no resume could read."""

    name = "zz_drifting"
    Options = BadOptions
    START = {"int": 0, "list": [], "dict": {}, "ok": 0.0, "tensor": torch.zeros(2)}
    state_keys = ("model", "extra")

    def init_state(self, env):
        return {**super().init_state(env), "extra": self.START[self.options.mode]}

    def round(self, env, state, t, cohort):
        result = super().round(env, state, t, cohort)
        extra = {"int": 0.5 * t, "list": [1.0] * t, "ok": 0.5 * t,
                 "dict": {str(c): 1.0 for c in cohort.ids.tolist()},
                 "tensor": torch.zeros(2 + t)}[self.options.mode]
        return dataclasses.replace(result, state={**result.state, "extra": extra})


@pytest.mark.parametrize("mode, what", [
    ("int", "state.extra is a float, not a int"),
    ("list", "state.extra is not a list of 0"),
    ("dict", "state.extra has other keys"),
    ("tensor", "state.extra is not a torch.float32 tensor of shape (2,)"),
])
def test_a_state_that_a_checkpoint_could_not_resume_is_refused_at_round_1(scratch, mode,
                                                                          what):
    """The loop checks the state against the checkpoint template in the first round (and
    at checkpoint rounds), not only when a resume of a long run reads it back."""
    message = _refused_algorithm(Drifting, mode)
    assert "round 1 returned a state whose checkpoint could not be resumed" in message
    assert what in message and "\n" not in message, message


class OwnEvalDrift(FedAvg):
    """FedAvg with its own eval_model (a pass-through of the default) whose round returns
    ``state["model"]`` in float64 (``mode`` "double") or without a key ("missing"): the
    model is then not checked against ``env.model``, but against init_state's model,
    as a resume would check it."""

    name = "zz_own_eval_drift"
    Options = BadOptions

    def eval_model(self, env, state):
        env.model.load_state_dict(state["model"])
        return env.model

    def round(self, env, state, t, cohort):
        result = super().round(env, state, t, cohort)
        model = dict(result.state["model"])
        if self.options.mode == "double":
            model = {k: v.double() for k, v in model.items()}
        else:
            model.pop(next(iter(model)))
        return dataclasses.replace(result, state={**result.state, "model": model})


@pytest.mark.parametrize("mode, what", [
    ("double", "is not a torch.float32 tensor"),
    ("missing", "state.model has other keys"),
])
def test_an_algorithm_with_its_own_eval_model_is_refused_a_model_that_drifts(scratch, mode,
                                                                           what):
    message = _refused_algorithm(OwnEvalDrift, mode)
    assert "round 1 returned a state whose checkpoint could not be resumed" in message
    assert what in message, message


class Modelless(FedAvg):
    """FedAvg (the default eval_model) whose state lacks its model, or holds a list."""

    name = "zz_modelless"
    Options = BadOptions

    def init_state(self, env):
        if self.options.mode == "nomodel":
            return {"weights": 1}
        return super().init_state(env)

    def round(self, env, state, t, cohort):
        result = super().round(env, state, t, cohort)
        return dataclasses.replace(result, state={**result.state, "model": [1]})


@pytest.mark.parametrize("mode, what", [
    ("nomodel", "init_state returned a state without 'model'; with the default eval_model "
                "it holds the whole model's state_dict"),
    ("list", "round 1 returned a state whose 'model' is list; with the default eval_model"),
])
def test_a_state_without_its_model_names_the_hook_that_returned_it(scratch, mode, what):
    assert what in _refused_algorithm(Modelless, mode)


class Unlisted(FedAvg):
    """FedAvg adding a state key that its ``state_keys`` does not list."""

    name = "zz_unlisted"
    Options = BadOptions

    def init_state(self, env):
        return {**super().init_state(env), "prox": 0.0}


def test_a_state_key_not_in_state_keys_is_refused_before_the_run_dir(scratch, capsys,
                                                                     tmp_path):
    """Unlisted, the key is a transform's name in another config (FedProx's ``prox``),
    whose state it would silently replace; listed, that config is refused."""
    message = _refused_algorithm(Unlisted, "ok")
    assert ("init_state returned the key(s) 'prox', which are not in its class's "
            "state_keys ('model') nor a transform's") in message
    cfg = tmp_path / "c.yaml"
    dump_yaml(digits_config(algorithm={"name": "zz_unlisted", "mode": "ok"},
                            out_dir=str(tmp_path / "runs")), cfg)
    assert "state_keys" in one_line_error(capsys, ["run", str(cfg)])
    assert "state_keys" in one_line_error(capsys, ["run", str(cfg), "--dry-run"])
    assert not (tmp_path / "runs").exists()
    Listed = type("Listed", (Unlisted,), {"state_keys": ("model", "prox"),
                                          "name": "zz_listed"})
    splitfed.register_algorithm("zz_listed", Listed)
    assert plugin_run(algorithm={"name": "zz_listed", "mode": "ok"}).state["prox"] == 0.0
    with pytest.raises(ConfigError, match="the transform state key"):
        plugin_run(algorithm={"name": "zz_listed", "mode": "ok",
                              "client_transforms": [{"name": "prox", "mu": 0.1}]})


def test_a_state_of_its_declared_kind_runs(scratch):
    splitfed.register_algorithm("zz_drifting", Drifting)
    result = plugin_run(algorithm={"name": "zz_drifting", "mode": "ok"}, rounds=2)
    assert result.state["extra"] == 1.0


def test_a_built_in_algorithms_exception_keeps_its_traceback(monkeypatch):
    from splitfed.algorithms.fedavg import FedAvg as BuiltIn

    def broken(self, env, state, t, cohort):
        raise ValueError("a bug of splitfed")

    monkeypatch.setattr(BuiltIn, "round", broken)
    with pytest.raises(ValueError, match="a bug of splitfed"):
        plugin_run(algorithm={"name": "fedavg"})


def test_an_option_named_as_a_key_of_its_section_is_refused_when_registered(scratch):
    """``data.limit_train`` or ``model.cut`` go to splitfed: an option of that name would
    silently keep its default."""
    def loader(data_dir, rng, limit_train=7):
        raise AssertionError("never called")

    def builder(input_shape, num_classes, *, cut=1):
        raise AssertionError("never called")

    def profile(num_clients, rng, deadline=3.0):
        raise AssertionError("never called")

    @dataclasses.dataclass
    class NameOptions:
        name: str = "hello"

    class Named(FedAvg):
        Options = NameOptions

    cases = [(splitfed.register_dataset, "zz_clash", loader, "'limit_train'", "data"),
             (splitfed.register_model, "zz_clash", builder, "'cut'", "model"),
             (splitfed.register_clock_profile, "zz_clash", profile, "'deadline'", "clock"),
             (splitfed.register_algorithm, "zz_clash", Named, "'name'", "algorithm")]
    for register, name, obj, option, section in cases:
        with pytest.raises(PluginError, match=rf"the option {option} has the name of the key "
                                              rf"{section}\.{option[1:-1]}, which splitfed "
                                              "reads itself"):
            register(name, obj)


def test_the_section_keys_registration_guards_are_the_config_classes_fields():
    from splitfed.config import _OPEN_SECTIONS, _field_names

    assert {s: set(keys) for s, keys in registry.SECTION_KEYS.items()} == {
        s: set(_field_names(s)) for s in _OPEN_SECTIONS}


def test_a_plugin_in_site_packages_inside_pythons_own_directory_is_not_pythons_own():
    from splitfed.origins import _python_own

    stdlib, sites = "/usr/local/lib/python3.11", ["/usr/local/lib/python3.11/site-packages"]
    assert _python_own("/usr/local/lib/python3.11/json/decoder.py", stdlib, sites)
    assert not _python_own("/usr/local/lib/python3.11/site-packages/lab/algo.py", stdlib,
                           sites)
    assert not _python_own("/usr/local/lib/python3.11x/lab.py", stdlib, sites)
    assert not _python_own("/home/me/lab/algo.py", stdlib, sites)


def test_a_plugins_digest_covers_the_helper_modules_beside_it(scratch, plugin_files,
                                                              tmp_path):
    """A plugin module that imports a helper of its own directory: editing the helper
    changes the plugin's recorded digest, so a study reruns the runs it made."""
    from splitfed.origins import LOADED_PLUGINS
    from splitfed.provenance import plugin_digests

    plugin_files({"zz_digest_helper.py": "HIDDEN = [64]\n",
                  "zz_digest_lab.py": "import json\nimport zz_digest_helper\n"
                                      "from splitfed import register_model\n"
                                      "@register_model('zz_digest')\n"
                                      "def f(input_shape, num_classes): ...\n"})
    saved = list(LOADED_PLUGINS)
    try:
        registry.load_plugins(["zz_digest_lab"])
        first = plugin_digests()["zz_digest_lab"]
        assert plugin_digests()["zz_digest_lab"] == first
        (tmp_path / "zz_digest_helper.py").write_text("HIDDEN = [8]\n")
        assert plugin_digests()["zz_digest_lab"] != first
    finally:
        LOADED_PLUGINS[:] = saved


def test_a_plugins_digest_covers_the_helpers_its_helpers_import(scratch, plugin_files,
                                                                tmp_path):
    """A helper of the plugin's directory that imports another one there: editing the
    second helper changes the plugin's recorded digest too; helpers that import each
    other, and the plugin, are each read once."""
    from splitfed.origins import LOADED_PLUGINS
    from splitfed.provenance import _helpers, plugin_digests

    plugin_files({"zz_chain_helper2.py": "import zz_chain_helper\nimport zz_chain_lab\n"
                                         "FACTOR = 2\n",
                  "zz_chain_helper.py": "from zz_chain_helper2 import FACTOR\n",
                  "zz_chain_lab.py": "import zz_chain_helper\n"
                                     "from splitfed import register_model\n"
                                     "@register_model('zz_chain')\n"
                                     "def f(input_shape, num_classes): ...\n"})
    saved = list(LOADED_PLUGINS)
    try:
        registry.load_plugins(["zz_chain_lab"])
        assert [p.name for p in _helpers(sys.modules["zz_chain_lab"])] == [
            "zz_chain_helper.py", "zz_chain_helper2.py"]
        first = plugin_digests()["zz_chain_lab"]
        (tmp_path / "zz_chain_helper2.py").write_text("import zz_chain_helper\n"
                                                      "import zz_chain_lab\nFACTOR = 3\n")
        assert plugin_digests()["zz_chain_lab"] != first
    finally:
        LOADED_PLUGINS[:] = saved


def test_options_that_are_an_instance_are_refused_when_registered(scratch):
    @dataclasses.dataclass
    class Opts:
        mu: float = 0.1

    class WithInstance(FedAvg):
        Options = Opts()

    class TransformWithInstance(GradientTransform):
        name = "zz_inst"
        Options = Opts()

    with pytest.raises(PluginError, match="Options must be a dataclass .* the class itself, "
                                          "not an instance of it"):
        splitfed.register_algorithm("zz_inst", WithInstance)
    with pytest.raises(PluginError, match="Options must be a dataclass .* the class itself, "
                                          "not an instance of it"):
        splitfed.register_transform("zz_inst", TransformWithInstance)


def test_a_transforms_name_and_options_are_checked_when_registered(scratch):
    """A transform's ``name`` attribute keys its state and must be the name it is
    registered under; an option called ``name`` would be taken by the key that names
    the transform in a transform list."""
    class Misnamed(GradientTransform):
        name = "zz_other"

        def start(self, env, state, t, cohort, round_):
            return None

    @dataclasses.dataclass
    class NameOption:
        name: str = "x"

    class NamedOption(GradientTransform):
        name = "zz_named"
        Options = NameOption

        def start(self, env, state, t, cohort, round_):
            return None

    with pytest.raises(PluginError, match=r"register_transform\('zz_misnamed'\): the class's "
                                          r"name attribute is 'zz_other'; set name = "
                                          r"'zz_misnamed'"):
        splitfed.register_transform("zz_misnamed", Misnamed)
    with pytest.raises(PluginError, match=r"register_transform\('zz_named'\): the option "
                                          r"'name' is the key that names the transform"):
        splitfed.register_transform("zz_named", NamedOption)
    assert not {"zz_misnamed", "zz_named"} & set(registry.registry("transform"))


def test_the_plugin_frame_skips_generated_code():
    """An error raised in generated code (a dataclass's __init__ is compiled from a
    string) is placed at the plugin's line that called it."""
    from splitfed.origins import plugin_frame

    def plugin_code():
        exec(compile("raise ValueError('bad value')", "<string>", "exec"))

    try:
        plugin_code()
    except ValueError as e:
        where = plugin_frame(e)
    line = next(i for i, text in enumerate(open(__file__), 1)
                if 'exec(compile("raise ValueError' in text)
    assert where == f"{__file__}:{line}"
