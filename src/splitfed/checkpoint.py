"""Checkpoints: everything a run needs to continue where it stopped, bit for bit.

Every ``checkpoint_every`` rounds (config key, default 10; 0 turns checkpoints off), at
the last round and at the round a run diverges, the round loop hands its state to a
:class:`Checkpointer`, which writes ``checkpoint.pt`` in the run directory. The file
holds plain data, tensors and numpy arrays only:

- ``state``: the algorithm's state dict (tensors and plain values, nested as the
  algorithm keeps them: global models, server optimizer state, SCAFFOLD's controls, ...;
  a module or an optimizer in it is stored as its ``state_dict()`` under the tag
  ``__module__`` or ``__optimizer__`` and loaded back into the objects the algorithm's
  ``init_state`` builds);
- ``streams``: every named random stream of the run (numpy and torch generators);
- ``clock``: the virtual clock (simulated time, its generator, the client profiles);
- ``ledger``: the communication ledger (bytes by round, kind, direction and client:
  per round and transfer, the ids of the clients that sent or received and their
  bytes, int64 vectors; a list of every client's bytes, as checkpoints held it before,
  is read too);
- ``components``: the state of any other engine part that keeps one between rounds
  (the participation sampler, the server's data pool) when it has ``state()``;
- ``round`` (the last finished round: the learning-rate schedule is a function of it),
  ``records`` (how many records ``metrics.jsonl`` held, the metrics offset), ``status``,
  ``wall_time_s`` (measured so far), ``resumed_from`` (rounds a run was resumed at),
  ``threads`` and ``cpu_capability`` (``torch.get_num_threads()`` and the CPU kernels
  the run was started with: a convolution's reduction order, hence the last bits of the
  results, depends on them) and ``resumed_threads`` (the thread count of each resume);
- ``config`` and ``config_sha256``: the run's resolved config as canonical JSON text
  (:func:`config_record`: every key but :data:`FREE_KEYS`, those a resume may change)
  and its SHA-256. A resume checks them against ``config.yaml``
  (:func:`check_config`): a run is continued only under the config it was started
  with, and a refusal names the first key that differs and both values. Checkpoints
  written before they held a config have neither key; they are read, without that check.
- ``data_sha256``: :func:`data_digest` of the run's data and partition (each client's
  sample indices, the labels, a sample of the inputs); a resume builds them again and
  refuses data that differ (changed files, or a plugin data set or partitioner drawing
  from a global random generator). Checkpoints written before it was recorded lack it.

It is written with :func:`splitfed.safeio.save` and read with :func:`splitfed.safeio.load`,
PyTorch's restricted (weights-only) loader, which builds nothing but those types: loading
a checkpoint cannot execute code, whoever wrote the file. :func:`load_checkpoint` then
checks the whole structure (keys, types, ranges) and :func:`restore` checks it against the
run being resumed, so a torn, foreign or altered file is refused with one line naming it,
before anything in the run directory is changed. Checkpoints of format 1 (pickles written
by earlier versions) are refused unread: such a run is rerun from the start.

The file is written atomically: to a temporary file in the run directory, flushed and
fsynced, then renamed over the old checkpoint with :func:`os.replace` (and the
directory fsynced), so a run killed at any instant leaves either the previous checkpoint
or the new one, never a torn file.

:func:`splitfed.experiment.resume_experiment` (``splitfed run --resume RUN_DIR``)
rebuilds the run from its ``config.yaml`` (same seed: same data, partition and initial
model), restores all of the above, cuts ``metrics.jsonl`` back to the checkpoint's
records and continues with the next round, so that the finished run equals an
uninterrupted one in its parameters and in every metric except the measured wall times
(``round_time_s``, ``wall_time_s``), provided it is resumed with the thread count and
on the kind of CPU it was started with (else a warning says the last bits will differ).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
import zipfile
from pathlib import Path
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np
import torch

from splitfed import safeio
from splitfed.errors import ConfigError, FormatError
from splitfed.files import (  # noqa: F401 - atomic_write, remove_stale_temp_files: re-exported
    atomic_write,
    remove_stale_temp_files,
)
from splitfed.provenance import cpu_capability  # noqa: F401 - re-exported
from splitfed.transport.base import DOWN, KINDS, UP

CHECKPOINT = "checkpoint.pt"
FORMAT = 2
#: the statuses a checkpoint can record (those the round loop ends a round with)
STATUSES = ("completed", "diverged", "no_client_trained")
#: engine parts whose ``state()``/``load_state()`` (when they have them) are saved
COMPONENTS = ("sampler", "server_data")
MODULE, OPTIMIZER = "__module__", "__optimizer__"
RERUN = "delete it to rerun the run from the start, or delete the run directory"
#: the keys of a checkpoint and the types of their values
KEYS: dict[str, tuple[type, ...]] = {
    "format": (int,), "round": (int,), "records": (int,), "status": (str,),
    "wall_time_s": (int, float), "resumed_from": (list,), "threads": (int,),
    "cpu_capability": (str,), "resumed_threads": (list,), "state": (dict,),
    "streams": (dict,), "clock": (dict,), "ledger": (dict,), "components": (dict,)}
#: keys a checkpoint may lack (those written before checkpoints recorded their config)
OPTIONAL_KEYS: dict[str, tuple[type, ...]] = {"config": (str,), "config_sha256": (str,)}
#: the key of the digest of the run's data and partition (:func:`data_digest`), which a
#: checkpoint written before it was recorded lacks
DATA_KEY = "data_sha256"
#: the input values :func:`data_digest` reads of each split, evenly spaced
DIGEST_VALUES = 1 << 20
#: config keys a resume may change: ``rounds`` (raised, it extends a finished run) and
#: the keys that do not change a run's numbers (its name, where it writes, what it shows,
#: how often it checkpoints, the evaluation's batch size)
FREE_KEYS = ("rounds", "name", "out_dir", "progress", "checkpoint_every", "tracking",
             "engine.eval_batch_size")
#: the longest config record a checkpoint may hold (a config file is at most 1 MiB)
MAX_CONFIG_CHARS = 4 << 20


def atomic_save(obj: Any, path: str | Path) -> None:
    """:func:`splitfed.safeio.save` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda fh: safeio.save(obj, fh))


