"""``splitfed sweep``: axes from the command line, deterministic run directories, the
summary table, skipping finished runs and resuming interrupted ones."""

from __future__ import annotations

import csv
import json
import re

import pytest

import splitfed.experiment as experiment
from splitfed.checkpoint import Checkpointer
from splitfed.cli import main
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError, RunInterrupted
from splitfed.study import RunsFailed
from splitfed.sweep import default_name, parse_axes, run_sweep
from tests.helpers import digits_config


def test_parse_axes_reads_yaml_values_split_at_top_level_commas():
    axes, over = parse_axes(["train.lr=0.01,0.1", "model.hidden=[64,32],[128]",
                             "rounds=5", "model.options.depth=[8,4]",
                             "algorithm.name=fedavg,sl", "partition.alpha=0.1,inf"])
    assert axes == {"train.lr": [0.01, 0.1], "model.hidden": [[64, 32], [128]],
                    "algorithm.name": ["fedavg", "sl"], "partition.alpha": [0.1, "inf"]}
    assert over == ["rounds=5", "model.options.depth=[8,4]"]


@pytest.mark.parametrize("items,match", [
    (["train.lr"], "must look like key.sub=v1,v2"),
    (["=1,2"], "must look like"),
    (["train..lr=1,2"], "must look like"),
    (["train.lr="], "gives no value"),
    (["train.lr=0.1,0.2", "train.lr=0.3,0.4"], "'train.lr' is given twice"),
    (["train.lr=0.1,0.2", "train.lr=0.3"], "'train.lr' is given twice"),
    # a section written as a mapping sets the keys inside it: the same error
    (["train.lr=0.1,0.2", "train={lr: 0.3}"], "^sweep: 'train.lr' is given twice; give all "
                                              "its values at once, train.lr=v1,v2,...$"),
    (["train={lr: 0.3, batch_size: 4}", "train.lr=0.1,0.2"], "'train.lr' is given twice"),
    (["train.lr=0.3", "train={lr: 0.4}"], "'train.lr' is given twice"),
    (["train={lr: 0.1},{lr: 0.2}", "train.lr=0.3"], "'train.lr' is given twice"),
    (["train.lr=0.1,0.1"], "repeats a value: the number 0.1 is given twice"),
    (["train.lr=0.1,1e-1"], "repeats a value: the number 0.1 is given twice"),
    (["partition.alpha=1,1.0"], "the number 1 and the number 1.0 are the same number"),
    (["partition.alpha=inf,.inf"], "the text 'inf' and the number inf read the same"),
    (["train.lr=[0.1,"], "cannot parse"),
    (["train.lr=0.1,0.2", "train={lr: 0.3},{lr: 0.4}"],
     "the axes 'train.lr' and 'train' set the same value"),
    (["algorithm.options.mu=0.1,0.2", "algorithm.mu=0.3,0.4"],
     "the axes 'algorithm.options.mu' and 'algorithm.mu' set the same value"),
    ([f"x{i}.y=1,2" for i in range(65)], "sweep: 65 keys, more than the 64 a grid may have"),
    # an option spelled flat and under its section's options is one key
    (["algorithm.mu=0.1,0.2", "algorithm.options.mu=0.3"],
     "^sweep: 'algorithm.options.mu' is given twice"),
    (["algorithm.options.mu=0.3", "algorithm.mu=0.1,0.2"], "'algorithm.mu' is given twice"),
    (["algorithm.mu=0.3", "algorithm={options: {mu: 0.4}}"],
     "'algorithm.options.mu' is given twice"),
    (["partition.options={alpha: 0.1},{alpha: 0.5}", "partition.alpha=0.3"],
     "'partition.alpha' is given twice"),
])
def test_parse_axes_errors_name_the_item(items, match):
    with pytest.raises(ConfigError, match=match):
        parse_axes(items)


