"""The one aggregation: x <- x + eta_g * sum_s w_s (x_s - x).

With weights that sum to one and eta_g = 1 this is the weighted average sum_s w_s x_s
(FedAvg). With bernoulli participation the weights are a_n / q_n (paper 002 eq. 3) and do
not sum to one; the delta form keeps the update unbiased. The global learning rate eta_g
(paper 003 Algorithm 1; paper 001 eq. 7 with its sign corrected, docs/design.md) scales the step.

Decision (docs/design.md, Aggregation and participation): BatchNorm buffers are averaged
like parameters. Integer buffers (``num_batches_tracked``) take the maximum over the cohort.

Dropped clients (a round deadline, :mod:`splitfed.engine.clock`): ``add(..., keep=mask)``
leaves out the slots whose mask is False. With ``renormalise`` (every participation mode
but bernoulli) the kept slots' weights are scaled by (sum of all weights offered) / (sum
of the kept weights), i.e. renormalised over the kept clients; under bernoulli the
dropped clients' terms are simply zero. Nothing dropped: exactly the plain aggregate.

A server step that needs each client's upload, not only their weighted sum (a
coordinate-wise median or trimmed mean), sets ``needs_uploads = True``; the round then
builds its accumulator with ``keep_uploads=True``, which also keeps a copy of every
aggregated upload and :meth:`DeltaAccumulator.uploads` returns them with the weights the
sum used (memory: one copy of the trained part per aggregated client).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Uploads:
    """The aggregated clients' uploads, in the order they were added.

    ``values``: per tensor name, the clients' new values stacked as ``[n, ...]`` (a copy,
    in the reference's dtype and device); ``weights``: float64 ``[n]``, the weights the
    aggregate gave them (renormalisation over the kept clients included), so that
    ``reference + sum_i weights[i] (values[i] - reference)`` is ``result(1.0)``;
    ``ids``: the clients' ids ``[n]`` (None where the caller did not give them)."""

    values: dict[str, torch.Tensor]
    weights: torch.Tensor
    ids: np.ndarray | None

    def __len__(self) -> int:
        return len(self.weights)


