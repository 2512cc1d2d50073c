"""Checkpoints and ``--resume``: an interrupted run, resumed, ends bit-identical to an
uninterrupted one (parameters, algorithm state and every metric but wall times)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import splitfed.experiment as experiment
from splitfed.checkpoint import CHECKPOINT, Checkpointer, atomic_save, load_checkpoint
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError, FormatError, RunInterrupted
from splitfed.experiment import resume_experiment, run_experiment
from splitfed.metrics import csv_text, read_records
from tests.helpers import digits_config, interrupt_round

WALL = {"round_time_s"}               # measured, not simulated: may differ
SPLIT = {"model": {"name": "mlp", "hidden": [32, 16], "cut": 1}}
#: the clock draws every round and the sampler draws a cohort: both streams must resume
MOVING = {"participation": {"mode": "uniform", "clients_per_round": 2},
          "clock": {"profile": "exponential", "mean": 1.0, "delay_mean": 0.5}}


class Interrupted(Exception):
    pass


def same(a, b, where="state") -> None:
    """``a`` and ``b`` are equal bit for bit, through nested dicts, lists and tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.nn.Module):
        same(a.state_dict(), b.state_dict(), where)
    elif isinstance(a, torch.optim.Optimizer):
        same(a.state_dict(), b.state_dict(), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in WALL} for line in lines]


def csv_rows(run_dir: Path) -> list[list[str]]:
    """The records as the CSV ``splitfed results --format csv`` gives (metrics.csv is no
    longer written by every run), less the measured round time."""
    text = csv_text(read_records(run_dir / "metrics.jsonl"))
    rows = [line.split(",") for line in text.splitlines()]
    drop = rows[0].index("round_time_s")
    return [r[:drop] + r[drop + 1:] for r in rows]


def interrupt_after(monkeypatch, stop: int) -> None:
    """The next run raises after logging (and maybe checkpointing) round ``stop``."""

    class Stopping(Checkpointer):
        def __call__(self, t, state, status):
            super().__call__(t, state, status)
            if t == stop:
                raise Interrupted

    monkeypatch.setattr(experiment, "Checkpointer", Stopping)


