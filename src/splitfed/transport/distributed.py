"""The transport over torch.distributed: tensors really cross process boundaries.

Rank 0 hosts the fed server and the main server; every other rank hosts a block of
clients (``hosts[c]`` is the rank of client ``c``). All ranks run the same round loop and
algorithm code (:mod:`splitfed.runtime`), so each transfer is called on every rank with a
payload of the same structure, shapes and dtypes; only the ranks at the two ends move
data, point to point (gloo ``isend``/``irecv``), one message per tensor:

- ``upload`` (per-client rows up): each client rank sends the rows of its clients, rank
  0 receives them into its copy of the payload;
- ``download`` (per-client rows down): rank 0 sends each client rank its rows;
- ``broadcast`` (the same payload to every receiver): rank 0 sends one copy per
  receiving client (a simulated client is a device; the ledger charges each receiver).

On a rank that is not an end of a transfer the call returns its own payload unchanged
(a placeholder there: nothing computes with it). The ledger and the virtual clock are
charged on every rank exactly as in the simulator (:class:`~splitfed.transport.base.
Transport`), and rank 0 counts the payload bytes it really sent and received in
:attr:`DistributedTransport.wire` (equal to the ledger while no rank is lost).

:class:`Links` are the point-to-point links with fault detection: on rank 0 every wait
has a deadline (``timeout_s``); a client rank whose connection closes, or that does not
answer in time, is *lost*: rank 0 never talks to it again and its clients are left out
(the runtime drops them like non-participants). Gloo's own per-operation timeout is not
used on rank 0: it would close every connection of the process, so rank 0 waits in
daemon threads and abandons a wait that misses its deadline. A client rank waits
without a deadline of its own (gloo's process-group timeout applies) and stops when
rank 0 is gone.

Control messages (:meth:`Links.send_object`: the run's config, the checkpoint's state on
resuming, each round's cohort, stop) are plain data and tensors written with
:func:`splitfed.safeio.dumps` and read with the weights-only loader (never unpickled),
and carry an HMAC-SHA256 under the run's secret (sender, receiver and a sequence number
per link included): a client rank refuses a message that is not rank 0's, unread.
The tensors of the transfers carry no HMAC (docs/distributed.md, Security).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import defaultdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from splitfed import safeio
from splitfed.errors import FormatError
from splitfed.transport.base import UP, Transport
from splitfed.transport.signing import message_key, sign, verify

SERVER_RANK = 0
#: largest control message a rank accepts (bytes)
MAX_MESSAGE = 1 << 30
_TAG = 32
#: each tensor goes as its bytes and a trailer of 8 (its byte count, little-endian):
#: gloo fills a posted buffer from a shorter message without a word, leaving its tail as
#: it was, so the receiver posts a zeroed buffer of the expected size plus the trailer
#: and checks the count at its end (a short message leaves zeros there)
_TRAILER = 8
_FOREVER = timedelta(days=3650)


class ServerLost(RuntimeError):
    """A client rank's link to rank 0 failed: the server is gone."""


