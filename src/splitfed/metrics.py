"""Where a run's numbers go: one JSON line per record (``metrics.jsonl``), a summary.

Algorithms return metrics; only the round loop logs them, through this interface.

Non-finite numbers: a record keeps a NaN or an infinity as a float, in memory and on
disk, where it is written as the token ``NaN``, ``Infinity`` or ``-Infinity`` (what
Python's :mod:`json` writes and reads back; strict JSON parsers need an option for it).
:func:`read_records` gives floats back, also for the text ``"nan"`` that earlier
versions wrote.

Divergence, one definition for every command (:func:`divergence`): a run diverges at the
first round whose ``train_loss``, ``test_loss`` or ``test_acc`` is not finite; the round
loop stops it there with status ``diverged``. Its final accuracy is NaN, its best
accuracy the best evaluated before that round (:func:`record_summary`).

``metrics.csv`` is no longer written by every run: ``splitfed results RUN_DIR --format
csv`` or :func:`splitfed.results.load_runs` give it on demand (:func:`write_csv`).
"""

from __future__ import annotations

import codecs
import csv
import errno
import io
import json
import math
import numbers
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from splitfed.errors import FormatError
from splitfed.files import MAX_JSON_DEPTH, atomic_write, iter_regular

#: the largest ``metrics.jsonl`` read back (far above any real run's records)
MAX_METRICS_BYTES = 1 << 30

#: the largest round number and byte count a record may hold (a 64-bit counter's)
MAX_COUNT = 2**63 - 1

#: the record fields that count bytes (integers 0..MAX_COUNT), besides those beginning
#: with one of :data:`COUNT_PREFIXES` (``bytes_up/model``, ``wire_down/activations``)
COUNT_KEYS = ("bytes_up", "bytes_down", "wire_up", "wire_down", "overhead_bytes",
              "server_param_bytes")
COUNT_PREFIXES = ("bytes_up/", "bytes_down/", "wire_up/", "wire_down/")

#: the record fields whose non-finite value makes a run diverge (:func:`divergence`)
DIVERGENCE_KEYS = ("train_loss", "test_loss", "test_acc")

#: the texts earlier versions wrote for non-finite floats, read back as floats
_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf,
                   "infinity": math.inf, "-infinity": -math.inf}


