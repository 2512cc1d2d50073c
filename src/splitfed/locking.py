"""One writer per directory: an exclusive, non-blocking ``flock`` on a lock file in it.

A sweep or a study holds the lock of its directory for its whole run, so a second
process started on the same directory is refused at once instead of interleaving its
records with the first one's::

    with DirLock.acquire(study_dir, "study directory"):
        ...                                     # run, write results

The lock file (:data:`LOCK_NAME`) holds the pid of the process that holds it, for the
message a refused process prints. The lock belongs to the open file: it is released on
exit from the ``with`` block, and by the kernel when the process dies however it dies
(Ctrl-C, SIGKILL, a crash), so a lock is never stale; a lock file left behind by a
killed process is simply locked again. The file is removed on release. Locks are
advisory: they only stop other splitfed processes, and rely on ``flock`` working on the
file system (local file systems do; some network file systems do not).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from splitfed.errors import ConfigError

LOCK_NAME = ".splitfed.lock"
HINT = "wait for it or choose another --name/--out-dir"


class DirLock:
    """An exclusive lock on a directory, held until :meth:`release` (or the end of a
    ``with`` block, or the process). Get one with :meth:`acquire`."""

    def __init__(self, directory: Path, fd: int):
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: str | Path, what: str = "directory", *,
                hint: str = HINT, remedy: str = "choose another --out-dir") -> DirLock:
        """Lock ``directory`` (created if missing) or raise :class:`ConfigError`:
        ``<what> <directory> is in use by another splitfed process (pid N); <hint>``;
        a directory or lock file that cannot be created: ``cannot create ... (<why>);
        <remedy>`` (nothing after the reason when ``remedy`` is empty)."""
        directory = Path(directory)
        then = f"; {remedy}" if remedy else ""
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the {what} {directory} "
                              f"({e.strerror or e}){then}") from None
        path = directory / LOCK_NAME
        for _ in range(10):   # the holder may remove the file between our open and flock,
            # or another process's holder() take a moment's shared lock on a free one
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                    kind = "a symbolic link" if e.errno == errno.ELOOP else "not a regular file"
                    raise ConfigError(_damaged(path, kind)) from None
                raise ConfigError(f"cannot create the lock file {path} "
                                  f"({e.strerror or e}){then}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):   # a pipe, a device
                os.close(fd)
                raise ConfigError(_damaged(path, "not a regular file"))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ConfigError(f"cannot lock {path} ({e.strerror or e}); the file "
                                      "system may not support locks") from None
                pid = holder(directory)
                if pid is None:       # only another process's holder() probe had it
                    time.sleep(0.001)
                    continue
                raise ConfigError(_in_use(what, directory, pid, hint)) from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:              # locked a file that its holder has just removed
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return cls(directory, fd)
        raise ConfigError(_in_use(what, directory, holder(directory), hint))

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and unlock; a second call does nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)   # while still locked: a waiting process retries
        except OSError:
            pass
        os.close(fd)               # closing the file releases the lock

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.release()


def holder(directory: str | Path) -> int | None:
    """The pid of the process that holds the lock of ``directory``, 0 when it is held
    by a process whose pid is unknown, None when it is free. Creates nothing."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None           # not splitfed's lock: acquire() refuses it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            try:
                text = os.read(fd, 64).decode("ascii", "replace").strip()
            except OSError:
                text = ""
            return int(text) if text.isdigit() else 0
        return None               # free (our shared lock goes with the close below)
    finally:
        os.close(fd)


def check_free(directory: str | Path, what: str = "directory", *, hint: str = HINT) -> None:
    """Raise the :meth:`DirLock.acquire` error at once when another process holds the
    lock of ``directory``; creates nothing (a check before the work that precedes
    taking the lock)."""
    pid = holder(directory)
    if pid is not None:
        raise ConfigError(_in_use(what, directory, pid, hint))


def _damaged(path: Path, what: str) -> str:
    return (f"the lock file {path} is {what}; the directory is damaged or not "
            "splitfed's: remove that file, or choose another --out-dir")


def _in_use(what: str, directory: Path | str, pid: int | None, hint: str) -> str:
    who = f" (pid {pid})" if pid else ""
    return (f"{what} {directory} is in use by another splitfed process{who}; {hint}")