class DeltaAccumulator:
    """Streams the weighted sum of client deltas, one chunk of clients at a time
    (``keep_uploads``: and keeps a copy of each upload, :meth:`uploads`)."""

    def __init__(self, reference: Mapping[str, torch.Tensor], *, renormalise: bool = False,
                 keep_uploads: bool = False):
        self.reference = dict(reference)
        self._sum = {k: torch.zeros_like(v, dtype=torch.float64 if v.is_floating_point()
                                          else v.dtype) for k, v in self.reference.items()}
        # the reference in float64, made once for every chunk's deltas
        self._ref64 = {k: v.to(torch.float64) for k, v in self.reference.items()
                       if v.is_floating_point()}
        self._count = 0
        self.renormalise = renormalise
        self._offered = 0.0
        self._kept = 0.0
        self.keep_uploads = keep_uploads
        self._kept_values: list[dict[str, torch.Tensor]] = []
        self._kept_weights: list[torch.Tensor] = []
        self._kept_ids: list[np.ndarray] | None = []

    @torch.no_grad()
    def add(self, weights: torch.Tensor, stacked: Mapping[str, torch.Tensor],
            keep=None, *, ids=None) -> None:
        """``weights`` [C] and per-name tensors [C, ...] of the clients' new values;
        ``keep`` [C] (bool, optional): which of them to aggregate; ``ids`` [C]
        (optional): the clients' ids, for :meth:`uploads`."""
        w = weights.to(torch.float64)
        self._offered += float(w.sum())
        if keep is not None and not np.all(keep):
            rows = torch.from_numpy(np.flatnonzero(keep))
            w = w[rows]
            stacked = {k: stacked[k][rows.to(stacked[k].device)] for k in self.reference}
            if ids is not None:
                ids = np.asarray(ids)[rows.numpy()]
        self._kept += float(w.sum())
        if len(w) == 0:
            return
        if self.keep_uploads:
            self._keep(w, stacked, ids)
        for k, ref in self.reference.items():
            x = stacked[k]
            if ref.is_floating_point():
                # the float64 copy, then the subtraction in place: one new tensor, not two
                delta = x.to(torch.float64, copy=True).sub_(self._ref64[k])
                self._sum[k] += torch.tensordot(w.to(delta.device), delta, dims=1)
            else:
                self._sum[k] = torch.maximum(self._sum[k], x.max(dim=0).values)
        self._count += len(w)

    def _keep(self, w: torch.Tensor, stacked, ids) -> None:
        self._kept_values.append({k: stacked[k].detach().to(ref.device, ref.dtype, copy=True)
                                  for k, ref in self.reference.items()})
        self._kept_weights.append(w.cpu())
        if ids is None or self._kept_ids is None:
            self._kept_ids = None
        else:
            self._kept_ids.append(np.asarray(ids).reshape(-1))

    def uploads(self) -> Uploads:
        """The aggregated uploads and their weights (:class:`Uploads`); only when the
        accumulator keeps them (``keep_uploads``: a server step with ``needs_uploads``)."""
        if not self.keep_uploads:
            raise RuntimeError(
                "aggregate.uploads(): the clients' uploads were not kept; a server step "
                "that reads them sets the class attribute needs_uploads = True")
        n = sum(len(w) for w in self._kept_weights)
        values = {k: (torch.cat([v[k] for v in self._kept_values]) if n else
                      ref.new_empty((0, *ref.shape)))
                  for k, ref in self.reference.items()}
        weights = (torch.cat(self._kept_weights) if n else
                   torch.zeros(0, dtype=torch.float64))
        scale = self._scale()
        if scale != 1.0:        # as _scaled: divided by the kept weight first if it overflows
            weights = (weights * scale if math.isfinite(scale) else
                       weights / self._kept * self._offered)
        ids = (None if self._kept_ids is None else
               np.concatenate(self._kept_ids) if n else np.zeros(0, dtype=np.int64))
        return Uploads(values, weights, ids)

    @property
    def count(self) -> int:
        return self._count

    @property
    def scale(self) -> float:
        """1, or the renormalisation over the kept clients when some were dropped."""
        return self._scale()

    def _scale(self) -> float:
        if self.renormalise and self._kept != self._offered and self._kept > 0:
            return self._offered / self._kept
        return 1.0

    def _scaled(self, k: str, factor: float = 1.0) -> torch.Tensor:
        """``factor * scale * sum[k]`` (float64). When the kept weights are so small that
        offered / kept overflows (subnormal weights), the sum is divided by the kept
        weight first, so that a zero delta stays zero instead of becoming inf * 0 = NaN."""
        scale = self._scale()
        if scale == 1.0:
            return self._sum[k] * factor if factor != 1.0 else self._sum[k]
        if math.isfinite(scale):
            return self._sum[k] * (factor * scale)
        return self._sum[k] / self._kept * self._offered * factor

    def delta(self) -> dict[str, torch.Tensor]:
        """sum_s w_s (x_s - x) per float tensor, in the reference dtype."""
        return {k: self._scaled(k).to(v.dtype)
                for k, v in self.reference.items() if v.is_floating_point()}

    @torch.no_grad()
    def result(self, global_lr: float = 1.0) -> dict[str, torch.Tensor]:
        """x + eta_g * sum_s w_s (x_s - x); the reference itself if nothing was added."""
        if self._count == 0:
            return {k: v.clone() for k, v in self.reference.items()}
        out = {}
        step = global_lr * self._scale()
        for k, ref in self.reference.items():
            if ref.is_floating_point():
                term = step * self._sum[k] if math.isfinite(step) else self._scaled(k, global_lr)
                out[k] = (ref.to(torch.float64) + term).to(ref.dtype)
            else:
                out[k] = torch.maximum(ref, self._sum[k])
        return out