def _number(v):
    """``v`` as a plain Python value: a numpy scalar becomes an int or a float, and a NaN
    the one object :data:`math.nan`, so that records holding NaN compare equal (``==``
    on lists and dicts takes an identical object as equal)."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return math.nan if v != v else v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        v = float(v)
        return math.nan if v != v else v
    return v


class MetricLogger:
    """Appends records to ``metrics.jsonl`` (flushed per record) and keeps them in memory.

    ``sinks``: objects with ``log(record)`` and ``close(status)`` (:mod:`splitfed.tracking`:
    TensorBoard, MLflow) that receive every record after it is written; they are closed
    by :meth:`close`, with the run's status."""

    def __init__(self, run_dir: str | Path | None, sinks: Iterable | None = None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.records: list[dict] = []
        self.sinks = list(sinks or [])
        self._fh = None
        if self.run_dir is not None:
            self._fh = _open_append(self.run_dir / "metrics.jsonl")

    def log(self, record: dict) -> None:
        record = {k: _number(v) for k, v in record.items()}
        self.records.append(record)
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")     # NaN stays NaN (allow_nan)
            self._fh.flush()
        for sink in self.sinks:
            sink.log(record)

    def sync(self) -> None:
        """Make the records written so far durable (``fsync``): a checkpoint that counts
        them is written after this, so a crash of the machine cannot leave a checkpoint
        whose records were lost."""
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self, status: str = "completed") -> None:
        """Close the file and the sinks (each sink is closed even if another fails)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        sinks, self.sinks = self.sinks, []
        error = None
        for sink in sinks:
            try:
                sink.close(status)
            except Exception as e:  # noqa: BLE001 - close the others, then raise it
                error = error or e
        if error is not None:
            raise error


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


def decode_record(record: dict) -> dict:
    """``record`` as read from JSON, as :class:`MetricLogger` keeps it in memory: the
    non-finite numbers earlier versions wrote as text (``"nan"``, ``"inf"``, ``"-inf"``)
    turned back into floats, every NaN the object :data:`math.nan`."""
    out = {}
    for k, v in record.items():
        if isinstance(v, str) and v.strip().lower() in _NONFINITE_TEXT:
            v = _NONFINITE_TEXT[v.strip().lower()]
        out[k] = _number(v)
    return out


class _Refused(ValueError):
    """What :func:`loads_strict` refuses in a well-formed JSON text."""


def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"the key {key!r} appears twice in one object")
    return out


def _parse(text: str | bytes) -> tuple[object, str | None]:
    """``text`` parsed as :func:`loads_strict` does, and the first number in it beyond
    the range of a float (its text), None when there is none: the caller says which
    fault it names first."""

    too_big: list[str] = []

    def parse_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            too_big.append(literal)
        return value

    def parse_int(literal: str) -> int:
        value = int(literal)
        try:
            float(value)
        except OverflowError:
            too_big.append(literal[:24] + "...")
        return value

    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=parse_float,
                          parse_int=parse_int)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:                                # without recursion: any depth is safe
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        items = node.values() if isinstance(node, dict) else node
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return data, (too_big[0] if too_big else None)


def _too_big(literal: str) -> str:
    return f"the number {literal} is beyond the range of a float"


def loads_strict(text: str | bytes):
    """A JSON document of a run directory (a ``metrics.jsonl`` line, ``summary.json``), as
    splitfed writes them: ``ValueError`` for a malformed one, one nested deeper than
    :data:`splitfed.safeio.MAX_JSON_DEPTH` levels, an object with a key twice, or a
    number beyond the range of a float (``1e400``, an integer of more than 308 digits).
    The tokens ``NaN``, ``Infinity`` and ``-Infinity`` are read as floats."""
    data, too_big = _parse(text)
    if too_big is not None:
        raise _Refused(_too_big(too_big))
    return data


def is_count_key(key: str) -> bool:
    """True for the record fields that count bytes (:data:`COUNT_KEYS` and the per-kind
    ``bytes_up/<kind>``, ``bytes_down/<kind>``, ``wire_up/<kind>``, ``wire_down/<kind>``)."""
    return key in COUNT_KEYS or key.startswith(COUNT_PREFIXES)


#: the record keys the round loop writes itself (no metric may take one, nor a byte
#: count's name: ``bytes_up``, ``bytes_down/<kind>``, ``wire_up`` ..., :func:`is_count_key`):
#: the round's, the ledger's, the clock's, the evaluation's and the costs
RESERVED_KEYS = ("round", "participants", "clients_used", "train_loss", "test_acc",
                 "test_loss", "sim_round_s", "sim_time_s", "slowest_client", "dropped",
                 "round_time_s", "client_macs", "server_macs", "server_param_bytes")


def metric_problem(key: Any, value: Any) -> str | None:
    """What is wrong with a round's metric ``key`` = ``value`` (an algorithm's, or a
    server step's ``ctx.metrics``), as "the metric ... ; a metric is ..."; None when it is
    a metric: a name that is no field of the record, a real number a float can hold, or
    None."""
    if not isinstance(key, str) or key in RESERVED_KEYS or is_count_key(key):
        return (f"the metric name {key!r:.60}; a metric is named by a string other than "
                f"the record's own fields ({', '.join(RESERVED_KEYS)}, bytes_up, "
                "bytes_down, wire_up, wire_down and their '/<kind>' parts)")
    if value is None:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return (f"the metric {key!r} = {value!r:.60} ({type(value).__name__}); a metric "
                "is a real number or None (float(x))")
    try:
        float(value)
    except OverflowError:
        return (f"the metric {key!r} = {str(value)[:40]}, beyond the range of a float; a "
                "metric is a real number a float can hold (NaN and infinities too)")
    return None


#: the fields splitfed always writes as numbers (NaN and infinities included)
NUMBER_KEYS = ("test_acc", "test_loss", "train_loss", "sim_time_s", "sim_round_s",
               "round_time_s")


def _check_record(record: dict, too_big: str | None) -> str | None:
    """Why ``record`` is not a metrics record (None when it is one): ``round`` must be an
    integer 0..MAX_COUNT, no number beyond the range of a float (``too_big``: the first
    one's text), every byte count an integer 0..MAX_COUNT."""
    r = record.get("round")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= MAX_COUNT:
        return f" has no round number (an integer 0..{MAX_COUNT})"
    if too_big is not None:
        return f": {_too_big(too_big)}"
    for key, value in record.items():
        if is_count_key(key) and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= MAX_COUNT):
            shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
            return (f" has {key} = {shown}; a byte count is an integer 0..{MAX_COUNT}")
    return None


