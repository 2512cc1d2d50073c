"""No checkpoint can execute code, a damaged one is refused before anything changes, and
a run directory has one writer.

A crafted ``checkpoint.pt`` whose unpickling would create a marker file is planted in
real run directories and reached through every entry point that loads checkpoints:
``splitfed run --resume`` (in-process and the installed binary), the auto-resume of
sweeps and studies, and ``splitfed launch --resume``; each refuses it with one line
naming the file, and the marker never appears.
"""

from __future__ import annotations

import builtins
import copy
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import splitfed.checkpoint as checkpoint
from splitfed import safeio
from splitfed.checkpoint import CHECKPOINT, FORMAT, load_checkpoint
from splitfed.cli import main
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError, FormatError, RunInterrupted, SplitfedError
from splitfed.experiment import lock_run_dir, resume_experiment, run_experiment
from splitfed.locking import LOCK_NAME, holder
from splitfed.study import run_study, study_from_mapping
from splitfed.sweep import run_sweep
from tests.helpers import copy_run, digits_config, interrupt_round

BIN = Path(sys.executable).parent / "splitfed"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ExecPayload(Payload):
    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


def plant(run_dir: Path, marker: Path, how: str = "zip") -> None:
    """A malicious checkpoint.pt that looks like one: the keys of a checkpoint, with a
    payload where the algorithm state goes."""
    cls = ExecPayload if how == "exec" else Payload
    obj = {"format": FORMAT, "round": 2, "records": 3, "status": "completed",
           "state": {"model": cls(marker)}}
    path = run_dir / CHECKPOINT
    if how == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    elif how == "pickle":
        path.write_bytes(pickle.dumps(obj))
    else:
        torch.save(obj, path)


def interrupted_run(run_dir: Path, monkeypatch, **over) -> Path:
    """A run of 6 rounds interrupted in round 4, checkpointed at round 2."""
    cfg = digits_config(rounds=6, checkpoint_every=2, **over)
    with monkeypatch.context() as m:
        interrupt_round(m, cfg.algorithm.name, 4)
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, run_dir=run_dir)
    assert load_checkpoint(run_dir)["round"] == 2
    return run_dir


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """An interrupted run (checkpoint at round 2, records of rounds 0..3) to copy."""
    root = tmp_path_factory.mktemp("stopped")
    mp = pytest.MonkeyPatch()
    try:
        return interrupted_run(root / "run", mp)
    finally:
        mp.undo()


# ------------------------------------------------------------------ the payload


@pytest.mark.parametrize("how", ["zip", "legacy", "pickle", "exec"])
def test_load_checkpoint_never_runs_the_payload(tmp_path, how):
    marker = tmp_path / "MARKER"
    plant(tmp_path, marker, how)
    with pytest.raises(FormatError) as info:
        load_checkpoint(tmp_path)
    msg = one_line(str(info.value))
    assert str(tmp_path / CHECKPOINT) in msg and "not a splitfed data file" in msg
    assert ("refused unread" if how in ("zip", "exec") else "not a zip archive") in msg
    assert "delete it to rerun the run from the start" in msg
    assert not marker.exists()


def test_the_payload_would_run_under_a_plain_load(tmp_path):
    """The payload is real: the loader that checkpoints used before runs it."""
    marker = tmp_path / "MARKER"
    plant(tmp_path, marker, "exec")
    torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert marker.exists()


def test_run_resume_refuses_the_payload(tmp_path, stopped, capsys):
    run_dir = copy_run(stopped, tmp_path / "run")
    marker = tmp_path / "MARKER"
    plant(run_dir, marker)
    before = snapshot(run_dir)
    capsys.readouterr()
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("splitfed: error: ") and str(run_dir / CHECKPOINT) in err
    assert not marker.exists()
    assert snapshot(run_dir) == before                 # nothing cut, nothing written


