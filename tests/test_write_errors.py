"""A write that the file system refuses (a full disk, a file size limit) is one line
naming the cause, and what was there before stays as it was.

``RLIMIT_FSIZE`` stands in for a full disk: the write that crosses it fails with
``EFBIG`` (Python ignores ``SIGXFSZ``), as a write to a full disk fails with ``ENOSPC``.
"""

from __future__ import annotations

import contextlib
import errno
import resource

import pytest
import torch

import splitfed.checkpoint as checkpoint
from splitfed import safeio
from splitfed.cli import main


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("to", ["handle", "path"])
def test_a_save_the_file_system_refuses_raises_its_os_error(tmp_path, to):
    # torch's archive writer answers the failed write with a RuntimeError (about the file
    # position for a handle, "iostream error" for a path), which hid the OSError
    obj = {"w": torch.zeros(64 * 1024)}
    with file_size_limit(8 * 1024), pytest.raises(OSError) as e:
        if to == "path":
            safeio.save(obj, tmp_path / "x.pt")
        else:
            with open(tmp_path / "x.pt", "wb") as fh:
                safeio.save(obj, fh)
    assert e.value.errno == errno.EFBIG


def test_an_atomic_save_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    checkpoint.atomic_save({"round": 1}, path)
    before = path.read_bytes()
    with file_size_limit(8 * 1024), pytest.raises(OSError):
        checkpoint.atomic_save({"w": torch.zeros(64 * 1024)}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_run_whose_checkpoint_cannot_be_written_stops_with_one_line(tmp_path, capsys):
    with file_size_limit(8 * 1024):
        code = main(["run", "quick_digits", f"out_dir={tmp_path}", "progress=false",
                     "rounds=3", "checkpoint_every=1", "name=r"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "splitfed: error: File too large; check the output directory and the free space")
    (run,) = tmp_path.iterdir()
    assert not any(p.name.endswith(".tmp") for p in run.iterdir())


def test_an_out_dir_on_a_read_only_file_system_says_so(tmp_path, monkeypatch, capsys):
    """The nearest existing directory of out_dir lies on a read-only mount (simulated:
    no write access, and statvfs says ST_RDONLY): the one line says "read-only file
    system", not "permission denied", and nothing is written."""
    import os
    import types

    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(
        f_flag=real_statvfs(path).f_flag | os.ST_RDONLY))
    assert main(["run", "quick_digits", "rounds=1", f"out_dir={tmp_path}/runs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitfed: error: out_dir: cannot create the run directory ")
    assert err.endswith(f"({tmp_path}: read-only file system); choose another out_dir"), err
    assert not any(tmp_path.iterdir())


def test_a_run_directory_whose_lock_cannot_be_made_names_no_option(tmp_path, monkeypatch):
    """A run directory's lock file that cannot be created (a read-only mount on resume)
    is one line with the reason; no remedy naming an option `splitfed run` lacks (a
    resume cannot move its directory anyway)."""
    import os

    from splitfed import locking
    from splitfed.errors import ConfigError
    from splitfed.experiment import lock_run_dir

    def refuse(path, *a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(locking.os, "open", refuse)
    with pytest.raises(ConfigError) as err:
        lock_run_dir(tmp_path)
    assert str(err.value) == (f"cannot create the lock file {tmp_path}/.splitfed.lock "
                              f"({os.strerror(errno.EROFS)})")
