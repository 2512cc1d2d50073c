"""Split a data set's sample indices among clients (names and parameters as in flwr-datasets).

``partition(labels, num_clients, scheme, rng, **params)`` returns one int64 index array per
client, each sorted ascending; the same ``rng`` state gives the same partition. The parts
are disjoint (no sample goes to two clients, nor twice to one) and need not cover every
sample; what a scheme returns is checked (:func:`checked_parts`), so that a plugin's
partitioner that returns another number of parts, indices out of range or shared between
clients is refused naming it. Schemes:

- ``iid``: shuffle, then ``np.array_split`` into ``num_clients`` near-equal parts.
- ``dirichlet(alpha, min_partition_size=10, self_balancing=False, max_tries=10)``: for each
  class, draw p ~ Dir(alpha * 1_K) over the K clients and cut the (shuffled) class at the
  cumulative proportions. Everything is redrawn until every client has at least
  ``min_partition_size`` samples (ConfigError after ``max_tries`` draws, at most
  :data:`MAX_TRIES`, naming the largest minimum any draw reached). With
  ``self_balancing``, clients already holding >= N / K samples get proportion 0 for the
  classes that follow (the rest renormalised).
  ``alpha = inf`` is IID and delegates to ``iid``. With ``self_balancing=True`` this is the
  label-Dirichlet partition of NIID-Bench (Li et al., ICDE 2022), which the public code of
  paper 003 uses unchanged (its ``DirPartitioner``: the same cap, the same cut, redrawn
  until every client holds >= 10 samples, without a bound on the draws); the sizes stay
  unbalanced (docs/design.md, Paper 003 partitions).
- ``pathological(num_classes_per_partition, class_assignment_mode="first-deterministic")``:
  each client is assigned C distinct classes; "deterministic" gives client i the classes
  (i + j) mod K, j < C; "first-deterministic" gives (i mod K) plus C - 1 other random ones;
  "random" gives C random ones (K = number of distinct labels present, taken in sorted order).
  Each class is shuffled and split evenly (``array_split``) among the clients holding it. A class
  that no client holds is dropped, so the parts then cover fewer than N samples.
- ``shard(num_shards_per_partition, shard_size=None, keep_incomplete_shard=False)``: shuffle,
  sort by label (stable), cut into shards of ``shard_size`` (default N // (K * shards)), and
  give each client ``num_shards_per_partition`` shards drawn at random without replacement
  (McMahan et al., 2017: "sort the data by digit label, divide it into 200 shards of size
  300, and assign each of 100 clients 2 shards"). An incomplete last shard is used only if
  ``keep_incomplete_shard``. When N is a multiple of K * shards every client gets exactly
  N / K samples. The cuts fall at fixed multiples of ``shard_size`` of the label-sorted
  order, not at class boundaries, so a shard that spans a boundary holds two classes (more
  if a class is smaller than a shard): a client holds at most
  2 * ``num_shards_per_partition`` classes when no class is smaller than ``shard_size``,
  and at most ``num_shards_per_partition`` (fewer when two of its shards come from one
  class) when every class size is a multiple of ``shard_size``, as every shard then holds
  one class. With C shards this is paper 003's balanced "C = #" partition (60 samples per
  client for 1000 clients on Fashion-MNIST: 6000 per class and shards of 60 / C, so single-
  class shards; docs/design.md, Paper 003 partitions).
- ``natural(natural)``: the data set's own per-client split (``DataBundle.natural_partition``,
  passed as ``natural=``); it must have exactly ``num_clients`` parts of distinct, in-range
  indices. Without ``natural=`` it raises ConfigError (only ``synthetic`` has one).
"""

from __future__ import annotations

import inspect

import numpy as np

from splitfed.configtools import typed_options
from splitfed.errors import ConfigError
from splitfed.origins import call_plugin, component

_MODES = ("deterministic", "first-deterministic", "random")


def _int_param(scheme: str, name: str, value, low: int, high: int | None = None) -> int:
    ok = not isinstance(value, bool) and isinstance(value, (int, np.integer))
    if not ok or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"partition.{name}: must be an integer {span} ({scheme}), "
                          f"got {value!r}")
    return int(value)