def test_the_splitfed_binary_refuses_the_payload(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    marker = tmp_path / "MARKER"
    plant(run_dir, marker, "legacy")
    before = snapshot(run_dir)
    proc = subprocess.run([str(BIN), "run", "--resume", str(run_dir)], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = one_line(proc.stderr)
    assert str(run_dir / CHECKPOINT) in err and "not a zip archive" in err
    assert not marker.exists() and snapshot(run_dir) == before


def _sweep_config(tmp_path) -> str:
    path = tmp_path / "small.yaml"
    dump_yaml(digits_config(rounds=4, checkpoint_every=2), path)
    return str(path)


def test_sweep_auto_resume_refuses_the_payload(tmp_path, monkeypatch, capsys):
    cfg = _sweep_config(tmp_path)
    axes = ["train.lr=0.05,0.1"]
    interrupt_round(monkeypatch, "fedavg", 3)
    with pytest.raises(RunInterrupted):                # Ctrl-C in the first run
        run_sweep(cfg, axes, out_dir=tmp_path, quiet=True, jobs=1)   # in this process
    monkeypatch.undo()
    run_dir = tmp_path / "small-sweep" / "runs" / "train.lr-0.05-s3"
    assert load_checkpoint(run_dir)["round"] == 2
    marker = tmp_path / "MARKER"
    plant(run_dir, marker)
    before = snapshot(run_dir)
    with pytest.raises(SplitfedError, match="checkpoint.pt: not a splitfed data file"):
        run_sweep(cfg, axes, out_dir=tmp_path, quiet=True)
    assert not marker.exists() and snapshot(run_dir) == before
    other = tmp_path / "small-sweep" / "runs" / "train.lr-0.1-s3" / "summary.json"
    assert json.loads(other.read_text())["status"] == "completed"   # not stopped by it
    capsys.readouterr()
    assert main(["sweep", cfg, *axes, "--out-dir", str(tmp_path)]) == 2
    head, line = capsys.readouterr().err.strip().splitlines()   # the failed run's line
    assert head.startswith("splitfed: error: 1 of 2 runs failed")
    assert line.startswith("  run 'train.lr=0.05' (seed 3): ") and str(run_dir / CHECKPOINT) in line
    assert not marker.exists() and snapshot(run_dir) == before


def test_sweep_refuses_a_planted_run_of_another_config(tmp_path, stopped):
    cfg = _sweep_config(tmp_path)
    run_dir = copy_run(stopped, tmp_path / "small-sweep" / "runs" / "train.lr-0.05-s3")
    marker = tmp_path / "MARKER"
    plant(run_dir, marker)                             # rounds 6 here, 4 in the sweep
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="holds a run of a different config .differs at "
                                          ".*rounds"):
        run_sweep(cfg, ["train.lr=0.05,0.1"], out_dir=tmp_path, quiet=True)
    assert not marker.exists() and snapshot(run_dir) == before


STUDY_BASE = {"name": "tiny", "seed": 0, "rounds": 4, "checkpoint_every": 2,
              "data": {"name": "digits"},
              "partition": {"scheme": "iid", "num_clients": 3},
              "model": {"name": "mlp", "hidden": [16]},
              "train": {"batch_size": 16, "local_steps": 2, "lr": 0.1},
              "participation": {"mode": "full"}}


def _study(tmp_path) -> dict:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(STUDY_BASE))
    return {"name": "st", "base": str(tmp_path / "base.yaml"),
            "runs": [{"label": "FL", "set": ["algorithm.name=fedavg"]},
                     {"label": "SL", "set": ["algorithm.name=sl", "model.cut=1",
                                             "model.hidden=[16,16]"]}],
            "out_dir": str(tmp_path / "out")}


def test_study_auto_resume_refuses_the_payload(tmp_path, monkeypatch):
    spec = _study(tmp_path)
    run_dir = study_from_mapping(spec).runs[0].run_dir
    interrupt_round(monkeypatch, "fedavg", 3)
    with pytest.raises(RunInterrupted):
        run_study(spec, quiet=True, jobs=1)                # in this process
    monkeypatch.undo()
    assert load_checkpoint(run_dir)["round"] == 2
    marker = tmp_path / "MARKER"
    plant(run_dir, marker, "exec")
    before = snapshot(run_dir)
    with pytest.raises(SplitfedError) as info:
        run_study(spec, quiet=True)
    head, msg = str(info.value).splitlines()              # a line for the failed run
    assert head.startswith("1 of 2 runs failed") and msg.startswith("  run 'FL' (seed 0): ")
    assert str(run_dir / CHECKPOINT) in msg and "refused unread" in msg
    assert not marker.exists() and snapshot(run_dir) == before