# ------------------------------------------------------------------ writing


def _plain(obj: Any) -> Any:
    """The algorithm state with modules and optimizers replaced by tagged state dicts."""
    if isinstance(obj, torch.nn.Module):
        return {MODULE: obj.state_dict()}
    if isinstance(obj, torch.optim.Optimizer):
        return {OPTIMIZER: obj.state_dict()}
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def capture(env, state: dict, t: int, *, records: int, status: str,
            wall_time_s: float, resumed_from: list[int], threads: int | None = None,
            cpu: str | None = None, resumed_threads: list[int] | None = None,
            config: Mapping | None = None, data: str | None = None) -> dict:
    """The checkpoint of a run after round ``t`` (see the module doc). ``threads`` and
    ``cpu``: those the run was started with (default: this process's); ``config``: the
    run's config as plain data (``to_dict``), recorded with :func:`config_record`;
    ``data``: :func:`data_digest` of ``env`` (computed when None)."""
    components = {}
    for name in COMPONENTS:
        saver = getattr(getattr(env, name, None), "state", None)
        if callable(saver):
            components[name] = saver()
    ckpt = {"format": FORMAT, "round": int(t), "records": int(records), "status": status,
            "wall_time_s": float(wall_time_s), "resumed_from": [int(r) for r in resumed_from],
            "threads": int(threads if threads is not None else torch.get_num_threads()),
            "cpu_capability": cpu if cpu is not None else cpu_capability(),
            "resumed_threads": [int(n) for n in (resumed_threads or [])],
            "state": _plain(state), "streams": env.streams.state(),
            "clock": env.clock.state(), "ledger": env.ledger.state(),
            "components": components, DATA_KEY: data or data_digest(env)}
    if config is not None:
        text = config_record(config)
        ckpt.update(config=text, config_sha256=_sha256(text))
    return ckpt


