"""``splitfed.results``: runs read back as rows (a DataFrame with pandas), a table per run
or per round, CSV on demand; run directory names; one metrics file per run."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys

import pytest

from splitfed.config import build_config, load_config
from splitfed.errors import ConfigError
from splitfed.experiment import resume_experiment, run_dir_name, run_experiment
from splitfed.metrics import read_records
from splitfed.results import (flatten_config, load_rows, load_runs, print_table, run_dirs,
                              summary_rows, summary_table)
from tests.helpers import digits_config

DIRICHLET = {"scheme": "dirichlet", "num_clients": 3, "alpha": 0.5}
SPLIT = {"name": "mlp", "hidden": [32], "cut": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real digits runs: two of 2 rounds and a diverged one in runs/, one in a sweep."""
    root = tmp_path_factory.mktemp("results")
    out = str(root / "runs")
    a = run_experiment(digits_config(out_dir=out, partition=DIRICHLET), overrides=["rounds=2"])
    b = run_experiment(digits_config(out_dir=out, partition=DIRICHLET, model=SPLIT,
                                     algorithm={"name": "sflv1"}),
                       overrides=["algorithm.name=sflv1", "model.cut=1"])
    c = run_experiment(digits_config(out_dir=out, rounds=5, train={
        "batch_size": 8, "local_steps": 5, "local_epochs": None, "lr": 1e10}),
        overrides=["train.lr=1.0e10"])
    d = run_experiment(digits_config(rounds=1), run_dir=root / "sweep" / "runs" / "lr-s3")
    assert (a.status, b.status, c.status, d.status) == ("completed", "completed",
                                                         "diverged", "completed")
    return root, [a, b, c, d]


# ------------------------------------------------------------------------ paths