def test_study_resumes_a_planted_stale_run_of_its_config(tmp_path, monkeypatch):
    """A stale run directory of the study's own config (planted by hand) is resumed."""
    spec = _study(tmp_path)
    run = study_from_mapping(spec).runs[0]
    with monkeypatch.context() as m:
        interrupt_round(m, "fedavg", 3)
        with pytest.raises(RunInterrupted):
            run_experiment(run.config, run_dir=run.run_dir)
    assert load_checkpoint(run.run_dir)["round"] == 2
    result = run_study(spec, quiet=True)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == [2] and result.completed


def test_study_refuses_a_planted_run_of_another_config(tmp_path, stopped):
    """A run directory whose config.yaml differs is neither resumed nor loaded."""
    spec = _study(tmp_path)
    run_dir = study_from_mapping(spec).runs[0].run_dir
    copy_run(stopped, run_dir)                         # digits_config: other partition
    marker = tmp_path / "MARKER"
    plant(run_dir, marker)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="holds a run of a different config"):
        run_study(spec, quiet=True)
    assert not marker.exists() and snapshot(run_dir) == before
    # the same with a sound checkpoint of the other config: refused, not resumed
    (run_dir / CHECKPOINT).write_bytes((stopped / CHECKPOINT).read_bytes())
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="holds a run of a different config"):
        run_study(spec, quiet=True)
    assert snapshot(run_dir) == before


def test_launch_resume_refuses_the_payload(tmp_path, stopped):
    """``splitfed launch --resume``: rank 0 loads the checkpoint (the multi-process
    runtime); it is refused there and every rank stops."""
    run_dir = copy_run(stopped, tmp_path / "run")
    marker = tmp_path / "MARKER"
    plant(run_dir, marker)
    before = snapshot(run_dir)
    proc = subprocess.run([str(BIN), "launch", "--resume", str(run_dir), "--nproc", "2",
                           "--launcher", "spawn"], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert f"{run_dir / CHECKPOINT}: not a splitfed data file" in proc.stderr
    assert "refused unread" in proc.stderr
    assert not marker.exists() and snapshot(run_dir) == before


# ------------------------------------------------------------------ damaged files


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _old_format(path: Path) -> None:
    """What splitfed wrote before: a pickle with numpy arrays in it (format 1)."""
    torch.save({"format": 1, "round": 2, "records": 3, "status": "completed",
                "clock": {"profiles": {"compute": np.ones(3)}}}, path,
               pickle_protocol=2)


def _foreign_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("notes.txt", "not a checkpoint")


def _flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10                       # inside a tensor's bytes
    path.write_bytes(bytes(data))


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _laughs(path: Path) -> None:
    """A few kilobytes that refer to one list 10^8 times (the "billion laughs")."""
    enc = safeio.encode(safeio.load(path))
    nested = [0.0] * 100
    for _ in range(3):
        nested = [nested] * 100
    enc["state"]["laughs"] = nested
    torch.save(enc, path)


def _shared_bytes(path: Path) -> None:
    """Many stored arrays made from one reference to the same bytes."""
    enc = safeio.encode(safeio.load(path))
    raw = bytes(1 << 16)
    enc["state"]["arrays"] = [{safeio.TAG: ["|u1", [1 << 16], raw]} for _ in range(64)]
    torch.save(enc, path)


def _deflated(path: Path) -> None:
    """The same archive with its members compressed (torch.save stores them)."""
    with zipfile.ZipFile(path) as z:
        members = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in members:
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)


def _repeated_member(path: Path) -> None:
    """The zip directory lists the largest member 2,000 more times (each entry would be
    read for its CRC check: hours for a file of a few hundred megabytes)."""
    with zipfile.ZipFile(path) as z:
        members = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in members:
            z.writestr(info, data)
        big = max(z.filelist, key=lambda i: i.file_size)
        z.filelist.extend(copy.copy(big) for _ in range(2000))


