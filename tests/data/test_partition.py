"""Tests for splitfed.data.partition."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitfed.data import PARTITIONERS, partition, partition_stats, partition_summary
from splitfed.errors import ConfigError

K = 10  # classes


@pytest.fixture(scope="module")
def labels():
    """5000 shuffled labels, 500 per class."""
    return np.random.default_rng(123).permutation(np.repeat(np.arange(K), 500))


def rng(seed=0):
    return np.random.default_rng(seed)


def tv_from_global(parts, labels):
    """Total-variation distance of each client's label distribution from the global one."""
    counts = partition_stats(parts, labels, K)
    local = counts / counts.sum(1, keepdims=True)
    glob = np.bincount(labels, minlength=K) / len(labels)
    return 0.5 * np.abs(local - glob).sum(1)


def assert_disjoint_sorted(parts, n, full=True):
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)
    assert flat.min() >= 0 and flat.max() < n
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)
    if full:
        assert len(flat) == n


COVERING = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.5}),
    ("dirichlet", {"alpha": 0.5, "self_balancing": True}),
    ("pathological", {"num_classes_per_partition": 2, "class_assignment_mode": "deterministic"}),
    ("pathological", {"num_classes_per_partition": 3}),
]


@pytest.mark.parametrize("scheme,params", COVERING)
def test_partition_covers_data_once(labels, scheme, params):
    parts = partition(labels, 10, scheme, rng(), **params)
    assert len(parts) == 10
    assert_disjoint_sorted(parts, len(labels))