def test_a_section_override_beside_an_axis_of_other_keys_is_kept():
    axes, over = parse_axes(["train.lr=0.1,0.2", "train={batch_size: 4}", "rounds=2"])
    assert axes == {"train.lr": [0.1, 0.2]}
    assert over == ["train={batch_size: 4}", "rounds=2"]
    axes, over = parse_axes(["train={lr: 0.1},{lr: 0.2}", "train.batch_size=4"])
    assert axes == {"train": [{"lr": 0.1}, {"lr": 0.2}]} and over == ["train.batch_size=4"]


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
    for row, csv_row in zip(data["runs"], rows):
        records = [json.loads(x) for x in (sweep / row["run_dir"] / "metrics.jsonl")
                   .read_text().splitlines()]
        summary = json.loads((sweep / row["run_dir"] / "summary.json").read_text())
        assert row["bytes_up"] == sum(r.get("bytes_up", 0) for r in records) > 0
        assert row["bytes_down"] == sum(r.get("bytes_down", 0) for r in records) > 0
        assert row["sim_time_s"] == records[-1]["sim_time_s"] > 0
        assert row["diverged_round"] == summary["diverged_round"]
        assert row["splitfed"] == summary["provenance"]["splitfed"] and not row["stale"]
        assert csv_row["bytes_up"] == str(row["bytes_up"])
        assert float(csv_row["sim_time_s"]) == row["sim_time_s"]
    assert [r["diverged_round"] is None for r in data["runs"]] == [True, True, False, False]
    assert list(rows[0])[:2] == ["train.lr", "train.batch_size"]
    for column in ("bytes_up", "bytes_down", "sim_time_s", "diverged_round", "splitfed",
                   "commit"):
        assert column in rows[0], column
    assert data["provenance"]["splitfed"] == data["runs"][0]["splitfed"]
    md = (sweep / "sweep.md").read_text()
    assert "| train.lr | train.batch_size | seed | status | final acc | best acc | rounds |" in md
    assert "| MB up | MB down | sim. time (s) |" in md
    assert md.count("| diverged | diverged at round ") == 2 and "n/a" not in md
    assert "Provenance: splitfed " in md
    assert "splitfed sweep" in md and "--group-by train.batch_size" in md
    assert json.loads((sweep / "results.json").read_text())["group_by"] == "train.batch_size"
    capsys.readouterr()
    assert main(argv) == 3
    out = capsys.readouterr().out
    assert out.count("done earlier, skipped") == 4


def test_a_sweep_over_rounds_keeps_the_swept_value_beside_the_rounds_run(tmp_path):
    cfg = _config(tmp_path)
    argv = ["sweep", cfg, "rounds=1,2", "train.lr=1.0e+10", "--out-dir",
            str(tmp_path / "out"), "--jobs", "1"]
    assert main(argv) == 3                          # both diverge in round 1
    sweep = tmp_path / "out" / "small-sweep"
    with open(sweep / "sweep.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["swept.rounds"], r["rounds"], r["status"]) for r in rows] == [
        ("1", "1", "diverged"), ("2", "1", "diverged")]
    runs = json.loads((sweep / "sweep.json").read_text())["runs"]
    assert [(r["swept.rounds"], r["rounds"]) for r in runs] == [(1, 1), (2, 1)]
    table = [line.split(" | ") for line in (sweep / "sweep.md").read_text().splitlines()
             if line.startswith("| ")]
    rounds = table[0].index("rounds")
    assert table[0][0] == "| swept.rounds"
    assert [(r[0], r[rounds]) for r in table[1:]] == [("| 1", "1"), ("| 2", "1")]


def test_an_interrupted_sweep_resumes_from_the_checkpoints(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    calls = []

    class Stopping(Checkpointer):
        def __call__(self, t, state, status):
            super().__call__(t, state, status)
            calls.append(t)
            if len(calls) == 5:                     # the second run, after round 2
                raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "Checkpointer", Stopping)
    with pytest.raises(RunInterrupted):             # in this process: jobs=1
        run_sweep(cfg, ["train.lr=0.05,0.1,0.2"], out_dir=tmp_path, quiet=True, jobs=1)
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


