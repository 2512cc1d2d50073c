"""The communication ledger: bytes by round, kind, direction and client.

One ledger per run. Every transfer that crosses the client/server boundary is recorded
here by the transport, never by an algorithm, so the totals are, by construction, the bytes
of the tensors that were actually handed over.

It keeps, per round and (kind, direction), the clients that sent or received and their
bytes (two int64 vectors, the ids in increasing order), never a vector of all clients: its
memory and its :meth:`Ledger.state` (saved in every checkpoint) grow with the transfers
made, not with the number of clients times the rounds.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


class _Sent:
    """The clients of one round's (kind, direction) and their bytes: ``ids`` (distinct,
    increasing) and ``nbytes``, int64 vectors of one length. ``last`` is the client
    recorded last (None when unknown) and ``at`` its position (the next record is often
    the same client's)."""

    __slots__ = ("ids", "nbytes", "last", "at")

    def __init__(self, ids: np.ndarray, nbytes: np.ndarray):
        self.ids, self.nbytes, self.last, self.at = ids, nbytes, None, -1


class Ledger:
    """Bytes per (round, kind, direction), with a per-client breakdown.

    ``record(round, kind, direction, client_ids, nbytes)`` adds ``nbytes[i]`` bytes for
    client ``client_ids[i]``. Units are bytes throughout.
    """

    def __init__(self, num_clients: int):
        self.num_clients = int(num_clients)
        self._rounds: dict[int, dict[tuple[str, str], _Sent]] = defaultdict(dict)
        self.round = 0

    def record(self, kind: str, direction: str, client_ids, nbytes) -> None:
        table = self._rounds[self.round]
        key = (kind, direction)
        sent = table.get(key)
        if sent is None:
            sent = table[key] = _Sent(_EMPTY, _EMPTY)
        if (type(nbytes) is int and type(client_ids) is np.ndarray and client_ids.size == 1
                and client_ids.dtype == np.int64):      # one client: the common SL step
            c = client_ids.item()
            if c != sent.last:
                self._find(sent, c)
            sent.nbytes[sent.at] += nbytes
            return
        ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if not ids.size:
            return
        add = nbytes if type(nbytes) is int else \
            np.broadcast_to(np.asarray(nbytes, dtype=np.int64), ids.shape)
        twice = False
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():
            order = ids.argsort(kind="stable")
            ids = ids[order]
            if type(add) is not int:
                add = add[order]
            twice = bool((ids[1:] == ids[:-1]).any())   # a client twice: summed by _merge
        lo, hi = int(ids[0]), int(ids[-1])
        if lo < 0 or hi >= self.num_clients:
            bad = lo if lo < 0 else hi
            raise IndexError(f"client id {bad} is out of range for {self.num_clients} clients")
        have = sent.ids
        if not twice and ids.size == have.size and (ids == have).all():
            sent.nbytes += add                          # the same clients again
            return
        add = np.broadcast_to(np.asarray(add, dtype=np.int64), ids.shape)
        if not twice and not have.size:                 # ids distinct and increasing
            sent.ids, sent.nbytes = ids.copy(), add.copy()
            return
        if not twice:              # a chunk of the cohort: often all new, or all known
            if ids[0] > have[-1]:                       # all after the recorded ones
                sent.ids = np.concatenate([have, ids])
                sent.nbytes = np.concatenate([sent.nbytes, add])
                return
            at = have.searchsorted(ids)
            if at[-1] < have.size and (have[at] == ids).all():
                sent.nbytes[at] += add                  # all recorded: distinct positions
                return
        self._merge(sent, ids, add)

    def _find(self, sent: _Sent, c: int) -> None:
        """Make ``c`` the last client of ``sent`` (with 0 bytes if it had none)."""
        ids = sent.ids
        i = int(ids.searchsorted(c))
        if i == ids.size or ids[i] != c:
            if not 0 <= c < self.num_clients:
                raise IndexError(f"client id {c} is out of range for "
                                 f"{self.num_clients} clients")
            sent.ids = np.insert(ids, i, c)
            sent.nbytes = np.insert(sent.nbytes, i, 0)
        sent.last, sent.at = c, i

    @staticmethod
    def _merge(sent: _Sent, ids: np.ndarray, add: np.ndarray) -> None:
        every, where = np.unique(np.concatenate([sent.ids, ids]), return_inverse=True)
        total = np.zeros(every.size, dtype=np.int64)
        np.add.at(total, where.reshape(-1), np.concatenate([sent.nbytes, add]))
        sent.ids, sent.nbytes, sent.last, sent.at = every, total, None, -1

    def round_totals(self, t: int) -> dict[str, int]:
        """``{"bytes_up/activations": n, ..., "bytes_up": total, "bytes_down": total}``."""
        out = {"bytes_up": 0, "bytes_down": 0}
        for (kind, direction), sent in sorted(self._rounds.get(t, {}).items(),
                                              key=lambda item: item[0]):
            n = int(sent.nbytes.sum())
            out[f"bytes_{direction}/{kind}"] = n
            out[f"bytes_{direction}"] += n
        return out

    def per_client(self, t: int, kind: str, direction: str) -> np.ndarray:
        """Bytes each client sent/received of ``kind`` in round ``t`` (zeros if none)."""
        out = np.zeros(self.num_clients, dtype=np.int64)
        sent = self._rounds.get(t, {}).get((kind, direction))
        if sent is not None:
            out[sent.ids] = sent.nbytes
        return out

    def total(self, kind: str | None = None, direction: str | None = None) -> int:
        n = 0
        for table in self._rounds.values():
            for (k, d), sent in table.items():
                if (kind is None or k == kind) and (direction is None or d == direction):
                    n += int(sent.nbytes.sum())
        return n

    def state(self) -> dict:
        """``{"num_clients", "round", "rounds": {t: {"kind|direction": {"ids": ...,
        "bytes": ...}}}}``: per round and transfer, the clients that sent or received
        (int64, distinct, increasing) and their bytes (int64), as copies."""
        return {"num_clients": self.num_clients, "round": self.round,
                "rounds": {t: {f"{k}|{d}": {"ids": s.ids.copy(), "bytes": s.nbytes.copy()}
                               for (k, d), s in tab.items()}
                           for t, tab in self._rounds.items()}}

    def load_state(self, state: dict) -> None:
        """Load what :meth:`state` returned. An entry may also be a list of every
        client's bytes (how checkpoints held the ledger before it kept only the clients
        that sent); its clients with bytes are kept."""
        self.num_clients = state["num_clients"]
        self.round = state["round"]
        self._rounds = defaultdict(dict)
        for t, tab in state["rounds"].items():
            for key, saved in tab.items():
                k, d = key.split("|")
                if isinstance(saved, dict):
                    ids = np.array(saved["ids"], dtype=np.int64).reshape(-1)
                    nbytes = np.array(saved["bytes"], dtype=np.int64).reshape(-1)
                    if ids.shape != nbytes.shape:
                        raise ValueError(f"ledger entry {key!r} of round {t} has "
                                         f"{ids.size} ids and {nbytes.size} byte counts")
                else:
                    every = np.asarray(saved, dtype=np.int64).reshape(-1)
                    ids = np.flatnonzero(every).astype(np.int64)
                    nbytes = every[ids]
                self._rounds[int(t)][(k, d)] = _Sent(ids, nbytes)
