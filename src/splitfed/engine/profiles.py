"""Client and server profiles: how fast each party computes and talks, and when it is there.

Units: compute in multiply-accumulates per second (MAC/s, the unit of
:mod:`splitfed.engine.flops`), links in bytes per second, times in seconds. A profile is
data (:class:`Profiles`); the :class:`~splitfed.engine.clock.VirtualClock` turns the MACs
and bytes of a round into simulated seconds with it.

Generators (config ``clock.profile``; their keyword arguments are the ``clock`` options):

- ``fixed``: the given speeds, a number (every client) or a list (one per client).
  Defaults: clients 1e9 MAC/s, uplink 1.25e6 B/s (10 Mbit/s), downlink 5e6 B/s
  (40 Mbit/s), server 1e11 MAC/s.
- ``exponential`` (paper 001 Sec. 5, following GAS and Reisizadeh et al. 2022): the
  fixed speeds, with each client's computation time multiplied every round by an
  independent draw from an exponential distribution of mean ``mean`` (straggling
  compute); ``per_round=false`` draws the multiplier once per client (heterogeneous but
  constant capacities). ``delay_mean`` > 0 adds an exponential delay (seconds) to the
  start of every participant's round.
- ``fedscale``: a FedScale-style cost model: per-client compute speed and link rates
  drawn once from log-normal distributions (medians ``*_median``, log-space standard
  deviations ``compute_sigma`` and ``bandwidth_sigma``); a sample's time is the MACs of
  its side of the cut over the speed, a transfer's time its bytes over the rate.
- ``trace``: a CSV file, one row per client, columns ``client_id``,
  ``compute_macs_per_s``, ``uplink_bytes_per_s``, ``downlink_bytes_per_s`` and optionally
  ``available_from`` / ``available_until`` (seconds of simulated time; an empty cell is
  unbounded). A client is available in a round when ``available_from <= start <
  available_until`` at the round's start; the clock takes unavailable clients out of the
  round's cohort and counts them as dropped.

Every speed, rate, distribution parameter and trace number is 0 (where allowed) or
within float32's range in magnitude (about 1.2e-38 .. 3.4e38, as every float of a config:
:mod:`splitfed.configtools`), so that simulated times stay finite.

Every random draw comes from the clock's own stream (``streams.numpy("clock")``): at
construction (``fedscale``, ``exponential`` with ``per_round=false``) and once per round
for all clients (``exponential``), so timelines are reproducible for a seed and never
disturb the learning's random streams.
"""

from __future__ import annotations

import csv
import inspect
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitfed.configtools import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FLOAT_RANGE_TEXT,
    as_number,
    show,
    typed_options,
)
from splitfed.errors import ConfigError
from splitfed.origins import call_plugin, component

CLIENT_COMPUTE = 1e9      # MAC/s
SERVER_COMPUTE = 1e11     # MAC/s
UPLINK = 1.25e6           # bytes/s (10 Mbit/s)
DOWNLINK = 5e6            # bytes/s (40 Mbit/s)


