"""Conformance checks for an algorithm: call them on your own (plugin) algorithm.

The checks are the ones every built-in algorithm passes (``tests/test_conformance.py``
runs them on each). They run a few rounds on small real data, scikit-learn's bundled
8x8 digits (nothing is downloaded; scikit-learn must be installed), in this process,
with no run directory written, and check that the algorithm:

- ``learns``: the test accuracy rises by more than :data:`LEARN_MARGIN` and the
  training loss falls over the run (:func:`check_learns`);
- ``deterministic``: two runs with the same seed give the same learned state and the
  same metrics, apart from the wall-clock ``round_time_s`` (:func:`check_deterministic`);
- ``state_untouched``: ``round`` leaves the state it is given as it was (it returns a
  new one; modules and optimizers in the state, which an algorithm may train in place,
  are not compared) (:func:`check_state_untouched`);

and, for a federated algorithm (class attribute ``federated = True``, the default):

- ``non_sampled_clients_send_nothing``: in every round the clients outside the sampled
  cohort send and receive nothing, of every kind, and the cohort sends something
  (:func:`check_non_sampled_clients_send_nothing`);
- ``ledger_matches_transport``: the bytes the ledger and the metrics report are the bytes
  of the tensors the transport actually delivered (:func:`check_ledger_matches_transport`);
- ``participation_modes``: it runs under every participation mode of
  :data:`PARTICIPATION_MODES` with ``train.local_epochs`` instead of ``local_steps``,
  reporting a finite loss and uploaded bytes whenever clients took part
  (:func:`check_participation_modes`).

In every check, what the round loop refuses fails the check too: a round that returns
something other than a :class:`~splitfed.engine.rounds.RoundResult`, a state with other
keys than ``init_state`` declared, a ``train_loss`` that is not a number, a metric that is
not a number, ``Round.finish()`` before ``Round.send()`` on a cohort, a gradient
transform's output of another count or shape than its input
(:func:`splitfed.engine.loop.check_result`).

A failed check raises :class:`AssertionError` naming the algorithm and the check; the
functions need no test framework, so any runner (pytest, unittest, a plain script) can
call them::

    from splitfed.testing import check_algorithm

    from my_lab.algorithms import MyAlgorithm      # registered with @register_algorithm

    def test_my_algorithm_conforms():
        check_algorithm(MyAlgorithm)                # or check_algorithm("my_algorithm")
        check_algorithm("my_zo_algorithm", overrides={"rounds": 40,
                                                      "train": {"lr": 0.01}})

``overrides`` changes the config of the ``learns`` check only (an algorithm that needs
more rounds, or another learning rate, to learn the small task); ``base`` changes the
config of every check (an option your algorithm needs). Both have the shape of a config
(:func:`base_config` shows the one the checks start from): a section given as a dict
updates that section's keys (``{"train": {"lr": 0.05}}`` keeps the other ``train``
keys), any other value replaces the key (``{"rounds": 12}``).

An algorithm is given by its registered name or by its class. A class that is not
registered (one defined in a test) is registered for the duration of the call, under its
``name`` attribute (or its class name; ``+check`` is appended when that name is taken),
and unregistered afterwards: the config names algorithms, so the checks need a name.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitfed import registry
from splitfed.transport import InProcessTransport

__all__ = ["CHECKS", "FEDERATED_CHECKS", "LEARN_MARGIN", "PARTICIPATION_MODES",
           "base_config", "check_algorithm", "check_deterministic", "check_learns",
           "check_state_untouched",
           "check_ledger_matches_transport", "check_non_sampled_clients_send_nothing",
           "check_participation_modes"]

#: every check, in the order :func:`check_algorithm` runs them
CHECKS = ("learns", "deterministic", "state_untouched", "non_sampled_clients_send_nothing",
          "ledger_matches_transport", "participation_modes")
#: the checks that apply to federated algorithms only (not to ``federated = False``)
FEDERATED_CHECKS = ("non_sampled_clients_send_nothing", "ledger_matches_transport",
                    "participation_modes")
#: the rise of the test accuracy (from round 0 to the last round) ``learns`` expects
LEARN_MARGIN = 0.3
#: the ``participation`` sections ``participation_modes`` runs (each replaces the section)
PARTICIPATION_MODES = ({"mode": "full"}, {"mode": "with_replacement", "clients_per_round": 4},
                       {"mode": "bernoulli", "q": 0.5})
#: rounds of every check but ``learns`` (which runs the base config's ``rounds``)
SHORT_ROUNDS = 2
#: the ``train`` keys ``participation_modes`` sets: local epochs instead of local steps
LOCAL_EPOCHS = {"local_steps": None, "local_epochs": 0.5}
#: the record keys that may differ between two runs with the same seed (wall-clock time)
NONDETERMINISTIC_KEYS = frozenset({"round_time_s"})
#: the transfer kinds ``non_sampled_clients_send_nothing`` looks at (splitfed.transport)
KINDS = ("model", "activations", "labels", "activation_grads", "scalars")


def base_config(name: str = "fedavg") -> dict:
    """The raw config (a dict, as YAML gives it) the checks start from, for the algorithm
    registered as ``name``: 6 rounds of digits over 6 clients (Dirichlet partition,
    alpha 1), 3 sampled per round, 8 local steps of batch 16 at lr 0.1, an MLP with one
    hidden layer of 32 units. A new dict on every call."""
    return {"name": name, "rounds": 6, "progress": False, "seed": 11,
            "algorithm": {"name": name},
            "data": {"name": "digits"},
            "partition": {"scheme": "dirichlet", "num_clients": 6, "alpha": 1.0,
                          "min_partition_size": 5},
            "model": {"name": "mlp", "hidden": [32]},
            "train": {"batch_size": 16, "local_steps": 8, "local_epochs": None, "lr": 0.1},
            "participation": {"mode": "uniform", "clients_per_round": 3}}


# ------------------------------------------------------------------ the algorithm


@dataclass(frozen=True)
class _Subject:
    name: str                                  # its key in the registry
    cls: type

    @property
    def label(self) -> str:
        return f"algorithm {self.name!r} ({self.cls.__module__}.{self.cls.__qualname__})"

    @property
    def federated(self) -> bool:
        return bool(getattr(self.cls, "federated", True))

    def fail(self, check: str, detail: str) -> AssertionError:
        return AssertionError(f"{self.label} fails the conformance check {check!r}: {detail}")


def _free_name(cls: type, table: Mapping[str, Any]) -> str:
    raw = cls.__dict__.get("name") or cls.__name__
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", str(raw)).lstrip(".+-") or "algorithm"
    candidate, n = name, 1
    while candidate in table:
        candidate = f"{name}+check" + (str(n) if n > 1 else "")
        n += 1
    return candidate


@contextmanager
def _subject(algorithm: str | type) -> Iterator[_Subject]:
    """The algorithm ``algorithm`` names; an unregistered class is registered meanwhile."""
    from splitfed.algorithms import ALGORITHMS, get_algorithm

    registry.load_entry_points()               # as build_config does: plugin names exist
    if isinstance(algorithm, str):
        yield _Subject(algorithm, get_algorithm(algorithm))   # ConfigError if unknown
        return
    known = sorted(name for name, cls in ALGORITHMS.items() if cls is algorithm)
    if known:
        yield _Subject(known[0], algorithm)
        return
    if not isinstance(algorithm, type):
        raise TypeError(f"expected an algorithm's registered name or its class, got "
                        f"{algorithm!r}")
    name = _free_name(algorithm, ALGORITHMS)
    registry.register_algorithm(name, algorithm)   # PluginError if it is no Algorithm
    try:
        yield _Subject(name, algorithm)
    finally:
        if ALGORITHMS.get(name) is algorithm:
            del ALGORITHMS[name]
            registry._ORIGINS["algorithm"].pop(name, None)


# ------------------------------------------------------------------ running it


def _merge(raw: dict, changes: Mapping[str, Any] | None) -> dict:
    """``raw`` with ``changes``: a dict updates a section's keys, anything else replaces."""
    out = copy.deepcopy(raw)
    for key, value in copy.deepcopy(dict(changes or {})).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _raw(subject: _Subject, base: Mapping | None, *changes: Mapping | None) -> dict:
    """:func:`base_config` changed by ``base``, then by each of ``changes``."""
    raw = _merge(base_config(subject.name), base)
    for change in changes:
        raw = _merge(raw, change)
    raw["algorithm"] = {**raw.get("algorithm", {}), "name": subject.name}
    return raw


