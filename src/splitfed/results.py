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

import csv
import glob
import io
import json
import math
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from splitfed.errors import ConfigError, FormatError
from splitfed.files import MAX_SUMMARY_BYTES, NOT_REGULAR, escape_controls, read_regular
from splitfed.metrics import (RunningSummary, is_finite_number, iter_records,
                              loads_strict)

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


def _status(summary: dict) -> str:
    status = summary.get("status")
    return status if isinstance(status, str) else "unfinished"


def _run_columns(run_dir: Path, status: str, diverged: int | None, config: dict,
                 summary: dict) -> dict:
    """The columns of a run besides its records': its status, the round it diverged at, its
    flattened config and the provenance of its summary."""
    out: dict[str, Any] = {"run": run_dir.name, "run_dir": str(run_dir), "status": status,
                           "diverged_round": diverged,
                           "wall_time_s": summary.get("wall_time_s")}
    out.update(config)
    prov = summary.get("provenance")
    if isinstance(prov, Mapping):
        for key, column in PROVENANCE_COLUMNS.items():
            if key in prov:
                out[column] = prov[key]
    for key in ("threads", "cpu_capability"):            # the run's own, not the resume's
        if key in summary:
            out[key] = summary[key]
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


def _records(run_dir: Path, each: Callable[[dict], None]) -> Iterator[dict]:
    """The records of the run's ``metrics.jsonl`` (:func:`splitfed.metrics.iter_records`),
    each given to ``each`` as well; ConfigError when the file cannot be read."""
    path = run_dir / "metrics.jsonl"
    try:
        for record in iter_records(path):
            each(record)
            yield record
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror or e})") from None


def _scan(run_dir: Path, each: Callable[[dict], None]) -> tuple[dict, dict, dict]:
    """Read a run (its records, then its config and summary) keeping no record: each
    is given to ``each``. Returns the flattened config,
    the summary and :func:`splitfed.metrics.record_summary` of the records."""
    tally = RunningSummary()

    def add(record: dict) -> None:
        tally.add(record)
        each(record)

    for _ in _records(run_dir, add):
        pass
    config = _read_config(run_dir / "config.yaml")
    summary = _read_summary(run_dir / "summary.json")
    return config, summary, tally.summary(_status(summary))


# ----------------------------------------------------------------- compact storage


class _Values:
    """A sequence of JSON values in about 9 bytes each (a Python float or int takes 32
    with its pointer): the kind of each in one byte, numbers in an array of doubles (an
    int when it is one a double holds exactly), anything else (text, a bool-free
    rarity such as a list or an int beyond 2**53) in a dict by position."""

    _FLOAT, _INT, _NONE, _TRUE, _FALSE, _OTHER = range(6)
    _EXACT = 1 << 53

    __slots__ = ("kinds", "numbers", "others")

    def __init__(self) -> None:
        self.kinds = array("b")
        self.numbers = array("d")
        self.others: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.kinds)

    def append(self, value) -> None:
        number = 0.0
        if value is None:
            kind = self._NONE
        elif value is True or value is False:
            kind = self._TRUE if value else self._FALSE
        elif type(value) is float:
            kind, number = self._FLOAT, value
        elif type(value) is int and -self._EXACT <= value <= self._EXACT:
            kind, number = self._INT, float(value)
        else:
            kind = self._OTHER
            self.others[len(self.kinds)] = value
        self.kinds.append(kind)
        self.numbers.append(number)

    def set(self, i: int, value) -> None:
        """Replace the value at ``i`` (for the last row of a run, once it is read)."""
        self.others.pop(i, None)
        n = len(self.kinds)
        self.append(value)
        self.kinds[i], self.numbers[i] = self.kinds[n], self.numbers[n]
        if n in self.others:
            self.others[i] = self.others.pop(n)
        del self.kinds[n], self.numbers[n]

    def __getitem__(self, i: int):
        kind = self.kinds[i]
        if kind == self._FLOAT:
            v = self.numbers[i]
            return math.nan if v != v else v      # every NaN math.nan, as read_records
        if kind == self._INT:
            return int(self.numbers[i])
        if kind == self._NONE:
            return None
        if kind == self._TRUE:
            return True
        if kind == self._FALSE:
            return False
        return self.others[i]


