"""Conformance: every registered algorithm passes these checks automatically.

It runs a few rounds on small real data (scikit-learn's digits), it learns, it is
deterministic for a seed, and it respects participation (clients that were not sampled
send and receive nothing). The checks are :mod:`splitfed.testing`'s, which plugin authors
call on their own algorithms; the settings some algorithms need to learn the small task
are kept here (LEARN_OVERRIDES), not on the algorithms' classes.
"""

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from splitfed import testing, transport
from splitfed.algorithms import ALGORITHMS, TRANSFORMS
from splitfed.algorithms.fedavg import FedAvg
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


# ------------------------------------------------- each check fails a broken algorithm


def _failure(cls, check, **kwargs):
    """The AssertionError ``check_algorithm(cls, checks=[check])`` raises (it must)."""
    with pytest.raises(AssertionError) as info:
        testing.check_algorithm(cls, checks=[check], **kwargs)
    message = str(info.value)
    assert f"fails 1 of 1 conformance checks ({check}):" in message, message
    return message


def test_learns_fails_a_training_loss_that_does_not_fall():
    """The model learns as FedAvg's does, but the reported training loss grows every
    round: the accuracy alone does not make the check pass."""

    class RisingLoss(FedAvg):
        name = "zz_rising_loss"

        def round(self, env, state, t, cohort):
            return dataclasses.replace(super().round(env, state, t, cohort),
                                       train_loss=float(t))

    message = _failure(RisingLoss, "learns")
    assert "the training loss did not fall: 1.0000 in the first round, 6.0000 in " \
           "the last" in message


class _Oracle(torch.nn.Module):
    """A model that knows the test set: right on its first ``share`` of the samples,
    wrong (the next class) on the others."""

    def __init__(self, test, share: float, classes: int):
        super().__init__()
        right = int(share * len(test.y))
        answers = test.y.clone()
        answers[right:] = (answers[right:] + 1) % classes
        self.answers = {row.numpy().tobytes(): int(a) for row, a in zip(test.x, answers)}
        self.classes = classes

    def forward(self, x):
        guess = torch.tensor([self.answers[row.numpy().tobytes()] for row in x])
        return torch.nn.functional.one_hot(guess, self.classes).to(torch.float32)


def test_learns_wants_a_rise_of_more_than_the_margin():
    """The evaluated model answers 20% of the test set right at round 0 and
    LEARN_MARGIN - 5% more afterwards (the clients train as FedAvg's, so the training
    loss falls): a rise, but not of more than LEARN_MARGIN, fails the check."""

    class SlowLearner(FedAvg):
        name = "zz_slow_learner"
        state_keys = ("model", "rounds")

        def init_state(self, env):
            return {**super().init_state(env), "rounds": 0}

        def round(self, env, state, t, cohort):
            result = super().round(env, state, t, cohort)
            return dataclasses.replace(result, state={**result.state, "rounds": t})

        def eval_model(self, env, state):
            share = 0.2 + (testing.LEARN_MARGIN - 0.05) * (state["rounds"] > 0)
            return _Oracle(env.data.test, share, env.data.num_classes)

    message = _failure(SlowLearner, "learns")
    first, last = map(float, re.search(r"the test accuracy went from ([\d.]+) \(round 0\) "
                                       r"to ([\d.]+) \(round 6\)", message).groups())
    assert 0 < last - first <= testing.LEARN_MARGIN, message
    assert f"expected a rise of more than {testing.LEARN_MARGIN}" in message


def test_deterministic_fails_metrics_that_differ_between_two_runs():
    """Same seed, same learned state, but a metric drawn from a source the seed does not
    govern (a counter shared by the runs): the records differ, so the check fails."""
    import itertools

    draws = itertools.count()

    class DriftingMetric(FedAvg):
        name = "zz_drifting_metric"

        def round(self, env, state, t, cohort):
            result = super().round(env, state, t, cohort)
            return dataclasses.replace(result, metrics={**result.metrics,
                                                        "draw": float(next(draws))})

    message = _failure(DriftingMetric, "deterministic")
    assert "log different metrics: record 1 (round 1) differs in ['draw']" in message


@pytest.mark.parametrize("entry, where", [("number", "state['extra'] (1 vs 3)"),
                                          ("tensor", "state['extra']"),
                                          ("module", "state['extra']['weight']")])