def test_paths_run_dirs_parents_globs_and_metrics_files(runs):
    root, (a, b, c, d) = runs
    assert run_dirs(a.run_dir) == [a.run_dir]
    assert run_dirs(a.run_dir / "metrics.jsonl") == [a.run_dir]
    assert run_dirs(root / "runs") == sorted([a.run_dir, b.run_dir, c.run_dir])
    assert run_dirs(root) == sorted([a.run_dir, b.run_dir, c.run_dir, d.run_dir])
    assert run_dirs(str(root / "runs" / "t-sflv1-*")) == [b.run_dir]
    assert run_dirs([d.run_dir, str(root / "*" / "*" / "lr-*"), root / "sweep"]) == [d.run_dir]
    for bad, match in [(root / "nope", "no such run directory"),
                       (str(root / "nope-*"), "no file or directory matches"),
                       (a.run_dir / "config.yaml", "not a run directory"),
                       ([], "give at least one")]:
        with pytest.raises(ConfigError, match=match):
            run_dirs(bad)
    (root / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no run"):
        run_dirs(root / "empty")


# ---------------------------------------------------------------------- DataFrame


def test_load_runs_has_a_row_per_round_with_config_and_provenance(runs):
    pd = pytest.importorskip("pandas")
    root, results = runs
    a, b, c, _ = results
    df = load_runs(root / "runs")
    assert isinstance(df, pd.DataFrame)
    assert len(df) == sum(len(r.records) for r in (a, b, c))
    assert list(df.columns[:2]) == ["run", "round"]
    for col in ("train_loss", "test_acc", "bytes_up", "bytes_down", "sim_time_s", "status",
                "diverged_round", "algorithm.name", "train.lr", "partition.alpha",
                "model.hidden", "splitfed_version", "git_commit", "python_version",
                "torch_version", "threads", "wall_time_s", "run_dir"):
        assert col in df.columns, col
    for result in (a, b, c):
        rows = df[df["run"] == result.run_dir.name]
        assert list(rows["round"]) == [r["round"] for r in result.records]
        for key in ("test_acc", "train_loss", "bytes_up", "sim_time_s"):
            expected = [r.get(key, math.nan) for r in result.records]
            got = list(rows[key])
            assert all((math.isnan(x) and math.isnan(y)) or x == y
                       for x, y in zip(got, expected)), key
    first = df[df["run"] == a.run_dir.name].iloc[0]
    assert first["algorithm.name"] == "fedavg" and first["train.lr"] == 0.1
    assert first["partition.alpha"] == 0.5 and first["model.hidden"] == "[32]"
    assert first["status"] == "completed" and first["splitfed_version"]
    diverged = df[df["run"] == c.run_dir.name]
    assert set(diverged["status"]) == {"diverged"}
    assert set(diverged["diverged_round"]) == {c.diverged_round}
    assert math.isnan(diverged.iloc[-1]["train_loss"])             # a float NaN
    assert df[df["run"] == b.run_dir.name].iloc[0]["algorithm.name"] == "sflv1"
    last = load_runs(root, last=True)
    assert len(last) == 4 and list(last["round"]) == [
        r.records[-1]["round"] for r in sorted(results, key=lambda r: str(r.run_dir))]


def test_without_pandas_load_runs_names_the_extra(runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ConfigError) as info:
        load_runs(runs[0])
    assert str(info.value) == "load_runs needs pandas: pip install 'splitfed[data]'"
    assert len(load_rows(runs[0])) == sum(len(r.records) for r in runs[1])   # no pandas


def test_numbers_a_config_file_writes_with_an_exponent_read_back_as_numbers(runs, tmp_path):
    import shutil
    root, (a, *_) = runs
    copy = tmp_path / a.run_dir.name
    shutil.copytree(a.run_dir, copy)
    text = (copy / "config.yaml").read_text()
    assert "alpha: 0.5" in text
    (copy / "config.yaml").write_text(text.replace("alpha: 0.5", "alpha: 5e-1"))
    (row,) = load_rows(copy, last=True)
    assert row["partition.alpha"] == 0.5 and isinstance(row["partition.alpha"], float)


def test_a_run_with_no_record_yet_has_a_row_that_says_so(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (row,) = summary_rows(run)
    assert (row["run"], row["status"], row["round"], row["final_test_acc"]) == (
        "r", "unfinished", None, None)
    lines = summary_table(run).splitlines()
    assert len(lines) == 3 and lines[2].split() == [
        "r", "n/a", "unfinished", "n/a", "n/a", "n/a", "0.00", "n/a"]
    assert summary_table(run, last=False).splitlines()[2].split()[:4] == [
        "r", "n/a", "unfinished", "n/a"]


def _hand_run(tmp_path, records, status=None):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if status is not None:
        (run / "summary.json").write_text(json.dumps({"status": status}))
    return run


def test_the_initial_models_row_is_at_simulated_time_zero(tmp_path):
    """summary_rows: round 0 (the initial model, whose record has no sim_time_s) is at
    simulated time 0; later rows give the cumulative sim_time_s."""
    run = _hand_run(tmp_path, [{"round": 0, "test_acc": 0.1},
                          {"round": 1, "test_acc": 0.2, "sim_round_s": 1.5,
                           "sim_time_s": 1.5}])
    assert [r["sim_time_s"] for r in summary_rows(run, last=False)] == [0.0, 1.5]
    (tmp_path / "only").mkdir()
    only = _hand_run(tmp_path / "only", [{"round": 0, "test_acc": 0.1}])
    assert summary_rows(only)[0]["sim_time_s"] == 0.0


def test_a_run_diverged_by_its_status_has_no_best_from_its_last_round(tmp_path):
    """summary_rows (per round): best_test_acc is the best so far before the divergence;
    a run whose status says diverged with finite records diverged at its last round
    (metrics.record_summary), so that round's accuracy is not its best, per round as in
    the one-row summary."""
    run = _hand_run(tmp_path, [{"round": 0, "test_acc": 0.1}, {"round": 1, "test_acc": 0.3},
                          {"round": 2, "test_acc": 0.5}], status="diverged")
    rows = summary_rows(run, last=False)
    assert [r["best_test_acc"] for r in rows] == [0.1, 0.3, 0.3]
    (row,) = summary_rows(run)
    assert row["diverged_round"] == 2 and row["best_test_acc"] == 0.3
    assert math.isnan(row["final_test_acc"])


@pytest.mark.parametrize("acc,cell", [(1e308, "1e+308"), (-2.5e6, "-2.5e+06"),
                                      (123456.0, "123456.0000"), (5e-7, "0.0000"),
                                      (0.0, "0.0000"), (0.5, "0.5000")])
def test_a_hand_written_accuracy_takes_a_cell_of_a_few_characters(tmp_path, acc, cell):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "test_acc": acc}) + "\n")
    for last in (True, False):
        body = summary_table(run, last=last).splitlines()[2].split()
        assert body[4:6] == [cell, cell], body


