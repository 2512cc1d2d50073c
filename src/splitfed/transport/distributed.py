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

Control messages travel under their own tag (:data:`_CONTROL`; tensors under tag 0), so
that a posted tensor receive never takes one, and a client rank always has a receive
posted for rank 0's next control message: a stop reaches it at any point of a round,
also while it waits in a transfer that rank 0 will no longer make (rank 0 failed mid-
round). The client rank then ends the run as at a stop between rounds
(:class:`StopRun`), and rank 0 sends every client rank its stop at once, so it neither
waits ``timeout_s`` per client rank nor reports healthy ranks as lost.

Control messages (:meth:`Links.send_object`: the run's config, the checkpoint's state on
resuming, each round's cohort, stop) are plain data and tensors written with
:func:`splitfed.safeio.dumps` and read with the weights-only loader (never unpickled),
and carry an HMAC-SHA256 under the run's secret (sender, receiver and a sequence number
per link included): a client rank refuses a message that is not rank 0's, unread.
The tensors of the transfers carry no HMAC (docs/distributed.md, Security).
"""

from __future__ import annotations

import queue
import re
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
#: the tag of control messages (:meth:`Links.send_object`); tensors go under tag 0
_CONTROL = 1
_FOREVER = timedelta(days=3650)
#: how often a client rank waiting in a transfer looks for a control message (seconds)
_POLL_S = 0.05


class ServerLost(RuntimeError):
    """A client rank's link to rank 0 failed: the server is gone."""


class StopRun(Exception):
    """Rank 0 ended the run (finished, diverged or failed)."""


def stop_reason(msg) -> str | None:
    """The reason of rank 0's stop message ``msg`` (a mapping with a text ``stop``);
    None when ``msg`` is no stop message. A stop whose reason is not text is a
    :class:`~splitfed.errors.FormatError`."""
    if not isinstance(msg, dict) or "stop" not in msg:
        return None
    if not isinstance(msg["stop"], str):
        raise FormatError("rank 0 sent a stop message without a reason; all ranks must "
                          "run the same splitfed version")
    return msg["stop"]


#: where in its sources gloo raised (``[/path/gloo/transport/tcp/pair.cc:537] ``)
_SOURCE_PLACE = re.compile(r"\[[^\[\]]*\.(?:cc|cpp|h):\d+\] ?")


def link_error(error: BaseException) -> str:
    """A failed transfer's error on one line, for the lost-rank message and the
    summary's ``lost_ranks``: gloo's text without the source file and line it names
    (``Read error [127.0.0.1]:23436: Connection reset by peer``)."""
    return " ".join(_SOURCE_PLACE.sub("", str(error)).split())