class _Waiter:
    """Daemon threads that wait on gloo works, so that rank 0 can give up on a wait."""

    def __init__(self, threads: int):
        self._jobs: queue.Queue = queue.Queue()
        for _ in range(threads):
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done, box = self._jobs.get()
            try:
                work.wait(_FOREVER)
            except Exception as e:  # noqa: BLE001 - reported to the waiting caller
                box.append(e)
            done.set()

    def submit(self, work) -> tuple[threading.Event, list]:
        done, box = threading.Event(), []
        self._jobs.put((work, done, box))
        return done, box


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _frame(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes followed by their count (:data:`_TRAILER`), as one uint8 tensor."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    count = torch.from_numpy(np.array([data.numel()], dtype="<i8").view(np.uint8))
    return torch.cat([data, count])


def _unframe(frame: torch.Tensor, t: torch.Tensor) -> str | None:
    """Copy the payload of a received ``frame`` into ``t``; what is wrong with the
    message instead (its byte count not ``t``'s: a shorter message leaves the zeros the
    buffer was made of where the count belongs), None when it fits."""
    n = _nbytes(t)
    got = int(np.frombuffer(frame[n:].numpy().tobytes(), dtype="<i8")[0])
    if got != n:
        return f"it sent a message of another size than the {n} bytes expected"
    if n:
        t.copy_(frame[:n].view(t.dtype).reshape(t.shape))
    return None


class Links:
    """Point-to-point links between rank 0 and the client ranks (module doc)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float,
                 secret: str | None = None):
        self.rank, self.world_size = int(rank), int(world_size)
        #: the control messages' HMAC key (None: no secret in use)
        self.key = message_key(secret)
        self._sent: dict[int, int] = defaultdict(int)
        self._received: dict[int, int] = defaultdict(int)
        self.timeout_s = float(timeout_s)
        #: ranks rank 0 gave up on, with the reason
        self.lost: dict[int, str] = {}
        #: bytes of control messages and metrics (not payload: not in the ledger)
        self.overhead_bytes = 0
        self.stopped = False
        self._waiter = _Waiter(4 * world_size + 8) if self.is_server else None

    @property
    def is_server(self) -> bool:
        return self.rank == SERVER_RANK

    def alive(self, rank: int) -> bool:
        return rank not in self.lost

    def live_clients(self) -> list[int]:
        return [r for r in range(1, self.world_size) if self.alive(r)]

    def lose(self, rank: int, reason: str) -> None:
        if rank in self.lost:
            return
        self.lost[rank] = reason
        print(f"splitfed: rank {rank} lost ({reason}); its clients are dropped from the "
              "rounds from now on", file=sys.stderr, flush=True)

    def exchange(self, sends=(), recvs=()) -> set[int]:
        """Post ``(peer, tensor)`` sends and receives, wait for all; returns the peers
        whose transfers failed (on rank 0; a client rank raises :class:`ServerLost`).
        Each tensor travels with its byte count (:data:`_TRAILER`): a message of another
        length than the receiving tensor's is a failed transfer, whose peer rank 0
        drops, and the tensor is left as it was. (A message longer than the posted
        buffer is beyond this: gloo aborts the receiving process.)"""
        works, failed, framed = [], set(), []
        for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
            for peer, t in pairs:
                if not self.alive(peer) or peer in failed:
                    failed.add(peer)
                    continue
                frame = _frame(t) if op is dist.isend else torch.zeros(
                    _nbytes(t) + _TRAILER, dtype=torch.uint8)
                try:
                    works.append((peer, op(frame, peer)))
                except RuntimeError as e:
                    self._fail(peer, e, failed)
                    continue
                if op is dist.irecv:
                    framed.append((peer, t, frame))
        if not self.is_server:
            for peer, w in works:
                try:
                    w.wait()
                except RuntimeError as e:
                    self._fail(peer, e, failed)
        else:
            pending = [(peer, *self._waiter.submit(w)) for peer, w in works]
            deadline = time.monotonic() + self.timeout_s
            for peer, done, box in pending:
                if not done.wait(max(0.0, deadline - time.monotonic())):
                    self._fail(peer, None, failed)
                elif box:
                    self._fail(peer, box[0], failed)
        for peer, t, frame in framed:
            if peer in failed:
                continue
            wrong = _unframe(frame, t)
            if wrong is not None:
                self._fail(peer, RuntimeError(wrong), failed)
        return failed

    def _fail(self, peer: int, error, failed: set) -> None:
        if not self.is_server:
            raise ServerLost(f"the link to the server (rank 0) failed: {error}") from error
        failed.add(peer)
        reason = (f"no answer within {self.timeout_s:g} s" if error is None
                  else str(error).split(". ")[0])
        self.lose(peer, reason)

    # ------------------------------------------------------------------ objects

    def send_object(self, peer: int, obj) -> bool:
        """Send ``obj`` (plain data and tensors, :mod:`splitfed.safeio`) to ``peer`` with
        its HMAC; False if the peer is lost."""
        body = safeio.dumps(obj)
        if self.key is not None:
            body += sign(self.key, self.rank, peer, self._sent[peer], body)
        self._sent[peer] += 1
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        head = torch.tensor([data.numel()], dtype=torch.int64)
        self.overhead_bytes += 8 + data.numel()
        return not (self.exchange(sends=[(peer, head)])
                    or self.exchange(sends=[(peer, data)]))

    def recv_object(self, peer: int):
        """The next object ``peer`` sent with :meth:`send_object` (a client rank: from
        rank 0 only; the server talks first). A message without the right HMAC, or that
        holds anything but plain data and tensors, raises (``AuthError``,
        :class:`~splitfed.errors.FormatError`) without being loaded."""
        head = torch.zeros(1, dtype=torch.int64)
        if self.exchange(recvs=[(peer, head)]):
            return None
        n = int(head[0])
        if not 0 < n <= MAX_MESSAGE or (self.key is not None and n <= _TAG):
            raise FormatError(f"a control message from rank {peer} announces {n} bytes; "
                              "refused")
        data = torch.empty(n, dtype=torch.uint8)
        if self.exchange(recvs=[(peer, data)]):
            return None
        self.overhead_bytes += 8 + data.numel()
        body = data.numpy().tobytes()
        if self.key is not None:
            body, tag = body[:-_TAG], body[-_TAG:]
            verify(self.key, peer, self.rank, self._received[peer], body, tag)
        self._received[peer] += 1
        return safeio.loads(body, what=f"a control message from rank {peer}")

    def stop_all(self, reason: str) -> None:
        """Rank 0: tell every live client rank, once, that the run ends."""
        if self.is_server and not self.stopped:
            self.stopped = True
            for r in self.live_clients():
                self.send_object(r, {"stop": reason})

    # ------------------------------------------------------------------ rows

    def gather_rows(self, owners: np.ndarray, tensors: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor], int]:
        """Per-client rows [C, ...] from the ranks that own them (``owners[i]``).

        Rank 0 returns new tensors holding the received rows (rows of lost ranks keep
        rank 0's own values: nothing arrived) and the bytes received; a client rank
        sends its rows and returns ``tensors`` with 0."""
        if not self.is_server:
            rows = np.flatnonzero(owners == self.rank)
            if rows.size:
                idx = torch.from_numpy(rows)
                self.exchange(sends=[(SERVER_RANK, t.detach()[idx].contiguous())
                                     for t in tensors])
            return [t.detach() for t in tensors], 0
        out = [t.detach().clone() for t in tensors]     # lost ranks' rows: nothing came
        posted = []
        for r in np.unique(owners).tolist():
            if not self.alive(r):
                continue
            idx = torch.from_numpy(np.flatnonzero(owners == r))
            bufs = [torch.empty((len(idx),) + tuple(t.shape[1:]), dtype=t.dtype)
                    for t in tensors]
            posted.append((r, idx, bufs))
        failed = self.exchange(recvs=[(r, b) for r, _, bs in posted for b in bs])
        nbytes = 0
        for r, idx, bufs in posted:
            if r in failed:
                continue
            for o, b in zip(out, bufs):
                o[idx] = b
                nbytes += b.numel() * b.element_size()
        return out, nbytes

    def scatter_rows(self, owners: np.ndarray, tensors: list[torch.Tensor]
                     ) -> tuple[list[torch.Tensor], int]:
        """Rank 0 sends each rank the rows [C, ...] of its clients; a client rank returns
        copies of ``tensors`` with its rows replaced by those received."""
        if self.is_server:
            sends = []
            for r in np.unique(owners).tolist():
                idx = torch.from_numpy(np.flatnonzero(owners == r))
                sends += [(r, t.detach()[idx].contiguous()) for t in tensors]
            failed = self.exchange(sends=sends)
            nbytes = sum(t.numel() * t.element_size() for r, t in sends
                         if r not in failed and self.alive(r))
            return [t.detach() for t in tensors], nbytes
        rows = np.flatnonzero(owners == self.rank)
        if not rows.size:
            return [t.detach() for t in tensors], 0
        idx = torch.from_numpy(rows)
        bufs = [torch.empty((len(rows),) + tuple(t.shape[1:]), dtype=t.dtype)
                for t in tensors]
        self.exchange(recvs=[(SERVER_RANK, b) for b in bufs])
        out = []
        for t, b in zip(tensors, bufs):
            o = t.detach().clone()
            o[idx] = b
            out.append(o)
        return out, 0

    def broadcast(self, owners: np.ndarray, tensors: list[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], int]:
        """One copy of ``tensors`` to every receiving client (``owners``: their ranks);
        a client rank returns the copy it received (``tensors`` if it hosts none)."""
        if self.is_server:
            sends = [(int(r), t.detach().contiguous()) for r in owners.tolist()
                     for t in tensors]
            failed = self.exchange(sends=sends)
            nbytes = sum(t.numel() * t.element_size() for r, t in sends
                         if r not in failed and self.alive(r))
            return [t.detach() for t in tensors], nbytes
        copies = int((owners == self.rank).sum())
        if not copies:
            return [t.detach() for t in tensors], 0
        bufs = []
        for _ in range(copies):
            bufs = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
            self.exchange(recvs=[(SERVER_RANK, b) for b in bufs])
        return bufs, 0


class DistributedTransport(Transport):
    """:class:`~splitfed.transport.base.Transport` whose payloads travel through
    :class:`Links` (module doc). ``hosts[c]``: the rank hosting client ``c``."""

    def __init__(self, ledger, links: Links, hosts: np.ndarray, clock=None):
        super().__init__(ledger, clock=clock)
        self.links = links
        self.hosts = np.asarray(hosts, dtype=np.int64)
        #: payload bytes rank 0 really sent and received: {(round, kind, direction): n}
        self.wire: dict[tuple[int, str, str], int] = defaultdict(int)
        self._per_client = True

    def send(self, kind, direction, client_ids, payload, *, per_client=True):
        self._per_client = per_client
        return super().send(kind, direction, client_ids, payload, per_client=per_client)

    def _deliver(self, kind, direction, ids, payload):
        names = None if isinstance(payload, torch.Tensor) else list(payload)
        tensors = [payload] if names is None else [payload[k] for k in names]
        owners = self.hosts[ids]
        if direction == UP:
            out, nbytes = self.links.gather_rows(owners, tensors)
        elif self._per_client:
            out, nbytes = self.links.scatter_rows(owners, tensors)
        else:
            out, nbytes = self.links.broadcast(owners, tensors)
        if self.links.is_server:
            self.wire[(self.ledger.round, kind, direction)] += nbytes
        return out[0] if names is None else dict(zip(names, out))

    def wire_totals(self, t: int | None = None) -> dict[str, int]:
        """``{"wire_up/<kind>": n, ..., "wire_up": total, "wire_down": total}`` over round
        ``t`` (every round when None), as :meth:`Ledger.round_totals` names them."""
        out = {"wire_up": 0, "wire_down": 0}
        for (r, kind, direction), n in sorted(self.wire.items()):
            if t is None or r == t:
                key = f"wire_{direction}/{kind}"
                out[key] = out.get(key, 0) + n
                out[f"wire_{direction}"] += n
        return out
