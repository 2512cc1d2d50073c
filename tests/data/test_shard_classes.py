"""The ``shard`` partitioner's class bound: shards are cut at fixed multiples of
``shard_size`` of the label-sorted order (McMahan et al.'s recipe), so a shard spanning a
class boundary holds two classes. A client holds at most S classes when every class size
is a multiple of the shard size, and at most 2 S when no class is smaller than a shard."""

import importlib

import numpy as np
import pytest

from splitfed.data import partition, partition_stats

K = 10


def _classes_held(labels, parts):
    return (partition_stats(parts, labels, K) > 0).sum(1)


def _shuffled(sizes, seed=0):
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(K), sizes))


@pytest.mark.parametrize("shards,size", [(1, 60), (2, 30), (3, 20), (3, 12)])
@pytest.mark.parametrize("seed", range(5))
def test_class_sizes_that_are_multiples_of_the_shard_size_give_at_most_s_classes(
        shards, size, seed):
    labels = _shuffled([120, 60, 240, 180, 60, 120, 60, 180, 240, 120], seed)  # all x 60
    clients = len(labels) // (shards * size) // 2
    parts = partition(labels, clients, "shard", np.random.default_rng(seed),
                      num_shards_per_partition=shards, shard_size=size)
    assert all(len(p) == shards * size for p in parts)
    assert _classes_held(labels, parts).max() <= shards
    for p in parts:                         # every shard of a client lies in one class
        counts = np.bincount(labels[p], minlength=K)
        assert np.all(counts % size == 0)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_shards_straddle_class_boundaries_otherwise_at_most_2s_classes(shards):
    sizes = [143, 146, 142, 146, 145, 146, 145, 143, 139, 136]   # no class below a shard
    worst = 0
    for seed in range(10):
        labels = _shuffled(sizes, seed)
        clients = 20
        parts = partition(labels, clients, "shard", np.random.default_rng(seed),
                          num_shards_per_partition=shards)
        size = len(labels) // (clients * shards)
        assert size <= min(sizes) and all(len(p) == shards * size for p in parts)
        held = _classes_held(labels, parts)
        assert held.max() <= 2 * shards
        worst = max(worst, int(held.max()))
    assert worst > shards          # the cuts do not follow the classes: S is no bound here


def test_a_class_smaller_than_a_shard_can_share_one_shard_with_two_others():
    labels = np.repeat(np.arange(3), [5, 2, 5])
    parts = partition(labels, 1, "shard", np.random.default_rng(0),
                      num_shards_per_partition=1, shard_size=12)
    assert sorted(np.unique(labels[parts[0]])) == [0, 1, 2]


def test_the_documented_class_bound_is_the_one_the_cuts_give():
    module = importlib.import_module("splitfed.data.partition")
    doc = " ".join(module.__doc__.split())
    assert "2 * ``num_shards_per_partition`` classes" in doc
    assert "a shard that spans a boundary holds two classes" in doc