class _Packed:
    """The records of a run, packed: their values in one :class:`_Values` (about 9 bytes
    a field), their keys as one tuple per distinct sequence of keys (the records of a
    run share a few), and 12 bytes a record for where its values begin and which keys
    it has. ``self[i]`` is record ``i`` again, equal to the one read (keys in order)."""

    def __init__(self) -> None:
        self.values = _Values()
        self.starts = array("Q")
        self.shapes = array("I")
        self.keys: list[tuple] = []
        self._shape: dict[tuple, int] = {}
        self._names: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.starts)

    def append(self, record: dict) -> tuple | None:
        """Keep ``record``; returns its keys when no record before had the same ones."""
        keys = tuple(record)
        shape = self._shape.get(keys)
        new = None
        if shape is None:
            shape = self._shape[keys] = len(self.keys)
            keys = tuple(self._names.setdefault(k, k) for k in keys)   # one copy of a name
            self.keys.append(keys)
            new = keys
        self.starts.append(len(self.values))
        self.shapes.append(shape)
        for value in record.values():
            self.values.append(value)
        return new

    def __getitem__(self, i: int) -> dict:
        start, values = self.starts[i], self.values
        return {k: values[start + j] for j, k in enumerate(self.keys[self.shapes[i]])}


class Rows(Sequence):
    """Rows of dicts built when they are asked for from compact storage: what
    :func:`load_rows` and :func:`summary_rows` return. A read-only sequence (``len``,
    indexing, slices, iteration, ``==`` with a list of the same dicts); ``list(rows)``
    makes it a list of dicts, many times the size of the records."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, Callable[[int], dict]]] = []
        self._ends: list[int] = []

    def _add(self, n: int, row: Callable[[int], dict]) -> None:
        self._parts.append((n, row))
        self._ends.append((self._ends[-1] if self._ends else 0) + n)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("row index out of range")
        i %= n
        from bisect import bisect_right
        part = bisect_right(self._ends, i)
        return self._parts[part][1](i - (self._ends[part - 1] if part else 0))

    def __iter__(self) -> Iterator[dict]:
        for n, row in self._parts:
            for i in range(n):
                yield row(i)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({len(self)} rows)"


# ------------------------------------------------------------------------------ rows


def load_rows(paths, *, last: bool = False) -> Rows:
    """One dict per round per run (only each run's last round when ``last``), with the
    columns of the module doc, as a :class:`Rows` sequence. The records are read as a
    stream and kept packed (about 9 bytes a field and 12 a record, below the size of
    ``metrics.jsonl``: a field takes at least 4 bytes there, most 15 to 30); a row's
    dict is built when it is asked for. With ``last`` only each run's last record is
    kept."""
    return _rows(paths, last)[0]


def _row(name: str, record: dict, extra: dict) -> dict:
    row = {"run": name, **record, **{k: v for k, v in extra.items() if k not in record}}
    row.update({"run": name, **{k: extra[k] for k in _OWN if k in extra}})
    return row


def _rows(paths, last: bool) -> tuple[Rows, list[str]]:
    """The rows and their columns: ``run``, the records' fields (in the order first
    seen), then the run's columns (status, config, provenance)."""
    rows, fields, extras = Rows(), {}, {}
    for d in run_dirs(paths):
        packed = _Packed()
        kept: list[dict] = []

        def keep(record: dict, packed=packed, kept=kept) -> None:
            if last:
                kept[:] = [record]
            else:
                keys = packed.append(record)
                if keys is not None:
                    fields.update(dict.fromkeys(keys))

        config, summary, numbers = _scan(d, keep)
        extra = {k: _cell(v) for k, v in _run_columns(
            d, _status(summary), numbers["diverged_round"], config, summary).items()}
        name = extra.pop("run")
        extras.update(dict.fromkeys(extra))        # those of no record are columns
        if last or not len(packed):
            for record in kept:
                fields.update(dict.fromkeys(record))
            records = kept or [{}]                 # a run with no record yet: a row of its own
            rows._add(len(records), lambda i, r=records, n=name, e=extra: _row(n, r[i], e))
        else:
            rows._add(len(packed), lambda i, p=packed, n=name, e=extra: _row(n, p[i], e))
    columns = ["run", *(k for k in fields if k != "run"),
               *(k for k in extras if k not in fields)]
    return rows, columns