@dataclass
class Profiles:
    """Per-client speeds [N] and the server's speed; optional availability windows."""

    compute: np.ndarray                        # client MAC/s
    uplink: np.ndarray                         # client -> server bytes/s
    downlink: np.ndarray                       # server -> client bytes/s
    server_compute: float                      # MAC/s of the server (of each server lane)
    available_from: np.ndarray | None = None   # seconds; None: always available
    available_until: np.ndarray | None = None
    slowdown_mean: float | None = None         # per-round exponential compute-time factor
    delay_mean: float | None = None            # per-round exponential start delay (s)

    def __post_init__(self):
        speeds = {name: np.asarray(getattr(self, name), dtype=np.float64).reshape(-1)
                  for name in ("compute", "uplink", "downlink")}
        windows = {name: np.asarray(getattr(self, name), dtype=np.float64).reshape(-1)
                   for name in ("available_from", "available_until")
                   if getattr(self, name) is not None}
        n = _clients_of({**speeds, **windows})
        for name, v in speeds.items():
            if not (np.isfinite(v).all() and (v > 0).all()):
                raise ValueError(f"{name}: expected {n} positive finite values")
            setattr(self, name, v)
        if not (math.isfinite(self.server_compute) and self.server_compute > 0):
            raise ValueError(f"server_compute: expected a positive number, "
                             f"got {self.server_compute}")
        self.server_compute = float(self.server_compute)
        if windows:
            self.available_from = windows.get("available_from", np.full(n, -np.inf))
            self.available_until = windows.get("available_until", np.full(n, np.inf))

    @property
    def num_clients(self) -> int:
        return len(self.compute)

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One round's compute-time multipliers and start delays, for every client."""
        n = self.num_clients
        scale = (rng.exponential(self.slowdown_mean, n) if self.slowdown_mean
                 else np.ones(n))
        delay = rng.exponential(self.delay_mean, n) if self.delay_mean else np.zeros(n)
        return scale, delay

    def never_available(self) -> np.ndarray:
        """Which clients no round can ever include: their availability window is empty
        or ends at or before simulated time 0, where the first round starts (simulated
        time never goes back)."""
        if self.available_from is None:
            return np.zeros(self.num_clients, dtype=bool)
        return ((self.available_until <= np.maximum(self.available_from, 0.0))
                | (self.available_until <= 0.0))

    def available(self, ids: np.ndarray, t: float) -> np.ndarray:
        """Which of ``ids`` are available at simulated time ``t``."""
        if self.available_from is None:
            return np.ones(len(ids), dtype=bool)
        return (self.available_from[ids] <= t) & (t < self.available_until[ids])


def _clients_of(fields: dict[str, np.ndarray]) -> int:
    """The number of clients that the per-client ``fields`` (``{name: values}``) agree
    on; ValueError naming the fields whose number of values differs from the one most of
    them have, or every field where no number is the most common."""
    lengths = {name: len(v) for name, v in fields.items()}
    counts = Counter(lengths.values()).most_common()
    if len(counts) == 1:
        return counts[0][0]
    if counts[0][1] == counts[1][1]:
        odd, others = list(lengths), []
    else:
        odd = [name for name, k in lengths.items() if k != counts[0][0]]
        others = [name for name in lengths if name not in odd]
    got = f"{_listing([str(lengths[name]) for name in odd])} values"
    if others:
        verb = "has" if len(others) == 1 else "have"
        got += f", but {_listing(others)} {verb} {counts[0][0]}"
    raise ValueError(f"{_listing(odd)}: {got}; expected one value per client in each")


