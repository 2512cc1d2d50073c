"""Where a run's numbers go: one JSON line per record, a CSV at the end, a summary.

Algorithms return metrics; only the round loop logs them, through this interface.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from splitfed.errors import FormatError


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
            self._fh = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")

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


def read_records(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, checked: every non-blank line a JSON
    object with an integer ``round`` >= 0.

    Raises :class:`FormatError` naming the file and line when it is not such a file
    (torn, truncated, foreign); :class:`OSError` when it cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
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
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(records)


def last_value(records: list[dict], key: str):
    for r in reversed(records):
        if key in r:
            return r[key]
    return None


def best_value(records: list[dict], key: str):
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return max(vals) if vals else None