def data_digest(env) -> str:
    """SHA-256 of the run's data and partition as ``env`` holds them: each client's
    sample indices, and of each split the labels and the shape, dtype and
    :data:`DIGEST_VALUES` evenly spaced values of the inputs (their bytes). A resume
    builds the data again and compares (:func:`restore`): a data set or partitioner
    that draws from a global random generator builds other data each time."""
    h = hashlib.sha256()
    for part in env.client_indices:
        part = np.ascontiguousarray(part, dtype=np.int64)
        h.update(np.int64(len(part)).tobytes() + part.tobytes())
    for split in (env.data.train, env.data.test):
        for values, whole in ((split.x, False), (split.y, True)):
            flat = values.detach().reshape(-1)
            step = 1 if whole else max(1, flat.numel() // DIGEST_VALUES)
            h.update(f"{tuple(values.shape)} {values.dtype}".encode())
            h.update(flat[::step].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ the run's config


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _json_safe(value: Any) -> Any:
    """``value`` with mappings' keys as strings and tuples as lists (what JSON keeps)."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _identity(config: Mapping) -> dict:
    """``config`` (plain data) without :data:`FREE_KEYS`, in its own key order."""
    out = _json_safe(config)
    for key in FREE_KEYS:
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def config_record(config: Mapping) -> str:
    """The canonical form of a run's config (plain data, as ``to_dict`` gives it): JSON
    with sorted keys, without :data:`FREE_KEYS`. Two configs of the same run have the
    same record, whatever the order of their keys."""
    return json.dumps(_identity(config), sort_keys=True, separators=(",", ":"),
                      allow_nan=True, default=str)


def _value(v: Any) -> str:
    """A config value as a message shows it: a string bare, anything else as JSON;
    past 60 characters its start and its length."""
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text)} characters)"


_ABSENT = object()


def _first_difference(saved: Any, current: Any, at: str = "") -> tuple | None:
    """The first key (dotted, in ``current``'s order, then ``saved``'s) where the two
    configs differ, with both values (``_ABSENT`` where a side lacks the key)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in [*current, *(k for k in saved if k not in current)]:
            found = _first_difference(saved.get(key, _ABSENT), current.get(key, _ABSENT),
                                      f"{at}.{key}" if at else key)
            if found is not None:
                return found
        return None
    if type(saved) is type(current) and saved == current:
        return None
    if isinstance(saved, float) and isinstance(current, float) and math.isnan(saved) and \
            math.isnan(current):
        return None
    if isinstance(saved, (int, float)) and isinstance(current, (int, float)) and \
            not isinstance(saved, bool) and not isinstance(current, bool) and \
            saved == current:
        return None
    return at, saved, current


def check_config(ckpt: dict, config: Mapping, where: str | Path = CHECKPOINT) -> bool:
    """Check that ``ckpt`` was written by a run of ``config`` (plain data, as ``to_dict``
    gives it; :data:`FREE_KEYS` aside). Raises :class:`FormatError` naming the first key
    that differs and both values; returns False when the checkpoint records no config
    (written before checkpoints did), True when it matched. Changes nothing."""
    if "config" not in ckpt:
        return False
    text = config_record(config)
    if _sha256(text) == ckpt["config_sha256"]:
        return True
    current = json.loads(json.dumps(_identity(config), allow_nan=True, default=str))
    saved = safeio.loads_json(ckpt["config"])
    if isinstance(saved, dict):     # the keys a resume may change are never compared
        saved = _identity(saved)
    found = _first_difference(saved, current)
    if found is None:
        return True
    key, old, new = found
    if old is _ABSENT:
        what = f"it was written without {key} but config.yaml says {key}={_value(new)}"
    elif new is _ABSENT:
        what = f"it was written with {key}={_value(old)} but config.yaml has no {key}"
    else:
        what = f"it was written with {key}={_value(old)} but config.yaml says {_value(new)}"
    raise FormatError(f"{where}: {what}; a resume continues the same run (only rounds may "
                      f"change): restore config.yaml, or {RERUN}")


# ------------------------------------------------------------------ reading


def _bad(path, what: str) -> FormatError:
    return FormatError(f"{path}: not a valid splitfed checkpoint ({what}); {RERUN}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 24 else text[:20] + "..."


def _is_num(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:                   # an int too large for a float
        return False


def load_checkpoint(run_dir: str | Path, *, rounds: int | None = None) -> dict | None:
    """The checkpoint in ``run_dir``, checked (see :func:`check_checkpoint`), or None
    when there is none. Raises :class:`FormatError` naming the file and what to do when
    it cannot be read or is not a checkpoint of this format; nothing in it is executed."""
    path = Path(run_dir) / CHECKPOINT
    if not os.path.lexists(path):
        return None
    if path.is_dir():
        raise FormatError(f"{path} is a directory, not a checkpoint file; remove it to "
                          "rerun the run from the start, or delete the run directory")
    if not path.is_file():
        raise FormatError(f"{path} is not a regular file (a broken link, a pipe, a "
                          f"device); {RERUN}")
    try:
        with open(path, "rb") as fh:
            _check_archive(fh, path)
            ckpt = _load(fh, path)
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e}); fix its "
                          f"permissions, or {RERUN}") from None
    check_checkpoint(ckpt, path, rounds=rounds)
    return ckpt


def _load(fh: BinaryIO, path) -> Any:
    fh.seek(0)
    try:
        with warnings.catch_warnings():     # torch's notes on foreign pickle protocols
            warnings.simplefilter("ignore")
            return safeio.load(fh, what=str(path))
    except RecursionError:
        raise _bad(path, "its data is nested too deeply") from None
    except FormatError as e:
        if "refused unread" in str(e):
            raise FormatError(f"{e}; if it is a checkpoint of an earlier splitfed (format 1, "
                              f"a pickle), the run cannot be resumed: {RERUN}") from None
        raise FormatError(f"{e}; the file is torn or foreign: {RERUN}") from None


def _check_archive(fh: BinaryIO, path) -> None:
    """The open file ``fh`` is a whole zip archive (what ``torch.save`` writes) whose
    members all match their CRC-32: a torn file or a flipped bit is refused before
    anything in it is unpickled. Nothing else (an older torch format, a bare pickle) is
    ever unpickled."""
    magic = fh.read(4)
    if not magic:
        raise _bad(path, "the file is empty")
    if magic != b"PK\x03\x04":
        raise FormatError(f"{path}: not a splitfed data file (not a zip archive, the format "
                          f"torch.save writes); the file is torn or foreign: {RERUN}")
    fh.seek(0)
    try:
        with zipfile.ZipFile(fh) as archive:
            infos = archive.infolist()
            packed = next((i.filename for i in infos
                           if i.compress_type != zipfile.ZIP_STORED), None)
            if packed is not None:    # torch.save stores; a deflated member can expand
                raise _bad(path, f"its member {packed[:80]!r} is compressed, which torch.save "
                                 "never writes (a small file could expand to gigabytes)")
            size = fh.seek(0, os.SEEK_END)
            if len({i.header_offset for i in infos}) != len(infos) or \
                    len({i.filename for i in infos}) != len(infos) or \
                    sum(i.compress_size for i in infos) > size:
                # each entry is read for its CRC: entries sharing one member's bytes
                # would make a small file take hours to check
                raise _bad(path, "its zip directory lists members that share their bytes, "
                                 "which torch.save never writes")
            bad = archive.testzip()
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged archive fails in many ways
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise FormatError(f"{path}: not a splitfed data file (a damaged zip archive: "
                          f"{type(e).__name__}: {first}); the file is torn: {RERUN}") from None
    if bad is not None:
        raise FormatError(f"{path}: not a splitfed data file ({bad[:80]!r} fails its CRC "
                          f"check: the file is damaged); {RERUN}")


def check_checkpoint(ckpt: Any, path: str | Path = CHECKPOINT, *,
                     rounds: int | None = None) -> None:
    """Raise :class:`FormatError` unless ``ckpt`` has every key of a checkpoint of this
    format, of the right type and in range; then :class:`ConfigError` when its ``round``
    is past ``rounds`` (config.yaml's rounds were lowered)."""
    if not isinstance(ckpt, dict):
        raise _bad(path, f"it holds a {type(ckpt).__name__}, not a dict")
    fmt = ckpt.get("format")
    if not _is_int(fmt):
        raise _bad(path, "it has no format number")
    if fmt != FORMAT:
        raise FormatError(f"{path}: a checkpoint of format {_short(fmt)}; this splitfed reads "
                          f"format {FORMAT} only, so the run cannot be resumed: {RERUN}")
    missing = [k for k in KEYS if k not in ckpt]
    extra = [repr(k)[:40] for k in ckpt
             if k not in KEYS and k not in OPTIONAL_KEYS and k != DATA_KEY]
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(extra[:5])}"] if extra else [])
        raise _bad(path, "; ".join(parts))
    for key, types in (*KEYS.items(), *OPTIONAL_KEYS.items()):
        v = ckpt.get(key, types[0]()) if key in OPTIONAL_KEYS else ckpt[key]
        if isinstance(v, bool) or not isinstance(v, types):
            raise _bad(path, f"{key} is a {type(v).__name__}")
    _check_config_record(ckpt, path)
    digest = ckpt.get(DATA_KEY, "0" * 64)
    if not (isinstance(digest, str) and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest)):
        raise _bad(path, f"{DATA_KEY} is not a SHA-256 digest")
    t = ckpt["round"]
    if t < 0:
        raise _bad(path, f"round {_short(t)} is not >= 0")
    if ckpt["records"] != t + 1:
        raise _bad(path, f"it counts {_short(ckpt['records'])} records after round "
                         f"{_short(t)}, not {_short(t + 1)}")
    if ckpt["status"] not in STATUSES:
        raise _bad(path, f"status {ckpt['status'][:40]!r} is not one of {', '.join(STATUSES)}")
    wall = ckpt["wall_time_s"]
    if not _is_num(wall) or wall < 0:
        raise _bad(path, f"wall_time_s {_short(wall)} is not a time")
    resumed = ckpt["resumed_from"]
    if not all(_is_int(r) and 0 <= r <= t for r in resumed) or resumed != sorted(resumed):
        raise _bad(path, f"resumed_from is not a list of rounds 0..{t} in order")
    threads = ckpt["resumed_threads"]
    if not all(_is_int(n) and n >= 1 for n in threads) or len(threads) != len(resumed):
        raise _bad(path, "resumed_threads is not a thread count per resume")
    if ckpt["threads"] < 1 or len(ckpt["cpu_capability"]) > 64:
        raise _bad(path, "threads or cpu_capability is out of range")
    if not all(isinstance(k, str) for k in ckpt["state"]):
        raise _bad(path, "the algorithm state's keys are not names")
    _check_streams(ckpt["streams"], path)
    _check_clock(ckpt["clock"], path)
    _check_ledger(ckpt["ledger"], t, path)
    unknown = [repr(k)[:40] for k in ckpt["components"] if k not in COMPONENTS]
    if unknown:
        raise _bad(path, f"unknown components {', '.join(unknown[:5])}")
    if rounds is not None and t > rounds:
        # a whole checkpoint of a run past config.yaml's rounds: they were lowered
        raise ConfigError(f"{path}: the run has reached round {_short(t)}, after "
                          f"config.yaml's rounds {rounds}; a run's rounds may only be "
                          f"raised (set rounds to {_short(t)} or more to keep the run)")


