"""Property-based tests of the three pieces every run goes through: the partitioners, the
participation samplers and the aggregation (DeltaAccumulator)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitfed.data.partition import partition, partition_stats
from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.participation import make_sampler
from splitfed.errors import ConfigError

from helpers import assert_float_close

PROPS = settings(max_examples=int(os.environ.get("SPLITFED_FUZZ_EXAMPLES", "60")), deadline=None)


@st.composite
def label_sets(draw, max_n=300, max_classes=8):
    """Labels over K classes (some possibly absent), a client count and a seed."""
    k = draw(st.integers(1, max_classes))
    n = draw(st.integers(1, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    labels = np.random.default_rng(seed).integers(0, k, n)
    clients = draw(st.integers(1, min(n, 15)))
    return labels, clients, seed


def run(labels, clients, scheme, seed, **params):
    """The partition twice from the same seed; asserts it is deterministic."""
    a = partition(labels, clients, scheme, np.random.default_rng(seed), **params)
    b = partition(labels, clients, scheme, np.random.default_rng(seed), **params)
    assert len(a) == clients
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    return a


def check_disjoint(parts, n):
    flat = np.concatenate(parts)
    assert flat.dtype == np.int64 and len(np.unique(flat)) == len(flat)
    assert flat.size == 0 or (flat.min() >= 0 and flat.max() < n)
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted, no repeats
    return flat


@PROPS
@given(label_sets())
def test_iid_property(setup):
    labels, clients, seed = setup
    parts = run(labels, clients, "iid", seed)
    assert len(check_disjoint(parts, len(labels))) == len(labels)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@PROPS
@given(label_sets(), st.floats(0.05, 50.0), st.integers(0, 5), st.booleans())
def test_dirichlet_property(setup, alpha, min_size, balance):
    labels, clients, seed = setup
    try:
        parts = run(labels, clients, "dirichlet", seed, alpha=alpha,
                    min_partition_size=min_size, self_balancing=balance)
    except ConfigError as err:  # no draw met min_partition_size, or it cannot be met
        assert "min_partition_size" in str(err)
        return
    assert len(check_disjoint(parts, len(labels))) == len(labels)
    assert min(len(p) for p in parts) >= min_size  # non-empty whenever min_size >= 1


@PROPS
@given(label_sets(), st.integers(1, 8),
       st.sampled_from(["deterministic", "first-deterministic", "random"]))
def test_pathological_property(setup, c, mode):
    labels, clients, seed = setup
    classes = np.unique(labels)
    if c > len(classes):
        with pytest.raises(ConfigError, match="num_classes_per_partition"):
            partition(labels, clients, "pathological", np.random.default_rng(seed),
                      num_classes_per_partition=c, class_assignment_mode=mode)
        return
    parts = run(labels, clients, "pathological", seed, num_classes_per_partition=c,
                class_assignment_mode=mode)
    check_disjoint(parts, len(labels))
    counts = partition_stats(parts, labels, int(labels.max()) + 1)
    assert np.all((counts > 0).sum(1) <= c)  # at most C classes each
    total = np.bincount(labels, minlength=counts.shape[1])
    covered = counts.sum(0)
    assert np.all((covered == 0) | (covered == total))  # a class is dealt whole or dropped
    for k in np.flatnonzero(covered):  # evenly among the clients that hold it
        held = counts[:, k][counts[:, k] > 0]
        assert held.max() - held.min() <= 1
    if mode == "deterministic":
        for i, p in enumerate(parts):
            allowed = set(classes[(i + np.arange(c)) % len(classes)].tolist())
            assert set(labels[p].tolist()) <= allowed


@PROPS
@given(label_sets(), st.integers(1, 4), st.one_of(st.none(), st.integers(1, 40)),
       st.booleans())
def test_shard_property(setup, shards, size, keep_incomplete):
    labels, clients, seed = setup
    n = len(labels)
    try:
        parts = run(labels, clients, "shard", seed, num_shards_per_partition=shards,
                    shard_size=size, keep_incomplete_shard=keep_incomplete)
    except ConfigError as err:  # not enough samples for clients x shards
        assert "shard" in str(err)
        assert clients * shards * (size or 1) > n or size is not None and size > n
        return
    check_disjoint(parts, n)
    size = size or n // (clients * shards)
    sizes = sorted(len(p) for p in parts)
    # every client gets S full shards, except that the one incomplete shard may be dealt
    assert all(s == shards * size for s in sizes[:-1]) or keep_incomplete
    assert sizes[0] >= 1
    assert sum(sizes) <= n
    if not keep_incomplete or n % size == 0:
        assert all(s == shards * size for s in sizes)


# ------------------------------------------------------------------- participation


@st.composite
def samplers(draw):
    sizes = draw(st.lists(st.integers(0, 500), min_size=1, max_size=12))
    n = len(sizes)
    weighting = draw(st.sampled_from(["data_size", "uniform"]))
    if weighting == "data_size" and sum(sizes) == 0:
        sizes[0] = 1
    mode = draw(st.sampled_from(["full", "uniform", "with_replacement", "bernoulli"]))
    opts = {}
    if mode == "uniform":
        opts["clients_per_round"] = draw(st.integers(1, n))
    elif mode == "with_replacement":
        opts["clients_per_round"] = draw(st.integers(1, 3 * n))
    elif mode == "bernoulli":
        prob = st.floats(1e-3, 1.0)
        opts["q"] = draw(prob | st.lists(prob, min_size=n, max_size=n))
    return mode, sizes, weighting, opts, draw(st.integers(0, 2**32 - 1))


@PROPS
@given(samplers())
def test_sampler_property(setup):
    mode, sizes, weighting, opts, seed = setup
    n = len(sizes)
    sampler = make_sampler(mode, n, sizes, weighting=weighting, **opts)
    a = np.asarray(sizes, float) / sum(sizes) if weighting == "data_size" else np.full(n, 1 / n)
    rng = np.random.default_rng(seed)
    again = make_sampler(mode, n, sizes, weighting=weighting, **opts)
    rng2 = np.random.default_rng(seed)
    for _ in range(5):
        c = sampler.sample(rng)
        d = again.sample(rng2)
        assert np.array_equal(c.ids, d.ids) and np.array_equal(c.weights, d.weights)
        w, ids = c.weights, c.ids
        assert np.all(np.isfinite(w)) and np.all(w >= 0)
        assert np.all((ids >= 0) & (ids < n))
        # the weights are float64 products and quotients of a_n, q_n and a sum of at most n
        # (a handful of) terms: a few eps64 (2.2e-16) off the formula; rtol=1e-12 is far
        # above that and far below a wrong weight
        if mode == "full":
            assert ids.tolist() == list(range(n))
            np.testing.assert_allclose(w, a, rtol=1e-12)
        elif mode in ("uniform", "with_replacement"):
            m = opts["clients_per_round"]
            assert c.size == m
            if mode == "uniform":
                assert len(set(ids.tolist())) == m
            if a[ids].sum() > 0:
                np.testing.assert_allclose(w, a[ids] / a[ids].sum(), rtol=1e-12)
                assert w.sum() == pytest.approx(1.0)
            else:
                assert np.all(w == 0)  # nobody sampled holds data: the model is kept
        else:
            q = np.broadcast_to(np.asarray(opts["q"], float), (n,))
            assert np.all(np.diff(ids) > 0)
            np.testing.assert_allclose(w, a[ids] / q[ids], rtol=1e-12)  # a_n / q_n
            if np.all(q == 1.0):
                assert ids.tolist() == list(range(n))


# ------------------------------------------------------------------------ aggregation


@st.composite
def cohorts(draw):
    """A reference state, C clients' new values (stacked), weights, chunking and a mask."""
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    c = draw(st.integers(1, 6))
    shapes = draw(st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3),
                           min_size=1, max_size=3))
    ref = {f"p{i}": torch.randn(tuple(s), generator=g) for i, s in enumerate(shapes)}
    ref["bn.num_batches_tracked"] = torch.tensor(draw(st.integers(0, 100)))
    stacked = {k: v + torch.randn((c, *v.shape), generator=g) for k, v in ref.items()
               if v.is_floating_point()}
    stacked["bn.num_batches_tracked"] = torch.tensor(
        draw(st.lists(st.integers(0, 200), min_size=c, max_size=c)))
    weights = torch.tensor(draw(st.lists(st.floats(0, 3), min_size=c, max_size=c)),
                           dtype=torch.float64)
    keep = np.array(draw(st.lists(st.booleans(), min_size=c, max_size=c)))
    cuts = sorted(draw(st.lists(st.integers(1, c), max_size=2, unique=True)))
    return ref, stacked, weights, keep, cuts, draw(st.floats(0.1, 2.0))


