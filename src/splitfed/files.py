"""Reading and writing the files of a run directory, without torch (so that commands
that only read run directories, ``splitfed results`` and ``plot``, start fast).

- :func:`read_regular`: the bytes of a regular file of bounded size (a pipe, a device or
  a file that is too large is refused without being read);
- :func:`loads_json`: JSON of bounded nesting;
- :func:`escape_controls`: text from a file or a path made safe to print on one line;
- :func:`atomic_write`: a file replaced whole or not at all (and
  :func:`remove_stale_temp_files`, for the temp files of a writer that was killed);
- :func:`new_file_mode`: the mode of the files splitfed writes. Files written atomically
  start as a temporary file from :func:`tempfile.mkstemp`, which makes it private (0600)
  whatever the umask; renamed into place it would stay private, so that the other
  members of a group could not read a run directory shared with them. Writers give the
  temporary file :func:`new_file_mode` first, the mode ``open()`` gives a new file (0644
  under the usual umask 022)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from splitfed.errors import FormatError

#: what :func:`read_regular` names a file that is not a regular one
NOT_REGULAR = "not a regular file (a directory, a pipe, a socket or a device)"


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it
    (``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode of a new regular file: 0666 less the umask."""
    return 0o666 & ~umask()


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], *,
                 replace: bool = True) -> None:
    """Write ``path`` atomically: ``write(fh)`` into a temp file in the same directory,
    fsync, :func:`os.replace`, fsync of the directory. A process killed at any instant
    leaves the old file or the new one, never a torn one (and maybe the temp file,
    ``.<name>.<random>.tmp``, which :func:`remove_stale_temp_files` removes). The file
    gets the mode a new file gets under the umask (:func:`new_file_mode`). With
    ``replace=False`` an existing ``path`` is never replaced, not even one that appeared
    while ``write`` ran: the temp file is linked to ``path`` instead of renamed, and
    :class:`FileExistsError` is raised."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode())            # the umask's mode, not mkstemp's 0600
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)                    # EEXIST if path exists
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write` of ``text`` as UTF-8 (a link at ``path`` is replaced, never
    written through)."""
    data = text.encode("utf-8")
    atomic_write(path, lambda fh: fh.write(data))


#: the errors of a write or read that come from the user's disk or files, whether or not
#: they name a file (a full disk names none)
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO,
                         errno.EACCES, errno.EPERM, errno.ENAMETOOLONG})


def is_user_os_error(e: OSError) -> bool:
    """Whether ``e`` is about the user's files or disk (it names a file, or is one of
    :data:`DISK_ERRNOS`), and so an error to report in one line, not a bug."""
    return e.filename is not None or e.errno in DISK_ERRNOS


def os_error_message(e: OSError) -> str:
    """``e`` in one line, with what to check: the path it names, else the output
    directory and the free space."""
    what = e.strerror or str(e)
    if e.filename is None:
        return f"{what}; check the output directory and the free space"
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{where}: {what}; check the path"


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Remove the temp files :func:`atomic_write` left in ``directory`` when its process
    was killed while writing (``.<name>.<random>.tmp``, regular files only); the caller
    holds the directory's lock, so no writer is using them. Returns what was removed."""
    removed = []
    for path in Path(directory).glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if is_temp_file(path):
                path.unlink()
                removed.append(path)
    return removed


def is_temp_file(path: Path) -> bool:
    """Whether ``path`` is a temp file of :func:`atomic_write` (``.<name>.<random>.tmp``,
    a regular file)."""
    return (path.name.startswith(".") and path.name.endswith(".tmp")
            and path.is_file() and not path.is_symlink())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_regular(path: str | Path, what: str, max_bytes: int, *,
                 error: type[Exception] = FormatError, hint: str = "") -> bytes:
    """The bytes of ``path``, which must be a regular file (a symbolic link to one is
    fine) of at most ``max_bytes`` bytes.

    A pipe, a socket, a device or a directory is refused without being read (a pipe is
    opened non-blocking, so a pipe with no writer cannot hang the process), and so is a
    file larger than ``max_bytes`` (at most ``max_bytes + 1`` bytes are ever read, so a
    file that grows or lies about its size cannot exhaust memory). Those refusals raise
    ``error`` with one line ``<what>: <reason>[; <hint>]``; ``what`` names the file.
    The file not existing or not being readable raises the :class:`OSError` as is."""
    return b"".join(iter_regular(path, what, max_bytes, error=error, hint=hint))