def check_resume(tmp_path, monkeypatch, cfg, stop: int) -> None:
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    assert full.status == "completed"
    cut = tmp_path / "cut"
    interrupt_after(monkeypatch, stop)
    with pytest.raises(Interrupted):
        run_experiment(cfg, run_dir=cut)
    monkeypatch.undo()
    assert not (cut / "summary.json").exists()
    expect_round = (stop // cfg.checkpoint_every) * cfg.checkpoint_every
    ckpt = load_checkpoint(cut)
    assert (ckpt["round"] if ckpt else 0) == expect_round
    assert len(records(cut)) == stop + 1          # records past the checkpoint are redone
    resumed = resume_experiment(cut)
    assert resumed.status == "completed"
    same(full.state, resumed.state)
    same(load_checkpoint(tmp_path / "full")["state"], load_checkpoint(cut)["state"])
    assert records(cut) == records(tmp_path / "full")
    assert csv_rows(cut) == csv_rows(tmp_path / "full")
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["resumed_from"] == ([expect_round] if expect_round else [])
    ref = json.loads((tmp_path / "full" / "summary.json").read_text())
    for key in ("rounds", "final_test_acc", "best_test_acc"):
        assert summary[key] == ref[key]


@pytest.mark.parametrize("name,over,stop", [
    ("fedavg", MOVING, 3),
    ("scaffold", MOVING, 4),            # per-client controls, after a checkpoint exactly
    ("fedopt", {}, 3),                  # the server's Adam moments
    ("sl", {**SPLIT, **MOVING}, 3),     # update order, server optimizer, clock lanes
    ("sflv2", {**SPLIT, **MOVING, "train": {"batch_size": 8, "local_steps": 2,
                                          "local_epochs": None, "lr": 0.1,
                                          "momentum": 0.9}}, 5),
    ("centralized", {}, 3),             # the state is a module and its optimizer
    ("musplitfed", {**SPLIT, **MOVING}, 3),  # zeroth-order directions from the streams
    ("gas", {**SPLIT, **MOVING}, 3),    # asynchronous serving, activation statistics
    ("sflv1", {**SPLIT, **MOVING, "train": {"batch_size": 8, "local_steps": 4,
                                          "local_epochs": None, "lr": 0.1,
                                          "momentum": 0.9}}, 3),
    ("csefsl", {**SPLIT, **MOVING}, 5),   # auxiliary heads, the random serving order
    ("fedprox", MOVING, 3),
    ("fedlora", MOVING, 3),               # the adapters drawn from their own stream
])
def test_resume_is_bit_identical(tmp_path, monkeypatch, name, over, stop):
    cfg = digits_config(algorithm={"name": name}, rounds=6, checkpoint_every=2, **over)
    check_resume(tmp_path, monkeypatch, cfg, stop)


def test_dropout_is_seeded_and_resumes_bit_identically(tmp_path, monkeypatch):
    """Dropout draws from torch's default generator: the run seeds it from its seed and
    the checkpoint carries it."""
    cfg = digits_config(rounds=6, checkpoint_every=2,
                        model={"name": "alexnet", "dropout": 0.5, "width": 0.125})
    torch.manual_seed(1)                    # whatever the process drew before
    first = run_experiment(cfg, write=False)
    torch.manual_seed(2)
    second = run_experiment(cfg, write=False)
    assert first.records[-1]["train_loss"] == second.records[-1]["train_loss"]
    check_resume(tmp_path, monkeypatch, cfg, 3)


def test_a_checkpoint_that_carries_the_default_generator_still_resumes(tmp_path,
                                                                        monkeypatch):
    """An earlier version saved torch's default generator (streams.torch["global"]);
    the rounds now seed it themselves, so the saved state is not used."""
    cfg = digits_config(rounds=4, checkpoint_every=2,
                        model={"name": "alexnet", "dropout": 0.5, "width": 0.125})
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    interrupt_after(monkeypatch, 3)
    with pytest.raises(Interrupted):
        run_experiment(cfg, run_dir=tmp_path / "cut")
    monkeypatch.undo()
    path = tmp_path / "cut" / CHECKPOINT
    raw = torch.load(path, weights_only=True)
    raw["streams"]["torch"]["global"] = torch.Generator().manual_seed(5).get_state()
    torch.save(raw, path)
    assert "global" in load_checkpoint(tmp_path / "cut")["streams"]["torch"]
    same(full.state, resume_experiment(tmp_path / "cut").state)


def test_interrupt_before_the_first_checkpoint_restarts_from_round_zero(tmp_path,
                                                                        monkeypatch):
    cfg = digits_config(rounds=4, checkpoint_every=3)
    check_resume(tmp_path, monkeypatch, cfg, 2)


def test_checkpoint_holds_the_whole_run_state(tmp_path):
    cfg = digits_config(algorithm={"name": "scaffold"}, rounds=3, checkpoint_every=2, **MOVING)
    result = run_experiment(cfg, run_dir=tmp_path / "r")
    ckpt = load_checkpoint(tmp_path / "r")
    assert ckpt["round"] == 3 and ckpt["status"] == "completed"
    assert ckpt["records"] == 4                           # rounds 0..3
    assert set(ckpt["state"]) == {"model", "scaffold"}
    assert set(ckpt["state"]["scaffold"]) == {"control", "client_controls"}
    assert all(c.shape[0] == 3 for c in ckpt["state"]["scaffold"]["client_controls"].values())
    assert {"participation", "batches", "clock"} <= set(ckpt["streams"]["numpy"])
    assert ckpt["clock"]["now"] == result.records[-1]["sim_time_s"]
    assert ckpt["ledger"]["rounds"].keys() == {1, 2, 3}
    same(result.state, ckpt["state"])


def test_checkpoints_are_written_every_k_rounds_and_at_the_end(tmp_path, monkeypatch):
    import splitfed.checkpoint as ck

    saved, orig = [], ck.atomic_save
    monkeypatch.setattr(ck, "atomic_save", lambda obj, path: (saved.append(obj["round"]),
                                                              orig(obj, path)))
    run_experiment(digits_config(rounds=7, checkpoint_every=3), run_dir=tmp_path / "a")
    assert saved == [3, 6, 7]
    saved.clear()
    run_experiment(digits_config(rounds=7, checkpoint_every=0), run_dir=tmp_path / "b")
    assert saved == [] and not (tmp_path / "b" / CHECKPOINT).exists()


def test_diverged_run_is_checkpointed_and_not_rerun(tmp_path):
    cfg = digits_config(rounds=6, checkpoint_every=4, train={
        "batch_size": 8, "local_steps": 5, "local_epochs": None, "lr": 1e10})
    first = run_experiment(cfg, run_dir=tmp_path / "d")
    assert first.status == "diverged"
    stopped = first.records[-1]["round"]
    assert load_checkpoint(tmp_path / "d")["round"] == stopped
    again = resume_experiment(tmp_path / "d")
    assert again.status == "diverged" and again.records == first.records


def test_resuming_a_finished_run_leaves_its_summary_as_it_was(tmp_path):
    """Its provenance (which code made the run, what a study's reuse check reads) and
    wall time stay; a missing summary is written again without a provenance, which a
    study treats as another code version (the run is rerun, not reused)."""
    from splitfed.study.reuse import run_dir_state
    from splitfed.study.spec import StudyRun

    d = tmp_path / "d"
    study_run = StudyRun("r", 3, digits_config(rounds=2), d)
    run_experiment(digits_config(rounds=2), run_dir=d)
    summary = json.loads((d / "summary.json").read_text())
    summary["provenance"]["splitfed"] = "0.0.1"              # made by other code
    (d / "summary.json").write_text(json.dumps(summary))
    before = (d / "summary.json").read_bytes()
    again = resume_experiment(d)
    assert again.status == "completed" and (d / "summary.json").read_bytes() == before
    assert run_dir_state(study_run).state == "stale"
    (d / "summary.json").unlink()
    resume_experiment(d)
    rewritten = json.loads((d / "summary.json").read_text())
    assert rewritten["status"] == "completed" and rewritten["provenance"] is None
    assert run_dir_state(study_run).state == "stale"


@pytest.mark.parametrize("lr", [0.1, 1e10])
def test_a_finished_run_without_checkpoints_is_not_run_again(tmp_path, lr):
    """checkpoint_every 0: the run's summary and records say that it ended (at its last
    round, or where it diverged), so a resume returns its result from them and changes
    no file; raising its rounds, or a summary that is gone, runs it again from round 0
    (there is no checkpoint to go on from)."""
    train = {"batch_size": 8, "local_steps": 5, "local_epochs": None, "lr": lr}
    d = tmp_path / "d"
    first = run_experiment(digits_config(rounds=3, checkpoint_every=0, train=train),
                           run_dir=d)
    assert first.status == ("completed" if lr == 0.1 else "diverged")
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}
    again = resume_experiment(d)
    assert again.status == first.status and again.records == first.records
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()} == files
    if lr == 0.1:
        dump_yaml(digits_config(rounds=4, checkpoint_every=0, train=train), d / "config.yaml")
        longer = resume_experiment(d)
        assert [r["round"] for r in longer.records] == [0, 1, 2, 3, 4]
        assert [r.get("train_loss") for r in longer.records[:4]] == [
            r.get("train_loss") for r in first.records]        # the same run, again
    (d / "summary.json").unlink()
    rerun = resume_experiment(d)
    assert (d / "summary.json").is_file() and rerun.status == first.status