BROKEN = {
    "directory": (lambda p: (p.unlink(), p.mkdir()), "is a directory"),
    "fifo": (lambda p: (p.unlink(), _fifo(p)), "not a regular file"),
    "broken link": (lambda p: (p.unlink(), p.symlink_to(p.parent / "gone")),
                    "not a regular file"),
    "empty": (lambda p: p.write_bytes(b""), "the file is empty"),
    "truncated": (_truncated, "a damaged zip archive"),
    "a flipped bit": (_flipped, "fails its CRC check"),
    "a bare pickle": (lambda p: p.write_bytes(pickle.dumps({"format": 2})), "not a zip archive"),
    "random bytes": (lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)),
                     "not a splitfed data file"),
    "foreign zip": (_foreign_zip, "not a splitfed data file"),
    "old format": (_old_format, "earlier splitfed"),
    "plain format 1": (lambda p: safeio.save({"format": 1, "round": 2}, p),
                       "a checkpoint of format 1"),
    "a tensor": (lambda p: torch.save(torch.zeros(3), p), "holds a Tensor"),
    "a list": (lambda p: torch.save([1, 2], p), "holds a list"),
    "a dict": (lambda p: torch.save({"weights": torch.zeros(2)}, p), "no format number"),
    "shared lists": (_laughs, "a container is referred to more than once"),
    "shared array bytes": (_shared_bytes, "bytes are referred to more than once"),
    "deflated members": (_deflated, "is compressed, which torch.save never writes"),
    "a member listed many times": (_repeated_member, "lists members that share their bytes"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_damaged_checkpoint_is_refused_before_anything_changes(tmp_path, stopped, kind,
                                                                 capsys):
    run_dir = copy_run(stopped, tmp_path / "run")
    make, what = BROKEN[kind]
    make(run_dir / CHECKPOINT)
    before = snapshot(run_dir)
    with pytest.raises(FormatError) as info:
        resume_experiment(run_dir)
    msg = one_line(str(info.value))
    assert str(run_dir / CHECKPOINT) in msg and what in msg, msg
    assert "delete" in msg or "remove it" in msg
    assert snapshot(run_dir) == before
    assert main(["run", "--resume", str(run_dir)]) == 2
    assert one_line(capsys.readouterr().err).endswith(msg)


def test_an_unreadable_checkpoint_is_refused(tmp_path, stopped, monkeypatch):
    run_dir = copy_run(stopped, tmp_path / "run")
    real_open = open

    def deny(path, *args, **kwargs):
        if Path(path).name == CHECKPOINT:
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "open", deny, raising=False)
    before = snapshot(run_dir)
    with pytest.raises(FormatError, match="checkpoint.pt: cannot be read .Permission denied"):
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before


def _rewrite(run_dir: Path, change) -> None:
    ckpt = load_checkpoint(run_dir)
    change(ckpt)
    safeio.save(ckpt, run_dir / CHECKPOINT)


