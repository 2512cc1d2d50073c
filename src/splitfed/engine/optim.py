"""Stacked SGD: one optimizer step for a whole cohort of clients.

Each parameter is a tensor with a leading client dimension. The update mirrors
``torch.optim.SGD`` (no dampening, no Nesterov): ``g <- g + wd * p``;
``buf <- momentum * buf + g`` (``buf = g`` on the first step); ``p <- p - lr * buf``.
``lr`` may be a scalar or one rate per client (shape [C]).

Decision (docs/design.md, Optimizers): client optimizer state is fresh each round (a new
:class:`StackedSGD` per round); it is never re-created per batch.
"""

from __future__ import annotations

import torch


class StackedSGD:
    def __init__(self, momentum: float = 0.0, weight_decay: float = 0.0):
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.buffers: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], lr) -> None:
        """Update ``params`` in place (they may be prefix views of the stacked leaves)."""
        if self.weight_decay:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum:
            n = params[0].shape[0]
            if self.buffers is None:
                self.buffers = [g.clone() for g in grads]
            else:
                bufs = [b[:n] for b in self.buffers]
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, grads)
            grads = [b[:n] for b in self.buffers]
        if isinstance(lr, torch.Tensor) and lr.dim() > 0:
            scaled = [g * lr[: g.shape[0]].view(-1, *([1] * (g.dim() - 1))) for g in grads]
            torch._foreach_sub_(params, scaled)
        else:
            torch._foreach_add_(params, grads, alpha=-float(lr))
