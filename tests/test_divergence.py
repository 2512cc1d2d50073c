"""One definition of a diverged run: the first round whose training loss, test loss or
test accuracy is not finite; status ``diverged``, ``diverged_round`` in summary.json,
final accuracy NaN, best accuracy the best before it; NaN a float in memory and the JSON
token NaN on disk; a line per evaluation on stderr with ``progress: false``."""

from __future__ import annotations

import json
import math

import pytest

import splitfed.engine.loop as loop
from splitfed.experiment import resume_experiment, run_experiment, summary_line
from splitfed.metrics import (MetricLogger, RunningSummary, decode_record, divergence,
                              read_records, record_summary)
from tests.helpers import digits_config

NAN, INF = math.nan, math.inf
DIVERGING = {"batch_size": 8, "local_steps": 5, "local_epochs": None, "lr": 1e10}


# ----------------------------------------------------------------------- the definition


@pytest.mark.parametrize("records, expected", [
    ([{"round": 0, "test_acc": 0.1}, {"round": 1, "train_loss": 1.0}], None),
    ([{"round": 0, "test_acc": 0.1}, {"round": 1, "train_loss": NAN}], 1),
    ([{"round": 0, "test_acc": 0.1}, {"round": 1, "train_loss": 1.0, "test_loss": INF,
                                      "test_acc": 0.1}], 1),
    ([{"round": 0, "test_acc": NAN}], 0),
    ([{"round": 0}, {"round": 1, "train_loss": 2.0}, {"round": 2, "train_loss": -INF},
      {"round": 3, "train_loss": NAN}], 2),
    ([{"round": 0}, {"round": 1, "train_loss": "nan"}], 1),     # an earlier version's text
    ([{"round": 0, "bytes_up": NAN}], None),                    # other fields do not count
    ([], None),
])
def test_divergence_is_the_first_non_finite_loss_or_accuracy(records, expected):
    assert divergence(records) == expected


def test_record_summary_of_a_diverged_and_a_completed_run():
    records = [{"round": 0, "test_acc": 0.1}, {"round": 1, "train_loss": 2.0, "test_acc": 0.5},
               {"round": 2, "train_loss": 1.0, "test_acc": 0.4},
               {"round": 3, "train_loss": NAN}]
    s = record_summary(records, "diverged")
    assert s["diverged_round"] == 3 and s["rounds"] == 3
    assert math.isnan(s["final_test_acc"]) and s["best_test_acc"] == 0.5
    s = record_summary(records[:3], "completed")
    assert s == {"rounds": 2, "diverged_round": None, "final_test_acc": 0.4,
                 "best_test_acc": 0.5}
    # diverged by the test loss: that round's accuracy (of a broken model) is not the best
    broken = records[:2] + [{"round": 2, "train_loss": 1.0, "test_acc": 0.9,
                             "test_loss": INF}]
    s = record_summary(broken)
    assert s["diverged_round"] == 2 and s["best_test_acc"] == 0.5
    # a status of diverged with finite records (a checkpoint that says so): the last round
    assert record_summary(records[:3], "diverged")["diverged_round"] == 2
    assert record_summary([], None) == {"rounds": None, "diverged_round": None,
                                        "final_test_acc": None, "best_test_acc": None}


def test_a_status_of_diverged_keeps_the_last_rounds_accuracy_out_of_the_best():
    """RunningSummary is record_summary of records given one at a time: with a status of
    ``diverged`` and finite records the run diverged at its last round, and its best
    accuracy is the best of the rounds before it (metrics.record_summary)."""
    records = [{"round": 0, "test_acc": 0.1}, {"round": 1, "test_acc": 0.3},
               {"round": 2, "test_acc": 0.5}]
    tally = RunningSummary()
    for r in records:
        tally.add(r)
    for s in (tally.summary("diverged"), record_summary(records, "diverged")):
        assert s["diverged_round"] == 2 and s["best_test_acc"] == 0.3
        assert math.isnan(s["final_test_acc"])
    assert tally.summary("completed")["best_test_acc"] == 0.5