@pytest.mark.parametrize("status", ["no_client_trained", "diverged"])
def test_a_finished_run_without_checkpoints_whose_records_contradict_its_status_runs_again(
        tmp_path, status):
    """checkpoint_every 0: a summary whose status the records contradict (clients
    trained, no non-finite value) is no finished run's; a resume runs it again from
    round 0 and writes the status the run has."""
    d = tmp_path / "d"
    first = run_experiment(digits_config(rounds=2, checkpoint_every=0), run_dir=d)
    assert first.status == "completed"
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**summary, "status": status}))
    again = resume_experiment(d)
    assert again.status == "completed" and again.state        # trained, not read back
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"
    assert [r.get("train_loss") for r in again.records] == [
        r.get("train_loss") for r in first.records]


def test_a_huge_summary_is_not_read_into_memory(tmp_path):
    """A summary.json larger than any run writes (a sparse file here) is damaged: a
    resume of the finished run writes it again, and a study's reuse check refuses it,
    naming the file, neither reading more than the bound."""
    import tracemalloc

    from splitfed.study.reuse import read_json, read_summary

    d = tmp_path / "d"
    run_experiment(digits_config(rounds=2), run_dir=d)
    summary = json.loads((d / "summary.json").read_text())
    with open(d / "summary.json", "r+b") as fh:      # the same object, then 64 MiB of
        fh.seek(1 << 26)                             # holes: never read whole
        fh.write(b" ")
    tracemalloc.start()
    try:
        assert read_json(d / "summary.json") == {}
        with pytest.raises(FormatError, match=r"summary\.json: .* bytes, more than the "
                                              r"\d+ allowed; the finished run in .* is "
                                              "damaged"):
            read_summary(d)
        assert resume_experiment(d).status == "completed"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * (1 << 24), peak                # MAX_SUMMARY_BYTES: 16 MiB
    rewritten = json.loads((d / "summary.json").read_text())
    assert rewritten["provenance"] is None
    assert {k: v for k, v in rewritten.items() if k not in ("provenance", "wall_time_s")} \
        == {k: v for k, v in summary.items() if k not in ("provenance", "wall_time_s")}