def _check_config_record(ckpt: dict, path) -> None:
    """``config`` and ``config_sha256`` are both there or both absent; the record is a
    JSON object of bounded size and matches its SHA-256 (else the file was altered)."""
    have = [k for k in OPTIONAL_KEYS if k in ckpt]
    if not have:
        return
    if len(have) != len(OPTIONAL_KEYS):
        lacks = next(k for k in OPTIONAL_KEYS if k not in ckpt)
        raise _bad(path, f"it has {have[0]} but no {lacks}")
    text = ckpt["config"]
    if len(text) > MAX_CONFIG_CHARS:
        raise _bad(path, f"its config has {len(text)} characters, more than the "
                         f"{MAX_CONFIG_CHARS} allowed")
    if _sha256(text) != ckpt["config_sha256"]:
        raise _bad(path, "its config does not match its config_sha256: the file was altered")
    try:
        record = safeio.loads_json(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise _bad(path, "its config is not a JSON object")


def _check_streams(streams: dict, path) -> None:
    if set(streams) != {"seed", "numpy", "torch"}:
        raise _bad(path, "streams does not hold seed, numpy and torch")
    if not _is_int(streams["seed"]):
        raise _bad(path, "streams.seed is not an integer")
    gens = streams["numpy"]
    if not isinstance(gens, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in gens.items()):
        raise _bad(path, "streams.numpy is not a dict of generator states by name")
    gens = streams["torch"]
    if not isinstance(gens, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.dtype == torch.uint8
            and v.dim() == 1 for k, v in gens.items()):
        raise _bad(path, "streams.torch is not a dict of generator states by name")


def _check_clock(clock: dict, path) -> None:
    if set(clock) != {"now", "rng", "profiles"}:
        raise _bad(path, "clock does not hold now, rng and profiles")
    if not _is_num(clock["now"]) or clock["now"] < 0:
        raise _bad(path, "clock.now is not a time")
    if not isinstance(clock["rng"], dict) or not isinstance(clock["profiles"], dict):
        raise _bad(path, "clock.rng or clock.profiles is not a dict")


def _check_ledger(ledger: dict, t: int, path) -> None:
    if set(ledger) != {"num_clients", "round", "rounds"}:
        raise _bad(path, "ledger does not hold num_clients, round and rounds")
    n = ledger["num_clients"]
    if not _is_int(n) or n < 1 or not _is_int(ledger["round"]) or \
            not 0 <= ledger["round"] <= t or not isinstance(ledger["rounds"], dict):
        raise _bad(path, "ledger.num_clients, ledger.round or ledger.rounds is malformed")
    for r, table in ledger["rounds"].items():
        if not _is_int(r) or not 0 <= r <= t or not isinstance(table, dict):
            raise _bad(path, f"ledger.rounds has an entry {str(r)[:20]!r} that is not a "
                             f"round 0..{t}")
        for key, sent in table.items():
            if not isinstance(key, str) or key.count("|") != 1 or \
                    key.split("|")[0] not in KINDS or key.split("|")[1] not in (UP, DOWN):
                raise _bad(path, f"ledger.rounds[{r}] has a key {str(key)[:40]!r} that is "
                                 "not kind|direction")
            if isinstance(sent, list):      # every client's bytes, as written before
                if len(sent) != n or not all(_is_int(b) and 0 <= b < 2 ** 63 for b in sent):
                    raise _bad(path, f"ledger.rounds[{r}][{key!r}] is not {n} byte counts")
                continue
            what = _check_sent(sent, n)
            if what is not None:
                raise _bad(path, f"ledger.rounds[{r}][{key!r}] {what}")


def _check_sent(sent: Any, n: int) -> str | None:
    """What is wrong with a ledger entry of ``n`` clients' run (None when nothing):
    ``{"ids": ..., "bytes": ...}``, int64 vectors of one length, the ids distinct
    clients 0..n-1 in increasing order, the bytes not negative."""
    if not isinstance(sent, dict) or set(sent) != {"ids", "bytes"}:
        return "does not hold the ids and bytes of the clients that sent"
    ids, nbytes = sent["ids"], sent["bytes"]
    if not all(isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 1
               for a in (ids, nbytes)):
        return "has ids or bytes that are not vectors of int64"
    if ids.size != nbytes.size:
        return f"has {ids.size} ids and {nbytes.size} byte counts"
    if ids.size > n or (ids.size and (ids[0] < 0 or ids[-1] >= n
                                      or not (ids[1:] > ids[:-1]).all())):
        return f"has ids that are not distinct clients 0..{n - 1} in increasing order"
    if nbytes.size and nbytes.min() < 0:
        return "has a negative byte count"
    return None


# ------------------------------------------------------------------ restoring


def restore(env, ckpt: dict, template: Any = None, *, where: str | Path = CHECKPOINT):
    """Load a checkpoint's streams, clock, ledger and components into ``env``; returns
    the algorithm state.

    ``template``: the algorithm's ``init_state(env)``; the saved state must have its
    structure (keys, tensor shapes and dtypes), and its modules and optimizers are loaded
    from the saved state dicts and returned. Without one, the saved state is returned
    as it is (it must then hold no module or optimizer). Raises :class:`FormatError`
    naming ``where`` when the checkpoint does not fit the run; changes no file."""
    try:
        _check_env(env, ckpt, where)
        if DATA_KEY in ckpt and ckpt[DATA_KEY] != data_digest(env):
            raise FormatError(
                f"{where}: the data or partition built now are not the run's ({DATA_KEY} "
                "differs): the data files changed, or a data set or partitioner draws from "
                "a global random generator instead of the rng it is given (docs/extending.md); "
                f"{RERUN}")
        env.streams.load_state(ckpt["streams"])
        env.clock.load_state(ckpt["clock"])
        env.ledger.load_state(ckpt["ledger"])
        for name, saved in ckpt["components"].items():
            loader = getattr(getattr(env, name, None), "load_state", None)
            if not callable(loader):
                raise FormatError(f"{where}: it holds the state of the run's {name}, which "
                                  f"this run's engine cannot load; {RERUN}")
            loader(saved)
        state = ckpt["state"]
        if state is None:
            return None
        if template is None:
            if _tagged(state):
                raise FormatError(f"{where}: its algorithm state holds a model or optimizer "
                                  "that only the algorithm can load")
            return state
        _conform(state, template, "state", where)
        return _live(state, template, getattr(env, "device", None))
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError,
            OverflowError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise FormatError(f"{where}: does not fit this run ({type(e).__name__}: {first}); "
                          f"{RERUN}") from None


def _check_env(env, ckpt: dict, where) -> None:
    seed = ckpt["streams"]["seed"]
    if seed != env.streams.seed:
        raise FormatError(f"{where}: written by a run of seed {seed}, config.yaml has seed "
                          f"{env.streams.seed}; it is not this run's checkpoint: {RERUN}")
    n = ckpt["ledger"]["num_clients"]
    if n != env.ledger.num_clients:
        raise FormatError(f"{where}: written by a run of {n} clients, this run has "
                          f"{env.ledger.num_clients}; it is not this run's checkpoint: {RERUN}")
    profiles = env.clock.state()["profiles"]
    _conform(ckpt["clock"]["profiles"], profiles, "clock.profiles", where, loose=False)
    generator = np.random.default_rng(0).bit_generator.state    # the streams' kind
    _conform(ckpt["clock"]["rng"], generator, "clock.rng", where, loose=False)
    saved = ckpt["streams"]
    for name, s in saved["numpy"].items():
        _conform(s, generator, f"streams.numpy[{name[:40]!r}]", where, loose=False)
    have = env.streams.state()                  # the streams a run has from its start
    for kind in ("numpy", "torch"):
        lost = sorted(set(have[kind]) - set(saved[kind]))
        if lost:
            raise FormatError(f"{where}: streams.{kind} lacks the run's stream "
                              f"{lost[0]!r}; it is not a checkpoint of this run: {RERUN}")


class Rule:
    """A part of a checkpoint template that the saved value is checked against by a
    function rather than by example: for state whose shape is known only when it is
    saved (a buffer of a varying number of uploads) or that starts empty (``None``) and
    later holds a structure, as a server optimizer's ``state_dict()``.
    :meth:`Algorithm.checkpoint_template <splitfed.engine.algorithm.Algorithm.
    checkpoint_template>` puts one where ``init_state`` has the value.

    ``check(saved)`` returns None when the saved value fits, else what is wrong with it,
    phrased to follow its place in the state ("is not ...", "holds ..."). The value is
    restored as it was saved (its tensors on the run's device)."""

    def __init__(self, check):
        self.check = check

    def __repr__(self) -> str:
        return f"Rule({getattr(self.check, '__qualname__', self.check)!r})"


class _Why(Exception):
    """What :func:`_conform_optimizer` found wrong, when a :class:`Rule` runs it."""


def optimizer_rule(opt: torch.optim.Optimizer, *, empty: bool = True) -> Rule:
    """A :class:`Rule` for a saved ``opt.state_dict()`` (a plain dict, as an algorithm
    keeps its server optimizer's state between rounds): the same parameter groups with
    the same hyperparameters (the learning rate aside, which a schedule changes), state
    only for the optimizer's parameters, each tensor of its parameter's shape (a
    ``step`` count a scalar). ``empty``: None (no state yet) fits as well."""
    def check(saved: Any) -> str | None:
        if saved is None:
            return None if empty else "is empty, not a saved optimizer"
        try:
            _conform_optimizer(saved, opt, "", _Why)
        except _Why as e:
            return str(e)
        return None
    return Rule(check)


def misfit(state: dict, template: Any) -> str | None:
    """Why a checkpoint of the live algorithm ``state`` could not be resumed against
    ``template`` (``checkpoint_template(env, init_state(env), state)``), as
    ``"state.KEY is ..."``; None when it could. The state is compared in the form a
    checkpoint stores and reads back (modules and optimizers as their state dicts)."""
    try:
        _conform(safeio.decode(safeio.encode(_plain(state))), template, "state", None)
    except _Why as e:
        return str(e)
    return None


def _tagged(obj: Any) -> bool:
    if isinstance(obj, dict):
        return MODULE in obj or OPTIMIZER in obj or any(_tagged(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_tagged(v) for v in obj)
    return False


def _conform(saved: Any, template: Any, at: str, where, *, loose: bool = True) -> None:
    """``saved`` has ``template``'s structure: the same keys, sequence lengths, tensor and
    array shapes and dtypes, kinds of scalars. A None in the template allows anything
    when ``loose`` (state that starts empty), else only None. ``where`` None: raise
    ``_Why("AT WHAT")`` instead of the :class:`FormatError` naming the file."""
    def bad(what: str) -> Exception:
        if where is None:
            return _Why(f"{at} {what}")
        return FormatError(f"{where}: {at} {what}; it is not a checkpoint of this run (or "
                           f"it was written by another splitfed version): {RERUN}")

    if template is None:
        if not loose and saved is not None:
            raise bad("should be empty")
        return
    if isinstance(template, Rule):
        why = template.check(saved)
        if why is not None:
            raise bad(str(why)[:300])
        return
    if isinstance(template, torch.nn.Module):
        sd = saved.get(MODULE) if isinstance(saved, dict) and len(saved) == 1 else None
        if not isinstance(sd, dict):
            raise bad("is not a saved model")
        _conform(sd, dict(template.state_dict()), at, where)
        return
    if isinstance(template, torch.optim.Optimizer):
        sd = saved.get(OPTIMIZER) if isinstance(saved, dict) and len(saved) == 1 else None
        if not isinstance(sd, dict):
            raise bad("is not a saved optimizer")
        _conform_optimizer(sd, template, at, bad)
        return
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.dtype != template.dtype or \
                saved.shape != template.shape:
            raise bad(f"is not a {template.dtype} tensor of shape {tuple(template.shape)}")
        return
    if isinstance(template, np.ndarray):
        if not isinstance(saved, np.ndarray) or saved.dtype != template.dtype or \
                saved.shape != template.shape:
            raise bad(f"is not a {template.dtype} array of shape {template.shape}")
        return
    if isinstance(template, dict):
        if not isinstance(saved, dict):
            raise bad("is not a dict")
        if set(saved) != set(template):
            diff = sorted(repr(k)[:40] for k in set(saved) ^ set(template))
            raise bad(f"has other keys ({', '.join(diff[:5])})")
        for k, v in template.items():
            _conform(saved[k], v, f"{at}.{k}", where, loose=loose)
        return
    if isinstance(template, (list, tuple)):
        if type(saved) is not type(template) or len(saved) != len(template):
            raise bad(f"is not a {type(template).__name__} of {len(template)}")
        for i, (s, v) in enumerate(zip(saved, template)):
            _conform(s, v, f"{at}[{i}]", where, loose=loose)
        return
    if isinstance(template, bool):
        ok = isinstance(saved, bool)
    elif isinstance(template, int):
        ok = _is_int(saved)
    elif isinstance(template, float):
        ok = isinstance(saved, (int, float)) and not isinstance(saved, bool)
    elif isinstance(template, (str, bytes)):
        ok = isinstance(saved, type(template))
    else:
        ok = type(saved) is type(template)
    if not ok:
        raise bad(f"is a {type(saved).__name__}, not a {type(template).__name__}")


#: optimizer hyperparameters a saved state may hold other values of (a schedule sets them)
SCHEDULED = ("lr", "initial_lr")


def _conform_optimizer(sd: Any, opt: torch.optim.Optimizer, at: str, bad) -> None:
    """``sd`` is a ``state_dict()`` of ``opt``: its parameter groups, with the same
    hyperparameters but the scheduled ones (a forged momentum would change the run's
    numbers), and per-parameter state of the parameters' shapes (``step`` a scalar)."""
    ref = opt.state_dict()
    if not isinstance(sd, dict) or set(sd) != {"state", "param_groups"} or \
            not isinstance(sd["state"], dict) or \
            not isinstance(sd["param_groups"], list) or \
            len(sd["param_groups"]) != len(ref["param_groups"]):
        raise bad("is not a saved optimizer of this run")
    shapes = {}
    for group, ref_group, live in zip(sd["param_groups"], ref["param_groups"],
                                      opt.param_groups):
        if not isinstance(group, dict) or set(group) != set(ref_group) or \
                group["params"] != ref_group["params"]:
            raise bad("has other parameter groups")
        for k, v in ref_group.items():
            if k != "params" and v is not None:
                ok = (isinstance(group[k], (int, float)) and not isinstance(group[k], bool)
                      if isinstance(v, (int, float)) and not isinstance(v, bool)
                      else isinstance(group[k], type(v)))
                if not ok:
                    raise bad(f"has a {k} of type {type(group[k]).__name__}")
                if k not in SCHEDULED and group[k] != v:
                    raise bad(f"has {k} {_short(group[k])}, the run's optimizer has "
                              f"{_short(v)}")
            elif k != "params" and v is None and group[k] is not None:
                raise bad(f"has {k} {_short(group[k])}, the run's optimizer has None")
        shapes.update(zip(ref_group["params"], (p.shape for p in live["params"])))
    for pid, entry in sd["state"].items():
        if pid not in shapes or not isinstance(entry, dict):
            raise bad(f"has state for an unknown parameter {str(pid)[:20]}")
        for name, v in entry.items():
            if not isinstance(v, (torch.Tensor, int, float)) or isinstance(v, bool):
                raise bad(f"has a {str(name)[:40]} of type {type(v).__name__}")
            if not isinstance(v, torch.Tensor):
                continue
            want = () if name == "step" else tuple(shapes[pid])
            if tuple(v.shape) != want or not (v.is_floating_point() or name == "step"):
                raise bad(f"has a {str(name)[:40]} of shape {tuple(v.shape)} "
                          f"({str(v.dtype).replace('torch.', '')}) for a parameter of "
                          f"shape {tuple(shapes[pid])}")


def _live(saved: Any, template: Any, device: torch.device | None = None) -> Any:
    """``saved`` with the template's modules and optimizers loaded from their saved state
    dicts (in the order modules first, so that optimizers see the loaded parameters), and
    its tensors (read onto the CPU) where the run keeps them: on the device of the
    template's tensor, or, where the template has none (state that starts empty), on the
    run's ``device`` (a GPU run's state goes back to the GPU)."""
    if isinstance(template, torch.nn.Module):
        template.load_state_dict(saved[MODULE])
        return template
    if isinstance(template, torch.optim.Optimizer):
        template.load_state_dict(saved[OPTIMIZER])
        return template
    if isinstance(template, dict):
        return {k: _live(saved[k], template[k], device) for k in saved}
    if isinstance(template, (list, tuple)):
        return type(saved)(_live(s, v, device) for s, v in zip(saved, template))
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(template.device)
    loose = template is None or isinstance(template, Rule)
    return _to(saved, device) if loose and device is not None else saved


def _to(saved: Any, device: torch.device) -> Any:
    """``saved`` with every tensor in it on ``device``."""
    if isinstance(saved, torch.Tensor):
        return saved.to(device)
    if isinstance(saved, dict):
        return {k: _to(v, device) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        return type(saved)(_to(v, device) for v in saved)
    return saved


# ------------------------------------------------------------------ metrics


#: the largest ``metrics.jsonl`` read back (far above any real run's records)
MAX_METRICS_BYTES = 1 << 30


def _read_metrics(path: Path) -> str:
    """``metrics.jsonl`` as text; a FormatError naming it when it is not a regular file
    (a pipe would block, ``/dev/zero`` exhaust memory) or larger than MAX_METRICS_BYTES."""
    data = safeio.read_regular(path, str(path), MAX_METRICS_BYTES,
                               hint="the run directory is damaged, delete it to rerun "
                                    "the run from the start")
    return data.decode("utf-8")


def _metric_lines(run_dir: str | Path, count: int, t: int | None) -> tuple[list[str],
                                                                            list[dict]]:
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = _read_metrics(path) if os.path.lexists(path) else ""
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise FormatError(f"{path}: cannot be read ({why}); the run directory is damaged, "
                          "delete it to rerun the run from the start") from None
    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) < count:
        raise FormatError(f"{path}: holds {len(lines)} records but the checkpoint was "
                          f"written after {count}; the run directory is damaged, delete it "
                          "to rerun the run from the start")
    kept, records = lines[:count], []
    for i, line in enumerate(kept, 1):
        try:
            record = safeio.loads_json(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not _is_int(record.get("round")):
            raise FormatError(f"{path}: record {i} is not a JSON record with a round; the "
                              "run directory is damaged, delete it to rerun the run from "
                              "the start")
        if t is not None and i < count and record["round"] != i - 1:
            raise FormatError(f"{path}: record {i} is of round {_short(record['round'])}, "
                              f"not {i - 1}; the run directory is damaged, delete it to "
                              "rerun the run from the start")
        records.append(record)
    if t is not None and records and records[-1]["round"] != t:
        raise FormatError(f"{path}: record {count} is of round {records[-1]['round']}, the "
                          f"checkpoint of round {t}; the run directory is damaged, delete "
                          "it to rerun the run from the start")
    return kept, records


def checkpoint_records(run_dir: str | Path, ckpt: dict, *,
                       rounds: int | None = None) -> list[dict]:
    """The records of ``metrics.jsonl`` up to ``ckpt``, checked; changes no file.

    ``rounds``: config.yaml's rounds. Lowered to exactly the checkpoint's round, they
    would end the run there; that is refused (:class:`ConfigError`) unless the round was
    evaluated (it was the run's last round when it ran, or an evaluated one) or the run
    diverged: else its result would be an earlier round's evaluation."""
    records = _metric_lines(run_dir, ckpt["records"], ckpt["round"])[1]
    t = ckpt["round"]
    if rounds is not None and t == rounds and t > 0 and ckpt["status"] == "completed" \
            and "test_acc" not in records[-1]:
        raise ConfigError(f"{Path(run_dir) / CHECKPOINT}: config.yaml's rounds {rounds} "
                          f"end the run at the round its checkpoint was written after, "
                          f"which was not evaluated (it was not the run's last round); a "
                          f"run's rounds may only be raised (set rounds to {t + 1} or "
                          "more to keep the run)")
    return records


def truncate_metrics(run_dir: str | Path, count: int, t: int | None = None) -> list[dict]:
    """Cut ``metrics.jsonl`` back to its first ``count`` records (atomically) and return
    them; records written after the checkpoint are dropped, so none is duplicated. The
    records are checked first (the last one of round ``t`` when given); a damaged file is
    refused unchanged."""
    kept, records = _metric_lines(run_dir, count, t)
    text = "".join(line + "\n" for line in kept).encode("utf-8")
    atomic_write(Path(run_dir) / "metrics.jsonl", lambda fh: fh.write(text))
    return records


# ------------------------------------------------------------------ threads


def thread_warnings(ckpt: dict) -> list[str]:
    """What differs from the session that started the run, in words: the thread count
    and the CPU kernels decide the reduction order of convolutions and matrix products,
    so results differ from an uninterrupted run in the last bits."""
    out = []
    n, m = torch.get_num_threads(), ckpt["threads"]
    if n != m:
        out.append(f"resumed with {n} threads, the run was started with {m}: results will "
                   "differ from an uninterrupted run in the last bits (set "
                   f"OMP_NUM_THREADS={m} to match)")
    cap, cap0 = cpu_capability(), ckpt["cpu_capability"]
    if cap != cap0:
        out.append(f"resumed on a CPU with {cap} kernels, the run was started with "
                   f"{cap0[:64]}: results will differ from an uninterrupted run in the last "
                   "bits")
    return out


class Checkpointer:
    """Called by the round loop after each round's record is logged; writes a
    checkpoint every ``every`` rounds, at the last round and when the run stops early.

    ``threads``, ``cpu`` and ``resumed_threads``: the thread count and CPU kernels the
    run was started with and the thread count of each resume (default: this process's,
    and none). ``config``: the run's config as plain data (``to_dict``), recorded in
    every checkpoint (:func:`config_record`) and checked when the run is resumed."""

    def __init__(self, run_dir: str | Path, env, logger, *, every: int, rounds: int,
                 wall_offset: float = 0.0, resumed_from: list[int] | None = None,
                 clock=None, threads: int | None = None, cpu: str | None = None,
                 resumed_threads: list[int] | None = None, config: Mapping | None = None):
        self.path = Path(run_dir) / CHECKPOINT
        self.config = config
        self.env, self.logger = env, logger
        self.every, self.rounds = int(every), int(rounds)
        self.wall_offset = float(wall_offset)
        self.resumed_from = list(resumed_from or [])
        self.threads = int(threads if threads is not None else torch.get_num_threads())
        self.cpu = cpu if cpu is not None else cpu_capability()
        self.resumed_threads = list(resumed_threads or [])
        if len(self.resumed_threads) != len(self.resumed_from):   # a caller without them
            self.resumed_threads = [torch.get_num_threads()] * len(self.resumed_from)
        self._clock = clock   # () -> seconds measured since this session's start
        self.saved: list[int] = []
        self._data: str | None = None             # data_digest(env), at the first save

    def due(self, t: int, status: str) -> bool:
        if self.every <= 0:
            return False
        return t % self.every == 0 or t >= self.rounds or status != "completed"

    def __call__(self, t: int, state: dict, status: str) -> None:
        if not self.due(t, status):
            return
        wall = self.wall_offset + (self._clock() if self._clock is not None else 0.0)
        sync = getattr(self.logger, "sync", None)
        if sync is not None:
            sync()                                # the records it counts are on disk first
        if self._data is None:
            self._data = data_digest(self.env)
        atomic_save(capture(self.env, state, t, records=len(self.logger.records),
                            status=status, wall_time_s=wall,
                            resumed_from=self.resumed_from, threads=self.threads,
                            cpu=self.cpu, resumed_threads=self.resumed_threads,
                            config=self.config, data=self._data), self.path)
        self.saved.append(t)
