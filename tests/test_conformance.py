"""Conformance: every registered algorithm passes these checks automatically.

It runs a few rounds on small real data (scikit-learn's digits), it learns, it is
deterministic for a seed, and it respects participation (clients that were not sampled
send and receive nothing). The checks are :mod:`splitfed.testing`'s, which plugin authors
call on their own algorithms; the settings some algorithms need to learn the small task
are kept here (LEARN_OVERRIDES), not on the algorithms' classes.
"""

import subprocess
import sys

import pytest

from splitfed import testing
from splitfed.algorithms import ALGORITHMS, TRANSFORMS
from splitfed.engine.transforms import GradientTransform
from splitfed.errors import ConfigError
from splitfed.registry import load_entry_points

load_entry_points()               # installed plugins' algorithms are checked too
NAMES = sorted(ALGORITHMS)
FEDERATED = [n for n in NAMES if ALGORITHMS[n].federated]

#: config overrides under which the ``learns`` check expects an algorithm to learn the
#: small task (the others learn under splitfed.testing.base_config() as it is)
LEARN_OVERRIDES = {
    # the server sees one batch per client per upload round: more rounds to learn
    "csefsl": {"rounds": 12},
    # zeroth-order: one ZO step per upload needs many more rounds than first-order methods
    "gas": {"rounds": 40, "eval_every": 10,
            "algorithm": {"server_lr": 0.02},
            "train": {"batch_size": 16, "local_steps": 4, "local_epochs": None,
                      "lr": 0.01}},
    # zeroth-order: one ZO step per round needs many more rounds than first-order methods
    "musplitfed": {"rounds": 60, "eval_every": 10,
                   "algorithm": {"server_lr": 0.05, "global_lr": 1.0},
                   "train": {"batch_size": 32, "local_steps": 1, "local_epochs": None,
                             "lr": 0.02}},
}


@pytest.mark.parametrize("name", NAMES)
def test_learns(name):
    testing.check_learns(name, LEARN_OVERRIDES.get(name))


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_a_seed(name):
    testing.check_deterministic(name)


@pytest.mark.parametrize("name", NAMES)
def test_round_leaves_the_state_it_is_given(name):
    testing.check_state_untouched(name)


def test_a_round_that_changes_its_state_in_place_fails():
    from splitfed.algorithms.fedavg import FedAvg

    class Halving(FedAvg):                     # scales the global model in place
        name = "zz_halving"

        def round(self, env, state, t, cohort):
            result = super().round(env, state, t, cohort)
            for v in state["model"].values():
                if v.is_floating_point():
                    v.mul_(0.5)
            return result

    with pytest.raises(AssertionError) as info:
        testing.check_algorithm(Halving, checks=["state_untouched"])
    message = str(info.value)
    assert "fails 1 of 1 conformance checks (state_untouched)" in message
    assert "round 1 changed the state it was given, at state['model']['fc1" in message
    assert testing.check_algorithm("fedavg", checks=["state_untouched"]) == [
        "state_untouched"]


@pytest.mark.parametrize("name", FEDERATED)
def test_non_sampled_clients_send_nothing(name):
    testing.check_non_sampled_clients_send_nothing(name)


@pytest.mark.parametrize("name", FEDERATED)
def test_ledger_matches_the_tensors_actually_moved(name):
    testing.check_ledger_matches_transport(name)


MODES = testing.PARTICIPATION_MODES


@pytest.mark.parametrize("participation", MODES, ids=[m["mode"] for m in MODES])
@pytest.mark.parametrize("name", FEDERATED)
def test_every_participation_mode_and_local_epochs(name, participation):
    testing.check_participation_modes(name, [participation])


# ------------------------------------------------------------- splitfed.testing itself


def test_learn_overrides_name_registered_algorithms():
    assert set(LEARN_OVERRIDES) <= set(ALGORITHMS)
    for name, overrides in LEARN_OVERRIDES.items():      # each builds a valid config
        raw = testing._merge(testing.base_config(name), overrides)
        assert raw["algorithm"]["name"] == name and raw["data"] == {"name": "digits"}