def test_flatten_config_lifts_the_options_of_open_sections():
    raw = {"name": "x", "partition": {"scheme": "dirichlet", "options": {"alpha": 0.5}},
           "model": {"name": "mlp", "options": {"hidden": [64, 32]}},
           "train": {"lr": 0.1}, "algorithm": {"name": "fedavg", "options": {}}}
    assert flatten_config(raw) == {"name": "x", "partition.scheme": "dirichlet",
                                   "partition.alpha": 0.5, "model.name": "mlp",
                                   "model.hidden": [64, 32], "train.lr": 0.1,
                                   "algorithm.name": "fedavg"}


# --------------------------------------------------------------------------- tables


def test_summary_table_one_row_per_run(runs):
    root, (a, b, c, d) = runs
    text = summary_table(root / "runs")
    lines = text.splitlines()
    assert lines[0].split() == ["run", "algorithm", "status", "rounds", "final", "acc",
                                "best", "acc", "MB", "sim", "time", "(s)"]
    assert len(lines) == 2 + 3
    row = next(line for line in lines if line.startswith(a.run_dir.name)).split()
    assert row[1:4] == ["fedavg", "completed", "2"]
    assert row[4] == f"{a.final_accuracy:.4f}" and row[5] == f"{a.best_accuracy:.4f}"
    mb = sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in a.records) / 1e6
    assert row[6] == f"{mb:.2f}" and row[7] == f"{a.records[-1]['sim_time_s']:.2f}"
    row = next(line for line in lines if line.startswith(c.run_dir.name))
    assert f"diverged (round {c.diverged_round})" in row
    assert row.split()[-4:-2] == ["nan", f"{c.best_accuracy:.4f}"]
    typed = {r["run"]: r for r in summary_rows(root / "runs")}
    assert math.isnan(typed[c.run_dir.name]["final_test_acc"])
    assert typed[a.run_dir.name]["bytes"] == round(mb * 1e6)


def test_summary_table_per_round(runs):
    root, (a, *_) = runs
    lines = summary_table(a.run_dir, last=False).splitlines()
    assert lines[0].split()[3:6] == ["round", "test", "acc"]
    assert [line.split()[3] for line in lines[2:]] == ["0", "1", "2"]
    assert [line.split()[4] for line in lines[2:]] == [f"{r['test_acc']:.4f}"
                                                       for r in a.records]


def test_print_table_csv_is_every_record(runs):
    root, (a, b, c, d) = runs
    buf = io.StringIO()
    print_table(root / "runs", fmt="csv", file=buf)
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert len(rows) == sum(len(r.records) for r in (a, b, c))
    mine = [r for r in rows if r["run"] == a.run_dir.name]
    records = read_records(a.run_dir / "metrics.jsonl")
    assert [float(r["test_acc"]) for r in mine] == [x["test_acc"] for x in records]
    assert mine[0]["algorithm.name"] == "fedavg" and mine[0]["status"] == "completed"
    assert [r["train_loss"] for r in rows if r["run"] == c.run_dir.name][-1] == "nan"
    buf = io.StringIO()
    print_table(root, fmt="csv", last=True, file=buf)
    assert len(list(csv.DictReader(io.StringIO(buf.getvalue())))) == 4
    buf = io.StringIO()
    print_table(root, last=True, file=buf)
    assert buf.getvalue() == summary_table(root) + "\n"
    with pytest.raises(ConfigError, match="--format: 'xml' is not a format"):
        print_table(root, fmt="xml")


