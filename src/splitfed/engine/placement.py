"""Where computation runs: the seam between the engine and a multi-process runtime.

In one process (the simulator, the default) every client and the servers live in the
same address space and nothing here is consulted beyond one ``None`` check. The
multi-process runtime (:mod:`splitfed.runtime`) runs the same round loop and algorithm
code on every rank (SPMD) and installs a :class:`Placement` that says which rank hosts
which clients; the engine's compute primitives ask it what to compute here:

- :class:`~splitfed.engine.stacked.StackedModel` trains only the copies hosted here
  (``local_slots``) and shows placeholders (zeros) for the others;
- :class:`~splitfed.engine.executor.ClientExecutor` hands each chunk's training losses
  to the server (``collect``), since on the server they were computed elsewhere;
- :func:`~splitfed.engine.split.server_step` and
  :func:`~splitfed.engine.split.client_forward` run only where their side is hosted.

Tensors cross between ranks only through the transport (``env.transport``); a
placeholder never leaves the rank that made it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class Placement(Protocol):
    def local_slots(self, role: str, ids: np.ndarray) -> np.ndarray:
        """Positions in ``ids`` whose ``role`` work (``client``, ``server``,
        ``server_copy``) this process computes, ascending."""

    def serves(self, client_id: int) -> bool:
        """Whether this process runs the single server model's step for ``client_id``."""

    def collect(self, ids: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        """Per-client values [C] (metrics, not payload) as the server sees them."""


_current: Placement | None = None


def current() -> Placement | None:
    """The installed placement, or None: everything runs in this process."""
    return _current


def install(placement: Placement | None) -> None:
    """Install (or, with None, remove) this process's placement."""
    global _current
    _current = placement