def read_records(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, checked: every non-blank line a JSON
    object (:func:`loads_strict`: no key twice, no number beyond the range of a float)
    with an integer ``round`` 0..MAX_COUNT greater than the previous line's, byte
    counts (:func:`is_count_key`) that are integers 0..MAX_COUNT, and numbers (not
    booleans) in the fields of :data:`NUMBER_KEYS`, each line at most
    :data:`MAX_RECORD_BYTES` long. Non-finite numbers written as ``NaN``/``Infinity``
    come back as floats (:func:`decode_record`).

    Raises :class:`FormatError` naming the file and line when it is not such a file
    (torn, truncated, foreign, edited), or naming the file when it is not a regular file
    (a pipe, a device) or is larger than :data:`MAX_METRICS_BYTES`; :class:`OSError`
    when it cannot be read. :func:`iter_records` gives the same records one at a time.
    """
    return list(iter_records(path))


#: the longest line of ``metrics.jsonl`` read back: a record is a flat object of numbers
#: (a few hundred bytes; one with a metric for each of 10,000 clients is under 1 MiB),
#: and parsing a line takes many times its length in memory
MAX_RECORD_BYTES = 1 << 22


#: the bytes of metrics.jsonl read at a time
_PIECE = 1 << 16


def iter_records(path: str | Path) -> Iterator[dict]:
    """The records of :func:`read_records`, checked the same way and with the same
    errors, read as a stream: memory holds one piece of the file (64 KiB) and one line
    (at most :data:`MAX_RECORD_BYTES`), whatever the file's size. The file is checked
    when the first record is asked for. A fault is raised where it is found, once the
    rest of the file has been read for the faults :func:`read_records` names first (a
    file larger than allowed, bytes that are not UTF-8), so every reader names the same
    one; the records given before it are of a file that is then refused."""
    path = Path(path)
    lines = _lines(iter_regular(path, str(path), MAX_METRICS_BYTES, chunk=_PIECE))
    previous: int | None = None
    for n, (start, raw, bad) in enumerate(lines, 1):
        if bad is None and raw is not None:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = start + e.start
        if bad is not None:
            _drain(lines, None)                   # only a larger file is named first
            raise _not_utf8(path, bad)
        try:
            if raw is None:
                raise FormatError(f"{path}: line {n} is longer than the {MAX_RECORD_BYTES} "
                                  "bytes a record may have; not a metrics file as splitfed "
                                  "writes it")
            record = _line_record(path, n, line, previous)
        except FormatError:
            _drain(lines, path)                   # a larger file, bytes not UTF-8 first
            raise
        if record is not None:
            previous = record["round"]
            yield record


def _not_utf8(path: Path, at: int) -> FormatError:
    return FormatError(f"{path}: not a metrics file (not UTF-8 text at byte {at})")


def _lines(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes | None, int | None]]:
    """The lines of a file read in ``chunks``, separated by ``\\n`` only (as
    ``str.split("\\n")``: the piece after the last ``\\n`` is a line, maybe empty):
    ``(offset of the line's first byte, its bytes without the newline, None)``. A line
    longer than :data:`MAX_RECORD_BYTES` is not kept: it comes as ``(offset, None, the
    offset of its first byte that is not UTF-8, or None)``."""
    pending, start = bytearray(), 0
    long_utf8 = None          # a too long line's decoder, and its first bad byte
    bad: int | None = None
    seen = 0                  # bytes of the file before the current chunk
    for chunk in chunks:
        pos = 0
        while pos < len(chunk):
            end = chunk.find(b"\n", pos)
            stop = len(chunk) if end < 0 else end
            if long_utf8 is not None:
                if bad is None:
                    bad = _feed(long_utf8, chunk[pos:stop], seen + pos)
            else:
                pending += chunk[pos:stop]
                if len(pending) > MAX_RECORD_BYTES:     # keep no more of it
                    long_utf8 = codecs.getincrementaldecoder("utf-8")()
                    bad = _feed(long_utf8, bytes(pending), start)
                    pending = bytearray()
            if end < 0:
                break
            yield _line(start, seen + end, pending, long_utf8, bad)
            pending, long_utf8, bad = bytearray(), None, None
            start = seen + end + 1
            pos = end + 1
        seen += len(chunk)
    yield _line(start, seen, pending, long_utf8, bad)


def _line(start: int, end: int, pending: bytearray, long_utf8, bad: int | None):
    """What :func:`_lines` gives for the line from ``start`` to ``end`` (its newline)."""
    if long_utf8 is None:
        return start, bytes(pending), None
    if bad is None:                           # a character cut by the end of the line
        bad = _feed(long_utf8, b"", end, final=True)
    return start, None, bad


def _feed(decoder, data: bytes, offset: int, final: bool = False) -> int | None:
    """Feed ``data`` (at ``offset`` in the file) to an incremental UTF-8 decoder; the
    offset of the first byte that is not UTF-8, None when there is none so far."""
    held = decoder.getstate()[0]
    try:
        decoder.decode(data, final)
    except UnicodeDecodeError as e:
        return offset - len(held) + e.start
    return None


def _drain(lines: Iterator, path: Path | None) -> None:
    """Read the rest of the file (for its size check) and, given ``path``, raise the
    first byte that is not UTF-8 in it."""
    for start, raw, bad in lines:
        if path is None:
            continue
        if bad is not None:
            raise _not_utf8(path, bad)
        if raw is None:
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(path, start + e.start) from None


def _line_record(path: Path, n: int, line: str, previous: int | None) -> dict | None:
    """Line ``n`` of a metrics file as a record, checked (:func:`read_records`); None for
    a blank line."""
    if not line.strip():
        return None
    try:
        record, too_big = _parse(line)
    except _Refused as e:
        raise FormatError(f"{path}: line {n}: {e}; not a metrics file as splitfed "
                          "writes it") from None
    except ValueError as e:
        raise FormatError(f"{path}: line {n} is not a JSON record ({e}); the file is "
                          "torn or not a metrics file") from None
    if not isinstance(record, dict):
        raise FormatError(f"{path}: line {n} is not a JSON object; not a metrics file")
    why = _check_record(record, too_big)
    if why is not None:
        raise FormatError(f"{path}: line {n}{why}; not a metrics file")
    if previous is not None and record["round"] <= previous:
        raise FormatError(f"{path}: line {n} is of round {record['round']}, after round "
                          f"{previous}; rounds must increase (a record "
                          "repeated or out of order: the file was edited or joined)")
    record = decode_record(record)
    wrong = next((k for k in NUMBER_KEYS if k in record
                  and (isinstance(record[k], bool)
                       or not isinstance(record[k], (int, float)))), None)
    if wrong is not None:
        shown = str(record[wrong])[:40]
        raise FormatError(f"{path}: line {n} has {wrong} = {shown!r}, not a number; not a "
                          "metrics file as splitfed writes it")
    return record


def write_csv(records: list[dict], path: Path) -> None:
    """The records as CSV (a column per field, in the order first seen), written
    atomically; non-finite numbers as ``nan``, ``inf``, ``-inf``."""
    data = csv_text(records).encode("utf-8")

    atomic_write(path, lambda fh: fh.write(data))   # replaces a link, never its target


def csv_text(rows: list[dict], columns: list[str] | None = None) -> str:
    """``rows`` as CSV text with a header; ``columns`` default to every key, in the order
    first seen. A missing value is an empty cell."""
    if columns is None:
        columns = []
        seen = set()
        for r in rows:
            for k in r:
                if k not in seen:
                    seen.add(k)
                    columns.append(k)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


# ------------------------------------------------------------------------ numbers


def is_finite_number(v) -> bool:
    """True for an int within the range of a float or a finite float (not a bool, not
    None, not text)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:                      # an int beyond the range of a float
        return False


def _non_finite(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, numbers.Real):
        return not math.isfinite(float(v))
    return isinstance(v, str) and v.strip().lower() in _NONFINITE_TEXT


def divergence(records: Iterable[dict]) -> int | None:
    """The round at which the run diverged: the first record whose ``train_loss``,
    ``test_loss`` or ``test_acc`` is not finite (NaN or infinite; also the text
    ``"nan"`` of files written by earlier versions); None when every one is finite."""
    for r in records:
        if any(_non_finite(r.get(k)) for k in DIVERGENCE_KEYS):
            return int(r["round"])
    return None


def record_summary(records: list[dict], status: str | None = None) -> dict:
    """What a run's records say, by the one definition used everywhere (summary.json,
    ``splitfed run``'s line, ``splitfed results``, sweeps and studies):

    - ``rounds``: the last round recorded (None without records);
    - ``diverged_round``: :func:`divergence` (or, when ``status`` is ``diverged`` and no
      record shows a non-finite value, the last round), else None;
    - ``final_test_acc``: NaN for a diverged run; else the last evaluated test accuracy
      (None when none was evaluated);
    - ``best_test_acc``: the best finite test accuracy of the rounds before the
      divergence (all rounds when it did not diverge); None when there is none.
    """
    diverged = diverged_round(records, status)
    before = before_divergence(records, diverged)
    accs = [float(r["test_acc"]) for r in before if is_finite_number(r.get("test_acc"))]
    if diverged is not None:
        final = math.nan
    else:
        final = last_value(records, "test_acc")
        final = None if final is None else float(final)
    return {"rounds": last_value(records, "round"), "diverged_round": diverged,
            "final_test_acc": final, "best_test_acc": max(accs) if accs else None}


class RunningSummary:
    """:func:`record_summary` of records given one at a time (:meth:`add`) in the order
    of their rounds, as :func:`iter_records` gives them, in constant memory: a reader
    of a long ``metrics.jsonl`` keeps no record. ``best`` is, after each record, the best
    finite test accuracy of the records so far that came before the first non-finite
    one (the best so far of a run whose records show its divergence)."""

    def __init__(self) -> None:
        self.count = 0
        self.last_round = None
        self.nonfinite_round: int | None = None    # divergence() of the records so far
        self.best: float | None = None
        self.best_before_last: float | None = None
        self._final = None                          # last_value(records, "test_acc")

    def add(self, record: dict) -> None:
        self.count += 1
        self.best_before_last = self.best
        if self.nonfinite_round is None:
            if any(_non_finite(record.get(k)) for k in DIVERGENCE_KEYS):
                self.nonfinite_round = int(record["round"])
            elif is_finite_number(record.get("test_acc")):
                acc = float(record["test_acc"])
                self.best = acc if self.best is None else max(self.best, acc)
        if "round" in record:
            self.last_round = record["round"]
        if "test_acc" in record:
            self._final = record["test_acc"]

    def summary(self, status: str | None = None) -> dict:
        """:func:`record_summary` of the records added, for a run of ``status``."""
        diverged, best = self.nonfinite_round, self.best
        if diverged is None and status == "diverged" and self.count:
            diverged, best = int(self.last_round), self.best_before_last   # the last round
        if diverged is not None:
            final = math.nan
        else:
            final = None if self._final is None else float(self._final)
        return {"rounds": self.last_round, "diverged_round": diverged,
                "final_test_acc": final, "best_test_acc": best}


def diverged_round(records: list[dict], status: str | None = None) -> int | None:
    """The round the run diverged at: :func:`divergence`, or, when ``status`` is
    ``diverged`` and no record shows a non-finite value, the last round; else None."""
    diverged = divergence(records)
    if diverged is None and status == "diverged" and records:
        diverged = int(records[-1]["round"])
    return diverged


def before_divergence(records: list[dict], diverged: int | None) -> list[dict]:
    """The records of the rounds before ``diverged`` (all of them when it is None): the
    rounds whose test accuracy is the model's, for the best accuracy and the rounds and
    time to a target."""
    return [r for r in records if diverged is None or r.get("round", 0) < diverged]


def last_value(records: list[dict], key: str):
    for r in reversed(records):
        if key in r:
            return r[key]
    return None


def best_value(records: list[dict], key: str):
    """The largest finite value of ``key`` (None when there is none); for test accuracy
    use :func:`record_summary`, which stops at the divergence."""
    vals = [r[key] for r in records if is_finite_number(r.get(key))]
    return max(vals) if vals else None