# -------------------------------------------------------------- run directory names


def test_run_dir_names_show_the_algorithm_and_the_overrides():
    quick = load_config("quick_digits")
    assert run_dir_name(quick) == "quick_digits-fedavg"
    assert run_dir_name(quick, ["train.lr=0.05", "out_dir=/tmp/x", "progress=false",
                                "rounds=5"]) == "quick_digits-fedavg-lr0.05-rounds5"
    assert run_dir_name(load_config("fedavg_fmnist"), ["partition.alpha=0.1"]) == (
        "fedavg_fmnist-alpha0.1")                      # the algorithm is in the name
    cfg = load_config("quick_digits", ["algorithm.name=sflv2"])
    assert run_dir_name(cfg, ["algorithm.name=sflv2", "model.cut=1"]) == (
        "quick_digits-sflv2-cut1")
    assert run_dir_name(quick, ["model.hidden=[64,32]", "~partition.alpha",
                                "partition.scheme=shard", "train.lr=0.1",
                                "train.lr=0.2", "tracking.mlflow=true",
                                "data.name=digits"]) == (
        "quick_digits-fedavg-hidden64_32-no_alpha-scheme_shard-lr0.2-digits")
    assert run_dir_name(quick, ["clock.mean=1", "data.mean=2", "seed=-1"]) == (
        "quick_digits-fedavg-clock.mean1-data.mean2-seed-1")   # same last part: full keys
    many = [f"algorithm.option_{i}={i * 1000}" for i in range(20)]
    name = run_dir_name(quick, many)
    assert name == run_dir_name(quick, many)                        # deterministic
    assert len(name) <= len("quick_digits-fedavg-") + 60
    assert re.fullmatch(r"[A-Za-z0-9._+-]+", name)
    assert name != run_dir_name(quick, many[:-1])                   # the hash tells apart
    odd = run_dir_name(quick, ["data.data_dir=/a b/c:d*?", "model.cut='x y'"])
    assert re.fullmatch(r"[A-Za-z0-9._+-]+", odd), odd


def test_run_experiment_names_its_directory(tmp_path):
    cfg = build_config({**_raw(tmp_path), "train": {"lr": 0.05}})
    result = run_experiment(cfg, overrides=["train.lr=0.05"])
    assert result.run_dir.parent == tmp_path
    assert re.fullmatch(r"t-fedavg-lr0\.05-\d{8}-\d{6}", result.run_dir.name)
    second = run_experiment(cfg, overrides=["train.lr=0.05"])         # the same second
    assert second.run_dir != result.run_dir


def _raw(tmp_path) -> dict:
    return {"name": "t", "rounds": 1, "progress": False, "seed": 3, "out_dir": str(tmp_path),
            "data": {"name": "digits"}, "partition": {"scheme": "iid", "num_clients": 3},
            "model": {"name": "mlp", "hidden": [16]},
            "train": {"batch_size": 8, "local_steps": 1, "local_epochs": None}}


# ------------------------------------------------------------------ one metrics file


def test_a_run_writes_no_csv_and_a_resume_removes_an_old_one(tmp_path):
    cfg = digits_config(rounds=2, checkpoint_every=1)
    result = run_experiment(cfg, run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "metrics.csv").exists()
    (tmp_path / "r" / "metrics.csv").write_text("round\n0\n")      # an earlier version's
    text = (tmp_path / "r" / "config.yaml").read_text().replace("rounds: 2", "rounds: 3")
    (tmp_path / "r" / "config.yaml").write_text(text)
    resumed = resume_experiment(tmp_path / "r")
    assert resumed.records[:3] == result.records and len(resumed.records) == 4
    assert not (tmp_path / "r" / "metrics.csv").exists()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["resumed_from"] == [2]