def test_nan_is_one_float_in_memory_and_the_json_token_on_disk(tmp_path):
    logger = MetricLogger(tmp_path)
    logger.log({"round": 0, "test_acc": 0.5})
    logger.log({"round": 1, "train_loss": float("nan"), "x": float("inf")})
    logger.close()
    assert logger.records[1]["train_loss"] is math.nan          # the one NaN object
    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"train_loss": NaN' in text and '"x": Infinity' in text
    back = read_records(tmp_path / "metrics.jsonl")
    assert back == logger.records and back[1]["x"] == INF
    assert decode_record({"round": 1, "a": "nan", "b": "-inf", "c": "text"}) == {
        "round": 1, "a": math.nan, "b": -INF, "c": "text"}


# ---------------------------------------------------------------------- real runs


def test_a_run_whose_training_loss_becomes_nan(tmp_path, capsys):
    cfg = digits_config(rounds=6, train=DIVERGING)
    result = run_experiment(cfg, run_dir=tmp_path / "d")
    assert result.status == "diverged"
    last = result.records[-1]
    n = last["round"]
    assert 1 <= n < 6 and isinstance(last["train_loss"], float)
    assert not math.isfinite(last["train_loss"]) and "test_acc" not in last
    assert result.diverged_round == n and math.isnan(result.final_accuracy)
    best = max(r["test_acc"] for r in result.records if "test_acc" in r)
    assert result.best_accuracy == best
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_round"] == n
    assert math.isnan(summary["final_test_acc"]) and summary["best_test_acc"] == best
    assert '"final_test_acc": NaN' in (tmp_path / "d" / "summary.json").read_text()
    assert read_records(tmp_path / "d" / "metrics.jsonl") == result.records
    line = summary_line(cfg, result)
    assert f"status diverged at round {n}" in line and "nan" not in line.lower()
    assert f"best test accuracy {best:.4f}" in line
    err = capsys.readouterr().err
    assert f"t: round {n}/6, train loss" in err and "diverged" in err
    again = resume_experiment(tmp_path / "d")            # ended: not run again
    assert again.status == "diverged" and again.records == result.records


def test_a_non_finite_test_loss_diverges_the_run(tmp_path, monkeypatch):
    original = loop._evaluate
    calls = []

    def evaluate(algorithm, env, state):
        out = original(algorithm, env, state)
        calls.append(1)
        return {**out, "test_loss": INF} if len(calls) == 3 else out  # rounds 0, 1, 2

    monkeypatch.setattr(loop, "_evaluate", evaluate)
    result = run_experiment(digits_config(rounds=5), run_dir=tmp_path / "r")
    assert result.status == "diverged" and result.diverged_round == 2
    assert [r["round"] for r in result.records] == [0, 1, 2]
    assert result.records[-1]["test_loss"] == INF
    assert result.best_accuracy == max(r["test_acc"] for r in result.records[:2])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["diverged_round"] == 2 and summary["rounds"] == 2


def test_a_non_finite_initial_model_diverges_at_round_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "_evaluate", lambda *a: {"test_acc": 0.1, "test_loss": NAN})
    result = run_experiment(digits_config(rounds=3), run_dir=tmp_path / "r")
    assert result.status == "diverged" and result.diverged_round == 0
    assert len(result.records) == 1 and result.best_accuracy is None
    assert math.isnan(result.final_accuracy)


def test_a_completed_run_keeps_its_numbers(tmp_path):
    cfg = digits_config(rounds=2)
    result = run_experiment(cfg, run_dir=tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["diverged_round"] is None and result.diverged_round is None
    assert summary["final_test_acc"] == result.records[-1]["test_acc"]
    line = summary_line(cfg, result)
    assert line.endswith(" s") and (f"status completed, test accuracy "
                                    f"{result.final_accuracy:.4f} after 2 rounds") in line


# ----------------------------------------------------------------------- progress


def test_progress_false_prints_a_line_per_evaluation_to_stderr(tmp_path, capsys):
    run_experiment(digits_config(rounds=4, eval_every=2), run_dir=tmp_path / "r")
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert [x.split(",")[0] for x in lines] == ["t: round 2/4", "t: round 4/4"]
    assert all("train loss " in x and "test acc " in x and x.endswith(" s") for x in lines)
    run_experiment(digits_config(rounds=2), write=False)       # in memory: quiet
    assert capsys.readouterr().err == ""
