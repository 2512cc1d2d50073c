"""Runs' results as data: every record of every run, with its config and provenance.

``metrics.jsonl`` is the one metrics file a run writes; this module reads run
directories back into rows (docs/results_data.md):

- :func:`load_runs` (needs pandas: ``pip install 'splitfed[data]'``): a DataFrame, one
  row per round per run; :func:`load_rows` gives the same rows as dicts, without pandas;
- :func:`summary_table`: one row per run (or per round), as text;
- :func:`print_table`: what ``splitfed results PATH ... [--format csv] [--last]`` prints.

A path is a run directory (it holds ``metrics.jsonl``), a ``metrics.jsonl`` file, a
directory holding run directories at any depth (a sweep, a study, ``runs/``), or a glob
(``runs/quick_digits-*``). Runs are listed in the order given, each directory's runs
sorted by path, each run once.

The columns of a row: ``run`` (the directory's name), ``run_dir`` (its path), every field
of the record (``round``, ``train_loss``, ``test_acc``, ``bytes_up``, ``sim_time_s``,
...), ``status`` (from ``summary.json``; ``unfinished`` when there is none: the run is
running or was interrupted), ``diverged_round``, ``wall_time_s``, the config flattened
to dotted keys as they are written on the command line (``algorithm.name``,
``train.lr``, ``partition.alpha``: the options of a section are keys of the section;
lists are JSON text, ``[64, 32]``), and the provenance of ``summary.json``
(``splitfed_version``, ``git_commit``, ``git_dirty``, ``python_version``,
``torch_version``, ``numpy_version``, ``threads``, ``cpu_capability``, ``platform``,
``command``). Non-finite numbers are floats (NaN), as in memory.
"""

from __future__ import annotations

import glob
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitfed.errors import ConfigError, FormatError
from splitfed.files import MAX_SUMMARY_BYTES, NOT_REGULAR, escape_controls, read_regular
from splitfed.metrics import (csv_text, is_finite_number, loads_strict, read_records,
                              record_summary)

#: sections whose ``options`` mapping holds the chosen component's options
OPEN_SECTIONS = ("data", "partition", "model", "algorithm", "clock")
#: provenance keys of summary.json -> column names
PROVENANCE_COLUMNS = {"splitfed": "splitfed_version", "commit": "git_commit",
                      "dirty": "git_dirty", "source": "source_digest",
                      "python": "python_version",
                      "torch": "torch_version", "numpy": "numpy_version",
                      "threads": "threads", "cpu_capability": "cpu_capability",
                      "platform": "platform", "command": "command"}
#: the types of the keys of ``summary.json`` that a reader uses or shows (what
#: :func:`splitfed.experiment.run_experiment` and ``splitfed launch`` write; other keys
#: are kept as they are): "count" an integer >= 0, "seconds" a finite number >= 0,
#: "number" an int or a float (NaN too: a diverged run's final accuracy)
SUMMARY_TYPES: dict[str, tuple[str, ...]] = {
    "name": ("text",), "algorithm": ("text",), "dataset": ("text",), "model": ("text",),
    "status": ("text",), "rounds": ("count", "null"), "diverged_round": ("count", "null"),
    "final_test_acc": ("number", "null"), "best_test_acc": ("number", "null"),
    "wall_time_s": ("seconds",), "resumed_from": ("list",), "threads": ("count", "null"),
    "cpu_capability": ("text", "null"), "resumed_threads": ("list",),
    "provenance": ("object", "null"), "processes": ("count",), "lost_ranks": ("object",)}
#: the types of the provenance keys (any other: text or null)
PROVENANCE_TYPES: dict[str, tuple[str, ...]] = {"dirty": ("boolean", "null"),
                                                "threads": ("count", "null"),
                                                "plugins": ("object", "null")}
FORMATS = ("table", "csv")
DATA_EXTRA = "pip install 'splitfed[data]'"


