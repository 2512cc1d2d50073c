"""The one aggregation: x <- x + eta_g * sum_s w_s (x_s - x).

With weights that sum to one and eta_g = 1 this is the weighted average sum_s w_s x_s
(FedAvg). With bernoulli participation the weights are a_n / q_n (paper 002 eq. 3) and do
not sum to one; the delta form keeps the update unbiased. The global learning rate eta_g
(paper 003 Algorithm 1; paper 001 eq. 7 with its sign corrected, SPEC) scales the step.

SPEC: BatchNorm buffers are averaged like parameters. Integer buffers
(``num_batches_tracked``) take the maximum over the cohort.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class DeltaAccumulator:
    """Streams the weighted sum of client deltas, one chunk of clients at a time."""

    def __init__(self, reference: Mapping[str, torch.Tensor]):
        self.reference = dict(reference)
        self._sum = {k: torch.zeros_like(v, dtype=torch.float64 if v.is_floating_point()
                                          else v.dtype) for k, v in self.reference.items()}
        self._count = 0

    @torch.no_grad()
    def add(self, weights: torch.Tensor, stacked: Mapping[str, torch.Tensor]) -> None:
        """``weights`` [C] and per-name tensors [C, ...] of the clients' new values."""
        w = weights.to(torch.float64)
        for k, ref in self.reference.items():
            x = stacked[k]
            if ref.is_floating_point():
                delta = x.to(torch.float64) - ref.to(torch.float64)
                self._sum[k] += torch.tensordot(w.to(delta.device), delta, dims=1)
            else:
                self._sum[k] = torch.maximum(self._sum[k], x.max(dim=0).values)
        self._count += len(w)

    @property
    def count(self) -> int:
        return self._count

    def delta(self) -> dict[str, torch.Tensor]:
        """sum_s w_s (x_s - x) per float tensor, in the reference dtype."""
        return {k: self._sum[k].to(v.dtype) for k, v in self.reference.items()
                if v.is_floating_point()}

    @torch.no_grad()
    def result(self, global_lr: float = 1.0) -> dict[str, torch.Tensor]:
        """x + eta_g * sum_s w_s (x_s - x); the reference itself if nothing was added."""
        if self._count == 0:
            return {k: v.clone() for k, v in self.reference.items()}
        out = {}
        for k, ref in self.reference.items():
            if ref.is_floating_point():
                out[k] = (ref.to(torch.float64) + global_lr * self._sum[k]).to(ref.dtype)
            else:
                out[k] = torch.maximum(ref, self._sum[k])
        return out