def _config(subject: _Subject, base: Mapping | None, *changes: Mapping | None):
    from splitfed.config import build_config

    return build_config(_raw(subject, base, *changes))


def _build(cfg):
    from splitfed.experiment import build_algorithm, build_environment, check_algorithm_env

    algorithm = build_algorithm(cfg)
    env = build_environment(cfg)
    check_algorithm_env(algorithm, env)        # as run_experiment does
    return algorithm, env


def _run(s: _Subject, check: str, cfg, env=None, algorithm=None):
    """Run ``cfg``'s rounds in memory. What the engine refuses while the rounds run (a
    round's result that is not a well-formed RoundResult, a transform's output of
    another shape, Round.finish before Round.send: a PluginError) fails ``check``."""
    from splitfed.engine.loop import run_rounds
    from splitfed.errors import PluginError
    from splitfed.metrics import MetricLogger

    if env is None:
        algorithm, env = _build(cfg)
    logger = MetricLogger(None)                # in memory: no run directory
    try:
        state, status = run_rounds(algorithm, env, logger)
    except PluginError as e:
        raise s.fail(check, f"the round loop refused it: {e}") from e
    return env, logger.records, state, status


def _difference(a: Any, b: Any, path: str) -> str | None:
    """Where two learned states differ (None when they are equal): tensors and arrays
    exactly, dicts and sequences element by element, modules by their state dicts, plain
    values by ``==``; other objects are not compared."""
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        a, b = a.state_dict(), b.state_dict()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.detach().cpu(), b.detach().cpu()))
        return None if same else path
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
        return None if same else path
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a) != list(b):
            return f"{path} (keys {sorted(map(str, a))} vs {sorted(map(str, b))})"
        for key in a:
            found = _difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (lengths {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    plain = (bool, int, float, str, bytes, type(None), np.generic)
    if isinstance(a, plain) and isinstance(b, plain):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return None
        return None if a == b else f"{path} ({a!r} vs {b!r})"
    return None


class _CountingTransport(InProcessTransport):
    """Counts the bytes of every tensor it delivers, independently of the ledger."""

    def __init__(self, ledger, clock=None):
        super().__init__(ledger, clock=clock)
        self.delivered = 0

    def send(self, kind, direction, client_ids, payload, *, per_client=True):
        tensors = [payload] if isinstance(payload, torch.Tensor) else list(payload.values())
        n = len(np.atleast_1d(client_ids))
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.delivered += size if per_client else size * n
        return super().send(kind, direction, client_ids, payload, per_client=per_client)


# ------------------------------------------------------------------ the checks


def _learns(s: _Subject, overrides: Mapping | None, base: Mapping | None) -> None:
    cfg = _config(s, base, overrides)
    _, records, _, status = _run(s, "learns", cfg)
    hint = ("; if it needs more rounds or other settings to learn this small task, pass "
            "overrides (e.g. overrides={'rounds': 20}; splitfed.testing.base_config() is "
            "the config they change)")
    if status != "completed":
        raise s.fail("learns", f"the run ended with status {status!r} after "
                               f"{records[-1]['round']} of {cfg.rounds} rounds{hint}")
    first, last = records[0].get("test_acc"), records[-1].get("test_acc")
    if first is None or last is None:
        raise s.fail("learns", "no test accuracy at round 0 or at the last round")
    if not last > first + LEARN_MARGIN:
        raise s.fail("learns", f"the test accuracy went from {first:.3f} (round 0) to "
                               f"{last:.3f} (round {records[-1]['round']}); expected a "
                               f"rise of more than {LEARN_MARGIN}{hint}")
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    if len(losses) < 2:
        raise s.fail("learns", f"train_loss was reported in {len(losses)} round(s) of "
                               f"{cfg.rounds}; expected it in every round that trained")
    if not losses[-1] < losses[0]:
        raise s.fail("learns", f"the training loss did not fall: {losses[0]:.4f} in the "
                               f"first round, {losses[-1]:.4f} in the last{hint}")


def _deterministic(s: _Subject, base: Mapping | None) -> None:
    cfg = _config(s, base, {"rounds": SHORT_ROUNDS})
    _, rec1, state1, _ = _run(s, "deterministic", cfg)
    _, rec2, state2, _ = _run(s, "deterministic", cfg)
    where = _difference(state1, state2, "state")
    if where:
        raise s.fail("deterministic", f"two runs with seed {cfg.seed} end with different "
                                      f"learned states: {where} differs")

    def drop(records):
        return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC_KEYS}
                for r in records]
    rec1, rec2 = drop(rec1), drop(rec2)
    if rec1 != rec2:
        if len(rec1) != len(rec2):
            detail = f"{len(rec1)} vs {len(rec2)} records"
        else:
            i = next(i for i, (a, b) in enumerate(zip(rec1, rec2)) if a != b)
            keys = sorted(k for k in rec1[i].keys() | rec2[i].keys()
                          if rec1[i].get(k) != rec2[i].get(k))
            detail = f"record {i} (round {rec1[i].get('round')}) differs in {keys}"
        raise s.fail("deterministic", f"two runs with seed {cfg.seed} log different "
                                      f"metrics: {detail}")


