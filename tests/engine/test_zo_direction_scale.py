"""Scale of the zeroth-order estimator (splitfed.engine.zo) under both direction kinds.

docs/algorithms/musplitfed.md, "Direction scaling: what the paper and its code do": the
``gaussian`` kind is the unscaled N(0, I) direction with the plain central difference
and no dimension factor (the convention of the zeroth-order code paper 001's authors
build on, and of MeZO); ``sphere`` is eq. (3)'s direction on the sphere of radius
sqrt(d). Both have E[u u^T] = I, so both estimate the gradient without bias on a
quadratic and both move the parameters by about sqrt(d) |grad| per unit of learning
rate: E|g|^2 = d |grad|^2 (sphere), (d + 2) |grad|^2 (gaussian). A learning rate means
the same under either kind.

Float64 throughout. On a quadratic the central difference is exact, (f(x + lam u) -
f(x - lam u)) / (2 lam) = u . grad f(x) for every lam, so the only error is sampling
error and the tolerances below are derived from the sample count.
"""

import math

import pytest
import torch

from splitfed.engine import zo
from splitfed.rng import derive_seed
from tests.algorithms.test_musplitfed import quadratic as musplitfed_quadratic

N_SAMPLES = 4000


def quadratic(c: int, d: int, seed: int = 0):
    """c independent quadratics in R^d with A's spectrum kept O(1) as d grows."""
    return musplitfed_quadratic(c, d, seed, scale=d)


def samples(kind: str, lam: float, c: int, d: int, n: int = N_SAMPLES) -> tuple:
    """n one-direction estimates [n, c, d] of the gradient, and the gradient [c, d]."""
    f, x, grad = quadratic(c, d)
    est = torch.stack([zo.zo_gradient(f, [x], lam, [derive_seed(11, f"{kind}/{i}")], kind)[0]
                       for i in range(n)])
    return est, grad


def test_gaussian_kind_is_unscaled_normal_noise_and_sphere_its_rescaling():
    params = [torch.zeros(3, 4, 2, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64)]
    d = 13
    gen = torch.Generator().manual_seed(77)
    raw = torch.randn(3, d, generator=gen, dtype=torch.float64)
    gauss = torch.cat([t.flatten(1) for t in zo.directions(77, params, "gaussian")], 1)
    sphere = torch.cat([t.flatten(1) for t in zo.directions(77, params, "sphere")], 1)
    assert torch.equal(gauss, raw)                   # no normalisation, no d factor
    assert torch.allclose(sphere, raw * math.sqrt(d) / raw.norm(dim=1, keepdim=True))


@pytest.mark.parametrize("kind", ["sphere", "gaussian"])
def test_one_direction_estimate_is_the_plain_central_difference_times_u(kind):
    """The estimator itself carries no extra factor: g = (f(x + lam u) - f(x - lam u)) /
    (2 lam) u, with u as drawn (MeZO's and DeComFL's formula when u is Gaussian)."""
    f, x, grad = quadratic(3, 6)
    lam, seed = 1e-3, 5
    (u,) = zo.directions(seed, [x], kind)
    want = ((f([x + lam * u]) - f([x - lam * u])) / (2 * lam))[:, None] * u
    (got,) = zo.zo_gradient(f, [x], lam, [seed], kind)
    # got and want evaluate the same formula with their own roundings (x + lam u fused or
    # not); the bound is the worst case of both. f = x'A x / 2 + b'x is a sum of n = d^2 + d
    # products, rounded by at most n eps64 times its absolute form |p|'|A||p| / 2 + |b|'|p|
    # at p = x +- lam u; each coordinate of p is rounded by eps64 (|x| + lam |u|), moving f
    # by at most (|A||p| + |b|)' that. Their sum over both points, divided by 2 lam, is the
    # coefficient's error (plus eps64 of the coefficient for the division and the product).
    eps, d = torch.finfo(torch.float64).eps, x.shape[1]
    hess = torch.autograd.functional.hessian(lambda p: f([p]).sum(), x)
    a = torch.stack([hess[c, :, c, :] for c in range(len(x))])          # A, per client
    a, b = a.abs(), (grad - torch.einsum("cij,cj->ci", a, x)).abs()      # |A|, |b|
    err = 0.0
    for p in (x + lam * u, x - lam * u):
        p = p.abs()
        form = 0.5 * torch.einsum("ci,cij,cj->c", p, a, p) + (b * p).sum(1)
        moved = ((torch.einsum("cij,cj->ci", a, p) + b) * (x.abs() + lam * u.abs())).sum(1)
        err = err + eps * ((d * d + d) * form + moved)
    coef = want / u
    bound = 2 * (err[:, None] / (2 * lam) + 2 * eps * coef.abs()) * u.abs()
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()


@pytest.mark.numerics
@pytest.mark.parametrize("lam", [1e-3, 5e-3])
@pytest.mark.parametrize("kind", ["sphere", "gaussian"])
def test_estimate_is_unbiased_within_its_sampling_error(kind, lam):
    """E[g] = grad. Per coordinate Var(g_i) <= |grad|^2 + grad_i^2 for both kinds (the
    Gaussian's variance is exactly that; the sphere's is smaller), so the mean of n
    estimates lies within 5 standard errors of grad_i."""
    c, d = 3, 8
    est, grad = samples(kind, lam, c, d)
    mean = est.mean(0)
    bound = 5 * torch.sqrt((grad.pow(2).sum(1, keepdim=True) + grad.pow(2)) / est.shape[0])
    assert torch.all((mean - grad).abs() <= bound), (mean - grad).abs() / bound


@pytest.mark.numerics
@pytest.mark.parametrize("d", [8, 64])
@pytest.mark.parametrize("kind", ["sphere", "gaussian"])
def test_update_size_is_about_d_times_the_gradient_for_both_kinds(kind, d):
    """E|g|^2 / |grad|^2 is d for the sphere of radius sqrt(d) and d + 2 for N(0, I): the
    same effective learning rate to within 2/d (a unit-sphere direction without a d
    factor would give 1, a d times smaller step). Checked within 5 standard errors of the
    sample mean."""
    c = 3
    est, grad = samples(kind, 1e-3, c, d)
    ratio = est.pow(2).sum(2) / grad.pow(2).sum(1)          # [n, c]
    want = d if kind == "sphere" else d + 2
    tol = 5 * ratio.std(0) / math.sqrt(ratio.shape[0])
    assert torch.all((ratio.mean(0) - want).abs() <= tol), (ratio.mean(0), want, tol)



def test_in_place_gaussian_directions_are_the_unscaled_noise():
    """The in-place path (direction_scale times the seed's chunked noise, as zo_step_
    shifts the parameters) leaves ``gaussian`` noise as drawn: a shift of zeros by 1 x u
    is the noise itself, of a norm that is not sqrt(d) (``sphere`` rescales it to that,
    tests/algorithms/test_musplitfed.py)."""
    params = [torch.zeros(3, 4, 2, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64)]
    noise = torch.cat([z for _, z in zo.noise_chunks(77, params)], 1)
    zo.shift_(params, 77, 1.0, zo.direction_scale(77, params, "gaussian"))
    u = torch.cat([p.flatten(1) for p in params], 1)
    assert torch.equal(u, noise)
    assert not torch.allclose(u.norm(dim=1), torch.full((3,), math.sqrt(13), dtype=u.dtype))
