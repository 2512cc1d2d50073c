"""Process statistics shared by the benchmark and the peer simulators' scripts (standard
library only: those scripts run under other interpreters)."""

from __future__ import annotations

from pathlib import Path


def vm_hwm_mb() -> float | None:
    """This process's peak RSS (VmHWM) in MB, or None where /proc cannot tell. Not
    ``ru_maxrss``: Linux keeps that across fork/exec, so a fresh subprocess would report
    its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None