def test_deterministic_compares_every_kind_of_state_entry(entry, where):
    """A state entry that differs between two runs with the same seed fails the check,
    whether it is a plain number, a tensor (compared exactly, however small the
    difference) or a module (compared by its state dict); the metrics of both runs are
    the same, so only the state can tell."""
    import itertools

    calls = itertools.count()

    def extra():
        if entry == "number":
            return next(calls)
        if entry == "tensor":                  # a few float32 ulps apart: exactly compared
            return torch.full((2,), 1.0 + 1e-6 * next(calls))
        probe = torch.nn.Linear(2, 1)
        with torch.no_grad():
            probe.weight.fill_(float(next(calls)))
            probe.bias.zero_()
        return probe

    class Drifting(FedAvg):
        name = "zz_drifting_state"
        state_keys = ("model", "extra")

        def init_state(self, env):
            return {**super().init_state(env),
                    "extra": 0 if entry == "number" else extra()}

        def round(self, env, state, t, cohort):
            result = super().round(env, state, t, cohort)
            if entry == "module":
                return result                  # round 0's module, one per run
            return dataclasses.replace(result, state={**result.state, "extra": extra()})

    message = _failure(Drifting, "deterministic")
    assert f"end with different learned states: {where} differs" in message


@pytest.mark.parametrize("kind", transport.KINDS)
@pytest.mark.parametrize("direction", [transport.UP, transport.DOWN])
def test_non_sampled_clients_send_nothing_of_any_kind_either_way(kind, direction):
    """An algorithm that moves one tensor of ``kind`` (every kind the transport knows)
    between the server and the clients outside the cohort fails the check, whatever the
    kind and the direction."""

    class Leaky(FedAvg):
        name = "zz_leaky"

        def round(self, env, state, t, cohort):
            others = np.setdiff1d(np.arange(env.num_clients), cohort.ids)
            env.transport.send(kind, direction, others, torch.zeros(len(others), 1))
            return super().round(env, state, t, cohort)

    message = _failure(Leaky, "non_sampled_clients_send_nothing")
    verb = "sent" if direction == "up" else "received"
    assert "not in the cohort" in message and f"{verb} {kind!r} bytes" in message


class _Silent:
    """A round that trains nobody and sends nothing, but reports a training loss."""

    def round(self, env, state, t, cohort):
        from splitfed.engine.rounds import RoundResult

        return RoundResult(state=state, train_loss=1.0)


def test_a_cohort_that_sends_nothing_fails():
    """The cohort's uploads must go through the transport: a round that moves nothing
    leaks nothing, and still fails non_sampled_clients_send_nothing and
    participation_modes."""

    Silent = type("Silent", (_Silent, FedAvg), {"name": "zz_silent"})
    message = _failure(Silent, "non_sampled_clients_send_nothing")
    assert "round 1: the cohort" in message and "sent nothing (bytes_up = 0)" in message
    message = _failure(Silent, "participation_modes")
    assert "participants but nothing was uploaded (bytes_up = 0)" in message


def test_participation_modes_fails_a_round_without_a_training_loss():

    class NoLoss(FedAvg):
        name = "zz_no_loss"

        def round(self, env, state, t, cohort):
            return dataclasses.replace(super().round(env, state, t, cohort),
                                       train_loss=None)

    message = _failure(NoLoss, "participation_modes")
    assert "participants but train_loss None" in message


def test_ledger_matches_transport_fails_bytes_charged_but_never_sent():
    """Bytes written into the ledger for tensors that never went through the transport:
    the metrics and the ledger agree, the transport delivered fewer bytes."""

    class Unsent(FedAvg):
        name = "zz_unsent"

        def round(self, env, state, t, cohort):
            result = super().round(env, state, t, cohort)
            env.ledger.record("scalars", "up", cohort.ids, 4)
            return result

    message = _failure(Unsent, "ledger_matches_transport")
    metrics, ledger, delivered = map(int, re.search(
        r"the metrics report (\d+) bytes, the ledger (\d+), the transport delivered "
        r"tensors of (\d+) bytes", message).groups())
    assert metrics == ledger == delivered + 2 * 3 * 4       # 2 rounds, 3 clients, 4 bytes


def test_ledger_matches_transport_fails_bytes_the_records_do_not_count():
    """A transfer made while the model is evaluated (after the round's record took the
    ledger's totals) is delivered and in the ledger, but in no record's bytes."""

    class SendsWhenEvaluated(FedAvg):
        name = "zz_sends_when_evaluated"

        def eval_model(self, env, state):
            env.transport.broadcast("model", np.arange(1), state["model"])
            return super().eval_model(env, state)

    message = _failure(SendsWhenEvaluated, "ledger_matches_transport")
    metrics, ledger, delivered = map(int, re.search(
        r"the metrics report (\d+) bytes, the ledger (\d+), the transport delivered "
        r"tensors of (\d+) bytes", message).groups())
    assert ledger == delivered > metrics > 0


def test_check_algorithm_runs_only_the_checks_of_a_server_only_algorithm():
    """With no ``checks``, an algorithm with federated = False runs the checks that
    apply to it, and is not failed by the federated ones."""
    assert testing.check_algorithm("centralized") == [
        c for c in testing.CHECKS if c not in testing.FEDERATED_CHECKS]


def test_check_algorithm_takes_one_check_by_its_name():
    assert testing.check_algorithm("fedavg", checks="state_untouched") == [
        "state_untouched"]