WRONG = {
    "round past rounds": (lambda c: c.update(round=9), "3 records after round 9, not 10"),
    "negative round": (lambda c: c.update(round=-1), "round -1"),
    "round of the wrong type": (lambda c: c.update(round="2"), "round is a str"),
    "records": (lambda c: c.update(records=7), "counts 7 records after round 2"),
    "status": (lambda c: c.update(status="running"), "status 'running' is not one of"),
    "missing key": (lambda c: c.pop("ledger"), "missing ledger"),
    "unknown key": (lambda c: c.update(extra=1), "unknown 'extra'"),
    "wall time": (lambda c: c.update(wall_time_s=float("nan")), "wall_time_s nan"),
    "a huge wall time": (lambda c: c.update(wall_time_s=10 ** 400), "is not a time"),
    "a huge round": (lambda c: c.update(round=10 ** 400), "3 records after round 1000"),
    "resumed_from": (lambda c: c.update(resumed_from=[5]), "resumed_from"),
    "threads": (lambda c: c.update(threads=0), "threads"),
    "streams": (lambda c: c["streams"].update(torch=[1]), "streams.torch"),
    "seed": (lambda c: c["streams"].update(seed=99), "written by a run of seed 99"),
    "generator": (lambda c: c["streams"]["numpy"].update(
        batches={"bit_generator": "PCG64", "state": "x"}), "streams.numpy['batches']"),
    "generator kind": (lambda c: c["streams"]["numpy"]["batches"].update(
        bit_generator="MT19937"), "does not fit this run"),
    "lost stream": (lambda c: c["streams"]["numpy"].pop("partition"),
                    "lacks the run's stream 'partition'"),
    "clock": (lambda c: c["clock"].update(now="soon"), "clock.now"),
    "profiles": (lambda c: c["clock"]["profiles"].update(compute=np.ones(7)),
                 "clock.profiles.compute"),
    "ledger": (lambda c: c["ledger"]["rounds"].update({1: {"model|up": [1]}}),
               "is not 3 byte counts"),
    "clients": (lambda c: c["ledger"].update(num_clients=5, rounds={}),
                "written by a run of 5 clients"),
    "components": (lambda c: c["components"].update(pool={}), "unknown components"),
    "a key with a newline": (lambda c: c["state"].update({"a\nb": 1}), "'a\\nb'"),
    "state key": (lambda c: c["state"].update(control=torch.zeros(3)), "other keys"),
    "state shape": (lambda c: c["state"]["model"].update(
        {next(iter(c["state"]["model"])): torch.zeros(2, 2)}), "of shape"),
    "state type": (lambda c: c["state"].update(model="weights"), "is not a dict"),
    "module tag": (lambda c: c["state"].update(model={"__module__": {}}), "other keys"),
}


@pytest.mark.parametrize("kind", list(WRONG))
def test_a_well_formed_but_wrong_checkpoint_is_refused(tmp_path, stopped, kind):
    run_dir = copy_run(stopped, tmp_path / "run")
    change, what = WRONG[kind]
    _rewrite(run_dir, change)
    before = snapshot(run_dir)
    with pytest.raises(FormatError) as info:
        resume_experiment(run_dir)
    msg = one_line(str(info.value))
    assert str(run_dir / CHECKPOINT) in msg and what in msg, msg
    assert snapshot(run_dir) == before


def test_the_checkpoint_of_another_algorithm_is_refused(tmp_path, monkeypatch):
    ours = interrupted_run(tmp_path / "fedavg", monkeypatch)
    other = interrupted_run(tmp_path / "scaffold", monkeypatch,
                            algorithm={"name": "scaffold"})
    (ours / CHECKPOINT).write_bytes((other / CHECKPOINT).read_bytes())
    before = snapshot(ours)
    with pytest.raises(FormatError, match="it was written with algorithm.name=scaffold but "
                                          "config.yaml says fedavg"):
        resume_experiment(ours)
    assert snapshot(ours) == before


