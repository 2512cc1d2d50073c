"""The client executor: local training of a whole cohort in batched chunks.

Clients are not Python objects. A cohort's parameters are stacked (leading client
dimension) and every local step runs one batched forward/backward for a chunk of clients
through :func:`splitfed.models.cohort.cohort_forward` (grouped convolutions, batched
matmuls). Chunking bounds memory and keeps the per-call batch near the cache-friendly
size (docs/design.md, Speed: about 160-640 samples per call on a 2-core CPU).

Clients may run different numbers of local steps (``local_epochs`` with unequal data).
Slots are processed in order of decreasing K, so within a chunk the clients still working
at step k are always a prefix: they run on prefix views of the stacked tensors and the
finished ones are left untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitfed.engine.batches import batch_plan, gather
from splitfed.engine.placement import Placement
from splitfed.engine.stacked import GradHook, placed_stacked
from splitfed.models.cohort import SAMPLES_PER_CALL


@dataclass
class ChunkResult:
    """What one chunk of clients ends its local work with."""

    slots: np.ndarray                 # positions of these clients in the cohort
    client_ids: np.ndarray            # their client ids
    state: dict[str, torch.Tensor]    # stacked final parameters and buffers [Cc, ...]
    loss: torch.Tensor                # mean training loss over each client's steps [Cc]


class ClientExecutor:
    """Trains the cohort's copies of ``module`` on their own data, many clients at once.

    ``placement`` (``env.placement``; None: every client in this process) says which
    copies the multi-process runtime computes here (engine/placement.py): only those are
    trained, and each chunk's losses are collected from where the clients are hosted.
    """

    def __init__(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 client_indices: Sequence[np.ndarray], *, batch_size: int,
                 chunk_size: int | None = None, clock=None,
                 placement: Placement | None = None):
        self.module = module
        self.clock = clock                # charges the clients' compute (None: not timed)
        self.placement = placement
        self.x, self.y = x, y
        self.client_indices = [np.asarray(i, dtype=np.int64) for i in client_indices]
        self.batch_size = int(batch_size)
        self.chunk_size = int(chunk_size or max(1, SAMPLES_PER_CALL // self.batch_size))
        self.param_names = [n for n, _ in module.named_parameters()]
        self.buffer_names = [n for n, _ in module.named_buffers()]

    def plans(self, client_ids: np.ndarray, steps: np.ndarray,
              rng: np.random.Generator) -> list[np.ndarray]:
        """Per-slot sample indices [K_s, B], drawn in slot order (independent of chunking)."""
        return [batch_plan(self.client_indices[c], int(k), self.batch_size, rng)
                for c, k in zip(client_ids, steps)]

    def chunks(self, steps: np.ndarray) -> list[np.ndarray]:
        order = np.argsort(-np.asarray(steps), kind="stable")
        return [order[i:i + self.chunk_size] for i in range(0, len(order), self.chunk_size)]

    def train(self, start: Mapping[str, torch.Tensor], client_ids: np.ndarray,
              steps: np.ndarray, *, lr: float, rng: np.random.Generator,
              momentum: float = 0.0, weight_decay: float = 0.0,
              grad_hook: GradHook | None = None) -> Iterator[ChunkResult]:
        """Local SGD from ``start`` for every slot; yields one result per chunk."""
        client_ids = np.asarray(client_ids, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64)
        plans = self.plans(client_ids, steps, rng)
        place = self.placement
        for slots in self.chunks(steps):
            chunk = self._train_chunk(start, slots, client_ids[slots], steps[slots],
                                      [plans[s] for s in slots], lr, momentum,
                                      weight_decay, grad_hook)
            if place is not None:         # the losses were computed where clients live
                chunk.loss = place.collect(chunk.client_ids, chunk.loss)
            yield chunk

    def _train_chunk(self, start, slots, ids, steps, plans, lr, momentum, weight_decay,
                     grad_hook) -> ChunkResult:
        n = len(slots)
        model = placed_stacked(self.placement, self.module, start, n, momentum=momentum,
                               weight_decay=weight_decay, clock=self.clock, ids=ids)
        device = self.x.device
        loss_sum = torch.zeros(n, device=device)
        for k in range(int(steps[0])):
            a = int((steps > k).sum())
            idx = torch.from_numpy(np.stack([p[k] for p in plans[:a]])).to(device)
            out = model.forward(gather(self.x, idx), a)
            losses = F.cross_entropy(out.flatten(0, 1), gather(self.y, idx).flatten(),
                                     reduction="none").view(a, -1).mean(1)
            model.step(losses.sum(), lr=lr, ids=slots[:a], hook=grad_hook)
            loss_sum[:a] += losses.detach()
        loss = loss_sum / torch.from_numpy(steps).to(loss_sum)
        return ChunkResult(slots=slots, client_ids=ids, state=model.final(), loss=loss)