#: the run's own columns, which a record's field of the same name does not replace
_OWN = ("run_dir", "status")


def load_runs(paths, *, last: bool = False):
    """A pandas DataFrame of :func:`load_rows`: one row per round per run (each run's
    last round only when ``last``). Needs pandas (``pip install 'splitfed[data]'``).
    ``load_runs(...).to_csv(path)`` writes what ``metrics.csv`` used to hold, for many
    runs at once. Memory: the packed rows of :func:`load_rows`, the DataFrame, and while
    it is built a tuple and an object pointer per cell (no dict per row)."""
    try:
        import pandas as pd
    except ImportError:
        raise ConfigError(f"load_runs needs pandas: {DATA_EXTRA}") from None
    rows, columns = _rows(paths, last)
    nan = float("nan")        # what a missing key of a dict row becomes in from_records
    return pd.DataFrame.from_records([tuple(row.get(k, nan) for k in columns)
                                      for row in rows], columns=columns)


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
    hand-written 1e308 would print 309 digits)."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


def summary_rows(paths, last: bool = True) -> list[dict] | Rows:
    """The rows of :func:`summary_table` as typed values. With ``last``, one row per run:
    ``run``, ``algorithm``, ``status``, ``diverged_round``, ``round`` (the last),
    ``final_test_acc`` (NaN for a diverged run), ``best_test_acc`` (the best before the
    divergence), ``bytes`` (up + down, all rounds), ``sim_time_s`` (simulated seconds,
    cumulative). Otherwise one row per round of each run, with ``test_acc`` (evaluated
    at that round, None when not) instead of ``final_test_acc``, and the best accuracy,
    bytes and time up to that round. A run with no record yet (an empty
    ``metrics.jsonl``) has one row, its ``round`` and accuracies None.

    The records are read as a stream. With ``last`` a list, and memory holds one record
    and a few numbers per run, whatever the size of ``metrics.jsonl``; otherwise a
    :class:`Rows` sequence whose dicts are built when asked for, from five packed
    numbers a round (about 45 bytes: less than a record's line)."""
    out: list[dict] = []
    rows = Rows()
    for d in run_dirs(paths):
        kept: list[dict] = []
        table = [_Values() for _ in range(5)]   # round, test_acc, best, bytes, sim time
        tally = RunningSummary()
        total = 0

        def each(record: dict, kept=kept, table=table, tally=tally) -> None:
            nonlocal total
            total += _bytes(record)
            tally.add(record)      # its best: of the rounds before a non-finite one so far
            sim = 0.0 if record["round"] == 0 else record.get("sim_time_s")
            sim = float(sim) if is_finite_number(sim) else None
            if last:
                kept[:] = [record, total, sim]
                return
            acc = record.get("test_acc")
            for column, value in zip(table, (record["round"], acc if isinstance(
                    acc, (int, float)) else None, tally.best, total, sim)):
                column.append(value)

        config, summary, numbers = _scan(d, each)
        # the records (so the best accuracy of each round) were read before the summary
        # that says whether the run diverged at its last round: of such a run, the last
        # round's best is the best before it (RunningSummary.summary)
        status, diverged = _status(summary), numbers["diverged_round"]
        n = len(table[0])
        if n and tally.nonfinite_round is None and diverged is not None:
            table[2].set(n - 1, numbers["best_test_acc"])
        head = {"run": d.name, "algorithm": config.get("algorithm.name",
                                                         summary.get("algorithm")),
                "status": status, "diverged_round": diverged}
        if kept:
            record, total_bytes, sim = kept
            out.append({**head, "round": record["round"],
                        "final_test_acc": numbers["final_test_acc"],
                        "best_test_acc": numbers["best_test_acc"], "bytes": total_bytes,
                        "sim_time_s": sim})
        elif n:
            rows._add(n, lambda i, h=head, t=table: {
                **h, "round": t[0][i], "test_acc": t[1][i], "best_test_acc": t[2][i],
                "bytes": t[3][i], "sim_time_s": t[4][i]})
        if not tally.count:                       # nothing recorded yet: a row that says so
            row = {**head, "diverged_round": None, "round": None}
            row["final_test_acc" if last else "test_acc"] = None
            row.update({"best_test_acc": None, "bytes": 0, "sim_time_s": None})
            if last:
                out.append(row)
            else:
                rows._add(1, lambda i, r=row: dict(r))
    return out if last else rows