def test_damaged_metrics_are_refused_before_anything_changes(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    before = snapshot(run_dir)
    with pytest.raises(FormatError, match="holds 2 records but the checkpoint was written "
                                          "after 3"):
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before
    (run_dir / "metrics.jsonl").write_text("\n".join([lines[0], "{torn", *lines[2:]]) + "\n")
    before = snapshot(run_dir)
    with pytest.raises(FormatError, match="record 2 is not a JSON record"):
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before
    middle = json.loads(lines[1])
    assert middle["round"] == 1
    (run_dir / "metrics.jsonl").write_text(
        "\n".join([lines[0], json.dumps({**middle, "round": 7}), *lines[2:]]) + "\n")
    before = snapshot(run_dir)
    with pytest.raises(FormatError, match="record 2 is of round 7, not 1; the run "
                                          "directory is damaged"):
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before


def test_a_torn_record_after_the_checkpoint_is_dropped(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 4, "train_lo')           # killed in the middle of a write
    result = resume_experiment(run_dir)
    assert [r["round"] for r in result.records] == list(range(7))


def test_a_checkpoint_that_does_not_exist_is_not_an_error(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    (run_dir / CHECKPOINT).unlink()
    assert resume_experiment(run_dir).status == "completed"     # from round 0


# ------------------------------------------------------------------ one writer


def test_a_locked_run_directory_is_refused_in_process(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    before = snapshot(run_dir)
    with lock_run_dir(run_dir):
        with pytest.raises(ConfigError) as info:
            resume_experiment(run_dir)
    with lock_run_dir(tmp_path / "new"):                # an empty directory being set up
        with pytest.raises(ConfigError, match="in use by another splitfed process"):
            run_experiment(digits_config(), run_dir=tmp_path / "new")
        assert [p.name for p in (tmp_path / "new").iterdir()] == [LOCK_NAME]
    assert one_line(str(info.value)).startswith(
        f"run directory {run_dir} is in use by another splitfed process (pid {os.getpid()})")
    assert snapshot(run_dir) == before and not (run_dir / LOCK_NAME).exists()


HOLD = """
import sys, time
from splitfed.experiment import lock_run_dir
lock = lock_run_dir(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run_dir)
        proc = subprocess.run([str(BIN), "run", "--resume", str(run_dir)], env=ENV,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2
        assert one_line(proc.stderr) == (
            f"splitfed: error: run directory {run_dir} is in use by another splitfed "
            f"process (pid {holder.pid}); wait for it to end, or stop it (a run directory "
            "has one writer at a time)")
        assert snapshot(run_dir) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert resume_experiment(run_dir).status == "completed"     # free again


def test_two_resumes_at_once_one_is_refused_and_a_kill_frees_the_lock(tmp_path,
                                                                     monkeypatch):
    """Two real ``splitfed run --resume DIR`` processes: the second is refused while the
    first runs; after the first is killed (SIGKILL) the directory resumes again."""
    cfg = digits_config(rounds=5000, checkpoint_every=50,
                        train={"batch_size": 32, "local_steps": 20, "local_epochs": None,
                               "lr": 0.05})
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_round(m, "fedavg", 3)
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, run_dir=run_dir)
    first = subprocess.Popen([str(BIN), "run", "--resume", str(run_dir)], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            if holder(run_dir) == first.pid:         # it holds the lock: it is resuming
                break
            time.sleep(0.01)
        assert first.poll() is None, first.stderr.read()
        second = subprocess.run([str(BIN), "run", "--resume", str(run_dir)], env=ENV,
                                capture_output=True, text=True, timeout=300)
        assert first.poll() is None, f"the first run ended: {first.stderr.read()}"
        assert second.returncode == 2, second.stderr
        assert f"in use by another splitfed process (pid {first.pid})" in \
            one_line(second.stderr)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    ckpt = load_checkpoint(run_dir)
    rounds = (ckpt["round"] if ckpt else 0) + 2
    short = dict(yaml.safe_load((run_dir / "config.yaml").read_text()), rounds=rounds)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(short, sort_keys=False))
    result = resume_experiment(run_dir)                 # the killed holder left no lock
    assert result.status == "completed" and result.records[-1]["round"] == rounds


def test_a_checkpoint_of_a_diverged_run_is_not_run_again(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    _rewrite(run_dir, lambda c: c.update(status="diverged"))
    result = resume_experiment(run_dir)
    assert result.status == "diverged" and [r["round"] for r in result.records] == [0, 1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"


def test_a_run_no_client_trained_in_goes_on_when_extended(tmp_path):
    # no_client_trained is decided at the last round: with more rounds the run goes on,
    # as the run started with them does (clients meet the deadline in later rounds)
    over = ["algorithm.name=sflv2", "clock.profile=fedscale", "clock.deadline=0.05",
            "progress=false"]
    assert main(["run", "quick_digits", *over, "rounds=2", f"out_dir={tmp_path / 'a'}"]) == 3
    assert main(["run", "quick_digits", *over, "rounds=5", f"out_dir={tmp_path / 'b'}"]) == 0
    (short,), (whole,) = (list((tmp_path / d).iterdir()) for d in "ab")
    assert json.loads((short / "summary.json").read_text())["status"] == "no_client_trained"
    text = (short / "config.yaml").read_text()
    assert text.count("\nrounds: 2\n") == 1
    (short / "config.yaml").write_text(text.replace("\nrounds: 2\n", "\nrounds: 5\n"))
    assert main(["run", "--resume", str(short)]) == 0
    summary = json.loads((short / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 5

    def numbers(run):
        return [{k: v for k, v in json.loads(x).items() if k != "round_time_s"}
                for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert numbers(short) == numbers(whole)


def test_launch_resume_of_a_locked_run_directory_is_refused(tmp_path, stopped):
    """Rank 0 of the multi-process runtime takes the same run-directory lock."""
    run_dir = copy_run(stopped, tmp_path / "run")
    before = snapshot(run_dir)
    with lock_run_dir(run_dir):
        proc = subprocess.run([str(BIN), "launch", "--resume", str(run_dir), "--nproc", "2",
                               "--launcher", "spawn"], env=ENV, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 2
    assert one_line(proc.stderr).startswith(
        f"splitfed: error: run directory {run_dir} is in use by another splitfed process "
        f"(pid {os.getpid()})")
    assert snapshot(run_dir) == before


# ------------------------------------------------- what a resume leaves as it was


def _with_tracking(run_dir: Path, **tracking) -> None:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["tracking"].update(tracking)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_tracker_that_cannot_open_fails_a_resume_before_any_file_changes(
        tmp_path, stopped, monkeypatch, checkpointed):
    """The trackers are opened before the resume cuts metrics.jsonl (or, without a
    checkpoint, removes the records of a run that did not end)."""
    pytest.importorskip("torch.utils.tensorboard")
    if checkpointed:
        run_dir = copy_run(stopped, tmp_path / "run")
    else:                             # no checkpoint, and no summary: it did not end
        run_dir = tmp_path / "run"
        run_experiment(digits_config(rounds=2, checkpoint_every=0), run_dir=run_dir)
        (run_dir / "summary.json").unlink()
        assert (run_dir / "metrics.jsonl").stat().st_size > 0
    _with_tracking(run_dir, tensorboard=True)
    (run_dir / "tensorboard").write_text("not a folder")
    before = snapshot(run_dir)
    modes = {p.name: p.stat().st_mode for p in run_dir.iterdir()}
    with pytest.raises(FormatError, match="tensorboard is a file, not a folder"):
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before
    assert {p.name: p.stat().st_mode for p in run_dir.iterdir()} == modes


def test_a_resume_asks_an_unreachable_mlflow_server_once(tmp_path, stopped, monkeypatch):
    pytest.importorskip("mlflow")
    import socket

    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = copy_run(stopped, tmp_path / "run")
    _with_tracking(run_dir, mlflow=True, mlflow_uri=f"http://127.0.0.1:{port}")
    before = snapshot(run_dir)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="^tracking.mlflow_uri: cannot open the MLflow"):
        resume_experiment(run_dir)
    assert time.monotonic() - t0 < 60          # MLflow's own retries take minutes
    assert snapshot(run_dir) == before


def test_a_resume_removes_temp_files_of_a_write_that_was_killed(tmp_path, stopped):
    run_dir = copy_run(stopped, tmp_path / "run")
    left = [run_dir / ".checkpoint.pt.abc123.tmp", run_dir / ".summary.json.x1.tmp"]
    for p in left:
        p.write_bytes(b"half a checkpoint")
    other = run_dir / "notes.tmp"              # not one of atomic_write's names
    other.write_text("mine")
    assert resume_experiment(run_dir).status == "completed"
    assert not any(p.exists() for p in left) and other.read_text() == "mine"


def test_the_files_of_a_run_get_the_umasks_mode(tmp_path, stopped):
    old = os.umask(0o027)
    try:
        run_dir = copy_run(stopped, tmp_path / "run")
        resume_experiment(run_dir)
        fresh = tmp_path / "fresh"
        run_experiment(digits_config(rounds=1), run_dir=fresh)
    finally:
        os.umask(old)
    for d in (run_dir, fresh):
        for name in ("config.yaml", "partition.txt", "metrics.jsonl", "summary.json",
                     CHECKPOINT):
            assert (d / name).stat().st_mode & 0o777 == 0o640, (d, name)


def test_the_records_a_checkpoint_counts_are_synced_before_it(tmp_path, monkeypatch):
    """A crash of the machine cannot leave a checkpoint whose records were lost: the
    records file is fsynced before each checkpoint is written."""
    events = []
    real_fsync, real_save = os.fsync, checkpoint.atomic_save

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1]))
        return real_fsync(fd)

    def save(obj, path):
        events.append(("checkpoint", obj["records"]))
        return real_save(obj, path)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoint, "atomic_save", save)
    run_experiment(digits_config(rounds=2, checkpoint_every=1), run_dir=tmp_path / "r")
    saves = [i for i, e in enumerate(events) if e[0] == "checkpoint"]
    assert len(saves) == 2
    for i in saves:
        assert ("fsync", "metrics.jsonl") in events[:i]
        last = max(j for j in range(i) if events[j] == ("fsync", "metrics.jsonl"))
        assert not any(e[0] == "checkpoint" for e in events[last + 1:i])


def test_launch_resume_with_a_tracker_that_cannot_open_changes_no_file(tmp_path, stopped):
    """``splitfed launch --resume`` opens the trackers before it cuts metrics.jsonl too,
    and removes a killed write's temp file only after they opened."""
    pytest.importorskip("torch.utils.tensorboard")
    run_dir = copy_run(stopped, tmp_path / "run")
    _with_tracking(run_dir, tensorboard=True)
    (run_dir / "tensorboard").write_text("not a folder")
    (run_dir / ".checkpoint.pt.x.tmp").write_bytes(b"half")
    before = snapshot(run_dir)
    proc = subprocess.run([str(BIN), "launch", "--resume", str(run_dir), "--nproc", "2",
                           "--launcher", "spawn"], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "tensorboard is a file, not a folder" in proc.stderr
    assert snapshot(run_dir) == before
    (run_dir / "tensorboard").unlink()
    proc = subprocess.run([str(BIN), "launch", "--resume", str(run_dir), "--nproc", "2",
                           "--launcher", "spawn"], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not (run_dir / ".checkpoint.pt.x.tmp").exists()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("shape", [[float("inf")], [float("nan")], [10**30], ["x"], 5, [-1],
                                   [1, -1]])
def test_a_stored_array_with_a_shape_that_is_no_list_of_sizes_is_refused(shape):
    from splitfed import safeio
    from splitfed.errors import FormatError

    with pytest.raises(FormatError, match=r"^a stored numpy array is malformed"):
        safeio.decode({safeio.TAG: ["<f4", shape, b"\0\0\0\0"]})


def test_a_numpy_array_of_python_objects_cannot_be_saved():
    """Its bytes would be pointers into this process: refused where it sits."""
    with pytest.raises(TypeError, match=r"^value\['a'\]\[1\]: numpy arrays of Python "
                                        "objects cannot be saved"):
        safeio.dumps({"a": [1, np.array([1, "x"], dtype=object)]})


def test_a_recorded_key_that_a_resume_may_change_is_not_compared():
    """A record holding a key that a resume may change (splitfed leaves them out; an
    older version, or an edit, may not) is compared without it: the message names the
    key that does differ, never "config.yaml has no rounds"."""
    import hashlib

    from splitfed.checkpoint import check_config

    def ckpt(record):
        text = json.dumps(record, allow_nan=True)
        return {"config": text, "config_sha256": hashlib.sha256(text.encode()).hexdigest()}

    config = {"rounds": 2, "name": "t", "train": {"lr": 0.1}}
    assert check_config(ckpt({"rounds": float("nan"), "train": {"lr": 0.1}}), config)
    with pytest.raises(FormatError, match=r"it was written with train\.lr=0\.5 but config\.yaml "
                                          r"says 0\.1; a resume continues"):
        check_config(ckpt({"rounds": float("nan"), "name": [], "train": {"lr": 0.5}}), config)
