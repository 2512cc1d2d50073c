"""Zeroth-order (SPSA) estimation on stacked per-client parameters: small pure functions.

Paper 001 (MU-SplitFed), eqs. (3), (5), (6). For parameters x in R^d, a direction u is
drawn uniformly on the sphere of radius sqrt(d) (default; E[u u^T] = I) or from N(0, I),
and the central difference

    G = (F(x + lambda u) - F(x - lambda u)) / (2 lambda) * u

estimates the gradient of F (of its lambda-smoothed version). With q directions the q
estimates are averaged. Every function works on a *cohort*: a list of tensors with a
leading client dimension C, one independent direction per client.

Directions are regenerated from an integer seed whenever they are needed (one generator
call per (seed, shapes)), never stored longer than a step (docs/design.md, MU-SplitFed).

In-place mode (MeZO's trick, chunked): :func:`shift_` adds ``alpha * u`` to the
parameters themselves, regenerating u from its seed in chunks of at most
``NOISE_CHUNK`` elements, so neither u nor a perturbed copy of the parameters is ever
materialised; :func:`direction_scale` is the per-client factor that puts the chunked
Gaussian on the sphere. x + lambda u, x - lambda u and back to x are three shifts (the
parameters return to x up to float rounding). :func:`zo_step_` is :func:`zo_gradient`
followed by the step, in place. The chunked stream is not the one :func:`directions`
draws (the same distribution, other numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

KINDS = ("sphere", "gaussian")
NOISE_CHUNK = 2 ** 20          # noise elements alive at a time in in-place mode


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
    return _mean(total, len(seeds))


def _mean(total: list[torch.Tensor], q: int) -> list[torch.Tensor]:
    """``total / q``; one direction's estimate as it is (x / 1 is x in IEEE arithmetic,
    so skipping that pass over every parameter changes no bit)."""
    return total if q == 1 else torch._foreach_div(total, float(q))


# ---------------------------------------------------------------- in place, chunked


def noise_chunks(seed: int, params: Sequence[torch.Tensor], chunk: int = NOISE_CHUNK):
    """(view [C, L] of a block of one parameter, its N(0, 1) noise [C, L]) for every block
    of every parameter, in a fixed order from one generator seeded with ``seed``; at most
    ``chunk`` noise elements exist at a time. ``params`` must be contiguous."""
    g = torch.Generator(device=params[0].device)
    g.manual_seed(int(seed) & (2**63 - 1))
    for p in params:
        flat = p.view(p.shape[0], -1)
        size = max(1, chunk // p.shape[0])
        for start in range(0, flat.shape[1], size):
            part = flat[:, start:start + size]
            yield part, torch.randn(part.shape, generator=g, device=p.device, dtype=p.dtype)


def direction_scale(seed: int, params: Sequence[torch.Tensor],
                    kind: str = "sphere") -> torch.Tensor:
    """Per-client factor s [C] such that u = s z (z the seed's chunked noise) is on the
    sphere of radius sqrt(d) (``sphere``) or Gaussian (``gaussian``: s = 1)."""
    if kind not in KINDS:
        raise ValueError(f"direction kind must be one of {KINDS}, got {kind!r}")
    c = params[0].shape[0]
    if kind == "gaussian":
        return torch.ones(c, dtype=torch.float64)
    sq = torch.zeros(c, dtype=torch.float64)
    for _, z in noise_chunks(seed, params):
        sq += torch.linalg.vector_norm(z, dim=1, dtype=torch.float64).square().cpu()
    d = sum(p[0].numel() for p in params)
    return (d / sq).sqrt()


def shift_(params: Sequence[torch.Tensor], seed: int, alpha, scale: torch.Tensor) -> None:
    """``params += alpha * u`` in place (u = ``scale`` x the seed's noise, per client);
    ``alpha`` a number or one value per client [C]."""
    coef = torch.as_tensor(alpha, dtype=torch.float64).cpu() * scale
    coef = coef.view(-1, 1)
    for part, z in noise_chunks(seed, params):
        part.addcmul_(z, coef.to(part))


def zo_step_(loss_fn, params: Sequence[torch.Tensor], lam: float, seeds: Sequence[int],
             lr: float, kind: str = "sphere") -> list[torch.Tensor]:
    """In place: ``params -= lr * G`` with G the q-direction estimate of
    :func:`zo_gradient`, never materialising a direction. ``loss_fn()`` evaluates every
    client's loss [C] at the current (shifted) parameters. Returns the 2q evaluations."""
    evals, scales = probe(lambda _: loss_fn(), params, seeds, lam, kind, in_place=True)
    coefs = torch.stack([central_difference(evals[2 * j], evals[2 * j + 1], lam)
                         for j in range(len(seeds))], dim=1)
    descend_(params, seeds, coefs, lr, kind, scales)
    return evals


# ---------------------------------------------------------------- one client ZO step


def probe(forward, params: Sequence[torch.Tensor], seeds: Sequence[int], lam: float,
          kind: str = "sphere", in_place: bool = False):
    """The perturbed passes of a ZO step: ``[forward(x + lam u_j), forward(x - lam u_j)
    for each seed j]`` and the per-direction scales of the in-place mode (empty list
    otherwise; hand them to :func:`descend_`). ``forward(p)`` evaluates at parameters
    ``p``; in place it is called with None after the parameters themselves were shifted
    (and they are shifted back before returning)."""
    outs, scales = [], []
    for seed in seeds:
        if in_place:
            scales.append(direction_scale(seed, params, kind))
            for shift in (lam, -2 * lam):
                shift_(params, seed, shift, scales[-1])
                outs.append(forward(None))
            shift_(params, seed, lam, scales[-1])
        else:
            u = directions(seed, params, kind)
            outs += [forward(perturb(params, u, s * lam)) for s in (1, -1)]
    return outs, scales


def descend_(params: Sequence[torch.Tensor], seeds: Sequence[int], coefs: torch.Tensor,
             lr: float, kind: str = "sphere", scales: Sequence[torch.Tensor] = ()) -> None:
    """``params -= lr * mean_j coefs[:, j] u_j`` in place: the step from the projected
    differences ``coefs`` [C, q] (delta / 2 lambda) of the directions of ``seeds``,
    regenerated whole, or chunk by chunk when ``scales`` (in-place mode) are given."""
    q = len(seeds)
    if scales:
        for j, seed in enumerate(seeds):
            shift_(params, seed, -lr * coefs[:, j].double().cpu() / q, scales[j])
        return
    total = None
    for j, seed in enumerate(seeds):
        g = scale_directions(coefs[:, j], directions(seed, params, kind))
        total = g if total is None else torch._foreach_add(total, g)
    torch._foreach_add_(list(params), _mean(total, q), alpha=-lr)
