"""``splitfed sweep``: axes from the command line, deterministic run directories, the
summary table, skipping finished runs and resuming interrupted ones."""

from __future__ import annotations

import csv
import json

import pytest

import splitfed.experiment as experiment
from splitfed.checkpoint import Checkpointer
from splitfed.cli import main
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError
from splitfed.sweep import default_name, parse_axes, run_sweep
from tests.helpers import digits_config


def test_parse_axes_reads_yaml_values_split_at_top_level_commas():
    axes, over = parse_axes(["train.lr=0.01,0.1", "model.hidden=[64,32],[128]",
                             "rounds=5", "model.options.hidden=[8,4]",
                             "algorithm.name=fedavg,sl", "partition.alpha=0.1,inf"])
    assert axes == {"train.lr": [0.01, 0.1], "model.hidden": [[64, 32], [128]],
                    "algorithm.name": ["fedavg", "sl"], "partition.alpha": [0.1, "inf"]}
    assert over == ["rounds=5", "model.options.hidden=[8,4]"]


@pytest.mark.parametrize("items,match", [
    (["train.lr"], "must look like key.sub=v1,v2"),
    (["=1,2"], "must look like"),
    (["train..lr=1,2"], "must look like"),
    (["train.lr="], "gives no value"),
    (["train.lr=0.1,0.2", "train.lr=0.3,0.4"], "'train.lr' is given twice"),
    (["train.lr=0.1,0.1"], "repeats a value"),
    (["train.lr=[0.1,"], "cannot parse"),
])
def test_parse_axes_errors_name_the_item(items, match):
    with pytest.raises(ConfigError, match=match):
        parse_axes(items)


def test_default_name():
    assert default_name("studies/paper003/lr_base.yaml") == "lr_base-sweep"
    assert default_name("quick_digits") == "quick_digits-sweep"


def test_a_sweep_needs_an_axis(tmp_path):
    with pytest.raises(ConfigError, match="at least one key with several values"):
        run_sweep("quick_digits", ["rounds=2"], out_dir=tmp_path, quiet=True)
    with pytest.raises(ConfigError, match="--group-by 'rounds' is not a swept key"):
        run_sweep("quick_digits", ["train.lr=0.1,0.2"], group_by="rounds", out_dir=tmp_path,
                  quiet=True)


def _config(tmp_path):
    path = tmp_path / "small.yaml"
    dump_yaml(digits_config(rounds=3, checkpoint_every=1), path)
    return str(path)


def test_sweep_runs_the_grid_writes_the_table_and_skips_finished_runs(tmp_path, capsys):
    cfg = _config(tmp_path)
    argv = ["sweep", cfg, "train.lr=0.1,1.0e+10", "train.batch_size=8,4", "rounds=3",
            "--out-dir", str(tmp_path / "out"), "--group-by", "train.batch_size"]
    assert main(argv) == 3                          # lr 1e10 diverges
    sweep = tmp_path / "out" / "small-sweep"
    names = sorted(p.name for p in (sweep / "runs").iterdir())
    assert names == ["train.lr-0.1-train.batch_size-4-s3", "train.lr-0.1-train.batch_size-8-s3",
                     "train.lr-10000000000.0-train.batch_size-4-s3",
                     "train.lr-10000000000.0-train.batch_size-8-s3"]
    with open(sweep / "sweep.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["train.lr"], r["train.batch_size"], r["status"]) for r in rows] == [
        ("0.1", "8", "completed"), ("0.1", "4", "completed"),
        ("10000000000.0", "8", "diverged"), ("10000000000.0", "4", "diverged")]
    data = json.loads((sweep / "sweep.json").read_text())
    assert data["axes"] == ["train.lr", "train.batch_size"]
    for row in data["runs"]:
        summary = json.loads((sweep / row["run_dir"] / "summary.json").read_text())
        if row["status"] == "completed":
            assert row["final_test_acc"] == summary["final_test_acc"]
        assert row["best_test_acc"] == summary["best_test_acc"]
        assert row["rounds"] == summary["rounds"]
    assert all(r["rounds"] == 3 for r in data["runs"][:2])
    assert all(r["rounds"] < 3 and r["final_test_acc"] is None for r in data["runs"][2:])
    assert rows[2]["final_test_acc"] == ""                # no final accuracy: diverged
    md = (sweep / "sweep.md").read_text()
    assert "| train.lr | train.batch_size | seed | status | final acc | best acc | rounds |" in md
    assert "splitfed sweep" in md and "--group-by train.batch_size" in md
    assert json.loads((sweep / "results.json").read_text())["group_by"] == "train.batch_size"
    capsys.readouterr()
    assert main(argv) == 3
    out = capsys.readouterr().out
    assert out.count("done earlier, skipped") == 4


def test_an_interrupted_sweep_resumes_from_the_checkpoints(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    calls = []

    class Interrupted(Exception):
        pass

    class Stopping(Checkpointer):
        def __call__(self, t, state, status):
            super().__call__(t, state, status)
            calls.append(t)
            if len(calls) == 5:                     # the second run, after round 2
                raise Interrupted

    monkeypatch.setattr(experiment, "Checkpointer", Stopping)
    with pytest.raises(Interrupted):
        run_sweep(cfg, ["train.lr=0.05,0.1,0.2"], out_dir=tmp_path, quiet=True)
    monkeypatch.undo()
    result = run_sweep(cfg, ["train.lr=0.05,0.1,0.2"], out_dir=tmp_path, quiet=True)
    assert [o.skipped for o in result.study.outcomes] == [True, False, False]
    runs = tmp_path / "small-sweep" / "runs"
    resumed = json.loads((runs / "train.lr-0.1-s3" / "summary.json").read_text())
    fresh = json.loads((runs / "train.lr-0.2-s3" / "summary.json").read_text())
    assert resumed["resumed_from"] == [2] and fresh["resumed_from"] == []
    lines = (runs / "train.lr-0.1-s3" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 2, 3]
    reference = experiment.run_experiment(
        digits_config(rounds=3, train={"batch_size": 8, "local_steps": 2,
                                       "local_epochs": None, "lr": 0.1}), write=False)
    assert result.rows[1]["final_test_acc"] == reference.final_accuracy
    assert [r["status"] for r in result.rows] == ["completed"] * 3