@dataclass
class Run:
    """One run directory read back."""

    run_dir: Path
    records: list[dict]
    config: dict          # flattened
    summary: dict         # summary.json ({} when absent)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def status(self) -> str:
        status = self.summary.get("status")
        return status if isinstance(status, str) else "unfinished"

    @property
    def numbers(self) -> dict:
        """:func:`splitfed.metrics.record_summary` of the records and status."""
        return record_summary(self.records, self.status)

    def columns(self) -> dict:
        """The run's columns besides the record's: status, config, provenance."""
        out: dict[str, Any] = {"run": self.name, "run_dir": str(self.run_dir),
                               "status": self.status,
                               "diverged_round": self.numbers["diverged_round"],
                               "wall_time_s": self.summary.get("wall_time_s")}
        out.update(self.config)
        prov = self.summary.get("provenance")
        if isinstance(prov, Mapping):
            for key, column in PROVENANCE_COLUMNS.items():
                if key in prov:
                    out[column] = prov[key]
        for key in ("threads", "cpu_capability"):        # the run's own, not the resume's
            if key in self.summary:
                out[key] = self.summary[key]
        return out


# ---------------------------------------------------------------------------- config


def flatten_config(config: Mapping, prefix: str = "") -> dict:
    """A config mapping (as ``config.yaml`` holds it) as ``{dotted key: value}``, the keys
    as they are written on the command line: the ``options`` of ``data``, ``partition``,
    ``model``, ``algorithm`` and ``clock`` are keys of their section
    (``partition.alpha``, not ``partition.options.alpha``). Lists stay lists."""
    out: dict = {}
    for key, value in config.items():
        key = str(key)
        if isinstance(value, Mapping):
            section = dict(value)
            if not prefix and key in OPEN_SECTIONS and isinstance(section.get("options"),
                                                                  Mapping):
                options = section.pop("options")
                section.update({k: v for k, v in options.items() if k not in section})
            inner = flatten_config(section, f"{prefix}{key}.")
            out.update(inner if inner or section else {f"{prefix}{key}": {}})
        else:
            out[f"{prefix}{key}"] = value
    return out


def _cell(value):
    """A config value as one DataFrame / CSV cell: lists and mappings as JSON text."""
    if isinstance(value, (list, tuple, Mapping)):
        return json.dumps(value, default=str)
    return value


# ----------------------------------------------------------------------------- paths