def _listing(words: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


def _per_client(value, n: int, name: str) -> np.ndarray:
    """A speed option: one positive number for every client, or a list of ``n``."""
    wanted = f"one positive number or a list of {n} (one per client)"
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    numbers = [as_number(item) for item in items]
    if None in numbers:
        raise ConfigError(f"clock.{name}: expected {wanted}, got {show(value)}")
    v = np.asarray(numbers, dtype=np.float64)
    if not isinstance(value, (list, tuple)):
        v = np.full(n, v[0])
    if v.shape != (n,):
        raise ConfigError(f"clock.{name}: expected {wanted}, got {len(v)} values")
    if not ((v >= FLOAT32_TINY) & (v <= FLOAT32_MAX)).all():
        raise ConfigError(f"clock.{name}: speeds must be positive numbers from "
                          f"{FLOAT32_TINY:.2g} to {FLOAT32_MAX:.2g}")
    return v


def fixed(num_clients: int, rng: np.random.Generator, *, client_compute=CLIENT_COMPUTE,
          uplink=UPLINK, downlink=DOWNLINK, server_compute: float = SERVER_COMPUTE
          ) -> Profiles:
    """The given speeds (numbers or per-client lists); draws nothing."""
    n = num_clients
    return Profiles(_per_client(client_compute, n, "client_compute"),
                    _per_client(uplink, n, "uplink"), _per_client(downlink, n, "downlink"),
                    float(server_compute))


def exponential(num_clients: int, rng: np.random.Generator, *, mean: float = 1.0,
                per_round: bool = True, delay_mean: float = 0.0,
                client_compute=CLIENT_COMPUTE, uplink=UPLINK, downlink=DOWNLINK,
                server_compute: float = SERVER_COMPUTE) -> Profiles:
    """Computation times scaled by Exp(``mean``) draws (paper 001 Sec. 5; GAS)."""
    if not 0 < mean < math.inf:
        raise ConfigError(f"clock.mean: must be a finite number > 0 (exponential), got {mean}")
    if not 0 <= delay_mean < math.inf:
        raise ConfigError(f"clock.delay_mean: must be a finite number >= 0 (exponential), "
                          f"got {delay_mean}")
    p = fixed(num_clients, rng, client_compute=client_compute, uplink=uplink,
              downlink=downlink, server_compute=server_compute)
    if per_round:
        p.slowdown_mean = float(mean)
    else:
        p.compute = p.compute / np.maximum(rng.exponential(mean, num_clients), 1e-12)
    p.delay_mean = float(delay_mean) or None
    return p


#: the widest log-normal spread of :func:`fedscale` (e^(5 sigma) is the ratio of a
#: client 5 standard deviations out; at 10 it is 5e21 and float speeds lose meaning)
MAX_SIGMA = 10.0


def fedscale(num_clients: int, rng: np.random.Generator, *,
             compute_median: float = CLIENT_COMPUTE, compute_sigma: float = 0.5,
             uplink_median: float = UPLINK, downlink_median: float = DOWNLINK,
             bandwidth_sigma: float = 0.8, server_compute: float = SERVER_COMPUTE
             ) -> Profiles:
    """Log-normal client speeds and link rates around the given medians, drawn once."""
    for key, sigma in (("compute_sigma", compute_sigma), ("bandwidth_sigma", bandwidth_sigma)):
        if not 0 <= sigma <= MAX_SIGMA:
            raise ConfigError(f"clock.{key}: must be in [0, {MAX_SIGMA}] (fedscale: a "
                              f"log-normal spread), got {sigma}")
    n = num_clients

    def draw(median, sigma, name):
        return _per_client(median, n, name) * np.exp(sigma * rng.standard_normal(n))
    return Profiles(draw(compute_median, compute_sigma, "compute_median"),
                    draw(uplink_median, bandwidth_sigma, "uplink_median"),
                    draw(downlink_median, bandwidth_sigma, "downlink_median"),
                    float(server_compute))


TRACE_COLUMNS = ("client_id", "compute_macs_per_s", "uplink_bytes_per_s",
                 "downlink_bytes_per_s")
TRACE_OPTIONAL = ("available_from", "available_until")


def trace(num_clients: int, rng: np.random.Generator, *, path: str,
          server_compute: float = SERVER_COMPUTE) -> Profiles:
    """Per-client speeds and availability windows from a CSV file (see the module doc)."""
    rows = load_trace(path, num_clients)
    p = Profiles(rows["compute_macs_per_s"], rows["uplink_bytes_per_s"],
                 rows["downlink_bytes_per_s"], float(server_compute))
    if "available_from" in rows or "available_until" in rows:
        p.available_from = rows.get("available_from", np.full(num_clients, -np.inf))
        p.available_until = rows.get("available_until", np.full(num_clients, np.inf))
    return p


#: the largest clock trace read (a CSV row per client: far above any real trace)
MAX_TRACE_BYTES = 256 << 20


def load_trace(path: str | Path, num_clients: int) -> dict[str, np.ndarray]:
    """The trace's columns as arrays indexed by client id; ConfigError naming the file,
    line and column on anything malformed."""
    from splitfed.safeio import read_regular

    path = Path(path)
    try:
        data = read_regular(path, f"clock trace {path}", MAX_TRACE_BYTES, error=ConfigError,
                            hint="give the path of a CSV file (clock.path)")
        text = data.decode("utf-8-sig")        # a byte-order mark (spreadsheets) is dropped
    except OSError as e:
        raise ConfigError(f"clock trace {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"clock trace {path}: not UTF-8 text (at byte {e.start}); give "
                          "the path of a CSV file (clock.path)") from None
    del data
    reader = csv.DictReader(_lines(text))   # row by row: a bad row stops the read
    try:
        return _read_trace(reader, path, num_clients)
    except csv.Error as e:          # a field over the csv module's limit, a NUL byte, ...
        raise ConfigError(f"clock trace {path}, line {reader.line_num + 1}: not a CSV "
                          f"row ({e})") from None


def _lines(text: str):
    """The lines of ``text`` with their ends, one at a time (no list of them all)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        if end < 0:
            yield text[start:]
            return
        yield text[start:end + 1]
        start = end + 1


def _read_trace(reader: csv.DictReader, path, num_clients: int) -> dict[str, np.ndarray]:
    header = [h.strip() for h in (reader.fieldnames or [])]
    for col in TRACE_COLUMNS:
        if col not in header:
            raise ConfigError(f"clock trace {path}: missing column {col!r}; required "
                              f"columns: {', '.join(TRACE_COLUMNS)}")
    for i, col in enumerate(header):
        if col not in TRACE_COLUMNS + TRACE_OPTIONAL:
            raise ConfigError(f"clock trace {path}: unknown column {col!r}; columns: "
                              f"{', '.join(TRACE_COLUMNS + TRACE_OPTIONAL)}")
        if col in header[:i]:
            raise ConfigError(f"clock trace {path}: column {col!r} appears twice in the "
                              "header; give each column once")
    reader.fieldnames = header
    cols = [c for c in TRACE_COLUMNS[1:] + TRACE_OPTIONAL if c in header]
    out = {c: np.full(num_clients, np.nan) for c in cols}
    seen = np.zeros(num_clients, dtype=bool)
    for row in reader:
        where = f"clock trace {path}, line {reader.line_num}"   # (the row's last line)
        if None in row:                     # csv.DictReader's key for surplus cells
            raise ConfigError(f"{where}: {len(header) + len(row[None])} cells, more than "
                              f"the header's {len(header)} columns")
        raw_id = (row.get("client_id") or "").strip()
        if not (raw_id.isascii() and raw_id.isdigit()) or int(raw_id) >= num_clients:
            raise ConfigError(f"{where}, column 'client_id': expected a client id in "
                              f"0..{num_clients - 1}, got {raw_id!r}")
        cid = int(raw_id)
        if seen[cid]:
            raise ConfigError(f"{where}, column 'client_id': client {cid} appears twice")
        seen[cid] = True
        for col in cols:
            out[col][cid] = _trace_number(row.get(col), col, where)
    if not seen.all():
        missing = ", ".join(str(i) for i in np.flatnonzero(~seen)[:10])
        raise ConfigError(f"clock trace {path}, column 'client_id': no row for client(s) "
                          f"{missing} (the run has {num_clients} clients)")
    if "available_from" in out and "available_until" in out:
        bad = np.flatnonzero(out["available_from"] >= out["available_until"])
        if bad.size:
            raise ConfigError(f"clock trace {path}, column 'available_until': must be after "
                              f"available_from (client {int(bad[0])})")
    return out


def _trace_number(cell, col: str, where: str) -> float:
    text = (cell or "").strip()
    if col in TRACE_OPTIONAL and text == "":
        return -np.inf if col == "available_from" else np.inf
    value = as_number(text)
    ok = value is not None and math.isfinite(value) and (
        value >= 0 if col in TRACE_OPTIONAL else value > 0)
    if not ok:
        kind = "a number >= 0" if col in TRACE_OPTIONAL else "a positive number"
        raise ConfigError(f"{where}, column {col!r}: expected {kind}, got {text!r}")
    if not (value == 0 or FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise ConfigError(f"{where}, column {col!r}: {text!r} is outside float32's range "
                          f"({FLOAT_RANGE_TEXT})")
    return value


#: the help of the speed options several profiles share
_SPEEDS = {
    "client_compute": "the clients' compute speed in MAC/s: a positive number, or a list "
                      "of one per client",
    "uplink": "client -> server rate in bytes/s (1.25e6: 10 Mbit/s): a positive number, or "
              "a list of one per client",
    "downlink": "server -> client rate in bytes/s (5e6: 40 Mbit/s): a positive number, or "
                "a list of one per client",
    "server_compute": "the server's compute speed in MAC/s, of each server lane (a positive "
                      "number)",
}
#: the options' help (``splitfed config explain NAME``, docs/config.md)
fixed.option_help = dict(_SPEEDS)
exponential.option_help = {
    "mean": "mean of the Exp draw that multiplies a client's computation time (a finite "
            "number > 0)",
    "per_round": "draw the multipliers every round (false: once per client, heterogeneous "
                 "but constant speeds)",
    "delay_mean": "mean, in seconds, of an exponential delay added to the start of every "
                  "participant's round (a finite number >= 0; 0: none)",
    **_SPEEDS,
}
fedscale.option_help = {
    "compute_median": "median of the clients' log-normal compute speeds in MAC/s: a positive "
                      "number, or a list of one per client",
    "compute_sigma": "log-space standard deviation of the compute speeds (0 to 10)",
    "uplink_median": "median of the clients' log-normal uplink rates in bytes/s: a positive "
                     "number, or a list of one per client",
    "downlink_median": "median of the clients' log-normal downlink rates in bytes/s: a "
                       "positive number, or a list of one per client",
    "bandwidth_sigma": "log-space standard deviation of both link rates (0 to 10)",
    "server_compute": _SPEEDS["server_compute"],
}
trace.option_help = {
    "path": "the CSV file: a row per client, columns client_id, compute_macs_per_s, "
            "uplink_bytes_per_s, downlink_bytes_per_s, optionally available_from and "
            "available_until (seconds)",
    "server_compute": _SPEEDS["server_compute"],
}

GENERATORS = {"fixed": fixed, "exponential": exponential, "fedscale": fedscale,
              "trace": trace}


def build_profiles(name: str, options: dict, num_clients: int,
                   rng: np.random.Generator) -> Profiles:
    """The profiles of generator ``name`` with the ``clock`` section's options."""
    if name not in GENERATORS:
        raise ConfigError(f"clock.profile: unknown profile {name!r}; profiles: "
                          f"{', '.join(GENERATORS)}")
    gen = GENERATORS[name]
    allowed = [p for p in inspect.signature(gen).parameters
               if p not in ("num_clients", "rng")]
    for key in options:
        if key not in allowed:
            raise ConfigError(f"clock.{key}: not an option of profile {name!r}; options: "
                              f"{', '.join(allowed)}")
    if name == "trace" and "path" not in options:
        raise ConfigError("clock.path: the trace profile needs the path of its CSV file")
    options = typed_options(gen, options, "clock")
    try:
        out = call_plugin("clock profile", name, "clock.profile", gen, num_clients, rng,
                          **options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"clock ({name}): {e}") from None
    if not isinstance(out, Profiles) or len(out.compute) != num_clients:
        from splitfed.errors import PluginError

        got = (f"profiles of {len(out.compute)} clients" if isinstance(out, Profiles)
               else type(out).__name__)
        raise PluginError(f"clock.profile: {component('clock profile', name)} returned {got}; "
                          f"it must return Profiles for the {num_clients} clients "
                          "(docs/extending.md, Reference: the registration API)")
    return out
