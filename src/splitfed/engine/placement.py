"""Where computation runs: the seam between the engine and a multi-process runtime.

The placement is a field of the run's environment, ``env.placement``
(:class:`~splitfed.engine.env.Environment`). In one process (the simulator, the default)
it is None: every client and the servers live in the same address space and nothing
here is consulted beyond one ``None`` check. The multi-process runtime
(:mod:`splitfed.runtime`) runs the same round loop and algorithm code on every rank
(SPMD) and sets ``env.placement`` to a :class:`Placement` that says which rank hosts
which clients; the engine's compute primitives, which receive it from the environment,
ask it what to compute here:

- :meth:`env.stacked <splitfed.engine.env.Environment.stacked>` builds stacked copies
  (:func:`~splitfed.engine.stacked.placed_stacked`): a
  :class:`~splitfed.engine.stacked.StackedModel` when every copy is computed here, else
  the placement's model (:meth:`Placement.stacked`), which trains only the copies hosted
  here (``local_slots``) and shows placeholders (zeros) for the others;
- :class:`~splitfed.engine.executor.ClientExecutor` (``env.executor``) hands each
  chunk's training losses to the server (``collect``; :func:`client_values` for
  algorithms with their own client loop), since on the server they were computed
  elsewhere;
- :func:`~splitfed.engine.split.server_step`, :func:`~splitfed.engine.split.
  client_forward` / :func:`~splitfed.engine.split.client_backward` (SL's sequential
  client) and :func:`cohort_forward_here` (batched passes outside a stacked model:
  :class:`~splitfed.engine.stacked.ForwardCopies`, MU-SplitFed and GAS) run only where
  their side is hosted.

Every helper here takes the placement as its first argument (None: everything runs in
this process). Tensors cross between ranks only through the transport
(``env.transport``); a placeholder never leaves the rank that made it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from splitfed.models.cohort import cohort_forward_chunked

class Placement(Protocol):
    def local_slots(self, role: str, ids: np.ndarray) -> np.ndarray:
        """Positions in ``ids`` whose ``role`` work (``client``, ``server``,
        ``server_copy``) this process computes, ascending."""

    def stacked(self, module: nn.Module, start: Mapping[str, torch.Tensor], n: int, *,
                role: str, ids, momentum: float, weight_decay: float,
                clock) -> Any:
        """Stacked copies of ``module`` for ``role`` work for the clients ``ids`` (one
        per copy), with :class:`~splitfed.engine.stacked.StackedModel`'s arguments: a
        plain ``StackedModel`` when all of them are computed here, else a model that
        computes only the local copies (it is given this placement)."""

    def serves(self, client_id: int) -> bool:
        """Whether this process runs the single server model's step for ``client_id``."""

    def collect(self, ids: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        """Per-client values [C] (metrics, not payload) as the server sees them."""


def client_values(place: Placement | None, ids, values: torch.Tensor) -> torch.Tensor:
    """Per-client values [C] computed on the clients' side (training losses), as the
    server sees them under the placement ``place``: gathered from where the clients are
    hosted (``collect``)."""
    return values if place is None else place.collect(np.asarray(ids), values)


def hosted(place: Placement | None, role: str, ids) -> np.ndarray | None:
    """Positions in ``ids`` computed in this process under ``place``; None when that is
    all of them."""
    if place is None:
        return None
    ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
    rows = place.local_slots(role, ids)
    return None if len(rows) == len(ids) else rows


def cohort_forward_here(place: Placement | None, role: str, ids, module: nn.Module,
                        state: Mapping[str, torch.Tensor], x: torch.Tensor, *,
                        training: bool = True, write_back: Sequence[str] = (),
                        chunk: int | None = None) -> torch.Tensor:
    """:func:`~splitfed.models.cohort.cohort_forward` over the copies computed in this
    process under ``place`` (``role`` work for the clients ``ids``, one per leading row
    of ``state`` and ``x``); the other rows of the output are zeros. ``write_back``:
    tensors of ``state`` the pass updates in place (BatchNorm statistics), copied back to
    their rows. ``chunk``: copies per call (:func:`~splitfed.models.cohort.
    cohort_forward_chunked`; the same values; None: one call)."""
    rows = hosted(place, role, ids)
    if rows is None:
        return cohort_forward_chunked(module, state, x, training=training, chunk=chunk)
    idx = torch.from_numpy(rows).to(x.device)
    if not len(rows):
        return placeholder(module, x)
    sub = {k: v[idx] for k, v in state.items()}
    out = cohort_forward_chunked(module, sub, x[idx], training=training, chunk=chunk)
    with torch.no_grad():
        for k in write_back:
            state[k][idx] = sub[k]
    return out.new_zeros((x.shape[0],) + tuple(out.shape[1:])).index_copy(0, idx, out)


_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def placeholder(module: nn.Module, x: torch.Tensor, *, stacked: bool = True) -> torch.Tensor:
    """Zeros standing for ``module``'s output on ``x`` ([C, B, ...] when ``stacked``,
    else [B, ...]) where it is not computed; the shape comes from one cached dry run."""
    from splitfed.models import output_shape

    lead = 2 if stacked else 1
    shapes = _SHAPES.setdefault(module, {})
    key = tuple(x.shape[lead:])
    if key not in shapes:
        shapes[key] = output_shape(module, key)
    return x.new_zeros(tuple(x.shape[:lead]) + shapes[key], dtype=_output_dtype(module, x))


def _output_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype of ``module``'s output: that of its floating-point parameters (a model
    on token ids takes integers and gives floats), else the input's when it is floating."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()
