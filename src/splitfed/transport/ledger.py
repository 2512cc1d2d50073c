"""The communication ledger: bytes by round, kind, direction and client.

One ledger per run. Every transfer that crosses the client/server boundary is recorded
here by the transport, never by an algorithm, so the totals are, by construction, the bytes
of the tensors that were actually handed over.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class Ledger:
    """Bytes per (round, kind, direction), with a per-client breakdown.

    ``record(round, kind, direction, client_ids, nbytes)`` adds ``nbytes[i]`` bytes for
    client ``client_ids[i]``. Units are bytes throughout.
    """

    def __init__(self, num_clients: int):
        self.num_clients = int(num_clients)
        self._rounds: dict[int, dict[tuple[str, str], np.ndarray]] = defaultdict(dict)
        self.round = 0

    def record(self, kind: str, direction: str, client_ids, nbytes) -> None:
        table = self._rounds[self.round]
        key = (kind, direction)
        arr = table.get(key)
        if arr is None:
            arr = table[key] = np.zeros(self.num_clients, dtype=np.int64)
        if (type(nbytes) is int and type(client_ids) is np.ndarray and client_ids.size == 1
                and client_ids.dtype == np.int64):      # one client: the common SL step
            arr[client_ids.item()] += nbytes
            return
        ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        np.add.at(arr, ids, np.broadcast_to(np.asarray(nbytes, dtype=np.int64), ids.shape))

    def round_totals(self, t: int) -> dict[str, int]:
        """``{"bytes_up/activations": n, ..., "bytes_up": total, "bytes_down": total}``."""
        out = {"bytes_up": 0, "bytes_down": 0}
        for (kind, direction), per_client in sorted(self._rounds.get(t, {}).items()):
            n = int(per_client.sum())
            out[f"bytes_{direction}/{kind}"] = n
            out[f"bytes_{direction}"] += n
        return out

    def per_client(self, t: int, kind: str, direction: str) -> np.ndarray:
        """Bytes each client sent/received of ``kind`` in round ``t`` (zeros if none)."""
        table = self._rounds.get(t, {})
        arr = table.get((kind, direction))
        return np.zeros(self.num_clients, dtype=np.int64) if arr is None else arr.copy()

    def total(self, kind: str | None = None, direction: str | None = None) -> int:
        n = 0
        for table in self._rounds.values():
            for (k, d), arr in table.items():
                if (kind is None or k == kind) and (direction is None or d == direction):
                    n += int(arr.sum())
        return n

    def state(self) -> dict:
        return {"num_clients": self.num_clients, "round": self.round,
                "rounds": {t: {f"{k}|{d}": a.tolist() for (k, d), a in tab.items()}
                           for t, tab in self._rounds.items()}}

    def load_state(self, state: dict) -> None:
        self.num_clients = state["num_clients"]
        self.round = state["round"]
        self._rounds = defaultdict(dict)
        for t, tab in state["rounds"].items():
            for key, arr in tab.items():
                k, d = key.split("|")
                self._rounds[int(t)][(k, d)] = np.asarray(arr, dtype=np.int64)