def _snapshot(value: Any) -> Any:
    """A copy of a state's data for :func:`_difference` (tensors and arrays cloned);
    modules and optimizers become None: an algorithm may train those in place."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Mapping):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(v) for v in value]
    return value


def _untouched(s: _Subject, base: Mapping | None) -> None:
    cfg = _config(s, base, {"rounds": SHORT_ROUNDS})
    algorithm, env = _build(cfg)
    changed = []
    own_round = algorithm.round

    def round_(env, state, t, cohort):          # the state as given, compared afterwards
        before = _snapshot(state)
        result = own_round(env, state, t, cohort)
        where = _difference(before, _snapshot(state), "state")
        if where and not changed:
            changed.append((t, where))
        return result
    algorithm.round = round_
    _run(s, "state_untouched", cfg, env, algorithm)
    if changed:
        t, where = changed[0]
        raise s.fail("state_untouched", f"round {t} changed the state it was given, at "
                                        f"{where}; round must return a new state (copy a "
                                        "tensor before changing it: x = x.clone())")


def _non_sampled(s: _Subject, base: Mapping | None) -> None:
    cfg = _config(s, base, {"rounds": SHORT_ROUNDS})
    algorithm, env = _build(cfg)
    cohorts = {}
    own_round = algorithm.round

    def round_(env, state, t, cohort):          # the cohort each round is given
        cohorts[t] = cohort
        return own_round(env, state, t, cohort)
    algorithm.round = round_
    _run(s, "non_sampled_clients_send_nothing", cfg, env, algorithm)
    for t in range(1, SHORT_ROUNDS + 1):
        if t not in cohorts:
            raise s.fail("non_sampled_clients_send_nothing", f"round {t} did not run")
        ids = np.asarray(cohorts[t].ids, dtype=np.int64)
        sampled = np.zeros(env.num_clients, dtype=bool)
        sampled[ids] = True
        for kind in KINDS:
            for direction in ("up", "down"):
                per_client = env.ledger.per_client(t, kind, direction)
                leaked = np.flatnonzero(per_client[~sampled] != 0)
                if leaked.size:
                    others = np.flatnonzero(~sampled)[leaked].tolist()
                    raise s.fail("non_sampled_clients_send_nothing",
                                 f"round {t}: clients {others}, not in the cohort "
                                 f"{sorted(set(ids.tolist()))}, "
                                 f"{'sent' if direction == 'up' else 'received'} "
                                 f"{kind!r} bytes")
        if not env.ledger.round_totals(t)["bytes_up"] > 0:
            raise s.fail("non_sampled_clients_send_nothing",
                         f"round {t}: the cohort {sorted(set(ids.tolist()))} sent nothing "
                         "(bytes_up = 0); clients' uploads must go through env.transport")


def _ledger(s: _Subject, base: Mapping | None) -> None:
    cfg = _config(s, base, {"rounds": SHORT_ROUNDS})
    algorithm, env = _build(cfg)
    env.transport = transport = _CountingTransport(env.ledger, clock=env.transport.clock)
    _, records, _, _ = _run(s, "ledger_matches_transport", cfg, env, algorithm)
    ledgered = sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in records)
    total = env.ledger.total()
    if not (ledgered == transport.delivered == total > 0):
        raise s.fail("ledger_matches_transport",
                     f"the metrics report {ledgered} bytes, the ledger {total}, the "
                     f"transport delivered tensors of {transport.delivered} bytes; expected "
                     "the same number, above 0")


def _participation(s: _Subject, modes: Iterable[Mapping], base: Mapping | None) -> None:
    from splitfed.config import build_config

    for mode in modes:
        raw = _raw(s, base, {"rounds": SHORT_ROUNDS, "train": LOCAL_EPOCHS})
        raw["participation"] = copy.deepcopy(dict(mode))     # the whole section
        cfg = build_config(raw)
        _, records, _, status = _run(s, "participation_modes", cfg)
        what = f"participation {dict(mode)} with train.local_epochs 0.5"
        if status != "completed":
            raise s.fail("participation_modes", f"{what}: the run ended with status "
                                                f"{status!r}")
        for r in records[1:]:
            if not r.get("participants", -1) >= 0:
                raise s.fail("participation_modes", f"{what}: round {r.get('round')} "
                                                    f"reports participants "
                                                    f"{r.get('participants')!r}")
            if r["participants"]:
                loss = r.get("train_loss")
                if not (isinstance(loss, (int, float)) and np.isfinite(loss)):
                    raise s.fail("participation_modes",
                                 f"{what}: round {r['round']} had {r['participants']} "
                                 f"participants but train_loss {loss!r}")
                if not r.get("bytes_up", 0) > 0:
                    raise s.fail("participation_modes",
                                 f"{what}: round {r['round']} had {r['participants']} "
                                 "participants but nothing was uploaded (bytes_up = 0)")


def _federated_only(s: _Subject, check: str) -> None:
    if not s.federated:
        raise ValueError(f"the check {check!r} applies to federated algorithms only; "
                         f"{s.label} sets federated = False")


# ------------------------------------------------------------------ the public API


def check_learns(algorithm: str | type, overrides: Mapping | None = None, *,
                 base: Mapping | None = None) -> None:
    """``learns``: a run of :func:`base_config` (changed by ``base``, then by
    ``overrides``) completes, its test accuracy at the last round exceeds round 0's by
    more than :data:`LEARN_MARGIN`, and its last ``train_loss`` is below its first."""
    with _subject(algorithm) as s:
        _learns(s, overrides, base)


def check_deterministic(algorithm: str | type, *, base: Mapping | None = None) -> None:
    """``deterministic``: two runs of 2 rounds with the same seed end with equal learned
    states (every tensor exactly) and log equal metrics (but ``round_time_s``)."""
    with _subject(algorithm) as s:
        _deterministic(s, base)


def check_state_untouched(algorithm: str | type, *, base: Mapping | None = None) -> None:
    """``state_untouched``: over 2 rounds, every round leaves the state it is given as it
    was (tensors and arrays exactly, element by element; modules and optimizers in the
    state are not compared)."""
    with _subject(algorithm) as s:
        _untouched(s, base)


def check_non_sampled_clients_send_nothing(algorithm: str | type, *,
                                           base: Mapping | None = None) -> None:
    """``non_sampled_clients_send_nothing`` (federated algorithms): over 2 rounds, the
    ledger charges no bytes of any kind, up or down, to a client outside the round's
    cohort, and the cohort uploads something every round."""
    with _subject(algorithm) as s:
        _federated_only(s, "non_sampled_clients_send_nothing")
        _non_sampled(s, base)


def check_ledger_matches_transport(algorithm: str | type, *,
                                   base: Mapping | None = None) -> None:
    """``ledger_matches_transport`` (federated algorithms): over 2 rounds, the bytes in
    the metrics (``bytes_up + bytes_down``), the ledger's total and the bytes of the
    tensors the transport delivered are the same number, above 0."""
    with _subject(algorithm) as s:
        _federated_only(s, "ledger_matches_transport")
        _ledger(s, base)


def check_participation_modes(algorithm: str | type,
                              modes: Iterable[Mapping] = PARTICIPATION_MODES, *,
                              base: Mapping | None = None) -> None:
    """``participation_modes`` (federated algorithms): 2 rounds under each
    ``participation`` section of ``modes`` (default :data:`PARTICIPATION_MODES`), with
    ``train.local_epochs: 0.5`` instead of local steps, complete; every round with
    participants reports a finite ``train_loss`` and ``bytes_up > 0``."""
    with _subject(algorithm) as s:
        _federated_only(s, "participation_modes")
        _participation(s, modes, base)


def check_algorithm(algorithm: str | type, *, overrides: Mapping | None = None,
                    checks: Iterable[str] | None = None,
                    base: Mapping | None = None) -> list[str]:
    """Run the conformance checks on one algorithm (a registered name or an algorithm
    class; see the module's docstring); returns the names of the checks it ran.

    ``checks``: names from :data:`CHECKS` (default: all of them that apply; the
    :data:`FEDERATED_CHECKS` are left out for an algorithm with ``federated = False``,
    and asking for one of them raises ValueError). ``overrides``: config changes for the
    ``learns`` check; ``base``: config changes for every check.

    Every check runs; if any fails, one AssertionError names the algorithm and lists each
    failed check with what was wrong. An exception the algorithm itself raises is
    not caught (a note names the check it happened in)."""
    if isinstance(checks, str):
        checks = [checks]
    wanted = list(CHECKS if checks is None else dict.fromkeys(checks))
    unknown = [c for c in wanted if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown conformance check(s) {unknown}; the checks: "
                         f"{', '.join(CHECKS)}")
    with _subject(algorithm) as s:
        if not s.federated:
            if checks is not None:
                for check in wanted:
                    if check in FEDERATED_CHECKS:
                        _federated_only(s, check)
            wanted = [c for c in wanted if c not in FEDERATED_CHECKS]
        runs = {"learns": lambda: _learns(s, overrides, base),
                "deterministic": lambda: _deterministic(s, base),
                "state_untouched": lambda: _untouched(s, base),
                "non_sampled_clients_send_nothing": lambda: _non_sampled(s, base),
                "ledger_matches_transport": lambda: _ledger(s, base),
                "participation_modes": lambda: _participation(s, PARTICIPATION_MODES, base)}
        failures = []
        for check in wanted:
            try:
                runs[check]()
            except AssertionError as e:
                failures.append((check, str(e)))
            except Exception as e:
                if hasattr(e, "add_note"):     # Python 3.11+
                    e.add_note(f"(while running the conformance check {check!r} of "
                               f"{s.label})")
                raise
        if failures:
            prefix = f"{s.label} fails the conformance check "
            lines = [f"- {msg.removeprefix(prefix)}" if msg.startswith(prefix)
                     else f"- {check!r}: an assertion failed: {msg or '(no message)'}"
                     for check, msg in failures]
            raise AssertionError(
                f"{s.label} fails {len(failures)} of {len(wanted)} conformance checks "
                f"({', '.join(c for c, _ in failures)}):\n" + "\n".join(lines))
        return wanted