def test_a_deleted_partition_file_is_written_again_on_resume(tmp_path):
    d = tmp_path / "d"
    run_experiment(digits_config(rounds=3, checkpoint_every=1), run_dir=d)
    expected = (d / "partition.txt").read_text()
    assert expected.strip()
    (d / "partition.txt").unlink()
    resume_experiment(d)                                # a finished run
    assert (d / "partition.txt").read_text() == expected
    (d / "partition.txt").unlink()
    (d / CHECKPOINT).unlink()                           # no checkpoint and no summary:
    (d / "summary.json").unlink()                       # from round 0
    resume_experiment(d)
    assert (d / "partition.txt").read_text() == expected


def test_lowering_rounds_of_a_run_is_refused_without_calling_its_checkpoint_bad(tmp_path):
    d = tmp_path / "d"
    run_experiment(digits_config(rounds=4, checkpoint_every=2), run_dir=d)
    dump_yaml(digits_config(rounds=3, checkpoint_every=2), d / "config.yaml")
    with pytest.raises(ConfigError) as err:
        resume_experiment(d)
    assert str(err.value) == (f"{d / CHECKPOINT}: the run has reached round 4, after "
                              "config.yaml's rounds 3; a run's rounds may only be raised (set "
                              "rounds to 4 or more to keep the run)")
    dump_yaml(digits_config(rounds=4, checkpoint_every=2), d / "config.yaml")
    assert resume_experiment(d).status == "completed"


def _stopped(run_dir: Path, monkeypatch, stop: int, **over) -> Path:
    cfg = digits_config(rounds=6, **over)
    with monkeypatch.context() as m:
        interrupt_round(m, "fedavg", stop)
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, run_dir=run_dir)
    return run_dir


