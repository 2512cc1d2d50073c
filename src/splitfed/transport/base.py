"""The transport seam: the one way tensors cross between clients and servers.

Kinds (docs/design.md, Communication ledger): ``activations`` (up), ``activation_grads`` (down),
``labels`` (up), ``model`` (parameters, up or down), ``scalars`` (up or down).
Raw inputs are not a kind: they never leave a client.

Payloads are tensors or flat ``{name: tensor}`` mappings. A *per-client* payload has a
leading cohort dimension (one slot per entry of ``client_ids``); its bytes are charged to
each client separately. A *broadcast* payload is the same for every receiver and is
charged once per receiver.

A transport built with a clock (``splitfed.engine.clock.VirtualClock``) also charges
every transfer's bytes to the simulated timelines of the clients involved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import numpy as np
import torch

from splitfed.transport.ledger import Ledger

UP = "up"
DOWN = "down"
KINDS = ("activations", "activation_grads", "labels", "model", "scalars")

Payload = Union[torch.Tensor, Mapping[str, torch.Tensor]]


def _tensors(payload: Payload) -> list[torch.Tensor]:
    if isinstance(payload, torch.Tensor):
        return [payload]
    return list(payload.values())


def payload_bytes(payload: Payload, per_client: bool) -> int:
    """Bytes of one receiver's (or one slot's) share of ``payload``."""
    total = 0
    for t in _tensors(payload):
        n = t.numel() // t.shape[0] if per_client else t.numel()
        total += n * t.element_size()
    return total


class Transport:
    """Moves payloads between clients and servers and records them in a :class:`Ledger`."""

    def __init__(self, ledger: Ledger, clock=None):
        self.ledger = ledger
        self.clock = clock

    def _check(self, kind: str, direction: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown transfer kind {kind!r}; kinds: {', '.join(KINDS)}")
        if direction not in (UP, DOWN):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")

    def send(self, kind: str, direction: str, client_ids, payload: Payload,
             *, per_client: bool = True) -> Payload:
        """Deliver ``payload`` between the server and ``client_ids``; returns what arrives."""
        self._check(kind, direction)
        ids = client_ids
        if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype == np.int64):
            ids = np.atleast_1d(np.asarray(client_ids, dtype=np.int64))
        if per_client:
            for t in _tensors(payload):
                if t.dim() == 0 or t.shape[0] != len(ids):
                    raise ValueError(f"per-client {kind} payload has leading dim "
                                     f"{tuple(t.shape)[:1]}, expected {len(ids)} clients")
        nbytes = payload_bytes(payload, per_client)
        self.ledger.record(kind, direction, ids, nbytes)
        if self.clock is not None:
            self.clock.transfer(kind, direction, ids, nbytes)
        return self._deliver(kind, direction, ids, payload)

    def settle(self, client_id: int, events) -> None:
        """Record what the single client ``client_id`` and the server handed each other
        by reference in this process, after the fact: ``events`` in the order they
        happened, ``(direction, kind, nbytes)`` for a transfer of ``nbytes`` (one
        slot's bytes, as :meth:`send` counts them) and ``(role, macs)`` for compute
        between them (the clock's roles). The transfers go into the ledger; transfers and
        compute are charged to the clock in their order, as step-by-step calls would
        charge them (an SL turn, :func:`splitfed.engine.split.sequential_turn`)."""
        ids = np.array([int(client_id)], dtype=np.int64)
        sent: dict[tuple[str, str], int] = {}
        for event in events:
            if event[0] in (UP, DOWN):
                direction, kind, nbytes = event
                key = (kind, direction)
                if key not in sent:
                    self._check(kind, direction)
                    sent[key] = 0
                sent[key] += int(nbytes)
        for (kind, direction), nbytes in sent.items():
            self.ledger.record(kind, direction, ids, nbytes)
        if self.clock is not None:
            self.clock.replay_one(int(client_id), events)

    def upload(self, kind: str, client_ids, payload: Payload) -> Payload:
        """Per-client payload from clients to the server."""
        return self.send(kind, UP, client_ids, payload, per_client=True)

    def download(self, kind: str, client_ids, payload: Payload) -> Payload:
        """Per-client payload from the server to clients."""
        return self.send(kind, DOWN, client_ids, payload, per_client=True)

    def broadcast(self, kind: str, client_ids, payload: Payload) -> Payload:
        """The same payload from the server to every client in ``client_ids``."""
        return self.send(kind, DOWN, client_ids, payload, per_client=False)

    def _deliver(self, kind: str, direction: str, ids: np.ndarray, payload: Payload) -> Payload:
        raise NotImplementedError


class InProcessTransport(Transport):
    """Delivers by reference: client and server share one process and one address space.

    Activations are detached on the way (the receiving side starts a new autograd graph,
    exactly as it would after a real network hop).
    """

    def _deliver(self, kind, direction, ids, payload):
        if isinstance(payload, torch.Tensor):
            return payload.detach()
        return {k: v.detach() for k, v in payload.items()}
