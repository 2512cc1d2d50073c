"""Where a run's numbers go: one JSON line per record, a CSV at the end, a summary.

Algorithms return metrics; only the round loop logs them, through this interface.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
from pathlib import Path

from splitfed.errors import FormatError

#: the largest ``metrics.jsonl`` read back (far above any real run's records)
MAX_METRICS_BYTES = 1 << 30


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricLogger:
    """Appends records to ``metrics.jsonl`` (flushed per record) and keeps them in memory."""

    def __init__(self, run_dir: str | Path | None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.records: list[dict] = []
        self._fh = None
        if self.run_dir is not None:
            self._fh = _open_append(self.run_dir / "metrics.jsonl")

    def log(self, record: dict) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        self.records.append(record)
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
            write_csv(self.records, self.run_dir / "metrics.csv")


def _open_append(path: Path):
    """``path`` opened for appending text, never through a symbolic link: a link planted
    in a shared run directory would have the records written into its target."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FormatError(f"{path} is a symbolic link; splitfed does not write through "
                              "links: the run directory is damaged or not splitfed's, "
                              "delete it to rerun the run") from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def read_records(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, checked: every non-blank line a JSON
    object with an integer ``round`` >= 0.

    Raises :class:`FormatError` naming the file and line when it is not such a file
    (torn, truncated, foreign), or naming the file when it is not a regular file (a
    pipe, a device) or is larger than :data:`MAX_METRICS_BYTES`; :class:`OSError` when
    it cannot be read.
    """
    from splitfed.safeio import read_regular   # (safeio imports torch: load it late)

    path = Path(path)
    try:
        text = read_regular(path, str(path), MAX_METRICS_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not a metrics file (not UTF-8 text at byte "
                          f"{e.start})") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise FormatError(f"{path}: line {n} is not a JSON record ({e}); the file is "
                              "torn or not a metrics file") from None
        if not isinstance(record, dict):
            raise FormatError(f"{path}: line {n} is not a JSON object; not a metrics file")
        r = record.get("round")
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise FormatError(f"{path}: line {n} has no round number (an integer >= 0); "
                              "not a metrics file")
        records.append(record)
    return records


def write_csv(records: list[dict], path: Path) -> None:
    columns: list[str] = []
    for r in records:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=columns)
    w.writeheader()
    w.writerows(records)
    data = buf.getvalue().encode("utf-8")
    from splitfed.checkpoint import atomic_write   # (imports torch: load it late)

    atomic_write(path, lambda fh: fh.write(data))   # replaces a link, never its target


def last_value(records: list[dict], key: str):
    for r in reversed(records):
        if key in r:
            return r[key]
    return None


def best_value(records: list[dict], key: str):
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return max(vals) if vals else None
