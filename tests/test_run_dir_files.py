"""Files planted in a shared run directory never make splitfed write through a link, read
a pipe or a device, or fail half-way.

- Every file a run writes is written atomically (a fresh temp file, then a rename that
  replaces a symbolic link itself) or opened with ``O_NOFOLLOW``: a link in the run
  directory never has its target overwritten.
- Every file read back (``metrics.jsonl``, a clock trace, a secret file) must be a regular
  file of bounded size: a pipe is refused without blocking, ``/dev/zero`` without reading.
- A resume checks every file name the run writes before anything changes.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml

import splitfed.metrics as metrics_mod
from splitfed import safeio
from splitfed.checkpoint import checkpoint_records, load_checkpoint
from splitfed.cli import main
from splitfed.engine.profiles import build_profiles, load_trace
from splitfed.errors import ConfigError, FormatError
from splitfed.experiment import RUN_FILES, resume_experiment, run_experiment, write_config
from splitfed.locking import LOCK_NAME, DirLock, holder
from splitfed.metrics import MetricLogger, read_records, write_csv
from splitfed.runtime import secure
from tests.helpers import copy_run, digits_config

VICTIM = "do not overwrite\n"


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks on a pipe fails the test instead of hanging the suite."""
    def expired(*_):
        raise TimeoutError("blocked: a pipe or a device was read")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished run of 2 rounds (checkpoint at round 2) to copy."""
    run_dir = tmp_path_factory.mktemp("base") / "base"
    result = run_experiment(digits_config(rounds=2), run_dir=run_dir)
    assert result.status == "completed"
    assert load_checkpoint(run_dir)["round"] == 2
    return run_dir


def extend(run_dir: Path, rounds: int = 3) -> None:
    """Raise ``rounds`` in the run's config.yaml, so that a resume trains again."""
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["rounds"] = rounds
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM)
    return path


def snapshot(run_dir: Path) -> dict[str, object]:
    """Every entry of ``run_dir``: a regular file's bytes, a link's target, else its kind."""
    out: dict[str, object] = {}
    for p in sorted(run_dir.iterdir()):
        if p.is_symlink():
            out[p.name] = ("link", os.readlink(p))
        elif p.is_dir():
            out[p.name] = "dir"
        elif p.is_file():
            out[p.name] = p.read_bytes()
        else:
            out[p.name] = "special"
    return out


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# ------------------------------------------------------------------ the lock file


def test_a_linked_lock_file_is_refused_and_its_target_kept(tmp_path, base, capsys):
    run_dir = copy_run(base, tmp_path / "run")
    target = victim(tmp_path)
    (run_dir / LOCK_NAME).symlink_to(target)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as info:
        resume_experiment(run_dir)
    msg = one_line(str(info.value))
    assert str(run_dir / LOCK_NAME) in msg and "damaged or not splitfed's" in msg, msg
    assert target.read_text() == VICTIM
    assert snapshot(run_dir) == before
    assert main(["run", "--resume", str(run_dir)]) == 2
    assert one_line(capsys.readouterr().err).endswith(msg)
    assert target.read_text() == VICTIM


def test_a_dangling_lock_link_creates_nothing(tmp_path):
    target = tmp_path / "created-by-the-lock"
    (tmp_path / LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="a symbolic link; the directory is damaged"):
        DirLock.acquire(tmp_path, "study directory")
    assert not target.exists()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_path_that_is_not_a_file_is_refused(tmp_path, kind):
    path = tmp_path / LOCK_NAME
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    assert holder(tmp_path) is None                    # neither blocks nor reads it
    with pytest.raises(ConfigError) as info:
        DirLock.acquire(tmp_path, "sweep directory")
    msg = one_line(str(info.value))
    assert str(path) in msg and "not a regular file" in msg and "not splitfed's" in msg


def test_the_lock_still_works(tmp_path):
    with DirLock.acquire(tmp_path, "run directory"):
        assert holder(tmp_path) == os.getpid()
        with pytest.raises(ConfigError, match="in use by another splitfed process"):
            DirLock.acquire(tmp_path, "run directory")
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------ writes


