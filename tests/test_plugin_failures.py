"""A plugin's own code failing, or returning the wrong kind of thing, is reported in one
line naming the component and its plugin: data sets, partitioners, clock profiles,
gradient transforms and server steps (models: tests/test_plugin_errors.py), and methods
a component must define are checked when it is registered.

The components are registered in this process (undone after each test by ``scratch``);
the runs are the few-round in-memory digits runs of ``splitfed.testing``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from helpers import ModeOptions, plugin_run
import torch
from torch import nn

import splitfed
from splitfed.cli import main
from splitfed.config import build_config
from splitfed.data import load_dataset
from splitfed.data.datasets import ArrayDataset, DataBundle
from splitfed.algorithms.fedavg import FedAvg
from splitfed.engine.algorithm import Algorithm
from splitfed.engine.profiles import Profiles
from splitfed.engine.transforms import GradientTransform, ServerStep
from splitfed.errors import PluginError
from splitfed.experiment import run_experiment
from splitfed.models import BlockModel
from splitfed.testing import base_config

HERE = __name__




def one_line(message: str) -> None:
    assert "\n" not in message and len(message) < 600, message


# ---------------------------------------------------------------------- data sets


def _bundle(n=60, shape=(1, 4, 4), classes=3, y_dtype=torch.int64, x_shape=None,
            top=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *(x_shape or shape), generator=g)
    y = (torch.arange(n) % classes).to(y_dtype)
    if top is not None:
        y[0] = top
    split = ArrayDataset(x, y)
    return DataBundle("zz", split, ArrayDataset(x.clone(), y.clone()), classes, shape)


@pytest.fixture
def zz_data(scratch):
    @splitfed.register_dataset("zz_data")
    def load(data_dir, rng, mode: str = "ok"):
        if mode == "raise":
            raise OSError("no such file: /nowhere/zz.bin")
        return {"ok": _bundle,
                "tuple": lambda: (1, 2),
                "float_labels": lambda: _bundle(y_dtype=torch.float32),
                "label_range": lambda: _bundle(top=5),
                "negative": lambda: _bundle(top=-1),
                "shape": lambda: _bundle(x_shape=(1, 8, 8)),
                "classes": lambda: dataclasses.replace(_bundle(), num_classes=0),
                "numpy": lambda: DataBundle("zz", np.zeros((3, 1, 4, 4)), np.zeros(3), 3,
                                            (1, 4, 4))}[mode]()


@pytest.mark.parametrize("mode, what", [
    ("raise", "failed: OSError: no such file: /nowhere/zz.bin"),
    ("tuple", "returned tuple; its loader must return a DataBundle"),
    ("float_labels", "has train labels of dtype torch.float32"),
    ("label_range", "has train labels from 0 to 5, outside 0..2 (num_classes 3)"),
    ("negative", "has train labels from -1 to 2, outside 0..2"),
    ("shape", "has train samples of shape (1, 8, 8), but input_shape (1, 4, 4)"),
    ("classes", "has num_classes 0, not a positive integer"),
    ("numpy", "has a train split of type ndarray, not an ArrayDataset"),
])
def test_a_data_sets_failure_names_it(zz_data, mode, what):
    with pytest.raises(PluginError) as info:
        load_dataset("zz_data", None, mode=mode)
    message = str(info.value)
    one_line(message)
    assert message.startswith(f"data.name: dataset 'zz_data' (plugin {HERE}) ")
    assert what in message


def test_a_right_data_set_loads(zz_data):
    bundle = load_dataset("zz_data", None)
    assert len(bundle.train) == 60 and bundle.num_classes == 3


def test_a_data_sets_failure_on_the_command_line(zz_data, capsys, tmp_path):
    argv = ["run", "quick_digits", "--dry-run", "data.name=zz_data", "data.mode=raise",
            "model.name=mlp", f"out_dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dataset 'zz_data'" in err[0] and "OSError" in err[0], err
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------ partitioners, profiles


def test_a_partitioners_exception_names_it(scratch):
    @splitfed.register_partitioner("zz_raise")
    def part(labels, num_clients, rng):
        return {}["missing"]

    raw = base_config()
    raw["partition"] = {"scheme": "zz_raise", "num_clients": 6}
    with pytest.raises(PluginError) as info:
        run_experiment(build_config(raw), write=False)
    message = str(info.value)
    one_line(message)
    assert message == (f"partition.scheme: partitioner 'zz_raise' (plugin {HERE}) failed: "
                       f"KeyError: 'missing' (at {__file__}:114)")


@pytest.fixture
def zz_clock(scratch):
    @splitfed.register_clock_profile("zz_clock")
    def profile(num_clients, rng, mode: str = "ok"):
        ones = np.ones(num_clients)
        if mode == "raise":
            raise RuntimeError("trace server unreachable")
        return {"ok": lambda: Profiles(ones * 1e9, ones * 1e7, ones * 1e7, 1e10),
                "tuple": lambda: (ones, ones),
                "fewer": lambda: Profiles(ones[:-1] * 1e9, ones[:-1] * 1e7, ones[:-1] * 1e7,
                                          1e10),
                "short_compute": lambda: Profiles(ones[:-1] * 1e9, ones * 1e7, ones * 1e7,
                                                  1e10)}[mode]()


@pytest.mark.parametrize("mode, what", [
    ("raise", "failed: RuntimeError: trace server unreachable"),
    ("tuple", "returned tuple; it must return Profiles for the 6 clients"),
    ("fewer", "returned profiles of 5 clients; it must return Profiles for the 6 clients"),
    ("short_compute", "failed: ValueError: compute: 5 values, but uplink and downlink have "
                      "6; expected one value per client in each"),
])
def test_a_clock_profiles_failure_names_it(zz_clock, mode, what):
    with pytest.raises(PluginError) as info:
        plugin_run(clock={"profile": "zz_clock", "options": {"mode": mode}})
    message = str(info.value)
    one_line(message)
    assert message.startswith(f"clock.profile: clock profile 'zz_clock' (plugin {HERE}) ")
    assert what in message


def test_a_right_clock_profile_runs(zz_clock):
    assert len(plugin_run(clock={"profile": "zz_clock"}).records) == 3


# ------------------------------------------------------------ transforms, server steps



class RaisingTransform(GradientTransform):
    name = "zz_raising"
    Options = ModeOptions

    def start(self, env, state, t, cohort, round_):
        if self.options.mode == "start":
            raise ZeroDivisionError("division by zero in start")

        def update(names, params, grads, slots):
            raise FloatingPointError("overflow in the correction")
        return update


@pytest.mark.parametrize("mode, what", [
    ("start", "failed: ZeroDivisionError: division by zero in start"),
    ("update", "failed: FloatingPointError: overflow in the correction"),
])
def test_a_gradient_transforms_exception_names_it(scratch, mode, what):
    splitfed.register_transform("zz_raising", RaisingTransform)
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"client_transforms": [{"name": "zz_raising", "mode": mode}]})
    message = str(info.value)
    one_line(message)
    assert message.startswith("algorithm.client_transforms: transform 'zz_raising' "
                              f"(plugin {HERE}) ")
    assert what in message


class OddStep(ServerStep):
    name = "zz_step"
    Options = ModeOptions
    aggregates = False

    def init(self, env, params):
        return {"grow": {"count": 0.0}, "init_set": {"s": {1, 2}}}.get(self.options.mode)

    def update(self, ctx, model):
        first = next(iter(model))
        if self.options.mode == "grow":             # a key init did not return
            ctx.state = {**ctx.state, "extra": torch.zeros(2)}
            return {}
        if self.options.mode == "late":             # init returned None (the default)
            ctx.state = {"count": 1.0}
            return {}
        if self.options.mode in ("metric", "reserved"):
            ctx.metrics["q" if self.options.mode == "metric" else "test_acc"] = "text"
            return {}
        return {"list": lambda: [model[first]],
                "key": lambda: {"nonexistent.weight": model[first]},
                "shape": lambda: {first: model[first].reshape(-1)[:3]},
                "dtype": lambda: {first: model[first].double()},
                "device": lambda: {first: model[first].to("meta")},
                "value": lambda: {first: 1.0},
                "raise": lambda: {}["state"],
                "ok": lambda: {first: model[first] * 1}}[self.options.mode]()


@pytest.mark.parametrize("mode, what", [
    ("list", "the update of transform 'zz_step' (plugin {}) returned list; it must return "
             "a dict of the model's tensors it changes"),
    ("key", "the update of transform 'zz_step' (plugin {}) returned 'nonexistent.weight', "
            "which is not a tensor of the model"),
    ("shape", "the update of transform 'zz_step' (plugin {}) returned shape (3,) for "
              "'fc1.1.weight', whose tensor has shape (32, 64)"),
    ("value", "the update of transform 'zz_step' (plugin {}) returned float for "
              "'fc1.1.weight'"),
    ("dtype", "the update of transform 'zz_step' (plugin {}) returned torch.float64 for "
              "'fc1.1.weight', whose tensor is torch.float32"),
    ("device", "the update of transform 'zz_step' (plugin {}) returned a tensor on meta "
               "for 'fc1.1.weight', whose tensor is on cpu"),
    ("raise", "transform 'zz_step' (plugin {}) failed: KeyError: 'state'"),
    ("metric", "the update of transform 'zz_step' (plugin {}) set the metric 'q' = 'text' "
               "(str); a metric is a real number or None"),
    ("late", "transform 'zz_step' (plugin {}) kept a state under 'zz_step' in round 1 "
             "that its init did not declare (it returned None)"),
    ("reserved", "the update of transform 'zz_step' (plugin {}) set the metric name "
                 "'test_acc'; a metric is named by a string other than the record's own"),
    ("grow", "transform 'zz_step' (plugin {}) kept a state in round 1 whose checkpoint "
             "could not be resumed: state.zz_step has other keys ('extra') (as its init "
             "returned it)"),
    ("init_set", "transform 'zz_step' (plugin {}) kept a state that a checkpoint cannot "
                 "hold (state['zz_step']['s']: a builtins.set)"),
])
def test_a_server_steps_mistake_names_the_step_not_the_algorithm(scratch, mode, what):
    splitfed.register_transform("zz_step", OddStep)
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"server_transforms": [{"name": "zz_step", "mode": mode}]})
    message = str(info.value)
    one_line(message)
    assert message.startswith("algorithm.server_transforms: " + what.format(HERE)), message
    assert "fedavg" not in message


def test_a_server_step_of_the_right_shape_runs(scratch):
    splitfed.register_transform("zz_step", OddStep)
    plain = plugin_run()
    same = plugin_run(algorithm={"server_transforms": [{"name": "zz_step"}]})
    assert same.records[-1]["test_acc"] == plain.records[-1]["test_acc"]


# ------------------------------------------------------------ registration


def test_methods_a_component_must_define_are_checked_when_registered(scratch):
    class NoRound(Algorithm):
        name = "zz_noround"

    class NoStart(GradientTransform):
        name = "zz_nostart"

    class NoUpdate(ServerStep):
        name = "zz_noupdate"

    with pytest.raises(PluginError, match=r"register_algorithm\('zz_noround'\): NoRound does "
                                          r"not define round\(self, env, state, t, cohort\)"):
        splitfed.register_algorithm("zz_noround", NoRound)
    with pytest.raises(PluginError, match=r"NoStart does not define start\(self, env, state"):
        splitfed.register_transform("zz_nostart", NoStart)
    with pytest.raises(PluginError, match=r"NoUpdate does not define update\(self, ctx, model"):
        splitfed.register_transform("zz_noupdate", NoUpdate)


def test_the_methods_splitfed_calls_must_take_its_arguments_when_registered(scratch):
    """A round, start or update that cannot take what splitfed passes is refused when it
    is registered, not in the first round of a run, after its directory is written."""
    class ShortRound(Algorithm):
        name = "zz_shortround"

        def round(self, env, state, t):
            return None

    class ShortStart(GradientTransform):
        name = "zz_shortstart"

        def start(self, env, state, t, cohort):
            return None

    class ShortUpdate(ServerStep):
        name = "zz_shortupdate"

        def update(self, ctx):
            return {}

    class Fine(GradientTransform):
        name = "zz_fine"

        def start(self, env, state, t, cohort, round_=None, *, extra=1):
            return None

    with pytest.raises(PluginError, match=r"register_algorithm\('zz_shortround'\): "
                                          r"ShortRound.round must take \(self, env, state, t, "
                                          r"cohort\), .* it takes \(self, env, state, t\)$"):
        splitfed.register_algorithm("zz_shortround", ShortRound)
    with pytest.raises(PluginError, match=r"ShortStart.start must take \(self, env, state, "
                                          r"t, cohort, round_\)"):
        splitfed.register_transform("zz_shortstart", ShortStart)
    with pytest.raises(PluginError, match=r"ShortUpdate.update must take \(self, ctx, "
                                          r"model\)"):
        splitfed.register_transform("zz_shortupdate", ShortUpdate)
    splitfed.register_transform("zz_fine", Fine)


def test_a_plugin_that_exits_while_importing_is_an_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "zz_exiting_lab.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "--dry-run", "--plugin", "zz_exiting_lab",
                 f"out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "'zz_exiting_lab' failed while importing: SystemExit: 0" in err[0]


def _blocks(n):
    return OrderedDict((f"b{i}", nn.Identity()) for i in range(n))


@pytest.mark.parametrize("cuts, default, what", [
    ({1: "a"}, 2, "default_cut 2 is not one of its cuts [1]"),
    ({1: "a", 2: "b"}, None, "default_cut is None, but the model has cuts [1, 2]"),
    ({3: "a"}, None, "cuts [3] are not 1..2 (the model has 3 blocks)"),
])
def test_block_models_name_what_is_wrong_with_their_cuts(cuts, default, what):
    with pytest.raises(ValueError) as info:
        BlockModel(_blocks(3), name="t", cut_descriptions=cuts, default_cut=default)
    assert what in str(info.value)
    BlockModel(_blocks(3), name="t", cut_descriptions={1: "a"}, default_cut=1)
    BlockModel(_blocks(1), name="t", cut_descriptions={}, default_cut=None)


class UnsaveableState(FedAvg):
    """FedAvg whose state carries an object a checkpoint cannot hold."""

    name = "zz_unsaveable"
    state_keys = ("model", "extra")

    def init_state(self, env):
        return {**super().init_state(env), "extra": {"log": []}}

    def round(self, env, state, t, cohort):
        result = super().round(env, state, t, cohort)
        return dataclasses.replace(result, state={**result.state,
                                                  "extra": {"log": [object()]}})


def test_a_state_a_checkpoint_cannot_hold_is_named_in_its_round(scratch):
    splitfed.register_algorithm("zz_unsaveable", UnsaveableState)
    with pytest.raises(PluginError) as info:
        plugin_run(algorithm={"name": "zz_unsaveable"})
    message = str(info.value)
    one_line(message)
    assert message == (f"algorithm.name: algorithm 'zz_unsaveable' (plugin {HERE}): round 1 "
                       "returned a state "
                       "that a checkpoint cannot hold (state['extra']['log'][0]: a "
                       "builtins.object); the state holds tensors, numpy arrays, numbers, "
                       "strings, modules, optimizers, and lists and dicts of these")


def test_unsaveable_names_where_and_what():
    import numpy as np
    import torch

    from splitfed.safeio import unsaveable

    ok = {"a": [1, 2.5, "x", None, b"y", (True,)], "t": torch.zeros(2), "n": np.zeros(3),
          3: {"g": np.float32(1)}}
    assert unsaveable(ok) is None
    assert unsaveable({"a": [1, {"b": len}]}) == \
        "value['a'][1]['b']: a builtins.builtin_function_or_method"
    assert unsaveable({(1, 2): 0}, "s") == "s: the dict key (1, 2) (a tuple)"
    assert unsaveable(np.array([object()])) == "value: a numpy array of Python objects"


class Silent(FedAvg):
    """FedAvg that trains its cohort but moves nothing through the transport."""

    name = "zz_silent"

    def round(self, env, state, t, cohort):
        from splitfed.engine.rounds import Round

        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        rnd.aggregate_against(state["model"])       # no rnd.send, no upload
        return rnd.finish()


def test_a_round_that_sends_nothing_is_warned_about_once(scratch, capsys):
    """Clients took part, the ledger counts nothing: one warning line for the run; FedAvg
    itself gets none."""
    splitfed.register_algorithm("zz_silent", Silent)
    result = plugin_run(algorithm={"name": "zz_silent"})
    assert result.status == "completed"
    assert all(r["bytes_up"] == 0 and r["bytes_down"] == 0 for r in result.records[1:])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "env.transport" in line]
    assert lines == [
        f"splitfed: warning: algorithm.name: algorithm 'zz_silent' (plugin {HERE}) used "
        f"{result.records[1]['clients_used']} client(s) in round 1 but sent nothing through "
        "env.transport: the records count 0 bytes and the clock no communication time for "
        "it (docs/extending.md: everything that crosses the network goes through the "
        "transport)"]
    plugin_run(algorithm={"name": "fedavg"})
    assert "env.transport" not in capsys.readouterr().err
