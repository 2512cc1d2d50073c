"""A study's ``average_last``: the mean test accuracy over the last N rounds (paper 003
Tables 7-9), as a column of results.md and numbers in results.json."""

import json
import math
import statistics

import pytest

from splitfed.errors import ConfigError
from splitfed.study import run_study, study_from_mapping
from splitfed.study.analysis import last_rounds_accuracy
from splitfed.study.report import markdown_table

BASE = {"name": "tiny", "seed": 0, "rounds": 6, "eval_every": 3,
        "data": {"name": "digits"},
        "partition": {"scheme": "iid", "num_clients": 3},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"batch_size": 16, "local_steps": 2, "local_epochs": None, "lr": 0.1},
        "participation": {"mode": "full"}}


def records(accs):
    return [{"round": t, "train_loss": 0.5, "test_acc": a} if a is not None
            else {"round": t, "train_loss": 0.5} for t, a in enumerate(accs)]


def test_mean_over_the_evaluated_rounds_of_the_window():
    recs = records([0.1, None, None, None, 0.5, None, None, None, 0.6, 0.7, 0.8])
    got = last_rounds_accuracy(recs, 3, 10)
    assert got == {"mean": pytest.approx(0.7), "evaluated": 3, "window": 3}
    got = last_rounds_accuracy(recs, 4, 10)                # round 7 was not evaluated
    assert got == {"mean": pytest.approx(0.7), "evaluated": 3, "window": 4}


def test_round_zero_never_counts():
    got = last_rounds_accuracy(records([0.1, 0.2, 0.4]), 100, 2)
    assert got == {"mean": pytest.approx(0.3), "evaluated": 2, "window": 2}


def test_a_diverged_run_has_no_mean():
    recs = records([0.1, 0.5, 0.6])
    recs[2]["train_loss"] = math.nan
    assert last_rounds_accuracy(recs, 2, 2)["mean"] is None
    assert last_rounds_accuracy(records([0.1, 0.5]), 2, 2, status="diverged")["mean"] is None


@pytest.mark.parametrize("value", [0, -3, 1.5, "x"])
def test_bad_average_last_is_refused(value):
    study = {"name": "s", "base_config": BASE, "runs": [{"label": "a", "set": []}],
             "average_last": value}
    with pytest.raises(ConfigError, match="average_last"):
        study_from_mapping(study)


def test_no_column_without_the_key():
    summary = {"target_accuracy": None, "runs": []}
    assert "mean acc" not in markdown_table(summary)


def test_study_reports_the_mean_of_the_last_rounds(tmp_path):
    study = {"name": "avg", "base_config": BASE, "average_last": 2,
             "runs": [{"label": "tail", "set": ["eval_last=2"]},
                      {"label": "sparse", "set": []}]}
    result = run_study(study, out_dir=tmp_path, quiet=True)
    tail, sparse = result.summary["runs"]
    assert result.summary["average_last"] == 2
    recs = [json.loads(line) for line in
            (tmp_path / "avg" / tail["per_seed"][0]["run_dir"] / "metrics.jsonl")
            .read_text().splitlines()]
    want = statistics.fmean(r["test_acc"] for r in recs if r["round"] in (5, 6))
    assert tail["mean_last_acc"]["mean"] == pytest.approx(want)
    assert tail["per_seed"][0]["mean_last_evaluated"] == 2
    # without eval_last only round 6 of rounds 5-6 is evaluated (every 3 and the last)
    assert sparse["per_seed"][0]["mean_last_evaluated"] == 1
    assert sparse["mean_last_acc"]["mean"] == pytest.approx(sparse["final_test_acc"]["mean"])
    lines = result.table.splitlines()
    assert lines[0].split(" | ")[3] == "mean acc (last 2 rounds)"
    assert lines[2].split(" | ")[3] == f"{want:.4f}"
    assert lines[3].split(" | ")[3].endswith("(1 of 2 rounds evaluated)")
    text = (tmp_path / "avg" / "results.md").read_text()
    assert "mean acc (last 2 rounds)" in text


def test_study_without_the_key_keeps_its_table(tmp_path):
    study = {"name": "plain", "base_config": BASE, "runs": [{"label": "a", "set": []}]}
    result = run_study(study, out_dir=tmp_path, quiet=True)
    assert "average_last" not in result.summary
    assert "mean_last_acc" not in result.summary["runs"][0]
    assert result.table.splitlines()[0] == ("| run | final acc | best acc | MB up | MB down "
                                            "| wall time (s) |")