def test_lowering_rounds_to_an_unevaluated_checkpoint_round_is_refused(tmp_path,
                                                                        monkeypatch):
    """Checkpoint after round 2 of 6, evaluated every 3 rounds: round 2 was never
    evaluated, so ending the run there would report round 0's accuracy."""
    over = {"checkpoint_every": 2, "eval_every": 3}
    d = _stopped(tmp_path / "d", monkeypatch, 4, **over)
    assert load_checkpoint(d)["round"] == 2 and "test_acc" not in records(d)[2]
    dump_yaml(digits_config(rounds=2, **over), d / "config.yaml")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(ConfigError) as err:
        resume_experiment(d)
    assert str(err.value) == (
        f"{d / CHECKPOINT}: config.yaml's rounds 2 end the run at the round its checkpoint "
        "was written after, which was not evaluated (it was not the run's last round); a "
        "run's rounds may only be raised (set rounds to 3 or more to keep the run)")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    dump_yaml(digits_config(rounds=3, **over), d / "config.yaml")
    resumed = resume_experiment(d)
    run_experiment(digits_config(rounds=3, **over), run_dir=tmp_path / "fresh")
    assert resumed.status == "completed"
    assert records(d) == records(tmp_path / "fresh")


def test_lowering_rounds_to_an_evaluated_checkpoint_round_ends_the_run(tmp_path,
                                                                       monkeypatch):
    over = {"checkpoint_every": 3, "eval_every": 3}
    d = _stopped(tmp_path / "d", monkeypatch, 5, **over)
    assert load_checkpoint(d)["round"] == 3
    dump_yaml(digits_config(rounds=3, **over), d / "config.yaml")
    resumed = resume_experiment(d)
    assert resumed.status == "completed"
    assert records(d)[-1]["round"] == 3
    assert resumed.final_accuracy == records(d)[-1]["test_acc"]


def test_resume_extends_a_finished_run_when_rounds_grow(tmp_path):
    run_experiment(digits_config(rounds=5, checkpoint_every=2), run_dir=tmp_path / "full")
    short = tmp_path / "short"
    run_experiment(digits_config(rounds=3, checkpoint_every=2), run_dir=short)
    dump_yaml(digits_config(rounds=5, checkpoint_every=2), short / "config.yaml")
    resume_experiment(short)
    assert records(short) == records(tmp_path / "full")


