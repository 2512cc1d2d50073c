"""Zeroth-order (SPSA) estimation on stacked per-client parameters: small pure functions.

Paper 001 (MU-SplitFed), eqs. (3), (5), (6). For parameters x in R^d, a direction u is
drawn uniformly on the sphere of radius sqrt(d) (default; E[u u^T] = I) or from N(0, I),
and the central difference

    G = (F(x + lambda u) - F(x - lambda u)) / (2 lambda) * u

estimates the gradient of F (of its lambda-smoothed version). With q directions the q
estimates are averaged. Every function works on a *cohort*: a list of tensors with a
leading client dimension C, one independent direction per client.

Directions are regenerated from an integer seed whenever they are needed (one generator
call per (seed, shapes)), never stored longer than a step (SPEC).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

KINDS = ("sphere", "gaussian")


def directions(seed: int, params: Sequence[torch.Tensor], kind: str = "sphere"
               ) -> list[torch.Tensor]:
    """One random direction per client over all ``params`` ([C, ...] each), from ``seed``.

    ``sphere``: uniform on the sphere of radius sqrt(d) per client (d = parameters per
    client); ``gaussian``: standard normal entries.
    """
    if kind not in KINDS:
        raise ValueError(f"direction kind must be one of {KINDS}, got {kind!r}")
    c = params[0].shape[0]
    sizes = [p[0].numel() for p in params]
    d = sum(sizes)
    g = torch.Generator(device=params[0].device)
    g.manual_seed(int(seed) & (2**63 - 1))
    z = torch.randn(c, d, generator=g, device=params[0].device, dtype=params[0].dtype)
    if kind == "sphere":
        z *= math.sqrt(d) / z.norm(dim=1, keepdim=True)
    return [part.reshape(p.shape) for part, p in zip(z.split(sizes, dim=1), params)]


def perturb(params: Sequence[torch.Tensor], u: Sequence[torch.Tensor],
            scale: float) -> list[torch.Tensor]:
    """``params + scale * u`` (new tensors)."""
    return torch._foreach_add(list(params), list(u), alpha=scale)


def central_difference(f_plus: torch.Tensor, f_minus: torch.Tensor,
                       lam: float) -> torch.Tensor:
    """(F(x + lambda u) - F(x - lambda u)) / (2 lambda), per client [C]."""
    return (f_plus - f_minus) / (2.0 * lam)


def scale_directions(coef: torch.Tensor, u: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``coef[c] * u[c]`` per client: the estimate G from the projected difference."""
    return [coef.view(-1, *([1] * (t.dim() - 1))).to(t) * t for t in u]


def zo_gradient(loss_fn, params: Sequence[torch.Tensor], lam: float, seeds: Sequence[int],
                kind: str = "sphere") -> list[torch.Tensor]:
    """Average over ``len(seeds)`` directions of the central-difference estimate.

    ``loss_fn(params) -> [C]`` evaluates every client's loss at its own parameters.
    """
    total = None
    for seed in seeds:
        u = directions(seed, params, kind)
        coef = central_difference(loss_fn(perturb(params, u, lam)),
                                  loss_fn(perturb(params, u, -lam)), lam)
        g = scale_directions(coef, u)
        total = g if total is None else torch._foreach_add(total, g)
    return torch._foreach_div(total, float(len(seeds)))
