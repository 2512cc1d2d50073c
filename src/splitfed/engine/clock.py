"""The virtual clock: simulated seconds, advanced by the engine and never by algorithms.

One clock per run (``env.clock``). The round loop opens a round with
:meth:`VirtualClock.begin_round` and closes it with :meth:`VirtualClock.end_round`; in
between, the engine charges it on the message path and in its compute primitives:

- the transport charges every transfer (kind, direction, client ids, bytes);
- :class:`~splitfed.engine.stacked.StackedModel` charges its forward passes (B x forward
  MACs per copy) and backward steps (2 x forward MACs) to the clients' timelines (role
  ``client``) or to per-client server lanes (role ``server_copy``, SFL-V1's copies);
- :func:`~splitfed.engine.split.server_step` (SL, SFL-V2, CSE-FSL) charges the shared
  server lane; :func:`~splitfed.engine.split.client_compute` charges SL's client passes.

Data-flow timelines. A round starting at ``start = now`` keeps, for every participant c,
a timeline ``t[c]`` (from ``start`` plus the profile's start delay), and server lanes: one
shared lane for sequential server work and one lane per client for parallel server
copies, all starting at ``start``:

- client compute: ``t[c] += macs * slowdown[c] / compute[c]``;
- upload from c: ``t[c] += bytes / uplink[c]``; it arrives at ``arrival[c] = t[c]``;
- server work for c on a lane: ``lane = max(lane, arrival[c]) + macs / server_compute``;
  c's reply is ready at ``reply[c] = lane``. The server's own work (centralized
  training, hybrid FL's server epochs) runs on the shared lane once the latest model
  upload of the round has arrived (``start`` if none; with a deadline, at the latest at
  the deadline: a later upload is dropped, not waited for);
- download to c: ``t[c] = max(t[c], depart) + bytes / downlink[c]``, where ``depart`` is
  ``reply[c]`` for per-client replies (activation gradients, scalars) and, for a model,
  the latest model upload that has arrived so far this round (``start`` if none): the
  server sends its newest model, which makes SL's hand-over through the server
  sequential;
- the round ends when the last participant's last message has completed and every lane
  is idle: ``end = max(lanes, message completions)``; ``sim_round_s = end - start``.
  A round whose end is not a finite number raises :class:`SimulatedTimeError` (one check
  per round, in :meth:`VirtualClock.end_round`) instead of writing infinite or NaN times.

Parallel client work therefore waits for the slowest participant, sequential server
work adds up, and work overlaps only where the data flow lets it. Aggregation is free.
A client id that occurs twice in a cohort (``with_replacement``) is one device: both
slots run on its one timeline, one after the other.

Deadline (``clock.deadline`` seconds after the round's start): a participant whose last
model upload arrives after ``start + deadline`` is dropped: :meth:`on_time` (asked by
the aggregation) says so and its update is not aggregated (the kept clients' weights are
renormalised, except under bernoulli participation), and the round ends at
``min(end, start + deadline)``, or later when the server's own work or a kept client's
last message (SCAFFOLD's control delta, sent after the model) ends later (without a
dropped client it ends at ``end``: the deadline never cuts the server's own work, nor
what the kept clients send). :meth:`can_start` (asked by SL's
:func:`~splitfed.engine.split.take_turn`) refuses a turn that would start after the
deadline. Dropped clients and clients a trace marks unavailable at the round's start
(taken out of the cohort by :meth:`begin_round`) are counted in ``dropped``. When a
trace makes no client at all available at ``now``, the round starts when the next one
becomes available (the wait is part of its ``sim_round_s``); once every window has
ended, rounds are empty and take no time.

For asynchronous algorithms (GAS) :class:`EventQueue` orders events by simulated time;
:meth:`client_time` and :meth:`arrival_time` read the timelines the engine keeps.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from splitfed.engine.flops import forward_macs
from splitfed.engine.participation import Cohort
from splitfed.engine.profiles import Profiles
from splitfed.errors import ConfigError

CLIENT = "client"             # work on a client's own device
SERVER = "server"             # the server's single model: the shared lane, in call order
SERVER_COPY = "server_copy"   # a per-client server copy: that client's own server lane


class SimulatedTimeError(ConfigError):
    """A round's simulated time became infinite or NaN. The options of the clock keep
    every speed and delay within float32's range, so this does not happen with accepted
    inputs; it is a last check, made once per round, that keeps non-finite times out of
    the metrics."""


class VirtualClock:
    """Simulated time of a run: ``now`` and the open round's timelines (module doc)."""

    def __init__(self, profiles: Profiles, rng: np.random.Generator, *,
                 deadline: float | None = None, renormalise: bool = True,
                 keep: int | None = None):
        self.profiles = profiles
        self.rng = rng
        self.deadline = deadline
        #: over-selection: keep this many of a round's sampled clients (:meth:`keep_fastest`)
        self.keep = keep
        #: renormalise the kept clients' aggregation weights when some are dropped
        self.renormalise = renormalise
        self.now = 0.0
        self._macs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        n = profiles.num_clients
        self._scale = np.ones(n)
        self._round_from = 0.0
        self._open(np.arange(n, dtype=np.int64), 0.0, np.zeros(n))

    # ------------------------------------------------------------------ rounds

    def begin_round(self, cohort: Cohort) -> Cohort:
        """Open a round at ``now`` for ``cohort``; returns the cohort of the clients
        available at its start (all of them unless a trace says otherwise)."""
        self._round_from = self.now
        # a round that samples nobody (the server alone trains, or an empty bernoulli
        # draw) waits for no client to come online
        start = self._next_window(self.now) if cohort.size else self.now
        scale, delay = self.profiles.draw(self.rng)
        ok = self.profiles.available(cohort.ids, start)
        unavailable = int(np.unique(cohort.ids[~ok]).size)
        if not ok.all():
            w = cohort.weights[ok]
            if self.renormalise and w.sum() > 0:
                w = w / w.sum()
            cohort = Cohort(cohort.ids[ok], w)
        self._scale = scale
        self._open(cohort.ids, start, delay)
        self._unavailable = unavailable
        return cohort

    @property
    def round_start(self) -> float:
        """When the open round started: ``now`` at :meth:`begin_round`, or later when a
        trace made the server wait for a client to come online."""
        return self._start

    def _next_window(self, t: float) -> float:
        """``t``, or, when a trace makes no client at all available at ``t``, the
        earliest later time one is: the server waits for a client to come online (an
        empty round took no time, so the clock stopped before every later window)."""
        p = self.profiles
        if p.available_from is None:
            return t
        if p.available(np.arange(p.num_clients), t).any():
            return t
        later = (p.available_from > t) & (p.available_until > p.available_from)
        return float(p.available_from[later].min()) if later.any() else t

    def end_round(self) -> dict[str, Any]:
        """Close the round: ``sim_round_s``, ``sim_time_s`` (cumulative),
        ``slowest_client`` (the participant whose last message completed last) and
        ``dropped``."""
        start, ids = self._start, self._ids
        end = max(start, self._shared)
        slowest = None
        if ids.size:
            last = self._last[ids]
            end = max(end, float(self._lane[ids].max()), float(last.max()))
            if last.max() > start:
                slowest = int(ids[int(np.argmax(last))])
        if self.deadline is not None and self._dropped:
            kept = ids[~np.isin(ids, np.fromiter(self._dropped, np.int64))]
            # the kept clients' later messages (SCAFFOLD's control deltas follow the
            # model) are waited for; the dropped clients' are not
            after = float(self._last[kept].max()) if kept.size else start
            end = max(min(end, start + self.deadline), after, self._own_end)
        if not math.isfinite(end):
            raise SimulatedTimeError(
                f"clock: the simulated time of a round starting at {start!r} s became "
                f"{end!r} (the clock's speeds, rates or delays are too extreme for its "
                "float64 arithmetic); choose less extreme clock options")
        self.now = end
        return {"sim_round_s": end - self._round_from, "sim_time_s": end,
                "slowest_client": slowest,
                "dropped": len(self._dropped) + self._unavailable + self._over_selected}

    def keep_fastest(self, cohort: Cohort, macs, up_bytes, down_bytes) -> Cohort:
        """Over-selection (FedScale's over-commitment): of the open round's cohort keep
        the ``keep`` clients predicted to finish first; the others are dropped before
        they start (counted in ``dropped``) and the kept weights renormalised.

        The prediction is the profile's cost of each client's own work, FedScale's
        completion-time model: its start delay, downloading ``down_bytes``, ``macs`` of
        computation (with this round's slowdown) and uploading ``up_bytes`` (each a
        number or one per slot). Queueing at the server is not predicted. Ties go to
        the earlier slot.
        """
        if self.keep is None or cohort.size <= self.keep:
            return cohort
        ids, p = cohort.ids, self.profiles
        predicted = (self._t[ids] + np.asarray(down_bytes) / p.downlink[ids]
                     + np.asarray(macs) * self._scale[ids] / p.compute[ids]
                     + np.asarray(up_bytes) / p.uplink[ids])
        chosen = np.sort(np.argsort(predicted, kind="stable")[:self.keep])
        w = cohort.weights[chosen]
        if self.renormalise and w.sum() > 0:
            w = w / w.sum()
        self._over_selected = int(cohort.size - chosen.size)
        self._ids = np.unique(ids[chosen])
        return Cohort(ids[chosen], w)

    def _open(self, ids: np.ndarray, start: float, delay: np.ndarray) -> None:
        n = self.profiles.num_clients
        self._start = float(start)
        self._ids = np.unique(np.asarray(ids, dtype=np.int64))
        self._t = np.full(n, self._start) + delay
        self._arrival = self._t.copy()
        self._reply = self._t.copy()
        self._last = np.full(n, self._start)
        self._model_up = np.full(n, self._start)
        self._lane = np.full(n, self._start)
        self._shared = self._start
        self._own_end = self._start           # the end of the server's own work
        self._latest_model = self._start
        self._dropped: set[int] = set()
        self._unavailable = 0
        self._over_selected = 0

    # ------------------------------------------------------------------ charges

    def macs(self, module: nn.Module, sample_shape) -> int:
        """Forward MACs of one sample of ``sample_shape`` through ``module`` (cached)."""
        per = self._macs.get(module)
        if per is None:
            per = self._macs[module] = {}
        macs = per.get(sample_shape)
        if macs is None:
            shape = tuple(int(s) for s in sample_shape)
            macs = per[shape] = forward_macs(module, shape)
        return macs

    def batch_macs(self, module: nn.Module, shape, *, stacked: bool = True) -> int:
        """Forward MACs of one pass of ``module`` over a batch of ``shape`` ([copies, B,
        ...] when ``stacked``, else [B, ...]), for one copy."""
        lead = 2 if stacked else 1
        return int(shape[lead - 1]) * self.macs(module, tuple(shape[lead:]))

    def charge(self, role: str, module: nn.Module, ids, x: torch.Tensor, *,
               passes: int = 1, stacked: bool = True) -> int:
        """Charge ``passes`` forward passes of ``module`` over the batch ``x`` to ``ids``
        (``x``: [copies, B, ...] when ``stacked``, else [B, ...]); returns the MACs of one
        pass of one copy."""
        macs = self.batch_macs(module, x.shape, stacked=stacked)
        self.compute(role, ids, passes * macs)
        return macs

    def compute(self, role: str, ids, macs) -> None:
        """Charge ``macs`` MACs (per id) of ``role`` work done for the clients ``ids``
        (an array, a list, or one client's int id)."""
        if type(ids) is int and type(macs) is int:   # one sequential client, on scalars
            if role == CLIENT:
                self._compute_one(ids, macs)
                return
            if role == SERVER:
                self._serve_one(ids, macs)
                return
        ids = _ids(ids)
        if role == CLIENT:
            p = self.profiles
            if ids.size == 1 and np.ndim(macs) == 0:    # one sequential client: scalars
                self._compute_one(int(ids[0]), macs)
            else:
                _add_at(self._t, ids, macs * self._scale[ids] / p.compute[ids])
        elif role == SERVER_COPY:
            self._after(self._lane, ids, self._arrival[ids],
                        macs / self.profiles.server_compute)
            self._reply[ids] = self._lane[ids]
        elif role == SERVER:
            dt = macs / self.profiles.server_compute
            if ids.size == 0:             # the server's own work: on its newest model
                self._shared = max(self._shared, self._model_wait()) + float(np.sum(dt))
                self._own_end = self._shared
                return
            dts = np.broadcast_to(dt, ids.shape).tolist() if np.ndim(dt) else [dt] * ids.size
            for c, d in zip(ids.tolist(), dts):
                self._shared = max(self._shared, float(self._arrival[c])) + d
                self._reply[c] = self._shared
        else:
            raise ValueError(f"unknown role {role!r}; roles: {CLIENT}, {SERVER}, "
                             f"{SERVER_COPY}")

    def transfer(self, kind: str, direction: str, ids, nbytes: int) -> None:
        """Charge a transfer of ``nbytes`` to (``down``) or from (``up``) each of ``ids``."""
        ids = _ids(ids)
        if ids.size == 0:
            return
        if ids.size == 1:             # one sequential client (SL's steps): the same
            self._transfer_one(kind, direction, int(ids[0]), nbytes)   # float64 arithmetic
        else:
            self._transfer_many(kind, direction, ids, nbytes)

    def _transfer_many(self, kind: str, direction: str, ids: np.ndarray, nbytes: int) -> None:
        p = self.profiles
        if direction == "up":
            _add_at(self._t, ids, nbytes / p.uplink[ids])
            done = self._t[ids]
            self._arrival[ids] = done
            self._reply[ids] = done
            if kind == "model":
                self._model_up[ids] = done
                self._latest_model = max(self._latest_model, float(done.max()))
        else:
            depart = (np.full(ids.shape, self._latest_model) if kind == "model"
                      else self._reply[ids])
            self._after(self._t, ids, depart, nbytes / p.downlink[ids])
        self._last[ids] = self._t[ids]

    def server_sends_after_own_work(self) -> None:
        """The server's next model downloads depart once its own work so far is done
        (FedCLG-C sends g^s_t, computed at the round's start, with x_t)."""
        self._latest_model = max(self._latest_model, self._shared)

    def _model_wait(self) -> float:
        """When the server's own work can start: once the latest model upload of the
        round has arrived, but not after the deadline (an upload arriving later is
        dropped, not waited for)."""
        if self.deadline is None:
            return self._latest_model
        return min(self._latest_model, self._start + self.deadline)

    def _compute_one(self, c: int, macs) -> None:
        """:meth:`compute` of client work for the single client ``c``, on scalars (the
        same float64 arithmetic as the array path)."""
        self._t[c] += macs * self._scale[c] / self.profiles.compute[c]

    def _serve_one(self, c: int, macs: int) -> None:
        """:meth:`compute` of work on the shared server lane for the single client ``c``,
        on scalars (the same float64 arithmetic as the array path)."""
        dt = macs / self.profiles.server_compute
        self._shared = max(self._shared, float(self._arrival[c])) + dt
        self._reply[c] = self._shared

    def _transfer_one(self, kind: str, direction: str, c: int, nbytes: int) -> None:
        """:meth:`transfer` for the single client ``c``, on scalars."""
        p = self.profiles
        if direction == "up":
            self._t[c] += nbytes / p.uplink[c]
            done = self._t[c]
            self._arrival[c] = done
            self._reply[c] = done
            if kind == "model":
                self._model_up[c] = done
                self._latest_model = max(self._latest_model, float(done))
        else:
            depart = self._latest_model if kind == "model" else self._reply[c]
            self._t[c] = max(self._t[c], depart) + nbytes / p.downlink[c]
        self._last[c] = self._t[c]

    def replay_one(self, c: int, events) -> None:
        """Charge the single client ``c``'s ``events`` in their order, as the calls that
        make them one by one would: ``(CLIENT, macs)`` its own compute, ``(SERVER,
        macs)`` work on the shared server lane for it, ``(direction, kind, nbytes)`` a
        transfer (:meth:`transfer`); the same float64 arithmetic (a settled SL turn,
        :func:`splitfed.engine.split.sequential_turn`)."""
        for event in events:
            role = event[0]
            if role == CLIENT:
                self._compute_one(c, event[1])
            elif role == SERVER:
                self._serve_one(c, event[1])
            elif role in ("up", "down"):
                self._transfer_one(event[1], role, c, event[2])
            else:
                raise ValueError(f"unknown clock event {event!r}")

    @staticmethod
    def _after(arr: np.ndarray, ids: np.ndarray, ready: np.ndarray, dt) -> None:
        """``arr[c] = max(arr[c], ready) + dt`` for each id in order (ids may repeat)."""
        listed = ids.tolist()
        if len(set(listed)) == len(listed):
            arr[ids] = np.maximum(arr[ids], ready) + dt
            return
        dts = np.broadcast_to(dt, ids.shape).tolist()
        for c, r, d in zip(listed, np.asarray(ready).tolist(), dts):
            arr[c] = max(arr[c], r) + d

    # ------------------------------------------------------------------ deadline

    def on_time(self, ids) -> np.ndarray:
        """Whether each client's last model upload arrived by the deadline; the late
        ones are counted as dropped. All True without a deadline."""
        ids = _ids(ids)
        if self.deadline is None:
            return np.ones(ids.shape, dtype=bool)
        ok = self._model_up[ids] <= self._start + self.deadline
        self._dropped.update(ids[~ok].tolist())
        return ok

    def used(self, ids) -> int:
        """How many distinct clients of ``ids`` the open round has not dropped (by the
        deadline: :meth:`on_time`, :meth:`can_start`): the clients whose work it used."""
        kept = np.setdiff1d(np.unique(_ids(ids)), np.fromiter(self._dropped, np.int64))
        return int(kept.size)

    def can_start(self, ids) -> np.ndarray:
        """Whether a turn that begins with a model download to each client would begin
        by the deadline (SL); the refused ones are counted as dropped."""
        ids = _ids(ids)
        if self.deadline is None:
            return np.ones(ids.shape, dtype=bool)
        begin = np.maximum(self._t[ids], self._latest_model)
        ok = begin <= self._start + self.deadline
        self._dropped.update(ids[~ok].tolist())
        return ok

    # ------------------------------------------------------------------ views

    def client_time(self, ids) -> np.ndarray:
        """Where each client's timeline stands now (seconds)."""
        return self._t[_ids(ids)].copy()

    def arrival_time(self, ids) -> np.ndarray:
        """When each client's last upload reached the server (seconds)."""
        return self._arrival[_ids(ids)].copy()

    def state(self) -> dict:
        """What the clock carries from one round to the next (for checkpoints): ``now``,
        its generator (per-round slowdowns and delays) and the client profiles (speeds
        and availability drawn when the run was built). The open round's timelines are
        not kept: :meth:`begin_round` rebuilds them."""
        profiles = {f.name: (v.copy() if isinstance(v, np.ndarray) else v)
                    for f in dataclasses.fields(self.profiles)
                    for v in [getattr(self.profiles, f.name)]}
        return {"now": self.now, "rng": self.rng.bit_generator.state, "profiles": profiles}

    def load_state(self, state: dict) -> None:
        self.now = float(state["now"])
        self.rng.bit_generator.state = state["rng"]
        for name, value in state.get("profiles", {}).items():
            setattr(self.profiles, name, value.copy() if isinstance(value, np.ndarray)
                    else value)


def _add_at(arr: np.ndarray, ids: np.ndarray, values) -> None:
    """``np.add.at(arr, ids, values)`` (repeated ids add up), with a cheap path for one
    id: sequential algorithms charge one client at a time, many times per round."""
    if ids.size == 1:
        arr[ids[0]] += np.asarray(values).reshape(-1)[0]
    else:
        np.add.at(arr, ids, values)


def _ids(ids) -> np.ndarray:
    if isinstance(ids, np.ndarray) and ids.ndim == 1:
        return ids
    if ids is None:
        return np.zeros(0, dtype=np.int64)
    return np.atleast_1d(np.asarray(ids, dtype=np.int64))


class EventQueue:
    """Events ordered by simulated time (ties in insertion order), for asynchronous
    algorithms: ``push(time, item)``, ``pop() -> (time, item)``."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()

    def push(self, time: float, item: Any) -> None:
        heapq.heappush(self._heap, (float(time), next(self._seq), item))

    def pop(self) -> tuple[float, Any]:
        time, _, item = heapq.heappop(self._heap)
        return time, item

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
