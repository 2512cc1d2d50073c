"""The mode of the files splitfed writes: what the process's umask gives a new file.

Files written atomically start as a temporary file from :func:`tempfile.mkstemp`, which
makes it private (0600) whatever the umask; renamed into place it would stay private, so
that the other members of a group could not read a run directory shared with them.
Writers give the temporary file :func:`new_file_mode` first, the mode ``open()`` gives a
new file (0644 under the usual umask 022)."""

from __future__ import annotations

import os


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