# ------------------------------------------- everything validated first, one writer

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import splitfed.study as study_mod  # noqa: E402
from splitfed.errors import FormatError  # noqa: E402
from splitfed.locking import LOCK_NAME, DirLock  # noqa: E402


def _forbid_runs(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a run was started")
    monkeypatch.setattr(study_mod, "run_experiment", fail)
    monkeypatch.setattr(study_mod, "resume_experiment", fail)


@pytest.mark.parametrize("axes, point, match", [
    (["partition.num_clients=2,3,5000"], "partition.num_clients=5000",
     "5000 clients for the"),                                # impossible for the data
    (["algorithm.name=sflv1", "model.hidden=[16],[8],[]"], "model.hidden=[]",
     "no valid cut"),                                        # fails when the model is built
    (["model.cut=1,fc1,2"], "model.cut=2", "not valid for mlp"),
])
def test_a_sweep_whose_third_point_is_invalid_writes_nothing(tmp_path, monkeypatch, capsys,
                                                              axes, point, match):
    _forbid_runs(monkeypatch)
    cfg = _config(tmp_path)
    code = main(["sweep", cfg, *axes, "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"run '{point}'" in err and re.search(match, err), err
    assert not (tmp_path / "out").exists()


def test_a_damaged_finished_run_stops_the_sweep_before_anything_runs(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    run_sweep(cfg, ["train.lr=0.05,0.1", "checkpoint_every=0"], out_dir=tmp_path, quiet=True)
    metrics = tmp_path / "small-sweep" / "runs" / "train.lr-0.1-s3" / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-20])                       # torn
    _forbid_runs(monkeypatch)
    with pytest.raises(FormatError, match=r"metrics.jsonl: line 4 is not a JSON record.*"
                                          r"delete that directory to run it again"):
        run_sweep(cfg, ["train.lr=0.05,0.1,0.2", "checkpoint_every=0"], out_dir=tmp_path,
                  quiet=True)
    assert not (tmp_path / "small-sweep" / "runs" / "train.lr-0.2-s3").exists()


def test_a_result_path_that_is_a_directory_is_refused_before_running(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    (tmp_path / "small-sweep" / "sweep.csv").mkdir(parents=True)
    _forbid_runs(monkeypatch)
    with pytest.raises(ConfigError, match="sweep.csv exists and is not a file"):
        run_sweep(cfg, ["train.lr=0.05,0.1"], out_dir=tmp_path, quiet=True)


def test_a_locked_sweep_directory_is_refused(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    _forbid_runs(monkeypatch)
    with DirLock.acquire(tmp_path / "small-sweep", "sweep directory"):
        with pytest.raises(ConfigError, match=(
                f"sweep directory {tmp_path}/small-sweep is in use by another splitfed "
                rf"process \(pid {os.getpid()}\); wait for it or choose another "
                "--name/--out-dir")):
            run_sweep(cfg, ["train.lr=0.05,0.1"], out_dir=tmp_path, quiet=True)
    assert not (tmp_path / "small-sweep" / LOCK_NAME).exists()


def test_a_failing_point_names_the_run_and_finished_points_are_kept(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    real = study_mod.run_experiment

    def second_fails(config, **kwargs):
        if config.train.lr == 0.1:
            raise ConfigError("algorithm: something impossible at round 2")
        return real(config, **kwargs)

    monkeypatch.setattr(study_mod, "run_experiment", second_fails)
    items = ["train.lr=0.05,0.1", "checkpoint_every=0"]
    with pytest.raises(RunsFailed, match=r"^1 of 2 runs failed; .*\n  run 'train.lr=0.1' "
                                         r"\(seed 3\): algorithm: something impossible"):
        run_sweep(cfg, items, out_dir=tmp_path, quiet=True, jobs=1)   # in this process
    assert not (tmp_path / "small-sweep" / "sweep.md").exists()
    monkeypatch.undo()
    result = run_sweep(cfg, items, out_dir=tmp_path, quiet=True)
    assert [o.skipped for o in result.study.outcomes] == [True, False]


# ------------------------------------------------------------- real processes

SLOW = ("name: s\nseed: 0\nrounds: 20\nprogress: false\ncheckpoint_every: 10\n"
        "eval_every: 1000\ndata: {name: synthetic}\nmodel: {name: mlp}\n"
        "partition: {scheme: natural, num_clients: 30}\n"
        "participation: {mode: uniform, clients_per_round: 3}\n"
        "train: {batch_size: 8, local_steps: 1, lr: 0.05}\n")


def _splitfed(argv, cwd):
    binary = Path(sys.executable).with_name("splitfed")
    cmd = [str(binary)] if binary.is_file() else [sys.executable, "-m", "splitfed"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.Popen(cmd + argv, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _rounds(run_dir):
    return [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text()
            .splitlines()]


def test_ctrl_c_during_a_sweep_then_the_same_command_finishes_it(tmp_path, monkeypatch):
    # 200 rounds: the sweep goes on for seconds after the first checkpoint (round 10), so
    # that Ctrl-C sent when it appears reaches a running sweep on a loaded machine too
    (tmp_path / "slow.yaml").write_text(SLOW.replace("rounds: 20", "rounds: 200"))
    argv = ["sweep", "slow.yaml", "train.lr=0.05,0.1", "--out-dir", "out"]
    runs = tmp_path / "out" / "slow-sweep" / "runs"
    proc = _splitfed(argv, tmp_path)
    deadline = time.monotonic() + 60
    while not any(runs.glob("*/checkpoint.pt")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    *progress, last = err.splitlines()          # runs print a line per evaluated round
    assert all(line.startswith("train.lr-") and ": round " in line for line in progress), err
    assert last == ("splitfed: interrupted; finished runs are kept, continue the sweep by "
                    "running the same command again: splitfed sweep slow.yaml "
                    "train.lr=0.05,0.1 --out-dir out")
    assert not (tmp_path / "out" / "slow-sweep" / LOCK_NAME).exists()
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0                                  # the same command finishes it
    data = json.loads((tmp_path / "out" / "slow-sweep" / "sweep.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["completed", "completed"]
    for row in data["runs"]:
        assert _rounds(tmp_path / "out" / "slow-sweep" / row["run_dir"]) == list(range(201))


def test_two_sweeps_on_one_directory_one_is_refused(tmp_path):
    (tmp_path / "slow.yaml").write_text(SLOW.replace("checkpoint_every: 10",
                                                     "checkpoint_every: 0"))
    argv = ["sweep", "slow.yaml", "train.lr=0.05,0.1", "--out-dir", "out"]
    procs = [_splitfed(argv, tmp_path) for _ in range(2)]
    results = [(p.pid, p.returncode, out, err) for p in procs
               for out, err in [p.communicate(timeout=120)]]
    codes = sorted(r[1] for r in results)
    assert codes == [0, 2], results
    (winner,) = [r for r in results if r[1] == 0]
    (loser,) = [r for r in results if r[1] == 2]
    assert loser[2] == "" and loser[3].count("\n") == 1, loser
    assert re.fullmatch(r"splitfed: error: sweep directory out/slow-sweep is in use by another "
                        rf"splitfed process( \(pid {winner[0]}\))?; wait for it or choose "
                        r"another --name/--out-dir\n", loser[3]), loser[3]
    sweep = tmp_path / "out" / "slow-sweep"
    for run_dir in (sweep / "runs").iterdir():
        assert _rounds(run_dir) == list(range(21))                # no duplicate record
    assert len(json.loads((sweep / "sweep.json").read_text())["runs"]) == 2


def test_a_sweep_reruns_a_point_recorded_by_other_code_or_keeps_it_marked(tmp_path,
                                                                          monkeypatch, capsys):
    cfg = _config(tmp_path)
    items = ["train.lr=0.05,0.1", "checkpoint_every=0"]
    run_sweep(cfg, items, out_dir=tmp_path, quiet=True)
    summary_path = tmp_path / "small-sweep" / "runs" / "train.lr-0.1-s3" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["provenance"]["splitfed"] = "0.0.1"
    summary_path.write_text(json.dumps(summary))
    capsys.readouterr()
    result = run_sweep(cfg, items, out_dir=tmp_path, keep_stale=True)
    out = capsys.readouterr().out
    assert "train.lr=0.1 (seed 3): completed (done earlier, skipped) [stale: recorded with " \
           "splitfed 0.0.1" in out and "rerunning" not in out
    assert [o.skipped for o in result.study.outcomes] == [True, True]
    sweep = tmp_path / "small-sweep"
    with open(sweep / "sweep.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["stale"] == "" and rows[1]["stale"].startswith("recorded with splitfed 0.0.1")
    assert rows[1]["splitfed"] == "0.0.1"
    md = (sweep / "sweep.md").read_text()
    assert "| completed (stale) |" in md and "- runs/train.lr-0.1-s3: stale, recorded" in md
    assert "--keep-stale" in md
    calls = []
    real = study_mod.run_experiment

    def counting(config, **kwargs):
        calls.append(config.train.lr)
        return real(config, **kwargs)

    monkeypatch.setattr(study_mod, "run_experiment", counting)
    result = run_sweep(cfg, items, out_dir=tmp_path)        # the default: rerun it
    out = capsys.readouterr().out
    assert calls == [0.1]
    assert out.startswith("[2/2] train.lr=0.1 (seed 3): stale: recorded with splitfed 0.0.1")
    assert "; rerunning\n" in out
    assert [o.skipped for o in result.study.outcomes] == [True, False]
    assert json.loads(summary_path.read_text())["provenance"]["splitfed"] != "0.0.1"
    assert all(r["stale"] is None for r in result.rows)


def test_a_sweep_publishes_its_tables_not_its_runs(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_sweep(cfg, ["train.lr=0.05,0.1", "rounds=1", "checkpoint_every=0"],
              publish_to="published", quiet=True)
    assert (tmp_path / "runs" / "sweeps" / "small-sweep" / "runs").is_dir()
    published = tmp_path / "published" / "small-sweep"
    assert sorted(p.name for p in published.iterdir()) == [
        "accuracy_vs_bytes.png", "accuracy_vs_round.png", "results.json", "results.md",
        "study.yaml", "sweep.csv", "sweep.json", "sweep.md"]


def test_sweep_axes_may_come_after_its_options(tmp_path, capsys):
    """``splitfed sweep CONFIG a=1 --jobs 1 b=x,y`` takes b as an axis, as ``run`` takes
    overrides after its options; an unknown option is still refused."""
    from splitfed.cli import main

    out = tmp_path / "sw"
    assert main(["sweep", "quick_digits", "rounds=1", "checkpoint_every=0", "--jobs", "1",
                 "train.lr=0.1,0.2", "--out-dir", str(out)]) == 0
    table = (out / "quick_digits-sweep" / "sweep.md").read_text()
    assert "| 0.1 |" in table and "| 0.2 |" in table, table
    capsys.readouterr()
    assert main(["sweep", "quick_digits", "rounds=1", "--jobs", "1", "train.lr=0.1,0.2",
                 "--bogus", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments:" in err and "--bogus" in err


def test_a_seed_axis_has_one_seed_column(tmp_path):
    from splitfed.cli import main

    out = tmp_path / "sw"
    assert main(["sweep", "quick_digits", "rounds=1", "checkpoint_every=0",
                 "train.lr=0.1,0.2", "seed=0,1", "--out-dir", str(out)]) == 0
    sweep = out / "quick_digits-sweep"
    with open(sweep / "sweep.csv", newline="") as fh:
        header = next(csv.reader(fh))
    assert header.count("seed") == 1 and header[:2] == ["train.lr", "seed"], header
    with open(sweep / "sweep.csv", newline="") as fh:
        assert sorted((r["train.lr"], r["seed"]) for r in csv.DictReader(fh)) == [
            ("0.1", "0"), ("0.1", "1"), ("0.2", "0"), ("0.2", "1")]
    head = (sweep / "sweep.md").read_text().split("\n| ", 1)[1].split("\n")[0]
    assert head.count("seed") == 1 and head.startswith("train.lr | seed | status"), head


def test_an_empty_sweep_name_is_refused(tmp_path, capsys):
    from splitfed.cli import main

    assert main(["sweep", "quick_digits", "train.lr=0.1,0.2", "--name", "",
                 "--out-dir", str(tmp_path / "sw")]) == 2
    assert "--name is empty" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


def test_a_sweep_reruns_points_whose_plugin_code_changed(tmp_path, monkeypatch, capsys):
    """A plugin's files are part of the code version of a run: after a fix to the
    plugin, the finished points are rerun, not reused."""
    module = f"plug_{abs(hash(str(tmp_path))) % 10**8}"
    source = tmp_path / f"{module}.py"
    source.write_text("from splitfed import register_partitioner\n"
                      "from splitfed.data.partition import iid\n\n"
                      f"register_partitioner('{module}_iid', iid)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _config(tmp_path)
    items = ["train.lr=0.05,0.1", "checkpoint_every=0"]
    run_sweep(cfg, items, out_dir=tmp_path, quiet=True, plugins=[module])
    summary = json.loads((tmp_path / "small-sweep" / "runs" / "train.lr-0.1-s3"
                          / "summary.json").read_text())
    assert set(summary["provenance"]["plugins"]) >= {module}
    capsys.readouterr()
    again = run_sweep(cfg, items, out_dir=tmp_path, plugins=[module])
    assert [o.skipped for o in again.study.outcomes] == [True, True]
    source.write_text(source.read_text() + "# a fix\n")
    capsys.readouterr()
    fixed = run_sweep(cfg, items, out_dir=tmp_path, plugins=[module])
    out = capsys.readouterr().out
    assert [o.skipped for o in fixed.study.outcomes] == [False, False]
    assert f"the code of plugin {module} changed since the run was recorded" in out


def test_a_rerun_replaces_links_in_the_sweep_directory_never_their_targets(tmp_path):
    argv = ["sweep", _config(tmp_path), "train.lr=0.1,0.2", "rounds=1",
            "--out-dir", str(tmp_path / "out")]
    assert main(argv) == 0
    sweep = tmp_path / "out" / "small-sweep"
    for name in ("sweep.md", "sweep.csv", "sweep.json"):
        (tmp_path / f"victim-{name}").write_text("keep")
        (sweep / name).unlink()
        (sweep / name).symlink_to(tmp_path / f"victim-{name}")
    assert main(argv) == 0                              # the run is reused
    for name in ("sweep.md", "sweep.csv", "sweep.json"):
        assert (tmp_path / f"victim-{name}").read_text() == "keep", name
        assert (sweep / name).is_file() and not (sweep / name).is_symlink(), name
    assert json.loads((sweep / "sweep.json").read_text())["axes"] == ["train.lr"]


def test_an_axis_of_sections_sets_only_the_keys_every_value_sets():
    """``train={lr: .., momentum: ..},...`` sets ``train.lr`` in every run but
    ``train.momentum`` only where a value gives it: an override of ``train.momentum``
    still reaches the run whose value leaves it out, so it is kept; one of
    ``train.lr`` would reach no run, so it is refused."""
    axis = "train={lr: 0.1, momentum: 0.9},{lr: 0.2, momentum: 0.8},{lr: 0.3}"
    axes, over = parse_axes([axis, "train.momentum=0.5"])
    assert len(axes["train"]) == 3 and over == ["train.momentum=0.5"]
    with pytest.raises(ConfigError, match="'train.lr' is given twice"):
        parse_axes([axis, "train.lr=0.5"])
