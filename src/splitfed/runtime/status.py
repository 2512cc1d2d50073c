"""What rank 0 and torchrun's agent tell ``splitfed launch`` through its status directory
(a private temporary directory whose path the launcher passes in :data:`STATUS_ENV`):
rank 0's exit status, its run directory, the workers that failed; and the one-line error
of a run directory that cannot be created. Shared by the launcher and the ranks, below
both (no torch)."""

from __future__ import annotations

import os
from pathlib import Path

from splitfed.errors import ConfigError

STATUS_ENV = "SPLITFED_STATUS_DIR"


def write_status(name: str, text: str) -> bool:
    """Write ``text`` as the file ``name`` of the launcher's status directory, atomically;
    False when there is none or it cannot be written."""
    from splitfed.files import atomic_write

    status_dir = os.environ.get(STATUS_ENV)
    if not status_dir:
        return False
    try:
        atomic_write(Path(status_dir) / name, lambda fh: fh.write(text.encode()))
    except OSError:
        return False
    return True


def run_dir_error(run_dir, e: OSError) -> ConfigError:
    """The one-line error of a ``--run-dir`` that cannot be created (its name cut as
    every error message cuts names, :func:`splitfed.experiment.short`)."""
    from splitfed.experiment import short

    return ConfigError(f"--run-dir: cannot create the run directory {short(str(run_dir))} "
                       f"({e.strerror or e}); choose another --run-dir")