def test_fixed_temp_names_are_not_followed(tmp_path, base):
    """The writes use fresh temp files: links planted at the old fixed temp names of
    summary.json, partition.txt and config.yaml are left alone."""
    run_dir = copy_run(base, tmp_path / "run")
    target = victim(tmp_path)
    for name in ("summary.json", "partition.txt", "config.yaml", "metrics.csv"):
        (run_dir / f".{name}.tmp").symlink_to(target)
    resume_experiment(run_dir)                          # a finished run: rewrites summary
    assert target.read_text() == VICTIM
    write_config(digits_config(), run_dir / "config.yaml")
    assert target.read_text() == VICTIM
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rounds"] == 2


def test_a_new_run_writes_whole_files(tmp_path):
    run_dir = tmp_path / "run"
    run_experiment(digits_config(rounds=1), run_dir=run_dir)
    names = {p.name for p in run_dir.iterdir()}
    assert set(RUN_FILES) <= names
    assert not [n for n in names if n.endswith(".tmp")], names
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rounds"] == 1


def test_write_csv_replaces_a_link_not_its_target(tmp_path):
    target = victim(tmp_path)
    path = tmp_path / "metrics.csv"
    path.symlink_to(target)
    write_csv([{"round": 0, "test_acc": 0.5}], path)
    assert target.read_text() == VICTIM
    assert not path.is_symlink()
    assert path.read_text().splitlines() == ["round,test_acc", "0,0.5"]


def test_the_metric_logger_does_not_append_through_a_link(tmp_path):
    target = victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(FormatError) as info:
        MetricLogger(tmp_path)
    msg = one_line(str(info.value))
    assert str(tmp_path / "metrics.jsonl") in msg and "symbolic link" in msg
    assert target.read_text() == VICTIM


def test_the_metric_logger_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 0}\n')
    logger = MetricLogger(tmp_path)
    logger.log({"round": 1, "test_acc": float("nan")})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[1] == (
        '{"round": 1, "test_acc": NaN}')                # a float on disk, the JSON token
    back = read_records(tmp_path / "metrics.jsonl")
    assert back == [{"round": 0}, {"round": 1, "test_acc": math.nan}]   # the one NaN
    assert math.isnan(back[1]["test_acc"]) and back[1:] == logger.records
    assert not (tmp_path / "metrics.csv").exists()     # written on demand only


# ------------------------------------------------------------------ checked before any change