def run_dirs(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """The run directories named by ``paths`` (see the module doc); ConfigError naming a
    path that is neither, or when none is found."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ConfigError("results: give at least one run directory, a directory of runs "
                          "or a glob")
    found: list[Path] = []
    for p in paths:
        text = str(p)
        if not text:
            raise ConfigError("results: an empty path; give a run directory, a directory "
                              "of runs or a glob")
        if glob.has_magic(text) and not Path(text).exists():  # a real name with [ or *
            matches = _glob(text)
            if not matches:
                raise ConfigError(f"{text}: no file or directory matches")
            for m in matches:
                found += _runs_under(m, strict=False)
        else:
            path = Path(p)
            if not path.exists():
                raise ConfigError(f"{path}: no such run directory, directory or file")
            got = _runs_under(path, strict=True)
            if not got:
                raise ConfigError(f"{path}: holds no run (no metrics.jsonl in it or below)")
            found += got
    first: dict[Path, Path] = {}
    for d in found:       # each run once, where first found, named without links if it can
        real = _real(d)
        if real not in first or (d.absolute() == real != first[real].absolute()):
            first[real] = d
    unique = list(first.values())
    if not unique:
        raise ConfigError("results: " + ", ".join(map(str, paths)) + ": no run found "
                          "(no metrics.jsonl)")
    return unique


def _glob(pattern: str) -> list[Path]:
    """The paths ``pattern`` matches, sorted; ``**`` does not follow symbolic links (a
    link to a parent would repeat the walk without end)."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base = Path(*parts[:first]) if first else Path(".")
    try:
        return sorted(base.glob("/".join(parts[first:])))
    except (OSError, ValueError):
        return []


def _real(path: Path) -> Path:
    """Where ``path`` really is: one run however it is named (``./runs/../runs/x``, a
    link to it)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _runs_under(path: Path, strict: bool) -> list[Path]:
    if path.is_file():
        if path.name == "metrics.jsonl":
            return [path.parent]
        if strict:
            raise ConfigError(f"{path}: not a run directory; give a run directory (with "
                              "metrics.jsonl), a directory of runs or a metrics.jsonl file")
        return []
    if (path / "metrics.jsonl").is_file():
        return [path]
    if not path.is_dir():
        if strict and path.exists():
            raise ConfigError(f"{path}: {NOT_REGULAR}; give a run directory (with "
                              "metrics.jsonl), a directory of runs or a metrics.jsonl file")
        return []
    found = sorted(path.rglob("metrics.jsonl"))
    odd = next((m for m in found if not m.is_file()), None)
    if strict and odd is not None:      # a pipe or a device would block or never end
        raise ConfigError(f"{odd}: {NOT_REGULAR}; a run's metrics.jsonl is a file")
    return sorted({m.parent for m in found if m.is_file()})


def _read_summary(path: Path) -> dict:
    """``summary.json`` checked (:data:`SUMMARY_TYPES`); {} when there is none."""

    try:
        data = loads_strict(read_regular(path, str(path), MAX_SUMMARY_BYTES,
                                         hint="the run directory is damaged"))
    except FileNotFoundError:
        return {}
    except FormatError:                        # not a regular file, or too large
        raise
    except (OSError, ValueError) as e:          # UnicodeDecodeError is a ValueError
        raise FormatError(f"{path}: not a summary file ({e}); the run directory is "
                          "damaged") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path}: not a summary file (a JSON {_json_type(data)}, not an "
                          "object); the run directory is damaged")
    for key, value in data.items():
        kinds = SUMMARY_TYPES.get(key)
        if kinds is not None and not _is_kind(value, kinds):
            raise _wrong_type(path, key, value, kinds)
    prov = data.get("provenance")
    for key, value in (prov.items() if isinstance(prov, dict) else ()):
        kinds = PROVENANCE_TYPES.get(key, ("text", "null"))
        if not _is_kind(value, kinds):
            raise _wrong_type(path, f"provenance.{key}", value, kinds)
    plugins = prov.get("plugins") if isinstance(prov, dict) else None
    for name, digest in (plugins.items() if isinstance(plugins, dict) else ()):
        if not isinstance(digest, str):        # module -> the digest of its files
            raise _wrong_type(path, f"provenance.plugins.{name}", digest, ("text",))
    return data


_KIND_WORDS = {"text": "text", "count": "an integer >= 0", "seconds": "a finite number >= 0",
               "number": "a number", "list": "a list", "object": "an object",
               "boolean": "true or false", "null": "null"}


def _wrong_type(path: Path, key: str, value, kinds: tuple[str, ...]) -> FormatError:
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return FormatError(f"{path}: not a summary file ({key} is {shown}; allowed: "
                       f"{' or '.join(_KIND_WORDS[k] for k in kinds)}); the run directory "
                       "is damaged")


def _is_kind(value, kinds: tuple[str, ...]) -> bool:
    """True when ``value`` is one of ``kinds`` (the names of :data:`SUMMARY_TYPES`)."""
    if value is None:
        return "null" in kinds
    if isinstance(value, bool):
        return "boolean" in kinds
    if isinstance(value, str):
        return "text" in kinds
    if isinstance(value, int):
        return ("count" in kinds and value >= 0) or "number" in kinds or (
            "seconds" in kinds and value >= 0)
    if isinstance(value, float):
        return "number" in kinds or ("seconds" in kinds and math.isfinite(value)
                                     and value >= 0)
    if isinstance(value, list):
        return "list" in kinds
    if isinstance(value, dict):
        return "object" in kinds
    return False


def _json_type(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _read_config(path: Path) -> dict:
    from splitfed.configtools import MAX_YAML_BYTES, yaml_load

    try:      # a regular file of bounded size: a pipe or /dev/zero is refused unread
        text = read_regular(path, str(path), MAX_YAML_BYTES).decode("utf-8")
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e})") from None
    raw = yaml_load(text, str(path), exponents=True)   # an option written 5e-1 is a number
    return flatten_config(raw) if isinstance(raw, Mapping) else {}


def read_runs(paths) -> list[Run]:
    """Every run of ``paths`` read back: records, flattened config, summary."""
    runs = []
    for d in run_dirs(paths):
        try:
            records = read_records(d / "metrics.jsonl")
        except OSError as e:
            raise ConfigError(f"cannot read {d / 'metrics.jsonl'} "
                              f"({e.strerror or e})") from None
        runs.append(Run(d, records, _read_config(d / "config.yaml"),
                        _read_summary(d / "summary.json")))
    return runs


# ------------------------------------------------------------------------------ rows


def load_rows(paths, *, last: bool = False) -> list[dict]:
    """One dict per round per run (only each run's last round when ``last``), with the
    columns of the module doc."""
    return _rows(paths, last)[0]


def _rows(paths, last: bool) -> tuple[list[dict], list[str]]:
    """The rows and their columns: ``run``, the records' fields (in the order first
    seen), then the run's columns (status, config, provenance)."""
    rows, fields, extras = [], {}, {}
    for run in read_runs(paths):
        extra = {k: _cell(v) for k, v in run.columns().items()}
        name = extra.pop("run")
        records = run.records[-1:] if last else run.records
        for record in records or [{}]:       # a run with no record yet: a row of its own
            fields.update(dict.fromkeys(record))
            extras.update(dict.fromkeys(k for k in extra if k not in record))
            row = {"run": name, **record,
                   **{k: v for k, v in extra.items() if k not in record}}
            row.update({"run": name, **{k: extra[k] for k in _OWN if k in extra}})
            rows.append(row)
    columns = ["run", *(k for k in fields if k != "run"),
               *(k for k in extras if k not in fields)]
    return rows, columns


#: the run's own columns, which a record's field of the same name does not replace
_OWN = ("run_dir", "status")


def load_runs(paths, *, last: bool = False):
    """A pandas DataFrame of :func:`load_rows`: one row per round per run (each run's
    last round only when ``last``). Needs pandas (``pip install 'splitfed[data]'``).
    ``load_runs(...).to_csv(path)`` writes what ``metrics.csv`` used to hold, for many
    runs at once."""
    try:
        import pandas as pd
    except ImportError:
        raise ConfigError(f"load_runs needs pandas: {DATA_EXTRA}") from None
    rows, columns = _rows(paths, last)
    return pd.DataFrame.from_records(rows, columns=columns)


# ----------------------------------------------------------------------------- tables


def _bytes(record: dict) -> int:
    total = 0
    for key in ("bytes_up", "bytes_down"):
        v = record.get(key)
        if is_finite_number(v):
            total += int(v)
    return total


def _seconds(value: float) -> str:
    """Simulated seconds for the table: two decimals, or 4 significant digits below
    0.01 s (a nanosecond round printed 0.00) and from 10^12 s on (a 1e308 would print
    309 digits)."""
    return f"{value:.2f}" if value == 0 or 0.01 <= abs(value) < 1e12 else f"{value:.4g}"


def _acc(value) -> str:
    """An accuracy for the table: four decimals; 4 significant digits from 10^6 on (a
    hand-written 1e308 would print 309 digits) and below 10^-4 (not 0.0000)."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4f}" if value == 0 or 1e-4 <= abs(value) < 1e6 else f"{value:.4g}"


def summary_rows(paths, last: bool = True) -> list[dict]:
    """The rows of :func:`summary_table` as typed values. With ``last``, one row per run:
    ``run``, ``algorithm``, ``status``, ``diverged_round``, ``round`` (the last),
    ``final_test_acc`` (NaN for a diverged run), ``best_test_acc`` (the best before the
    divergence), ``bytes`` (up + down, all rounds), ``sim_time_s`` (simulated seconds,
    cumulative). Otherwise one row per round of each run, with ``test_acc`` (evaluated
    at that round, None when not) instead of ``final_test_acc``, and the best accuracy,
    bytes and time up to that round. A run with no record yet (an empty
    ``metrics.jsonl``) has one row, its ``round`` and accuracies None."""
    out = []
    for run in read_runs(paths):
        algorithm = run.config.get("algorithm.name", run.summary.get("algorithm"))
        numbers = run.numbers
        diverged = numbers["diverged_round"]
        total, best = 0, None
        for i, record in enumerate(run.records):
            total += _bytes(record)
            acc = record.get("test_acc")
            if is_finite_number(acc) and (diverged is None or record["round"] < diverged):
                best = float(acc) if best is None else max(best, float(acc))
            if last and i < len(run.records) - 1:
                continue
            sim = 0.0 if record["round"] == 0 else record.get("sim_time_s")
            row = {"run": run.name, "algorithm": algorithm, "status": run.status,
                   "diverged_round": diverged, "round": record["round"]}
            if last:
                row["final_test_acc"] = numbers["final_test_acc"]
            else:
                row["test_acc"] = acc if isinstance(acc, (int, float)) else None
            row.update({"best_test_acc": best, "bytes": total,
                        "sim_time_s": float(sim) if is_finite_number(sim) else None})
            out.append(row)
        if not run.records:                  # nothing recorded yet: a row that says so
            row = {"run": run.name, "algorithm": algorithm, "status": run.status,
                   "diverged_round": None, "round": None}
            row["final_test_acc" if last else "test_acc"] = None
            row.update({"best_test_acc": None, "bytes": 0, "sim_time_s": None})
            out.append(row)
    return out


def summary_table(paths, last: bool = True) -> str:
    """A plain-text table: one row per run (``last``) with its name, algorithm, status
    (``diverged (round N)`` for a diverged run), rounds, final and best test accuracy
    (final ``nan`` for a diverged run, best: before it diverged), MB sent (up + down,
    10^6 bytes) and simulated time (s); with ``last=False`` one row per round of each run
    (the test accuracy evaluated at that round, the best so far, the cumulative MB and
    time)."""
    rows = summary_rows(paths, last)
    head = ["run", "algorithm", "status", "rounds" if last else "round",
            "final acc" if last else "test acc", "best acc", "MB", "sim time (s)"]
    body = []
    for r in rows:
        status = r["status"]
        if r["diverged_round"] is not None:
            status = f"{status} (round {r['diverged_round']})"
        acc = r["final_test_acc"] if last else r["test_acc"]
        body.append([r["run"], str(r["algorithm"] or "n/a"), status,
                     "n/a" if r["round"] is None else str(r["round"]),
                     ("" if acc is None and not last else _acc(acc)),
                     _acc(r["best_test_acc"]), f"{r['bytes'] / 1e6:.2f}",
                     "n/a" if r["sim_time_s"] is None else _seconds(r["sim_time_s"])])
    return _text_table(head, body)


def _csv_cell(value):
    """A value as a CSV cell: lists and mappings as JSON text; text that a spreadsheet
    would run as a formula (it begins with ``=``, ``+``, ``-``, ``@``, a tab or a carriage
    return: a run named ``=HYPERLINK(...)``) is prefixed with ``'``, which spreadsheets
    show as text."""
    value = _cell(value)
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _text_table(head: list[str], body: list[list[str]]) -> str:
    body = [[escape_controls(c) for c in row] for row in body]   # text from files: one line
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
              for i, h in enumerate(head)]
    right = {3, 4, 5, 6, 7}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])]
                     + [line(row) for row in body])


def print_table(paths: str | Path | Sequence[str | Path], fmt: str = "table",
                last: bool = False, file=None) -> None:
    """What ``splitfed results`` prints: ``fmt="table"``: :func:`summary_table` (one row
    per round of each run, or per run with ``last``); ``fmt="csv"``: every column of
    :func:`load_rows` (every record, or each run's last with ``last``), the CSV that
    ``metrics.csv`` used to be, for any number of runs. Needs no pandas."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not a format; allowed: "
                          + ", ".join(FORMATS))
    out = sys.stdout if file is None else file
    if fmt == "csv":
        rows, columns = _rows(paths, last)
        head = {k: _csv_cell(str(k)) for k in columns}     # column names are text from
        out.write(csv_text([{head[k]: _csv_cell(v) for k, v in r.items() if k in head}
                            for r in rows], list(head.values())))      # files too
    else:
        out.write(summary_table(paths, last=last) + "\n")
    out.flush()
