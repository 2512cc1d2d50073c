"""``splitfed launch`` checks the run in the launcher before any rank starts: every
config ``splitfed run --dry-run`` refuses is refused with the same one-line error and
exit status 2, and so is what only the runtime refuses (MU-SplitFed's and GAS's
first-order options); nothing is started or written. One real launch: the config's
trackers receive rank 0's records."""

import json
import os
import subprocess
import sys

import pytest
from helpers import digits_config

from splitfed.cli import build_parser, main
from splitfed.config import load_config
from splitfed.errors import ConfigError
from splitfed.plan import build_plan
from splitfed.runtime import launch
from splitfed.runtime.session import check_supported

LIMIT_S = 240


def launch_args(*argv, options=()):
    """``splitfed launch`` parsed as the command line does (options, then the config and
    its overrides)."""
    return build_parser().parse_args(["launch", "--nproc", "2", *options, *argv])


@pytest.mark.parametrize("overrides", [
    ["participation.clients_per_round=100"],                       # the environment
    ["algorithm.name=sflv2", "algorithm.recipe=released_code",      # the algorithm's check
     "algorithm.order=iteration"],
    ["partition.num_clients=4000"],                                 # more clients than data
])
def test_launch_refuses_what_dry_run_refuses_with_the_same_error(tmp_path, overrides):
    out = f"out_dir={tmp_path / 'runs'}"
    with pytest.raises(ConfigError) as dry:
        build_plan(load_config("quick_digits", ["rounds=1", out, *overrides]))
    args = launch_args("quick_digits", "rounds=1", out, *overrides)
    with pytest.raises(ConfigError) as launched:
        launch.check_config(args)
    assert str(launched.value) == str(dry.value)
    assert not (tmp_path / "runs").exists()


def test_launch_refuses_an_out_dir_it_cannot_write(tmp_path):
    (tmp_path / "file").write_text("x")
    args = launch_args("quick_digits", f"out_dir={tmp_path / 'file'}")
    with pytest.raises(ConfigError, match="^out_dir: cannot create the run directory"):
        launch.check_config(args)


def test_a_run_dir_is_checked_instead_of_out_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    base = ["quick_digits", f"out_dir={tmp_path / 'file'}"]
    with pytest.raises(ConfigError, match=r"^run directory .*busy exists and is not empty"):
        launch.check_config(launch_args(*base, options=["--run-dir", str(busy)]))
    launch.check_config(launch_args(*base, options=["--run-dir", str(tmp_path / "new")]))
    assert not (tmp_path / "new").exists()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"^run directory .*dangling is a symbolic link to "
                                          r"a missing path"):
        launch.check_config(launch_args(*base, options=["--run-dir",
                                                        str(tmp_path / "dangling")]))
    with pytest.raises(ConfigError, match=r"^run directory .*file exists and is not a "
                                          r"directory"):
        launch.check_config(launch_args(*base, options=["--run-dir", str(tmp_path / "file")]))


@pytest.mark.parametrize("algorithm, key", [("musplitfed", "client_order"),
                                            ("musplitfed", "server_order"),
                                            ("gas", "server_order")])
def test_first_order_options_are_refused_by_the_runtime(algorithm, key):
    check_supported(digits_config(algorithm={"name": algorithm}))     # zeroth: runs
    cfg = digits_config(algorithm={"name": algorithm, key: "first"})
    with pytest.raises(ConfigError, match=rf"^algorithm\.{key}: 'first' .* does not run on "
                                          rf"the multi-process runtime .* {key} 'zeroth'"):
        check_supported(cfg)


@pytest.mark.parametrize("overrides, key", [
    (["algorithm.name=musplitfed", "algorithm.client_order=first"], "algorithm.client_order"),
    (["algorithm.name=gas", "algorithm.server_order=first"], "algorithm.server_order"),
    (["participation.clients_per_round=100"], "participation.clients_per_round"),
    (["tracking.mlflow=true", "tracking.mlflow_uri=file:///dev/null"], "tracking.mlflow_uri"),
])
def test_the_command_refuses_in_one_line_before_any_rank(tmp_path, capsys, no_ranks,
                                                         overrides, key):
    if key == "tracking.mlflow_uri":
        pytest.importorskip("mlflow")
    code = main(["launch", "quick_digits", "--nproc", "2", "rounds=1",
                 f"out_dir={tmp_path / 'runs'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"splitfed: error: {key}: "), err
    assert not (tmp_path / "runs").exists()


def test_a_launched_run_sends_its_records_to_the_trackers(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")    # this process reads it too
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_ALLOW_FILE_STORE": "true"}
    proc = subprocess.run([sys.executable, "-m", "splitfed", "launch", "quick_digits",
                           "--nproc", "2", "rounds=1", "tracking.tensorboard=true",
                           "tracking.mlflow=true", "--run-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    saved = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=saved["uri"])
    run = client.get_run(saved["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["splitfed.status"] == "completed"
    history = client.get_metric_history(saved["run_id"], "wire_up")
    assert [(m.step, m.value) for m in history] == [(r["round"], r["wire_up"])
                                                    for r in records if "wire_up" in r]
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("test_acc")] == [r["round"] for r in records
                                                         if "test_acc" in r]
    # the run records the command the user gave, not the rank's worker command line
    command = json.loads((run_dir / "summary.json").read_text())["provenance"]["command"]
    assert command.endswith(f"launch quick_digits --nproc 2 rounds=1 tracking.tensorboard="
                            f"true tracking.mlflow=true --run-dir {run_dir}"), command


def test_a_launched_run_of_no_rounds_evaluates_the_initial_model(tmp_path):
    # as splitfed run does: round 0 is evaluated and the run completes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "splitfed", "launch", "quick_digits",
                           "--nproc", "2", "--launcher", "spawn", "rounds=0",
                           "--run-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 0
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in records] == [0]


def test_status_dirs_of_launchers_that_are_gone_are_removed(tmp_path, monkeypatch):
    """A launcher killed with SIGKILL leaves its status directory; the next launch
    removes it, and leaves those of live launchers and names without a pid."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    stale = tmp_path / f"{launch.STATUS_PREFIX}{done.pid}-abc"
    live = tmp_path / f"{launch.STATUS_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{launch.STATUS_PREFIX}xyz"
    for d in (stale, live, other):
        d.mkdir()
        (d / "rank0").write_text("0\n")
    ranks, _ = launch._setup()
    try:
        assert not stale.exists() and live.exists() and other.exists()
        assert ranks.status_dir.parent == tmp_path
        assert ranks.status_dir.name.startswith(f"{launch.STATUS_PREFIX}{os.getpid()}-")
    finally:
        ranks.close()
    assert not ranks.status_dir.exists()


def test_a_launched_run_is_named_as_splitfed_run_names_it(tmp_path):
    """The run directory a launch makes carries its key=value overrides, as `splitfed
    run` names it (two launches that differ in an override used to get the same name but
    for the time)."""
    from splitfed.experiment import run_dir_name

    overrides = ["rounds=1", "train.lr=0.07", f"out_dir={tmp_path / 'runs'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "splitfed", "launch", "quick_digits",
                           "--nproc", "2", *overrides],
                          env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (made,) = (tmp_path / "runs").iterdir()
    name = run_dir_name(load_config("quick_digits", overrides), overrides)
    assert name.endswith("-lr0.07") and made.name.startswith(f"{name}-"), made.name