@pytest.mark.parametrize("scheme,params", COVERING + [("shard", {"num_shards_per_partition": 2})])
def test_partition_is_deterministic_per_seed(labels, scheme, params):
    a = partition(labels, 10, scheme, rng(1), **params)
    b = partition(labels, 10, scheme, rng(1), **params)
    c = partition(labels, 10, scheme, rng(2), **params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_sizes_differ_by_at_most_one(labels):
    sizes = [len(p) for p in partition(labels[:4999], 7, "iid", rng())]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 4999


@pytest.mark.parametrize("mode", ["deterministic", "first-deterministic", "random"])
@pytest.mark.parametrize("c", [1, 2, 3])
def test_pathological_exactly_c_classes(labels, mode, c):
    parts = partition(labels, 20, "pathological", rng(), num_classes_per_partition=c,
                      class_assignment_mode=mode)
    held = (partition_stats(parts, labels, K) > 0).sum(1)
    assert np.all(held == c)
    assert_disjoint_sorted(parts, len(labels), full=False)


def test_pathological_deterministic_classes(labels):
    parts = partition(labels, 4, "pathological", rng(), num_classes_per_partition=2,
                      class_assignment_mode="deterministic")
    for i, p in enumerate(parts):
        assert set(np.unique(labels[p])) == {i, i + 1}


def test_pathological_first_class_and_drop(labels):
    parts = partition(labels, 3, "pathological", rng(), num_classes_per_partition=2)
    for i, p in enumerate(parts):
        assert i in set(labels[p])
    assert sum(map(len, parts)) < len(labels)  # 3 clients x 2 classes leave classes unheld


def test_dirichlet_huge_alpha_is_near_iid(labels):
    parts = partition(labels, 10, "dirichlet", rng(), alpha=1e6)
    assert tv_from_global(parts, labels).max() < 0.05


def test_dirichlet_small_alpha_is_skewed(labels):
    parts = partition(labels, 10, "dirichlet", rng(), alpha=0.1)
    assert tv_from_global(parts, labels).mean() > 0.3


def test_dirichlet_inf_is_iid(labels):
    b = partition(labels, 10, "iid", rng(5))
    for alpha in (float("inf"), "inf"):
        a = partition(labels, 10, "dirichlet", rng(5), alpha=alpha)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_dirichlet_min_partition_size(labels):
    parts = partition(labels, 20, "dirichlet", rng(), alpha=0.3, min_partition_size=50)
    assert min(map(len, parts)) >= 50


def test_dirichlet_gives_up_with_advice(labels):
    with pytest.raises(ConfigError, match="min_partition_size.*alpha"):
        partition(labels, 20, "dirichlet", rng(), alpha=0.01, min_partition_size=240,
                  max_tries=3)
    with pytest.raises(ConfigError, match="min_partition_size"):
        partition(labels, 20, "dirichlet", rng(), alpha=1.0, min_partition_size=300)


@pytest.mark.parametrize("shards,size", [(2, None), (3, 100), (5, 50)])
def test_shard_sizes_and_classes(labels, shards, size):
    parts = partition(labels, 10, "shard", rng(), num_shards_per_partition=shards,
                      shard_size=size)
    size = size or len(labels) // (10 * shards)
    assert all(len(p) == shards * size for p in parts)
    assert np.all((partition_stats(parts, labels, K) > 0).sum(1) <= shards)
    assert_disjoint_sorted(parts, len(labels), full=size * shards * 10 == len(labels))


def test_shard_not_enough_shards(labels):
    with pytest.raises(ConfigError, match="need 60 shards"):
        partition(labels, 20, "shard", rng(), num_shards_per_partition=3, shard_size=100)


def test_keep_incomplete_shard_deals_no_empty_shard_when_the_size_divides_n():
    """partition module doc (shard): an incomplete last shard is used only with
    keep_incomplete_shard, and when N is a multiple of K * shards every client gets
    exactly N / K samples; with no incomplete shard there is nothing extra to deal."""
    labels = np.repeat(np.arange(10), 10)                    # N = 100, shards of 5
    for seed in range(6):
        parts = partition(labels, 10, "shard", rng(seed),
                          num_shards_per_partition=2, shard_size=5,
                          keep_incomplete_shard=True)
        assert [len(p) for p in parts] == [10] * 10
    with pytest.raises(ConfigError, match="need 21 shards of 5 samples, but 100 samples "
                                          "make only 20"):
        partition(labels, 21, "shard", rng(0),
                  num_shards_per_partition=1, shard_size=5, keep_incomplete_shard=True)



def test_natural_scheme():
    y = np.zeros(10, dtype=np.int64)
    nat = [np.array([3, 1]), np.array([0, 2, 4])]
    parts = partition(y, 2, "natural", rng(), natural=nat)
    assert [p.tolist() for p in parts] == [[1, 3], [0, 2, 4]]
    with pytest.raises(ConfigError, match="synthetic"):
        partition(y, 2, "natural", rng())
    with pytest.raises(ConfigError, match="3"):
        partition(y, 3, "natural", rng(), natural=nat)
    with pytest.raises(ConfigError, match="more than one"):
        partition(y, 2, "natural", rng(), natural=[np.array([1]), np.array([1])])


@pytest.mark.parametrize("scheme,params,match", [
    ("bogus", {}, "iid, dirichlet, pathological, shard, natural"),
    ("dirichlet", {"alpha": 0.0}, "alpha"),
    ("dirichlet", {"alpha": -1}, "alpha"),
    ("dirichlet", {"alpha": "lots"}, "alpha"),
    ("dirichlet", {"alpha": float("nan")}, "alpha"),
    ("dirichlet", {}, "missing.*alpha"),
    ("iid", {"alpha": 1.0}, "unknown.*alpha"),
    ("pathological", {"num_classes_per_partition": 11}, "exceeds the 10 classes"),
    ("pathological", {"num_classes_per_partition": 2, "class_assignment_mode": "x"}, "mode"),
    ("shard", {"num_shards_per_partition": 0}, "num_shards_per_partition"),
])
def test_bad_parameters(labels, scheme, params, match):
    with pytest.raises(ConfigError, match=match):
        partition(labels, 10, scheme, rng(), **params)


@pytest.mark.parametrize("n", [0, 5001, 2.5])
def test_bad_num_clients(labels, n):
    with pytest.raises(ConfigError, match="num_clients"):
        partition(labels, n, "iid", rng())


def test_registry_names():
    assert set(PARTITIONERS) == {"iid", "dirichlet", "pathological", "shard", "natural"}


def test_summary_small_and_large(labels):
    parts = partition(labels, 10, "dirichlet", rng(), alpha=0.5)
    text = partition_summary(parts, labels, K)
    assert "total" in text and "c9" in text and str(len(labels)) in text
    big = partition(labels, 1000, "iid", rng())
    text = partition_summary(big, labels, K, max_rows=20)
    assert "980 more clients not shown" in text
    assert len(text.splitlines()) < 30


def test_stats_counts(labels):
    parts = partition(labels, 10, "iid", rng())
    counts = partition_stats(parts, labels, K)
    assert counts.shape == (10, K)
    assert np.array_equal(counts.sum(0), np.bincount(labels, minlength=K))
    assert np.array_equal(counts.sum(1), [len(p) for p in parts])


def test_large_scale_runs():
    y = np.random.default_rng(0).integers(0, 10, 60_000)
    for scheme, params in [("iid", {}), ("dirichlet", {"alpha": 0.5, "min_partition_size": 0}),
                           ("pathological", {"num_classes_per_partition": 2}),
                           ("shard", {"num_shards_per_partition": 2})]:
        parts = partition(y, 1000, scheme, rng(), **params)
        assert len(parts) == 1000


@settings(max_examples=30, deadline=None)
@given(n=st.integers(20, 400), clients=st.integers(1, 20), seed=st.integers(0, 2**32 - 1),
       alpha=st.floats(0.05, 100.0))
def test_dirichlet_and_iid_cover_any_input(n, clients, seed, alpha):
    y = np.random.default_rng(seed).integers(0, 5, n)
    for scheme, params in [("iid", {}), ("dirichlet", {"alpha": alpha, "min_partition_size": 0})]:
        parts = partition(y, clients, scheme, rng(seed), **params)
        assert len(parts) == clients
        assert_disjoint_sorted(parts, n)


@pytest.mark.parametrize("mode", ["random", "first-deterministic"])
def test_pathological_with_many_clients_and_classes_needs_no_clients_x_classes_table(mode):
    """Memory in proportion to clients x C, not clients x classes (a score per class and
    client, drawn in slices of rows: the same draws as one call)."""
    import tracemalloc

    labels = np.arange(20_000) % 1_000
    tracemalloc.start()
    try:
        parts = partition(labels, 10_000, "pathological", np.random.default_rng(0),
                          num_classes_per_partition=1, class_assignment_mode=mode)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(len(p) for p in parts) <= len(labels)
    assert {len(set(labels[p].tolist())) for p in parts} <= {0, 1}
    assert peak < 90 * 2**20, peak           # a [10000, 1000] table of scores: 80 MB,
    #                                          its argsort 80 MB more