def test_atomic_save_leaves_the_old_checkpoint_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT
    atomic_save({"format": 1, "round": 1}, path)

    def broken(obj, fh):
        fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        atomic_save({"format": 1, "round": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False)["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]


def test_resume_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml"):
        resume_experiment(tmp_path)
    run_dir = tmp_path / "r"
    run_experiment(digits_config(rounds=2, checkpoint_every=1), run_dir=run_dir)
    (run_dir / CHECKPOINT).write_bytes(b"torn")
    with pytest.raises(FormatError, match="checkpoint.pt: not a splitfed data file.*delete it"):
        resume_experiment(run_dir)


def test_sigkill_at_a_random_round_then_resume(tmp_path, capsys):
    """A real ``splitfed run`` process killed with SIGKILL at a seeded random round, then
    ``splitfed run --resume``: the same final parameters and metrics as one run."""
    rounds = 20
    raw = {"name": "k", "rounds": rounds, "seed": 5, "progress": False,
           "checkpoint_every": 3, "out_dir": str(tmp_path),
           "algorithm": {"name": "scaffold"}, "data": {"name": "digits"},
           "partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5},
           "model": {"name": "mlp", "hidden": [64]},
           "train": {"batch_size": 16, "local_steps": 8, "local_epochs": None, "lr": 0.05},
           **MOVING}
    cfg_path = tmp_path / "k.yaml"
    cfg_path.write_text(json.dumps(raw))
    from splitfed.cli import main
    from splitfed.config import load_config

    full = run_experiment(load_config(cfg_path), run_dir=tmp_path / "full")
    kill_at = int(np.random.default_rng(2024).integers(3, 12))
    run_dir = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "splitfed.cli", "run", str(cfg_path)]
    proc = subprocess.Popen(cmd + [f"out_dir={run_dir}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(run_dir.glob("k-*/metrics.jsonl"))
            if found and len(found[0].read_text().splitlines()) > kill_at:
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    (killed,) = run_dir.glob("k-*")
    assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed"
    assert not (killed / "summary.json").exists()
    assert load_checkpoint(killed)["round"] < rounds
    assert main(["run", "--resume", str(killed)]) == 0
    assert "status completed" in capsys.readouterr().out
    same(full.state, load_checkpoint(killed)["state"])
    assert records(killed) == records(tmp_path / "full")
    assert csv_rows(killed) == csv_rows(tmp_path / "full")
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "completed" and len(summary["resumed_from"]) == 1


def test_cli_resume_arguments(tmp_path, capsys):
    from splitfed.cli import main

    assert main(["run"]) == 2
    assert "give a CONFIG" in capsys.readouterr().err
    assert main(["run", "quick_digits", "--resume", str(tmp_path)]) == 2
    assert "give no CONFIG or key=value" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    run_dir = tmp_path / "r"
    run_experiment(digits_config(rounds=2, checkpoint_every=1), run_dir=run_dir)
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert "status completed" in capsys.readouterr().out


@pytest.mark.parametrize("name,over", [
    ("fedprox", {}), ("scaffold_plus", {}), ("fedlora", {}), ("sflv1", SPLIT),
    ("csefsl", SPLIT), ("clgsgd", SPLIT), ("fedclg_c", SPLIT), ("fedclg_s", SPLIT),
    ("server_only", SPLIT),
])
def test_every_algorithm_resumes_bit_identically(tmp_path, monkeypatch, name, over):
    """The saved state must fit the state ``init_state`` builds (checked on resume) for
    every algorithm, not only the ones above."""
    cfg = digits_config(algorithm={"name": name}, rounds=3, checkpoint_every=2, **over,
                        **MOVING)
    check_resume(tmp_path, monkeypatch, cfg, 2)


@pytest.mark.parametrize("name", ["server_only", "clgsgd", "fedclg_c", "fedclg_s",
                                  "scaffold_plus"])
def test_server_momentum_resumes_bit_identically(tmp_path, monkeypatch, name):
    """With momentum the server's state gains its momentum buffers after the first
    round; the checkpoint of such a run is this run's (checkpoint_template)."""
    cfg = digits_config(algorithm={"name": name}, rounds=3, checkpoint_every=2,
                        train={"momentum": 0.5}, **MOVING)
    check_resume(tmp_path, monkeypatch, cfg, 2)


def test_ctrl_c_leaves_a_resumable_run(tmp_path, monkeypatch):
    cfg = digits_config(algorithm={"name": "scaffold"}, rounds=6, checkpoint_every=2,
                        **MOVING)
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    cut = tmp_path / "cut"
    interrupt_round(monkeypatch, "scaffold", 5)
    with pytest.raises(RunInterrupted) as info:
        run_experiment(cfg, run_dir=cut)
    monkeypatch.undo()
    assert info.value.run_dir == cut
    assert f"splitfed run --resume {cut}" in str(info.value)
    assert load_checkpoint(cut)["round"] == 4
    assert sorted(p.name for p in cut.iterdir()) == [
        CHECKPOINT, "config.yaml", "metrics.jsonl", "partition.txt"]
    assert [r["round"] for r in records(cut)] == [0, 1, 2, 3, 4]
    resumed = resume_experiment(cut)
    same(full.state, resumed.state)
    assert records(cut) == records(tmp_path / "full")
    assert json.loads((cut / "summary.json").read_text())["resumed_from"] == [4]


def test_ctrl_c_while_a_checkpoint_is_written_keeps_the_previous_one(tmp_path,
                                                                     monkeypatch):
    import splitfed.safeio as safeio

    cfg = digits_config(rounds=6, checkpoint_every=2, **MOVING)
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    cut, original = tmp_path / "cut", safeio.save

    def save(obj, fh):
        if obj["round"] == 4:
            fh.write(b"PK\x03\x04 half a checkpoint")
            raise KeyboardInterrupt
        original(obj, fh)

    monkeypatch.setattr(safeio, "save", save)
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, run_dir=cut)
    monkeypatch.undo()
    assert load_checkpoint(cut)["round"] == 2
    assert not [p for p in cut.iterdir() if p.name.endswith(".tmp")]
    resumed = resume_experiment(cut)
    same(full.state, resumed.state)
    assert records(cut) == records(tmp_path / "full")


def test_ctrl_c_before_the_first_round_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "build_environment", interrupted)
    with pytest.raises(RunInterrupted) as info:
        run_experiment(digits_config(), run_dir=tmp_path / "r")
    assert info.value.run_dir is None and not (tmp_path / "r").exists()


def test_ctrl_c_during_a_resume_leaves_it_resumable(tmp_path, monkeypatch):
    cfg = digits_config(rounds=6, checkpoint_every=2)
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    cut = tmp_path / "cut"
    interrupt_round(monkeypatch, "fedavg", 3)
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, run_dir=cut)
    monkeypatch.undo()
    interrupt_round(monkeypatch, "fedavg", 5)
    with pytest.raises(RunInterrupted) as info:
        resume_experiment(cut)
    monkeypatch.undo()
    assert info.value.run_dir == cut and load_checkpoint(cut)["round"] == 4
    resumed = resume_experiment(cut)
    same(full.state, resumed.state)
    assert records(cut) == records(tmp_path / "full")
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from"] == [2, 4] and len(summary["resumed_threads"]) == 2