def accumulate(ref, stacked, weights, cuts, keep=None, renormalise=False):
    acc = DeltaAccumulator(ref, renormalise=renormalise)
    bounds = [0, *[b for b in cuts if b < len(weights)], len(weights)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # any chunking gives the same sum
        acc.add(weights[lo:hi], {k: v[lo:hi] for k, v in stacked.items()},
                keep=None if keep is None else keep[lo:hi])
    return acc


def direct(ref, stacked, weights, rows, lr, scale=1.0, dtype=torch.float64):
    """x + lr * scale * sum_s w_s (x_s - x) computed in ``dtype``, over ``rows``; with
    ``dtype=None``: the size of its terms, |x| + lr * scale * sum_s |w_s| |x_s - x|."""
    out = {}
    for k, r in ref.items():
        if r.is_floating_point():
            t = dtype or torch.float64
            x, w, r = stacked[k].to(t)[rows], weights[rows].double(), r.to(t)
            if dtype is None:
                out[k] = r.abs() + lr * scale * torch.tensordot(w.abs(), (x - r).abs(), dims=1)
            elif dtype == torch.float64:
                out[k] = r + lr * scale * torch.tensordot(w, x - r, dims=1)
            else:  # the coefficients lr * scale * w_s are float64 scalars in the accumulator
                c = (lr * scale * w).to(dtype)
                out[k] = r + torch.tensordot(c, x - r, dims=1)
        else:
            out[k] = torch.maximum(r, stacked[k][rows].max()) if len(rows) else r
    return out


def close(got, args):
    """The float32 aggregate equals x + lr * scale * sum_s w_s (x_s - x) within the bound
    derived from the float32 reference's own error (tests/helpers.py); integers exactly."""
    want, want32, size = direct(*args), direct(*args, dtype=torch.float32), \
        direct(*args, dtype=None)
    for k, w in want.items():
        assert got[k].dtype == (torch.float32 if got[k].is_floating_point() else w.dtype)
        if got[k].is_floating_point():
            finite = size[k][torch.isfinite(size[k])]
            magnitude = finite.max().item() if finite.numel() else 0.0
            assert_float_close(got[k], want32[k], w, magnitude=magnitude,
                               terms=len(args[3]) + 1, what=k)
        else:
            assert torch.equal(got[k], w)


@pytest.mark.numerics
@PROPS
@given(cohorts())
def test_weighted_average_equals_float64(case):
    ref, stacked, weights, _, cuts, lr = case
    acc = accumulate(ref, stacked, weights, cuts)
    rows = np.arange(len(weights))
    close(acc.result(lr), (ref, stacked, weights, rows, lr))
    assert acc.count == len(weights)
    norm = weights / weights.sum() if weights.sum() > 0 else weights
    avg = accumulate(ref, stacked, norm, cuts).result()
    if weights.sum() > 0:  # normalised weights, eta_g = 1: the plain weighted average
        for k, r in ref.items():
            if r.is_floating_point():
                want = torch.tensordot(norm, stacked[k].double(), dims=1)
                want32 = torch.tensordot(norm.float(), stacked[k], dims=1)
                size = torch.tensordot(norm, stacked[k].double().abs(), dims=1)
                assert_float_close(avg[k], want32, want, terms=len(norm),
                                   magnitude=size.max().item() if size.numel() else 0.0,
                                   what=k)


@pytest.mark.numerics
@PROPS
@given(cohorts())
def test_clients_returning_the_global_model_change_nothing(case):
    ref, stacked, weights, keep, cuts, lr = case
    same = {k: ref[k].expand(len(weights), *ref[k].shape).clone() for k in stacked}
    for renormalise in (False, True):
        out = accumulate(ref, same, weights, cuts, keep, renormalise).result(lr)
        for k, r in ref.items():
            assert torch.equal(out[k], r), k  # bit for bit


@pytest.mark.numerics
@PROPS
@given(cohorts())
def test_keep_mask(case):
    ref, stacked, weights, keep, cuts, lr = case
    rows = np.flatnonzero(keep)
    for renormalise in (False, True):
        acc = accumulate(ref, stacked, weights, cuts, keep, renormalise)
        assert acc.count == len(rows)
        if len(rows) == 0:  # everyone dropped: the model is kept
            for k, r in ref.items():
                assert torch.equal(acc.result(lr)[k], r)
            continue
        kept, offered = float(weights[rows].sum()), float(weights.sum())
        scale = offered / kept if renormalise and kept > 0 and kept != offered else 1.0
        if renormalise and 0 < kept < sys.float_info.min:
            # subnormal kept weights: w_s (x_s - x) underflows and has lost its digits, so
            # only finiteness is promised (weights are data fractions, never this small)
            assert all(torch.isfinite(v).all() for v in acc.result(lr).values())
            continue
        close(acc.result(lr), (ref, stacked, weights, rows, lr, scale))
    everyone = accumulate(ref, stacked, weights, cuts, np.ones(len(weights), bool), True)
    plain = accumulate(ref, stacked, weights, cuts)
    for k in ref:
        assert torch.equal(everyone.result(lr)[k], plain.result(lr)[k])