def summary_table(paths, last: bool = True) -> str:
    """A plain-text table: one row per run (``last``) with its name, algorithm, status
    (``diverged (round N)`` for a diverged run), rounds, final and best test accuracy
    (final ``nan`` for a diverged run, best: before it diverged), MB sent (up + down,
    10^6 bytes) and simulated time (s); with ``last=False`` one row per round of each run
    (the test accuracy evaluated at that round, the best so far, the cumulative MB and
    time). Memory: that of :func:`summary_rows` and the text."""
    return "\n".join(_table_lines(summary_rows(paths, last), last))


_HEAD_LAST = ["run", "algorithm", "status", "rounds", "final acc", "best acc", "MB",
              "sim time (s)"]
_HEAD_ROUNDS = ["run", "algorithm", "status", "round", "test acc", "best acc", "MB",
                "sim time (s)"]


def _cells(rows: Iterable[dict], last: bool) -> Iterator[list[str]]:
    for r in rows:
        status = r["status"]
        if r["diverged_round"] is not None:
            status = f"{status} (round {r['diverged_round']})"
        acc = r["final_test_acc"] if last else r["test_acc"]
        yield [escape_controls(c) for c in (   # text from files: one line
            r["run"], str(r["algorithm"] or "n/a"), status,
            "n/a" if r["round"] is None else str(r["round"]),
            ("" if acc is None and not last else _acc(acc)),
            _acc(r["best_test_acc"]), f"{r['bytes'] / 1e6:.2f}",
            "n/a" if r["sim_time_s"] is None else _seconds(r["sim_time_s"]))]


def _table_lines(rows: Sequence[dict], last: bool) -> Iterator[str]:
    """The lines of the table of ``rows``: the cells are made twice (for the widths of
    the columns, then for the lines), so that no more than a line is held at a time."""
    head = _HEAD_LAST if last else _HEAD_ROUNDS
    widths = [len(h) for h in head]
    for cells in _cells(rows, last):
        widths = [max(w, len(c)) for w, c in zip(widths, cells)]
    right = {3, 4, 5, 6, 7}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    yield line(head)
    yield line(["-" * w for w in widths])
    for cells in _cells(rows, last):
        yield line(cells)


def _csv_cell(value):
    """A value as a CSV cell: lists and mappings as JSON text; text that a spreadsheet
    would run as a formula (it begins with ``=``, ``+``, ``-``, ``@``, a tab or a carriage
    return: a run named ``=HYPERLINK(...)``) is prefixed with ``'``, which spreadsheets
    show as text."""
    value = _cell(value)
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def print_table(paths: str | Path | Sequence[str | Path], fmt: str = "table",
                last: bool = False, file=None) -> None:
    """What ``splitfed results`` prints: ``fmt="table"``: :func:`summary_table` (one row
    per round of each run, or per run with ``last``); ``fmt="csv"``: every column of
    :func:`load_rows` (every record, or each run's last with ``last``), the CSV that
    ``metrics.csv`` used to be, for any number of runs. Needs no pandas."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not a format; allowed: "
                          + ", ".join(FORMATS))
    if fmt == "csv":
        rows, columns = _rows(paths, last)
        lines: Iterable[str] = _csv_lines(rows, columns)
    else:
        lines = (line + "\n" for line in _table_lines(summary_rows(paths, last), last))
    out = sys.stdout if file is None else file
    for text in lines:                # every file is read before the first line is written
        out.write(text)
    out.flush()


def _csv_lines(rows: Rows, columns: list[str]) -> Iterator[str]:
    """``rows`` as CSV text (:func:`splitfed.metrics.csv_text`: a header, then each row),
    in pieces of a few thousand rows."""
    head = {k: _csv_cell(str(k)) for k in columns}     # column names are text from files
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=list(head.values()), extrasaction="ignore")
    writer.writeheader()
    for i, r in enumerate(rows, 1):
        writer.writerow({head[k]: _csv_cell(v) for k, v in r.items() if k in head})
        if i % 4096 == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()