def check_regular(path: str | Path, what: str, *, error: type[Exception] = FormatError,
                  hint: str = "") -> None:
    """Refuse ``path`` unless it is a regular file (a symbolic link to one is fine),
    before anything opens it: a pipe with no writer would block the process, a device
    never ends. Raises ``error`` with one line ``<what>: not a regular file ...[; <hint>]``;
    the file not existing raises the :class:`OSError` as is."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise error(f"{what}: {NOT_REGULAR}" + (f"; {hint}" if hint else ""))


def open_regular(path: str | Path, what: str, mode: str = "rb", *,
                 error: type[Exception] = FormatError, hint: str = "", **kwargs):
    """``open(path, mode, **kwargs)`` for reading, refused unless what was opened is a
    regular file: the path is opened non-blocking (a pipe with no writer returns at once)
    and checked with ``fstat``, so a path swapped for a pipe or a device after
    :func:`check_regular` looked at it is refused too, with the same one line. The file
    not existing or not being readable raises the :class:`OSError` as is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{what}: {NOT_REGULAR}" + (f"; {hint}" if hint else ""))
        os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def iter_regular(path: str | Path, what: str, max_bytes: int, *,
                 error: type[Exception] = FormatError, hint: str = "",
                 chunk: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of ``path`` as :func:`read_regular` reads them, with its checks and
    errors, in pieces of at most ``chunk`` bytes: a reader holds one piece at a time,
    not the file. The checks run when the first piece is asked for; a file that grows
    beyond ``max_bytes`` while it is read raises when the excess is reached."""
    def refuse(reason: str) -> Exception:
        return error(f"{what}: {reason}" + (f"; {hint}" if hint else ""))

    check_regular(path, what, error=error, hint=hint)   # no open (a device's side effects)
    with open_regular(path, what, "rb", buffering=0, error=error, hint=hint) as f:
        size = os.fstat(f.fileno()).st_size         # what was opened, not what was seen
        if size > max_bytes:
            raise refuse(f"{size} bytes, more than the {max_bytes} allowed")
        left, got = max_bytes + 1, 0
        while left > 0:
            # a raw read allocates what it is asked for: ask for what the file holds (then
            # a little, for what was appended since), not a whole chunk for a small file
            want = size - got + 1 if got < size else 1 << 16
            piece = f.read(min(left, chunk, want))
            got += len(piece)
            if not piece:
                return
            left -= len(piece)
            if left <= 0:
                raise refuse(f"more than the {max_bytes} bytes allowed")
            yield piece


#: the deepest nesting of JSON arrays and objects read back: records and summaries are a
#: few levels deep, and a deeper document would exhaust the parser's stack
MAX_JSON_DEPTH = 64


#: the largest ``summary.json`` read back (a run's is a few kilobytes)
MAX_SUMMARY_BYTES = 1 << 24


def read_json_object(path: str | Path, max_bytes: int = MAX_SUMMARY_BYTES) -> dict | None:
    """A JSON object (a run's ``summary.json``) as a dict, read through
    :func:`read_regular` (at most ``max_bytes``); None when it is absent, unreadable,
    larger, not a regular file, not JSON or not an object (a damaged file)."""
    data, _ = json_object_or_why(path, max_bytes)
    return data


def json_object_or_why(path: str | Path, max_bytes: int = MAX_SUMMARY_BYTES
                       ) -> tuple[dict | None, str]:
    """(the JSON object in ``path`` as a dict, "") as :func:`read_json_object` reads it,
    or (None, why it is not one: not a regular file, larger than ``max_bytes``, cannot
    be read (absent too), not JSON, not an object)."""
    try:
        data = loads_json(read_regular(path, str(path), max_bytes))
    except FormatError as e:                  # not a regular file, too large
        return None, str(e).removeprefix(f"{path}: ")
    except ValueError as e:                   # not UTF-8 (UnicodeDecodeError), not JSON
        return None, f"not JSON ({e})"
    except OSError as e:
        return None, f"cannot read it ({e})"
    return (data, "") if isinstance(data, dict) else (None, "not a JSON object")


def loads_json(text: str | bytes) -> Any:
    """``json.loads(text)`` for the JSON files of a run directory (``metrics.jsonl``
    lines, ``summary.json``): a document nested deeper than :data:`MAX_JSON_DEPTH` levels
    raises ``ValueError``, as a malformed one does, so that readers report both alike."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:                                # without recursion: any depth is safe
        node, depth = stack.pop()
        items = node.values() if isinstance(node, dict) else node
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return data


#: characters escaped by :func:`escape_controls`: C0 controls but tab (newline, ESC), DEL, C1
#: controls and Unicode's line and paragraph separators
_CONTROLS = str.maketrans({c: repr(c)[1:-1] for c in (
    *(chr(i) for i in range(32) if i != 9), "\x7f", *(chr(i) for i in range(0x80, 0xa0)),
    "\u2028", "\u2029")})


_CONTROLS_BUT_NEWLINE = {k: v for k, v in _CONTROLS.items() if k != ord("\n")}


def escape_controls(text: str, *, newlines: bool = False) -> str:
    """``text`` with its control characters escaped as Python writes them (``\\n``,
    ``\\x1b``): text read from a file or a path can then neither break a line of output
    (a table row) nor send escape sequences to the terminal. ``newlines``: keep newlines
    (a message of several lines, each escaped)."""
    return str(text).translate(_CONTROLS_BUT_NEWLINE if newlines else _CONTROLS)