def test_the_thread_count_is_recorded_and_a_change_is_reported(tmp_path, monkeypatch,
                                                               capsys):
    cfg = digits_config(rounds=4, checkpoint_every=2)
    run_dir = tmp_path / "r"
    interrupt_round(monkeypatch, "fedavg", 3)
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, run_dir=run_dir)
    monkeypatch.undo()
    threads = torch.get_num_threads()
    ckpt = load_checkpoint(run_dir)
    assert ckpt["threads"] == threads and ckpt["cpu_capability"]
    capsys.readouterr()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 3)
    resume_experiment(run_dir)
    err = capsys.readouterr().err
    assert (f"resumed with {threads + 3} threads, the run was started with {threads}: "
            "results will differ from an uninterrupted run in the last bits") in err
    warnings = [line for line in err.splitlines() if line.startswith("splitfed: ")]
    assert len(warnings) == 1                   # (the others: a line per evaluated round)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["threads"] == threads and summary["resumed_threads"] == [threads + 3]
    assert summary["cpu_capability"] == ckpt["cpu_capability"]


def test_resuming_with_the_same_threads_says_nothing(tmp_path, monkeypatch, capsys):
    cfg = digits_config(rounds=4, checkpoint_every=2)
    interrupt_round(monkeypatch, "fedavg", 3)
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, run_dir=tmp_path / "r")
    monkeypatch.undo()
    capsys.readouterr()
    resume_experiment(tmp_path / "r")
    assert "warning" not in capsys.readouterr().err


def test_restored_tensors_go_where_the_run_keeps_them():
    # read onto the CPU, a GPU run's state goes back to the template's device, or to the
    # run's device where the template has none (here the meta device stands in for a GPU)
    from splitfed.checkpoint import _live

    meta = torch.device("meta")
    saved = {"model": {"w": torch.ones(2)}, "stats": {"m": torch.ones(3)},
             "buffer": {"h": [torch.ones(1), torch.ones(1)], "n": 2}, "steps": 4}
    template = {"model": {"w": torch.zeros(2, device=meta)}, "stats": {"m": torch.zeros(3)},
                "buffer": None, "steps": 0}
    live = _live(saved, template, meta)
    assert live["model"]["w"].device == meta              # the template's device
    assert live["stats"]["m"].device.type == "cpu"        # state the run keeps on the CPU
    assert all(h.device == meta for h in live["buffer"]["h"]) and live["buffer"]["n"] == 2
    assert live["steps"] == 4
    cpu = _live(saved, {**template, "model": {"w": torch.zeros(2)}}, torch.device("cpu"))
    assert cpu["model"]["w"] is saved["model"]["w"]       # on the CPU: no copy