def test_base_config_is_a_fresh_dict():
    a = testing.base_config("fedavg")
    a["train"]["lr"] = 9.0
    assert testing.base_config("fedavg")["train"]["lr"] == 0.1
    assert testing.base_config("sl")["algorithm"] == {"name": "sl"}


def test_overrides_update_sections_and_replace_values():
    raw = testing._merge(testing.base_config("fedavg"),
                         {"rounds": 12, "train": {"lr": 0.05}, "model": {"hidden": [8]}})
    assert raw["rounds"] == 12
    assert raw["train"] == {"batch_size": 16, "local_steps": 8, "local_epochs": None,
                            "lr": 0.05}
    assert raw["model"] == {"name": "mlp", "hidden": [8]}


def test_check_algorithm_selects_the_checks_that_apply():
    assert not ALGORITHMS["centralized"].federated
    assert testing.check_algorithm("centralized", checks=["deterministic"]) == [
        "deterministic"]
    with pytest.raises(ValueError, match="'participation_modes' applies to federated "
                                         "algorithms only; algorithm 'centralized'"):
        testing.check_algorithm("centralized", checks=["participation_modes"])
    with pytest.raises(ValueError, match=r"unknown conformance check\(s\) \['learn'\]"):
        testing.check_algorithm("fedavg", checks=["learn"])
    with pytest.raises(ConfigError, match="unknown algorithm 'no_such_algorithm'"):
        testing.check_algorithm("no_such_algorithm")


def test_a_failed_check_names_the_algorithm_and_the_check():
    # fedavg cannot gain 0.3 of test accuracy in one round at this learning rate
    with pytest.raises(AssertionError) as info:
        testing.check_algorithm("fedavg", checks=["learns"],
                                overrides={"rounds": 1, "train": {"lr": 0.001}})
    message = str(info.value)
    assert message.startswith("algorithm 'fedavg' (splitfed.algorithms.fedavg.FedAvg) "
                              "fails 1 of 1 conformance checks (learns):")
    assert "test accuracy went from" in message and "overrides" in message


def test_splitfed_testing_needs_no_test_framework():
    code = "import sys, splitfed.testing; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# every registered transform, on an FL and a split algorithm that take it (plugins' too)
GRADIENT = sorted(n for n, t in TRANSFORMS.items() if issubclass(t, GradientTransform))
STEPS = sorted(n for n, t in TRANSFORMS.items() if not issubclass(t, GradientTransform))


def _hosts(name):
    t = TRANSFORMS[name]
    return ["fedavg", "sflv2"] if getattr(t, "splits", True) else ["fedavg"]


#: FedCLG-S without server epochs moves x_t by about K eta g_s (eq. 11): with the small
#: default server pool (a noisy g_s) and K eta = 0.8 it does not learn the small task, as
#: fedclg_s with server_epochs=0 does not; a larger pool and a smaller rate do
TRANSFORM_LEARN_OVERRIDES = {"fedclg_s": {"rounds": 10, "server_data": {"fraction": 0.2},
                                          "train": {"lr": 0.05}}}


@pytest.mark.parametrize("transform,host", [(n, h) for n in GRADIENT for h in _hosts(n)])
def test_gradient_transforms_conform(transform, host):
    testing.check_algorithm(host, base={"algorithm": {"client_transforms": [
        {"name": transform}]}}, overrides=TRANSFORM_LEARN_OVERRIDES.get(transform),
        checks=["learns", "deterministic", "state_untouched",
                "non_sampled_clients_send_nothing"])


@pytest.mark.parametrize("transform,host", [(n, h) for n in STEPS for h in ("sflv1", "sl")])
def test_server_steps_conform(transform, host):
    testing.check_algorithm(host, base={"algorithm": {"server_transforms": [
        {"name": transform}]}}, checks=["learns", "deterministic", "state_untouched",
                                         "non_sampled_clients_send_nothing"])