def _owners_to_parts(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """owner[i] = client of sample i (or -1: unassigned) -> sorted int64 index arrays."""
    idx = np.flatnonzero(owner >= 0)
    who = owner[idx]
    idx = idx[np.argsort(who, kind="stable")]
    counts = np.bincount(who, minlength=num_clients)
    return np.split(idx.astype(np.int64), np.cumsum(counts)[:-1])


def _class_groups(labels: np.ndarray, rng: np.random.Generator):
    """Shuffled indices grouped by class: (sorted class values, list of index arrays)."""
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    classes, starts = np.unique(labels[order], return_index=True)
    return classes, np.split(order, starts[1:])


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and split as evenly as possible (part sizes differ by at most one)."""
    perm = rng.permutation(len(labels))
    sizes = np.array([len(p) for p in np.array_split(np.empty(len(labels)), num_clients)])
    owner = np.empty(len(labels), dtype=np.int64)
    owner[perm] = np.repeat(np.arange(num_clients), sizes)
    return _owners_to_parts(owner, num_clients)


def _dirichlet_owners(labels, num_clients, rng, alpha, self_balancing) -> np.ndarray:
    owner = np.empty(len(labels), dtype=np.int64)
    held = np.zeros(num_clients, dtype=np.int64)
    _, groups = _class_groups(labels, rng)
    for idx in groups:
        p = rng.dirichlet(np.full(num_clients, alpha))
        if self_balancing:
            q = np.where(held >= len(labels) / num_clients, 0.0, p)
            p = q / q.sum() if q.sum() > 0 else p
        cuts = np.minimum((np.cumsum(p)[:-1] * len(idx)).astype(np.int64), len(idx))
        counts = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
        owner[idx] = np.repeat(np.arange(num_clients), counts)
        held += counts
    return owner


#: the most Dirichlet draws a partition may take (each costs a pass over the labels: a
#: larger bound could keep a run, or its --dry-run, busy for days before it starts)
MAX_TRIES = 1000


def _alpha(alpha) -> float:
    try:
        value = float(alpha) if not isinstance(alpha, bool) else float("nan")
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"partition.alpha: must be a number > 0 (or inf for IID), got "
                          f"{alpha!r}")
    return value


def dirichlet(labels, num_clients, rng, alpha: float, min_partition_size=10, self_balancing=False,
              max_tries=10) -> list[np.ndarray]:
    """Label-skewed split with per-class proportions ~ Dir(alpha); see the module docstring.

    ``alpha`` may also be a numeric string (``"inf"``, as a command line gives it).
    """
    alpha = _alpha(alpha)
    min_size = _int_param("dirichlet", "min_partition_size", min_partition_size, 0)
    tries = _int_param("dirichlet", "max_tries", max_tries, 1, MAX_TRIES)
    if min_size * num_clients > len(labels):
        raise ConfigError(f"partition.min_partition_size: {min_size} x {num_clients} clients "
                          f"exceeds the {len(labels)} samples; lower min_partition_size")
    if np.isinf(alpha):
        return iid(labels, num_clients, rng)
    reached = 0                  # the largest smallest-client size of any draw
    for _ in range(tries):
        owner = _dirichlet_owners(labels, num_clients, rng, float(alpha), bool(self_balancing))
        smallest = int(np.bincount(owner, minlength=num_clients).min())
        if smallest >= min_size:
            return _owners_to_parts(owner, num_clients)
        reached = max(reached, smallest)
    raise ConfigError(f"partition.max_tries: no draw in max_tries={tries} gave every client >= "
                      f"min_partition_size={min_size} samples (the best draw's smallest "
                      f"client held {reached}); lower min_partition_size, raise max_tries "
                      f"or raise alpha (now {alpha})")


def _assign_classes(num_clients, K, C, mode, rng) -> np.ndarray:
    """[num_clients, C] class positions (0..K-1), distinct within each row."""
    rows = np.arange(num_clients)
    if mode == "deterministic":
        return (rows[:, None] + np.arange(C)) % K
    out = np.empty((num_clients, C), dtype=np.int64)
    step = max(1, _SCORES // K)     # rows of scores at a time: the draws are those of one
    for lo in range(0, num_clients, step):      # [num_clients, K] call, in less memory
        part = rows[lo:lo + step]
        scores = rng.random((part.size, K))
        if mode == "first-deterministic":
            scores[np.arange(part.size), part % K] = -1.0
        out[lo:lo + step] = np.argsort(scores, axis=1, kind="stable")[:, :C]
    return out


#: the most random scores :func:`_assign_classes` holds at once
_SCORES = 1 << 22


def _holders(assigned: np.ndarray, K: int) -> list[np.ndarray]:
    """For each class position 0..K-1, the clients (ascending) whose row of ``assigned``
    holds it."""
    n, C = assigned.shape
    flat = assigned.ravel()
    client = np.repeat(np.arange(n), C)
    order = np.lexsort((client, flat))
    return np.split(client[order], np.cumsum(np.bincount(flat, minlength=K))[:-1])


def pathological(labels, num_clients, rng, num_classes_per_partition,
                 class_assignment_mode="first-deterministic") -> list[np.ndarray]:
    """Every client holds exactly C classes; see the module docstring."""
    classes, groups = _class_groups(labels, rng)
    K = len(classes)
    C = _int_param("pathological", "num_classes_per_partition", num_classes_per_partition, 1)
    if C > K:
        raise ConfigError(f"partition.num_classes_per_partition: {C} exceeds the {K} classes "
                          "of the data set")
    if class_assignment_mode not in _MODES:
        raise ConfigError(f"partition.class_assignment_mode: must be one of {_MODES}, "
                          f"got {class_assignment_mode!r}")
    assigned = _assign_classes(num_clients, K, C, class_assignment_mode, rng)
    owner = np.full(len(labels), -1, dtype=np.int64)
    for idx, holders in zip(groups, _holders(assigned, K)):
        if len(holders):
            n, h = len(idx), len(holders)
            owner[idx] = np.repeat(holders, n // h + (np.arange(h) < n % h))
    return _owners_to_parts(owner, num_clients)


def shard(labels, num_clients, rng, num_shards_per_partition, shard_size=None,
          keep_incomplete_shard=False) -> list[np.ndarray]:
    """Label-sorted shards of ``shard_size`` dealt at random (a shard spanning a class
    boundary holds two classes); see the module docstring."""
    n = len(labels)
    S = _int_param("shard", "num_shards_per_partition", num_shards_per_partition, 1)
    if shard_size is None:
        shard_size = n // (num_clients * S)
        if shard_size < 1:
            raise ConfigError(f"partition.num_shards_per_partition: {n} samples cannot fill "
                              f"{num_clients} clients x {S} shards")
    size = _int_param("shard", "shard_size", shard_size, 1, n)
    n_full = n // size
    n_shards = n_full + int(bool(keep_incomplete_shard) and n % size > 0)
    need = num_clients * S
    if need > n_shards:
        raise ConfigError(f"partition.shard_size: {num_clients} clients x {S} shards need "
                          f"{need} shards of "
                          f"{size} samples, but {n} samples make only {n_shards}")
    _, groups = _class_groups(labels, rng)
    order = np.concatenate(groups)
    shard_owner = np.full(n_full + 1, -1, dtype=np.int64)
    shard_owner[rng.permutation(n_shards)[:need]] = np.repeat(np.arange(num_clients), S)
    owner = np.empty(n, dtype=np.int64)
    owner[order] = shard_owner[np.arange(n) // size]
    return _owners_to_parts(owner, num_clients)


def natural(labels, num_clients, rng, natural=None) -> list[np.ndarray]:
    """The data set's own split (``DataBundle.natural_partition``): a run takes it from
    the data set and its config gives no option (``natural=`` serves calls of
    :func:`partition`); validated, sorted, int64."""
    if natural is None:
        raise ConfigError("natural: only data sets with a natural partition (synthetic) support "
                          "this scheme; pass natural=bundle.natural_partition")
    if len(natural) != num_clients:
        raise ConfigError(f"natural: the data set has {len(natural)} clients, "
                          f"num_clients is {num_clients}")
    parts = [np.sort(np.asarray(p, dtype=np.int64).ravel()) for p in natural]
    flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= len(labels)):
        raise ConfigError(f"natural: indices must lie in [0, {len(labels)})")
    if len(np.unique(flat)) != len(flat):
        raise ConfigError("natural: an index appears in more than one client (or twice)")
    return parts


#: parameters that code passes (``partition(..., natural=...)``) and a config cannot: left
#: out of ``config explain``
natural.code_only = ("natural",)

#: the options' help (``splitfed config explain NAME``, docs/config.md)
dirichlet.option_help = {
    "alpha": "concentration of the per-class proportions p ~ Dir(alpha * 1_K) over the K "
             "clients: the smaller, the more skewed (a number > 0; inf: IID)",
    "min_partition_size": "every client holds at least this many samples, else everything "
                          "is redrawn (an integer >= 0; times num_clients at most the samples)",
    "self_balancing": "clients already holding >= N / num_clients of the N samples get no "
                      "share of the classes that follow (NIID-Bench's partition, as in paper "
                      "003's code)",
    "max_tries": "draws before the partition is refused (an integer from 1 to 1000)",
}
pathological.option_help = {
    "num_classes_per_partition": "C, the distinct classes every client holds (an integer "
                                 "from 1 to the data set's classes)",
    "class_assignment_mode": "of the K classes, client i holds: (i + j) mod K, j < C "
                             "(deterministic); i mod K and C - 1 random others "
                             "(first-deterministic); C random ones (random)",
}
shard.option_help = {
    "num_shards_per_partition": "shards every client gets, drawn at random without "
                                "replacement (an integer >= 1; McMahan et al. 2017: 2)",
    "shard_size": "samples per shard of the label-sorted data (an integer from 1 to the "
                  "samples; null: N // (num_clients x num_shards_per_partition))",
    "keep_incomplete_shard": "also deal the incomplete last shard",
}


PARTITIONERS = {
    "iid": iid,
    "dirichlet": dirichlet,
    "pathological": pathological,
    "shard": shard,
    "natural": natural,
}


def _check_params(scheme: str, params: dict) -> None:
    sig = list(inspect.signature(PARTITIONERS[scheme]).parameters.values())[3:]
    names = [p.name for p in sig]
    unknown = sorted(set(params) - set(names))
    missing = [p.name for p in sig if p.default is p.empty and p.name not in params]
    if unknown or missing:
        what = f"unknown {unknown}" if unknown else f"missing {missing}"
        raise ConfigError(f"partition.{(unknown or missing)[0]}: partition scheme "
                          f"{scheme!r}: {what} parameter(s); allowed: "
                          f"{', '.join(names) or 'none'}")


def as_labels(labels) -> np.ndarray:
    """1-D non-negative int64 numpy labels (accepts numpy arrays, lists, CPU tensors)."""
    y = np.asarray(labels)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.size == 0):
        raise ConfigError(f"labels must be a 1-D integer array, got {y.dtype} {y.shape}")
    if y.size and y.min() < 0:
        raise ConfigError("labels must be >= 0")
    return y.astype(np.int64, copy=False)


def partition(labels, num_clients: int, scheme: str, rng: np.random.Generator,
              **params) -> list[np.ndarray]:
    """Split ``range(len(labels))`` among ``num_clients`` clients with ``scheme``."""
    y = as_labels(labels)
    if scheme not in PARTITIONERS:
        raise ConfigError(f"partition.scheme: unknown partition scheme {scheme!r}; "
                          f"known: {', '.join(PARTITIONERS)}")
    _int_param(scheme, "num_clients", num_clients, 1, max(1, len(y)))
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy Generator, got {type(rng).__name__}")
    _check_params(scheme, params)
    params = typed_options(PARTITIONERS[scheme], params, "partition")
    parts = call_plugin("partitioner", scheme, "partition.scheme", PARTITIONERS[scheme], y,
                        int(num_clients), rng, **params)
    return checked_parts(parts, scheme, int(num_clients), len(y))


def _component(scheme: str) -> str:
    """``partitioner 'name'``, with the plugin that registered it."""
    return component("partitioner", scheme)


def checked_parts(parts, scheme: str, num_clients: int, n: int) -> list[np.ndarray]:
    """What a partitioner returned, checked: a list (or tuple, or a 2-D array: one row per
    client) of exactly ``num_clients`` 1-D integer index arrays, indices in ``[0, n)``,
    no index in two parts (or twice in one); returned as int64 arrays, in the order
    given. Anything else raises :class:`~splitfed.errors.PluginError` naming the scheme
    and what it returned."""
    from splitfed.errors import PluginError

    def bad(what: str) -> PluginError:
        return PluginError(f"partition.scheme: {_component(scheme)} {what}; it must return "
                           f"a list of {num_clients} integer index arrays (one per client, "
                           f"indices in [0, {n}), no index in two clients)")

    if isinstance(parts, np.ndarray) and parts.ndim == 2:
        parts = list(parts)                     # one row per client
    if not isinstance(parts, (list, tuple)):
        raise bad(f"returned {type(parts).__name__}")
    if len(parts) != num_clients:
        raise bad(f"returned {len(parts)} parts for num_clients {num_clients}")
    out = []
    for i, part in enumerate(parts):
        try:
            a = np.asarray(part)
        except Exception:  # noqa: BLE001 - any object numpy cannot read is refused below
            a = None
        if a is None or a.dtype == object or a.ndim != 1:
            shape = "" if a is None or a.dtype == object else f" of shape {a.shape}"
            raise bad(f"returned {type(part).__name__}{shape} for client {i}")
        if a.size == 0:
            out.append(np.empty(0, dtype=np.int64))
            continue
        if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
            raise bad(f"returned {a.dtype} indices for client {i}")
        outside = a[(a < 0) | (a >= n)]
        if outside.size:
            raise bad(f"returned index {int(outside[0])} for client {i}, outside the {n} "
                      "samples")
        out.append(a.astype(np.int64, copy=False))
    flat = np.concatenate(out) if out else np.empty(0, np.int64)
    counts = np.bincount(flat, minlength=n)
    if flat.size and counts.max() > 1:
        index = int(np.argmax(counts))
        holders = [i for i, a in enumerate(out) if np.any(a == index)]
        where = (f"clients {holders[0]} and {holders[1]}" if len(holders) > 1
                 else f"client {holders[0]} twice")
        raise bad(f"gave sample {index} to {where}")
    return out


def partition_stats(parts: list[np.ndarray], labels, num_classes: int) -> np.ndarray:
    """Label counts per client: int64 [num_clients, num_classes]."""
    y = as_labels(labels)
    if y.size and y.max() >= num_classes:
        raise ConfigError(f"labels reach {y.max()} but num_classes is {num_classes}")
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    flat = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    cell = np.repeat(np.arange(len(parts)), sizes) * num_classes + y[flat]
    counts = np.bincount(cell, minlength=len(parts) * num_classes)
    return counts.reshape(len(parts), num_classes)


def _table_rows(counts: np.ndarray, show_hist: bool) -> list[list[str]]:
    n, held = counts.sum(1), (counts > 0).sum(1)
    rows = []
    for i, row in enumerate(counts):
        hist = [str(c) for c in row] if show_hist else []
        rows.append([str(i), str(n[i]), str(held[i]), *hist])
    return rows


def partition_summary(parts: list[np.ndarray], labels, num_classes: int,
                      max_rows: int = 20) -> str:
    """A printable table: client, samples, classes held and (for <= 20 classes) the label
    histogram; at most ``max_rows`` clients are listed, then totals and min/mean/max lines."""
    counts = partition_stats(parts, labels, num_classes)
    show_hist = num_classes <= 20
    header = ["client", "n", "classes", *(f"c{k}" for k in range(num_classes) if show_hist)]
    rows = _table_rows(counts[:max_rows], show_hist)
    total = counts.sum(0)
    rows.append(["total", str(total.sum()), str((total > 0).sum()),
                 *(str(c) for c in total if show_hist)])
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(row, widths))

    lines = [fmt(header), *map(fmt, rows[:-1])]
    if len(counts) > max_rows:
        lines.append(f"... {len(counts) - max_rows} more clients not shown")
    lines.append(fmt(rows[-1]))
    if len(counts):
        n, held = counts.sum(1), (counts > 0).sum(1)
        lines.append(f"samples per client: min {n.min()}, mean {n.mean():.1f}, max {n.max()}; "
                     f"classes per client: min {held.min()}, mean {held.mean():.1f}, "
                     f"max {held.max()}")
    return "\n".join(lines)