def _plant(path: Path, kind: str, target: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(target)
    else:
        path.symlink_to(path.parent / "gone")


KINDS = {"directory": "a directory", "fifo": "a pipe", "link": "a symbolic link",
         "dangling link": "a symbolic link"}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", [n for n in RUN_FILES if n != "config.yaml"])
def test_a_resume_checks_every_file_before_anything_changes(tmp_path, base, name, kind):
    run_dir = copy_run(base, tmp_path / "run")
    extend(run_dir)                                     # the resume would train round 3
    target = victim(tmp_path)
    if kind == "link":
        target.write_bytes((run_dir / name).read_bytes())
    original = target.read_bytes()
    _plant(run_dir / name, kind, target)
    before = snapshot(run_dir)
    with pytest.raises(FormatError) as info:
        resume_experiment(run_dir)
    msg = one_line(str(info.value))
    assert f"{run_dir / name} is {KINDS[kind]}, not a regular file" in msg, msg
    assert "delete it to rerun" in msg
    assert snapshot(run_dir) == before
    assert target.read_bytes() == original


def test_a_linked_config_is_refused(tmp_path, base, capsys):
    run_dir = copy_run(base, tmp_path / "run")
    target = tmp_path / "config.yaml"
    target.write_bytes((run_dir / "config.yaml").read_bytes())
    (run_dir / "config.yaml").unlink()
    (run_dir / "config.yaml").symlink_to(target)
    before = snapshot(run_dir)
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{run_dir / 'config.yaml'} is a symbolic link" in err
    assert snapshot(run_dir) == before


def test_a_metrics_csv_link_is_not_overwritten_by_an_extending_resume(tmp_path, base):
    """metrics.csv of an earlier version: checked like the run's files, then removed."""
    run_dir = copy_run(base, tmp_path / "run")
    extend(run_dir)
    target = victim(tmp_path)
    (run_dir / "metrics.csv").symlink_to(target)
    with pytest.raises(FormatError, match="metrics.csv is a symbolic link"):
        resume_experiment(run_dir)
    assert target.read_text() == VICTIM


def test_an_intact_run_still_resumes(tmp_path, base):
    run_dir = copy_run(base, tmp_path / "run")
    extend(run_dir)
    result = resume_experiment(run_dir)
    assert result.status == "completed"
    assert [r["round"] for r in read_records(run_dir / "metrics.jsonl")][-1] == 3


# ------------------------------------------------------------------ reads


def _zero_link(path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    path.symlink_to("/dev/zero")


SPECIAL = {"fifo": os.mkfifo, "/dev/zero": _zero_link, "directory": os.mkdir}


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_metrics_records_are_read_from_regular_files_only(tmp_path, base, kind):
    run_dir = copy_run(base, tmp_path / "run")
    ckpt = load_checkpoint(run_dir)
    (run_dir / "metrics.jsonl").unlink()
    SPECIAL[kind](run_dir / "metrics.jsonl")
    for read in (lambda: read_records(run_dir / "metrics.jsonl"),
                 lambda: checkpoint_records(run_dir, ckpt)):
        with pytest.raises(FormatError) as info:
            read()
        msg = one_line(str(info.value))
        assert str(run_dir / "metrics.jsonl") in msg and "not a regular file" in msg, msg


def test_a_linked_metrics_file_is_still_read(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text('{"round": 0}\n')
    (tmp_path / "metrics.jsonl").symlink_to(real)
    assert read_records(tmp_path / "metrics.jsonl") == [{"round": 0}]


def test_an_oversized_metrics_file_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 0}\n' * 10)
    monkeypatch.setattr(metrics_mod, "MAX_METRICS_BYTES", 20)
    with pytest.raises(FormatError, match="more than the 20 allowed"):
        read_records(path)


def test_read_regular_bounds(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert safeio.read_regular(path, "f", 10) == b"x" * 10
    with pytest.raises(ConfigError, match=r"^f: 10 bytes, more than the 9 allowed; hint$"):
        safeio.read_regular(path, "f", 9, error=ConfigError, hint="hint")
    with pytest.raises(FileNotFoundError):
        safeio.read_regular(tmp_path / "missing", "missing", 10)


def test_read_regular_refuses_a_pipe_without_opening_it(tmp_path, monkeypatch):
    """Opening a device can have side effects, and opening a pipe can block: a file
    that is not a regular one is refused from its status, before anything opens it."""
    path = tmp_path / "pipe"
    os.mkfifo(path)
    opened, real_open = [], os.open

    def tracking_open(name, *args, **kwargs):
        opened.append(str(name))
        return real_open(name, *args, **kwargs)
    monkeypatch.setattr(os, "open", tracking_open)
    with pytest.raises(FormatError, match=r"^f: not a regular file"):
        safeio.read_regular(path, "f", 10)
    assert str(path) not in opened


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_a_clock_trace_must_be_a_regular_file(tmp_path, kind):
    path = tmp_path / "trace.csv"
    SPECIAL[kind](path)
    with pytest.raises(ConfigError) as info:
        load_trace(path, 3)
    msg = one_line(str(info.value))
    assert f"clock trace {path}" in msg and "not a regular file" in msg, msg
    with pytest.raises(ConfigError, match="not a regular file"):
        build_profiles("trace", {"path": str(path)}, 3, np.random.default_rng(0))


def test_a_run_with_a_fifo_trace_fails_at_once(tmp_path):
    path = tmp_path / "trace.csv"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        run_experiment(digits_config(clock={"profile": "trace", "path": str(path)}),
                       run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_a_secret_file_must_be_a_regular_file(tmp_path, kind):
    path = tmp_path / "secret"
    SPECIAL[kind](path)
    with pytest.raises(ConfigError) as info:
        secure.read_secret(str(path), {})
    msg = one_line(str(info.value))
    assert f"--secret-file {path}" in msg and "not a regular file" in msg, msg


def test_a_huge_secret_file_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"a" * (secure.MAX_SECRET_BYTES + 1))
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="--secret-file .*more than the 65536 allowed"):
        secure.read_secret(str(path), {})
    path.write_text("0123456789abcdef" * 4 + "\n")
    assert secure.read_secret(str(path), {}) == "0123456789abcdef" * 4


def test_a_lock_that_only_a_holder_probe_has_is_taken(tmp_path, monkeypatch):
    """``holder()`` (the check before a study or sweep takes its locks) holds a shared
    lock on a free lock file for a moment; an ``acquire`` at that moment waits it out
    instead of refusing a directory that nobody holds."""
    import fcntl

    import splitfed.locking as locking

    (tmp_path / LOCK_NAME).write_text("")
    probe = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)       # as holder() takes it
    assert holder(tmp_path) is None
    waited = []

    def sleep(seconds):                                     # the probe ends meanwhile
        waited.append(seconds)
        os.close(probe)
    monkeypatch.setattr(locking.time, "sleep", sleep)
    with DirLock.acquire(tmp_path, "run directory") as lock:
        assert lock.held and len(waited) == 1
        with pytest.raises(ConfigError, match=f"in use by another splitfed process "
                                              f"\\(pid {os.getpid()}\\)"):
            DirLock.acquire(tmp_path, "run directory")


def test_a_lock_file_removed_while_it_is_being_locked_is_locked_anew(tmp_path, monkeypatch):
    """A holder removes the lock file as it releases it. A process that opened the old
    file just before then locks a file that no longer has a name, which a third process
    would not see: it must lock the new file at the lock's path instead."""
    import fcntl

    import splitfed.locking as locking

    real, calls = fcntl.flock, []

    def flock(fd, op):
        if not calls:                                      # the holder releases meanwhile
            os.unlink(tmp_path / LOCK_NAME)
        calls.append(op)
        return real(fd, op)
    monkeypatch.setattr(locking.fcntl, "flock", flock)
    with DirLock.acquire(tmp_path, "run directory") as lock:
        assert len(calls) == 2                            # the orphan, then the new file
        assert os.fstat(lock._fd).st_ino == os.stat(tmp_path / LOCK_NAME).st_ino
        assert holder(tmp_path) == os.getpid()


def test_a_lock_held_by_a_process_of_unknown_pid_is_in_use(tmp_path):
    """A locked lock file that names no pid (its holder has not written it yet) is in
    use all the same: ``holder()`` says 0, and the check before the work refuses."""
    import fcntl

    from splitfed.locking import check_free

    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert holder(tmp_path) == 0
        with pytest.raises(ConfigError, match=r"^run directory .* is in use by another "
                                              r"splitfed process; "):
            check_free(tmp_path, "run directory")
    finally:
        os.close(fd)
    assert holder(tmp_path) is None
    check_free(tmp_path, "run directory")


def test_an_atomic_write_that_may_not_replace_keeps_a_file_that_appeared(tmp_path):
    """``replace=False``: a file that another process created while the new one was
    being written is kept, the new one is dropped (no temp file is left)."""
    from splitfed.files import atomic_write

    path = tmp_path / "figure.png"

    def write(fh):
        path.write_bytes(b"theirs")                        # appears meanwhile
        fh.write(b"ours")
    with pytest.raises(FileExistsError):
        atomic_write(path, write, replace=False)
    assert path.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["figure.png"]
    atomic_write(tmp_path / "new.png", lambda fh: fh.write(b"x"), replace=False)
    assert (tmp_path / "new.png").read_bytes() == b"x"
