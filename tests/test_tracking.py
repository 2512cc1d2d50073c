"""Trackers (``tracking:`` in the config): TensorBoard event files and an MLflow run
receive every record of a real run; read back with the packages' own readers, they equal
``metrics.jsonl``. A missing package is a config error before anything is written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import splitfed.tracking as tracking
from splitfed.cli import main
from splitfed.config import build_config
from splitfed.errors import ConfigError, RunInterrupted
from splitfed.experiment import resume_experiment, run_experiment
from splitfed.metrics import read_records
from splitfed.tracking import mlflow_key, numeric
from tests.helpers import digits_config, interrupt_round

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

BOTH = {"tensorboard": True, "mlflow": True}


@pytest.fixture(autouse=True)
def file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3: the file store


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def mlflow_run(run_dir):
    saved = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=saved["uri"])
    return client, client.get_run(saved["run_id"])


def expected(records) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for r in records:
        for key, value in numeric(r).items():
            out.setdefault(key, []).append((r["round"], value))
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_tensorboard_and_mlflow_receive_every_record(tmp_path):
    cfg = digits_config(rounds=3, tracking=BOTH, partition={
        "scheme": "dirichlet", "num_clients": 3, "alpha": 0.5})
    result = run_experiment(cfg, run_dir=tmp_path / "r")
    run_dir = result.run_dir
    records = read_records(run_dir / "metrics.jsonl")
    want = expected(records)
    assert {"train_loss", "test_acc", "bytes_up", "bytes_up/model", "sim_time_s"} <= set(want)
    # TensorBoard keeps float32
    got = tensorboard_scalars(run_dir)
    assert set(got) == set(want)
    for key, points in want.items():
        assert [s for s, _ in got[key]] == [s for s, _ in points], key
        assert all(same(v, float(np.float32(w))) for (_, v), (_, w) in zip(got[key], points))
    # MLflow keeps float64: equal
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    for key, points in want.items():
        history = sorted(client.get_metric_history(run.info.run_id, mlflow_key(key)),
                         key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == points, key
    params = run.data.params
    assert params["train.lr"] == "0.1" and params["partition.alpha"] == "0.5"
    assert params["algorithm.name"] == "fedavg" and params["model.hidden"] == "[32]"
    assert params["rounds"] == "3" and params["tracking.mlflow"] == "True"
    tags = run.data.tags
    summary = json.loads((run_dir / "summary.json").read_text())
    assert tags["splitfed.version"] == summary["provenance"]["splitfed"]
    assert tags["splitfed.status"] == "completed"
    if summary["provenance"]["commit"]:
        assert tags["mlflow.source.git.commit"] == summary["provenance"]["commit"]
    assert run.data.metrics["test_acc"] == records[-1]["test_acc"]


def test_a_diverged_run_is_a_failed_mlflow_run_with_its_nan(tmp_path):
    cfg = digits_config(rounds=5, tracking=BOTH, train={
        "batch_size": 8, "local_steps": 5, "local_epochs": None, "lr": 1e10})
    result = run_experiment(cfg, run_dir=tmp_path / "r")
    assert result.status == "diverged"
    client, run = mlflow_run(result.run_dir)
    assert run.info.status == "FAILED"
    assert run.data.tags["splitfed.status"] == "diverged"
    assert run.data.tags["splitfed.diverged_round"] == str(result.diverged_round)
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history][-1] == result.diverged_round
    assert not math.isfinite(history[-1].value)
    scalars = tensorboard_scalars(result.run_dir)["train_loss"]
    assert scalars[-1][0] == result.diverged_round and not math.isfinite(scalars[-1][1])


def test_an_interrupted_run_closes_its_trackers_and_a_resume_continues_them(tmp_path,
                                                                             monkeypatch):
    cfg = digits_config(rounds=4, checkpoint_every=2, tracking=BOTH)
    run_dir = tmp_path / "r"
    interrupt_round(monkeypatch, "fedavg", 4)              # after rounds 1-3 were logged
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, run_dir=run_dir)
    monkeypatch.undo()
    client, run = mlflow_run(run_dir)
    assert run.info.status == "KILLED" and run.data.tags["splitfed.status"] == "interrupted"
    assert [s for s, _ in tensorboard_scalars(run_dir)["train_loss"]] == [1, 2, 3]
    first_id = run.info.run_id
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    result = resume_experiment(run_dir)                     # from the checkpoint of round 2
    assert result.status == "completed"
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == first_id and run.info.status == "FINISHED"
    records = read_records(run_dir / "metrics.jsonl")
    got = tensorboard_scalars(run_dir)                      # round 3 once: purged, rerun
    for key, points in expected(records).items():
        assert [s for s, _ in got[key]] == [s for s, _ in points], key
    # MLflow cannot delete: round 3 was logged twice, with the same numbers
    history = client.get_metric_history(run.info.run_id, "test_acc")
    assert sorted({m.step for m in history}) == [0, 1, 2, 3, 4]
    by_step = {m.step: m.value for m in history}
    assert all(by_step[r["round"]] == r["test_acc"] for r in records)


def test_a_run_resumed_before_its_first_checkpoint_keeps_one_mlflow_run(tmp_path,
                                                                         monkeypatch):
    cfg = digits_config(rounds=3, checkpoint_every=10,
                        tracking={"mlflow": True, "mlflow_uri": (tmp_path / "s").as_uri()})
    run_dir = tmp_path / "r"
    interrupt_round(monkeypatch, "fedavg", 2)               # no checkpoint yet
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, run_dir=run_dir)
    monkeypatch.undo()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _, first = mlflow_run(run_dir)
    assert resume_experiment(run_dir).status == "completed"   # again from round 0
    client, run = mlflow_run(run_dir)
    assert run.info.run_id != first.info.run_id and run.info.status == "FINISHED"
    experiment = client.get_experiment_by_name(cfg.name).experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment])] == [run.info.run_id]
    assert client.get_run(first.info.run_id).info.lifecycle_stage == "deleted"
    history = client.get_metric_history(run.info.run_id, "test_acc")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]


def test_a_sweep_that_runs_an_interrupted_run_again_keeps_one_mlflow_run(tmp_path,
                                                                         monkeypatch):
    from splitfed.configtools import dump_yaml
    from splitfed.sweep import run_sweep

    uri = (tmp_path / "store").as_uri()
    cfg = str(tmp_path / "lab.yaml")
    dump_yaml(digits_config(rounds=3, checkpoint_every=10, tracking={
        "mlflow": True, "mlflow_uri": uri, "experiment": "lab"}), cfg)
    grid = ["train.lr=0.1,0.2"]
    interrupt_round(monkeypatch, "fedavg", 2)       # the first run, before a checkpoint
    with pytest.raises(RunInterrupted):
        run_sweep(cfg, grid, out_dir=tmp_path / "out", quiet=True, jobs=1)
    monkeypatch.undo()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lab").experiment_id
    (first,) = client.search_runs([experiment])
    assert first.info.status == "KILLED"
    run_sweep(cfg, grid, out_dir=tmp_path / "out", quiet=True, jobs=1)
    runs = client.search_runs([experiment])               # the new ones only
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert first.info.run_id not in {r.info.run_id for r in runs}
    assert client.get_run(first.info.run_id).info.lifecycle_stage == "deleted"


def test_a_shared_mlflow_store_and_experiment(tmp_path):
    uri = (tmp_path / "store").as_uri()
    for lr in (0.1, 0.2):
        cfg = digits_config(rounds=1, train={"batch_size": 8, "local_steps": 1,
                                             "local_epochs": None, "lr": lr},
                            tracking={"mlflow": True, "mlflow_uri": uri, "experiment": "lab"})
        run_experiment(cfg, run_dir=tmp_path / f"lr{lr}")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lab")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["train.lr"] for r in runs) == ["0.1", "0.2"]
    assert not (tmp_path / "lr0.1" / "mlruns").exists()


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def broken(self, step, values):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tracking.TensorBoardSink, "_log", broken)
    result = run_experiment(digits_config(rounds=2, tracking={"tensorboard": True}),
                            run_dir=tmp_path / "r")
    assert result.status == "completed"
    warnings = [x for x in capsys.readouterr().err.splitlines()
                if x.startswith("splitfed: warning: tensorboard:")]
    assert len(warnings) == 1 and "No space left" in warnings[0]


@pytest.mark.parametrize("key, extra", [("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_a_missing_package_is_a_config_error_before_anything_is_written(
        tmp_path, monkeypatch, capsys, key, extra):
    monkeypatch.setattr(tracking, "_installed", lambda module: module != key)
    with pytest.raises(ConfigError) as info:
        build_config({"tracking": {key: True}})
    assert str(info.value) == (f"tracking: {key}=true needs the {key} package, which is "
                               f"not installed: pip install 'splitfed[{extra}]'")
    code = main(["run", "quick_digits", f"out_dir={tmp_path / 'runs'}", f"tracking.{key}=true"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"pip install 'splitfed[{extra}]'" in err
    assert not (tmp_path / "runs").exists()
    build_config({"tracking": {key: False}})                # off: nothing is needed


def test_tracking_keys_are_checked():
    with pytest.raises(ConfigError, match="tracking.mlflow_uri"):
        build_config({"tracking": {"mlflow_uri": 3}})
    with pytest.raises(ConfigError, match="tracking: experiment: ' ' is empty"):
        build_config({"tracking": {"experiment": " "}})
    with pytest.raises(ConfigError, match="unknown key 'tracking.wandb'"):
        build_config({"tracking": {"wandb": True}})


def test_trackers_get_a_records_numbers_only():
    """What a tracker logs of a record: its ints and floats as floats; not the round (the
    step), not flags (``True`` is no metric), not text."""
    from splitfed.tracking import numeric

    record = {"round": 3, "test_acc": 0.5, "bytes_up": 12, "stopped": True, "note": "x"}
    assert numeric(record) == {"test_acc": 0.5, "bytes_up": 12.0}