class _Waiter:
    """Daemon threads that wait on gloo works, so that rank 0 can give up on a wait and
    a client rank can take a control message while it waits in a transfer."""

    def __init__(self, threads: int):
        self._jobs: queue.Queue = queue.Queue()
        for _ in range(threads):
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            work, timeout, done, box = self._jobs.get()
            try:
                work.wait() if timeout is None else work.wait(timeout)
            except Exception as e:  # noqa: BLE001 - reported to the waiting caller
                box.append(e)
            done.set()

    def submit(self, work, timeout: timedelta | None = _FOREVER
               ) -> tuple[threading.Event, list]:
        """Wait on ``work`` in a thread (``timeout`` None: gloo's process-group timeout);
        returns the event set when the wait ends and the list that then holds its
        exception, if any."""
        done, box = threading.Event(), []
        self._jobs.put((work, timeout, done, box))
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
                 secret: str | None = None, client_timeout_s: float | None = None):
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
        #: a client rank: seconds it waits for rank 0's next control message (None:
        #: gloo's process-group timeout, as for its transfers)
        self.client_timeout_s = client_timeout_s
        #: a client rank left a transfer unfinished (rank 0 stopped the run mid-round):
        #: the process must not wait for gloo's orderly shutdown
        self.abandoned = False
        self._waiter = _Waiter(4 * world_size + 8) if self.is_server else None
        #: a client rank: the receive posted for the next control message's length
        #: (peer, frame, done, box), and control messages taken during a transfer
        self._head: tuple | None = None
        self._taken: list = []

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

    def exchange(self, sends=(), recvs=(), *, tag: int = 0) -> set[int]:
        """Post ``(peer, tensor)`` sends and receives, wait for all; returns the peers
        whose transfers failed (on rank 0; a client rank raises :class:`ServerLost`,
        or :class:`StopRun` when rank 0's stop comes meanwhile). Each tensor travels
        with its byte count (:data:`_TRAILER`): a message of another length than the
        receiving tensor's is a failed transfer, whose peer rank 0 drops, and the
        tensor is left as it was. (A message longer than the posted buffer is beyond
        this: gloo aborts the receiving process.) ``tag``: 0 for tensors,
        :data:`_CONTROL` for control messages."""
        works, failed, framed = [], set(), []
        for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
            for peer, t in pairs:
                if not self.alive(peer) or peer in failed:
                    failed.add(peer)
                    continue
                frame = _frame(t) if op is dist.isend else torch.zeros(
                    _nbytes(t) + _TRAILER, dtype=torch.uint8)
                try:
                    works.append((peer, op(frame, peer, tag=tag)))
                except RuntimeError as e:
                    self._fail(peer, e, failed)
                    continue
                if op is dist.irecv:
                    framed.append((peer, t, frame))
        if not self.is_server:
            self._client_wait(works, failed)
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

    def _client_wait(self, works, failed: set) -> None:
        """A client rank waits for its transfers (gloo's process-group timeout), and
        takes any control message rank 0 sends meanwhile: a stop ends the wait
        (:class:`StopRun`), another is kept for :meth:`recv_object`."""
        if self._waiter is None:
            self._waiter = _Waiter(8)
        pending = [(peer, *self._waiter.submit(w, None)) for peer, w in works]
        for peer, done, box in pending:
            while not done.wait(_POLL_S):
                if self._head is not None and self._head[2].is_set():
                    msg = self._take_control()
                    reason = stop_reason(msg)
                    if reason is not None:
                        self.abandoned = True
                        raise StopRun(reason)
                    self._taken.append(msg)
            if box:
                self._fail(peer, box[0], failed)

    def _fail(self, peer: int, error, failed: set) -> None:
        if not self.is_server:
            if error is None:
                timeout = self._client_timeout()
                why = "no answer" + ("" if timeout is None else f" within {timeout:g} s")
            else:
                why = link_error(error)
            raise ServerLost(f"the link to the server (rank 0) failed: {why}") from error
        failed.add(peer)
        reason = (f"no answer within {self.timeout_s:g} s" if error is None
                  else link_error(error).split(". ")[0])
        self.lose(peer, reason)

    # ------------------------------------------------------------------ objects

    def send_object(self, peer: int, obj) -> bool:
        """Send ``obj`` (plain data and tensors, :mod:`splitfed.safeio`) to ``peer`` with
        its HMAC; False if the peer is lost."""
        return peer not in self.send_objects({peer: obj})

    def send_objects(self, objs: dict) -> set[int]:
        """:meth:`send_object` for ``{peer: obj}``, to all the peers at once (one
        deadline for them all, not one after another); returns the peers lost."""
        heads, bodies = [], []
        for peer, obj in objs.items():
            body = safeio.dumps(obj)
            if self.key is not None:
                body += sign(self.key, self.rank, peer, self._sent[peer], body)
            self._sent[peer] += 1
            data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            heads.append((peer, torch.tensor([data.numel()], dtype=torch.int64)))
            bodies.append((peer, data))
            self.overhead_bytes += 8 + data.numel()
        failed = self.exchange(sends=heads, tag=_CONTROL)
        return failed | self.exchange(sends=[(p, d) for p, d in bodies if p not in failed],
                                      tag=_CONTROL)

    def send_all(self, obj) -> set[int]:
        """Rank 0: :meth:`send_objects` of ``obj`` to every live client rank."""
        return self.send_objects({r: obj for r in self.live_clients()})

    def recv_object(self, peer: int):
        """The next object ``peer`` sent with :meth:`send_object` (a client rank: from
        rank 0 only; the server talks first). A message without the right HMAC, or that
        holds anything but plain data and tensors, raises (``AuthError``,
        :class:`~splitfed.errors.FormatError`) without being loaded. None when the
        link failed (on rank 0; a client rank raises :class:`ServerLost`)."""
        if self._taken:
            return self._taken.pop(0)
        return self._take_control(peer)

    def _post_head(self, peer: int) -> None:
        """Post the receive of the next control message's length from ``peer``."""
        if self._waiter is None:
            self._waiter = _Waiter(8)
        frame = torch.zeros(8 + _TRAILER, dtype=torch.uint8)
        try:
            work = dist.irecv(frame, peer, tag=_CONTROL)
        except RuntimeError as e:
            self._fail(peer, e, set())
            return
        self._head = (peer, frame, *self._waiter.submit(work))

    def _take_control(self, peer: int = SERVER_RANK):
        """The next control message from ``peer``, checked and loaded (None: the link
        failed, on rank 0); then, on a client rank, post the receive of the next one
        unless this one stops the run."""
        body = self._receive_control(peer)
        if body is None:
            return None
        if self.key is not None:
            body, tag = body[:-_TAG], body[-_TAG:]
            verify(self.key, peer, self.rank, self._received[peer], body, tag)
        self._received[peer] += 1
        msg = safeio.loads(body, what=f"a control message from rank {peer}")
        if not self.is_server and stop_reason(msg) is None:
            self._post_head(peer)
        return msg

    def _receive_control(self, peer: int) -> bytes | None:
        """The bytes of the next control message from ``peer`` (HMAC included), waited
        for within the client timeout on a client rank (``timeout_s`` on rank 0)."""
        if self._head is None or self._head[0] != peer:
            self._post_head(peer)
            if self._head is None:
                return None
        _, frame, done, box = self._head
        limit = self.timeout_s if self.is_server else self._client_timeout()
        if not done.wait(limit):
            self._head = None
            self._fail(peer, None, set())
            return None
        self._head = None
        head = torch.zeros(1, dtype=torch.int64)
        wrong = _unframe(frame, head) if not box else None
        if box or wrong is not None:
            self._fail(peer, box[0] if box else RuntimeError(wrong), set())
            return None
        n = int(head[0])
        if not 0 < n <= MAX_MESSAGE or (self.key is not None and n <= _TAG):
            raise FormatError(f"a control message from rank {peer} announces {n} bytes; "
                              "refused")
        data = torch.empty(n, dtype=torch.uint8)
        if self.exchange(recvs=[(peer, data)], tag=_CONTROL):
            return None
        self.overhead_bytes += 8 + data.numel()
        return data.numpy().tobytes()

    def _client_timeout(self) -> float | None:
        """A client rank's wait for rank 0: :attr:`client_timeout_s`, else gloo's
        process-group timeout (None: unknown, no limit)."""
        if self.client_timeout_s is not None:
            return float(self.client_timeout_s)
        try:
            group = dist.distributed_c10d._get_default_group()
            return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no group, or another torch: wait without limit
            return None

    def stop_all(self, reason: str) -> None:
        """Rank 0: tell every live client rank, once, that the run ends (all at once:
        a client rank waiting in a transfer takes it too, module doc)."""
        if self.is_server and not self.stopped:
            self.stopped = True
            self.send_all({"stop": reason})

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
