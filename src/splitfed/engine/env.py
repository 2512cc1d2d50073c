"""The environment a run's algorithm works in: data, clients, model template, engine parts.

Built once per run by :func:`splitfed.experiment.build_environment`; algorithms read from
it and never rebuild its parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from splitfed.engine.batches import local_step_counts
from splitfed.engine.clock import CLIENT, VirtualClock
from splitfed.engine.executor import ClientExecutor
from splitfed.engine.placement import Placement
from splitfed.engine.profiles import fixed
from splitfed.engine.stacked import StackedModel, placed_stacked
from splitfed.rng import RandomStreams
from splitfed.transport import Ledger, Transport


@dataclass
class Environment:
    """What a run's algorithm works in (module doc).

    ``placement`` says where computation runs: None (the default, the simulator) when
    every client and the servers are in this process; the multi-process runtime sets it
    to its rank's :class:`~splitfed.engine.placement.Placement` (which clients this rank
    hosts), and the engine's primitives that get it from here (:meth:`stacked`,
    :meth:`executor`, :mod:`splitfed.engine.split`, ``ForwardCopies(placement=...)``)
    compute only this rank's side (engine/placement.py).
    """

    config: Any                      # splitfed.config.RunConfig
    data: Any                        # splitfed.data.DataBundle (tensors on `device`)
    client_indices: list[np.ndarray]
    model: nn.Module                 # the initial global model (a BlockModel)
    cut: int                         # client blocks, for split algorithms
    sampler: Any                     # participation sampler
    transport: Transport
    ledger: Ledger
    streams: RandomStreams
    device: torch.device
    server_data: Any = None          # splitfed.data.server_data.ServerData (hybrid FL)
    clock: VirtualClock | None = None  # simulated time; default: fixed default speeds
    placement: Placement | None = None  # where computation runs; None: all in this process

    def __post_init__(self):
        if self.clock is None:
            rng = np.random.default_rng(0)
            self.clock = VirtualClock(fixed(self.num_clients, rng), rng)
        if getattr(self.transport, "clock", None) is None:
            self.transport.clock = self.clock

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def data_sizes(self) -> np.ndarray:
        return np.array([len(i) for i in self.client_indices], dtype=np.int64)

    def local_steps(self, client_ids: np.ndarray) -> np.ndarray:
        """K per cohort slot (docs/design.md, Local work: local_steps, or
        ceil(D_n / B) * local_epochs)."""
        tr = self.config.train
        return local_step_counts(self.data_sizes[np.asarray(client_ids)], tr.batch_size,
                                 tr.local_steps, tr.local_epochs)

    def lr(self, t: int, base: float | None = None) -> float:
        """The step size of round ``t`` (1-based): ``base`` (default ``train.lr``) times
        ``lr_decay ** (t - 1)``, floored at ``lr_min``. Every training step's size follows
        it, the clients' and the servers' (an algorithm's ``server_lr``); rates applied to
        a round's aggregate (``global_lr``, FedOpt's server optimizer) stay constant."""
        tr = self.config.train
        base = tr.lr if base is None else base
        return max(base * tr.lr_decay ** (t - 1), min(tr.lr_min, base))

    def executor(self, module: nn.Module) -> ClientExecutor:
        """A batched executor training copies of ``module`` on the clients' data."""
        return ClientExecutor(module, self.data.train.x, self.data.train.y,
                              self.client_indices, batch_size=self.config.train.batch_size,
                              chunk_size=self.config.engine.chunk_size, clock=self.clock,
                              placement=self.placement)

    def stacked(self, module: nn.Module, start, n: int, *, role: str = CLIENT,
                ids: np.ndarray | None = None, momentum: float = 0.0,
                weight_decay: float = 0.0, timed: bool = True) -> StackedModel:
        """``n`` stacked copies of ``module`` from ``start``
        (:class:`~splitfed.engine.stacked.StackedModel`) doing ``role`` work for the
        clients ``ids`` (one per copy). Under a :attr:`placement` whose process computes
        only some of them, the placement's model, which holds and trains only those.
        ``timed``: charged to the run's clock (with ``ids``)."""
        return placed_stacked(self.placement, module, start, n, role=role, ids=ids,
                              momentum=momentum, weight_decay=weight_decay,
                              clock=self.clock if timed else None)
