"""Which rank computes what, and the engine parts the multi-process runtime swaps in.

- :class:`RankPlacement` (the environment's ``env.placement`` on every rank, set by
  :func:`splitfed.runtime.session.adapt`): client work runs on the rank that hosts the
  client, server work (the single server model, server copies) on rank 0.
- :class:`PartialStackedModel` (built by :meth:`RankPlacement.stacked`, i.e.
  ``env.stacked``): a :class:`~splitfed.engine.stacked.StackedModel` whose copies are
  partly hosted elsewhere: it holds and trains only the local copies and shows zeros
  (placeholders) for the others; the clock is still charged for every copy so that all
  ranks keep the same timelines.
- :class:`RuntimeClock`: the virtual clock, plus real delays (a client rank sleeps for
  its clients' simulated compute and transfer times) and lost ranks (their clients are
  late: left out of aggregation, counted in ``dropped``).
- :class:`RoundControl`: the participation sampler, plus the round's control message:
  rank 0 tells every live client rank the cohort (without clients of lost ranks), the
  lost ranks and the clock, or that the run stops; the client ranks check they agree.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from splitfed.engine.clock import CLIENT, VirtualClock
from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.engine.placement import Placement, placeholder
from splitfed.engine.participation import Cohort
from splitfed.engine.stacked import StackedModel
from splitfed.errors import FormatError, SplitfedError
from splitfed.metrics import is_finite_number
from splitfed.transport.distributed import SERVER_RANK, Links, StopRun, stop_reason


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: the fields of rank 0's message at a round's start, and what each must be
ROUND_FIELDS = {
    "round": ("a whole number", _whole),
    "ids": ("a list of client ids", lambda v: isinstance(v, list) and all(map(_whole, v))),
    "lost": ("a mapping of ranks to reasons", lambda v: isinstance(v, dict) and all(
        _whole(k) and isinstance(r, str) for k, r in v.items())),
    "now": ("a finite number", is_finite_number),
}


def control_message(msg, fields: dict) -> dict:
    """Rank 0's control message ``msg`` checked before a client rank acts on it: a
    mapping with a text ``stop`` (raises :class:`StopRun`), else with each of ``fields``
    (name: (what it is, check)); FormatError naming what is wrong (a message is signed
    by the run's secret, so this catches a rank 0 of other code, not an attacker)."""
    if not isinstance(msg, dict):
        raise FormatError(f"rank 0 sent a control message that is not a mapping "
                          f"({type(msg).__name__}); all ranks must run the same splitfed "
                          "version")
    reason = stop_reason(msg)
    if reason is not None:
        raise StopRun(reason)
    for name, (what, check) in fields.items():
        if name not in msg or not check(msg[name]):
            raise FormatError(f"rank 0 sent a control message whose {name!r} is not "
                              f"{what}; all ranks must run the same splitfed version")
    return msg


def host_ranks(num_clients: int, world_size: int) -> np.ndarray:
    """The rank hosting each client: contiguous blocks over ranks 1..world_size-1."""
    if world_size < 2:
        raise ValueError("the multi-process runtime needs at least 2 processes (rank 0 is "
                         "the server, the others host clients)")
    ranks = world_size - 1
    return 1 + (np.arange(num_clients, dtype=np.int64) * ranks) // max(1, num_clients)


class RankPlacement:
    """:class:`splitfed.engine.placement.Placement` of one rank (module doc)."""

    def __init__(self, links: Links, hosts: np.ndarray):
        self.links, self.hosts = links, np.asarray(hosts, dtype=np.int64)
        self.rank = links.rank

    @property
    def is_server(self) -> bool:
        return self.rank == SERVER_RANK

    def local_slots(self, role: str, ids) -> np.ndarray:
        ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        if role == CLIENT:
            return np.flatnonzero(self.hosts[ids] == self.rank)
        return np.arange(len(ids)) if self.is_server else np.zeros(0, dtype=np.int64)

    def stacked(self, module, start, n, *, role, ids, momentum, weight_decay,
                clock) -> StackedModel:
        if ids is None:
            raise RuntimeError("the multi-process runtime needs the client ids of every "
                               "stacked model (env.stacked(..., ids=...)) to place it")
        kw = {"role": role, "ids": ids, "momentum": momentum, "weight_decay": weight_decay,
              "clock": clock}
        if len(self.local_slots(role, ids)) == len(np.atleast_1d(ids)):
            return StackedModel(module, start, n, **kw)
        return PartialStackedModel(self, module, start, n, **kw)

    def serves(self, client_id: int) -> bool:
        return self.is_server and self.links.alive(int(self.hosts[int(client_id)]))

    def collect(self, ids, values: torch.Tensor) -> torch.Tensor:
        owners = self.hosts[np.atleast_1d(np.asarray(ids, dtype=np.int64))]
        (out,), nbytes = self.links.gather_rows(owners, [values.detach().cpu()])
        self.links.overhead_bytes += nbytes
        return out.to(values.device)


class PartialStackedModel(StackedModel):
    """Stacked copies of which only those computed here under ``placement`` (this rank's
    hosted copies of ``role`` work for the clients ``ids``) are held and trained."""

    def __init__(self, placement: Placement, module, start, n, *, momentum=0.0,
                 weight_decay=0.0, clock=None, ids=None, role=CLIENT):
        self.placement = placement
        self.full_ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        self.rows = placement.local_slots(role, self.full_ids)
        self.full_n = int(n)
        super().__init__(module, start, len(self.rows), momentum=momentum,
                         weight_decay=weight_decay, role=role)
        self.full_clock = clock
        self._a = self._la = 0
        self._full_macs = 0

    def forward(self, x, a=None, *, training=True):
        a = self.full_n if a is None else a
        if self.full_clock is not None:
            self._full_macs = self.full_clock.charge(self.role, self.module,
                                                     self.full_ids[:a], x)
            self.charged += a * self._full_macs
        la = int((self.rows < a).sum())         # local copies still working: a prefix
        self._a, self._la = a, la
        if la == 0:
            self._views = None
            return placeholder(self.module, x)
        idx = torch.from_numpy(self.rows[:la]).to(x.device)
        out = super().forward(x[idx], la, training=training)
        return out.new_zeros((a,) + tuple(out.shape[1:])).index_copy(0, idx, out)

    def step(self, outputs, grad_outputs=None, *, lr, extra_inputs=(), ids=None, hook=None):
        if self.full_clock is not None:
            self.full_clock.compute(self.role, self.full_ids[:self._a],
                                    (TRAIN_FACTOR - 1) * self._full_macs)
            self.charged += self._a * (TRAIN_FACTOR - 1) * self._full_macs
        if self._la == 0:
            return [torch.zeros_like(e) for e in extra_inputs]
        local_ids = None if ids is None else np.asarray(ids)[self.rows[:self._la]]
        return super().step(outputs, grad_outputs, lr=lr, extra_inputs=extra_inputs,
                            ids=local_ids, hook=hook)

    def final(self):
        idx = torch.from_numpy(self.rows)
        out = {}
        for k, t in self.state.items():
            t = t.detach()
            full = t.new_zeros((self.full_n,) + tuple(t.shape[1:]))
            out[k] = full.index_copy(0, idx.to(t.device), t) if len(idx) else full
        return out


class RuntimeClock(VirtualClock):
    """The run's virtual clock with real delays and lost ranks (module doc). Built from
    the environment's clock with :meth:`adopt` (same profiles, generator and state)."""

    placement: RankPlacement
    delay_scale: float | None
    lost_in_cohort: int

    @classmethod
    def adopt(cls, clock: VirtualClock, placement: RankPlacement,
              delay_scale: float | None) -> RuntimeClock:
        new = cls.__new__(cls)
        new.__dict__.update(clock.__dict__)
        new.placement, new.delay_scale, new.lost_in_cohort = placement, delay_scale, 0
        #: clients that trained in a round (neither dropped nor of a lost rank), summed
        new.clients_trained, new._cohort_size = 0, 0
        return new

    def _local(self, ids) -> np.ndarray:
        ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        return ids[self.placement.hosts[ids] == self.placement.rank]

    def _sleep(self, seconds) -> None:
        if self.delay_scale and np.size(seconds):
            dt = float(np.max(seconds)) * self.delay_scale
            if dt > 0:
                time.sleep(dt)

    def begin_round(self, cohort):
        cohort = super().begin_round(cohort)
        self._unavailable += self.lost_in_cohort
        self._cohort_size = int(np.unique(cohort.ids).size)
        if self.delay_scale:
            local = self._local(cohort.ids)
            self._sleep(self._t[local] - self._start)
        return cohort

    def end_round(self):
        self.clients_trained += max(0, self._cohort_size - len(self._dropped))
        return super().end_round()

    def compute(self, role, ids, macs) -> None:
        super().compute(role, ids, macs)
        if self.delay_scale and role == CLIENT:
            local_mask = self.placement.hosts[np.atleast_1d(ids)] == self.placement.rank
            if local_mask.any():
                ids = np.atleast_1d(ids)[local_mask]
                per = np.broadcast_to(np.asarray(macs, dtype=np.float64),
                                      local_mask.shape)[local_mask]
                self._sleep(per * self._scale[ids] / self.profiles.compute[ids])

    def transfer(self, kind, direction, ids, nbytes) -> None:
        super().transfer(kind, direction, ids, nbytes)
        if self.delay_scale:
            local = self._local(ids)
            if local.size:
                rate = self.profiles.uplink if direction == "up" else self.profiles.downlink
                self._sleep(nbytes / rate[local])

    def _not_lost(self, ids, ok: np.ndarray) -> np.ndarray:
        """``ok`` without the clients of lost ranks (counted as dropped)."""
        ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        links = self.placement.links
        lost = np.array([not links.alive(int(r)) for r in self.placement.hosts[ids]],
                        dtype=bool)
        self._dropped.update(ids[lost].tolist())
        return ok & ~lost

    def on_time(self, ids):
        return self._not_lost(ids, super().on_time(ids))

    def can_start(self, ids):
        return self._not_lost(ids, super().can_start(ids))


class RoundControl:
    """The participation sampler with the round's control message (module doc)."""

    def __init__(self, sampler, env, links: Links, hosts: np.ndarray, renormalise: bool):
        self.inner, self.env, self.links = sampler, env, links
        self.hosts, self.renormalise = hosts, renormalise

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _without_lost(self, cohort: Cohort) -> tuple[Cohort, int]:
        ok = np.array([self.links.alive(int(r)) for r in self.hosts[cohort.ids]], dtype=bool)
        if ok.all():
            return cohort, 0
        w = cohort.weights[ok]
        if self.renormalise and w.sum() > 0:
            w = w / w.sum()
        return Cohort(cohort.ids[ok], w), int(np.unique(cohort.ids[~ok]).size)

    def sample(self, rng) -> Cohort:
        clock = self.env.clock
        if not self.links.is_server:
            msg = control_message(self.links.recv_object(SERVER_RANK), ROUND_FIELDS)
            self.links.lost.update(msg["lost"])
        cohort, lost = self._without_lost(self.inner.sample(rng))
        if self.links.is_server:
            msg = {"round": self.env.ledger.round, "ids": cohort.ids.tolist(),
                   "lost": dict(self.links.lost), "now": clock.now}
            self.links.send_all(msg)
        elif msg["ids"] != cohort.ids.tolist() or msg["round"] != self.env.ledger.round:
            raise SplitfedError(f"out of step with rank 0 at round "
                               f"{msg['round']} (cohort {msg['ids']} here "
                               f"{cohort.ids.tolist()}); all ranks must run the same "
                               "splitfed version and config")
        else:
            clock.now = msg["now"]
        clock.lost_in_cohort = lost
        return cohort

    def stop(self, reason: str) -> None:
        """Rank 0: tell every live client rank that the run ends."""
        self.links.stop_all(reason)
