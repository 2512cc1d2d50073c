"""Paper 003's partitions (docs/design.md, Paper 003 partitions): the label-Dirichlet
partition with the self-balancing cap and the redraw loop of NIID-Bench (which the paper's
public code uses), and McMahan's shards for the balanced "C = #" partitions, on the
paper's scale (1000 clients, 60,000 Fashion-MNIST labels)."""

import numpy as np
import pytest

from splitfed.data.partition import dirichlet, partition, partition_stats
from splitfed.errors import ConfigError


class ScriptedRng:
    """Identity shuffles and the given Dirichlet proportions, one array per class."""

    def __init__(self, proportions):
        self.proportions = [np.asarray(p, dtype=float) for p in proportions]

    def permutation(self, n):
        return np.arange(n)

    def dirichlet(self, alpha):
        p = self.proportions.pop(0)
        assert p.shape == np.shape(alpha)
        return p


LABELS = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])          # 3 classes, 9 samples, 3 clients
DRAW = [[0.75, 0.125, 0.125], [0.25, 0.25, 0.5], [0.375, 0.125, 0.5]]


def test_self_balancing_by_hand():
    # N / K = 3. class 0: cuts floor(3 * [0.75, 0.875]) = [2, 2] -> counts [2, 0, 1];
    # class 1: floor(3 * [0.25, 0.5]) = [0, 1] -> [0, 1, 2]; now client 2 holds 3 >= 3, so
    # class 2 uses [0.375, 0.125, 0] / 0.5 = [0.75, 0.25, 0]: floor(3 * [0.75, 1]) = [2, 3]
    # -> [2, 1, 0]. Sizes [4, 2, 3].
    parts = dirichlet(LABELS, 3, ScriptedRng(DRAW), alpha=1.0, min_partition_size=0,
                      self_balancing=True)
    assert [p.tolist() for p in parts] == [[0, 1, 6, 7], [3, 8], [2, 4, 5]]


def test_without_the_cap_by_hand():
    # class 2 uncapped: floor(3 * [0.375, 0.5]) = [1, 1] -> [1, 0, 2]. Sizes [3, 1, 5].
    parts = dirichlet(LABELS, 3, ScriptedRng(DRAW), alpha=1.0, min_partition_size=0)
    assert [p.tolist() for p in parts] == [[0, 1, 6], [3], [2, 4, 5, 7, 8]]


def test_redraws_until_every_client_has_the_minimum():
    second = [[1 / 3, 1 / 3, 1 / 3]] * 3                  # one sample of each class each
    parts = dirichlet(LABELS, 3, ScriptedRng(DRAW + second), alpha=1.0,
                      min_partition_size=2, max_tries=2)
    assert [p.tolist() for p in parts] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_gives_up_and_names_the_best_draw():
    with pytest.raises(ConfigError, match=r"max_tries=1 .* smallest client held 1\)"):
        dirichlet(LABELS, 3, ScriptedRng(DRAW), alpha=1.0, min_partition_size=2,
                  max_tries=1)


def _niid_bench_owners(labels, num_clients, proportions):
    """The label-Dirichlet loop as NIID-Bench and paper 003's public code write it: class
    by class, zero the proportion of every client already holding at least the average,
    renormalise, cut the class at the truncated cumulative proportions."""
    per_client = [[] for _ in range(num_clients)]
    for k, p in enumerate(proportions):
        idx = np.flatnonzero(labels == k)
        p = np.array([q * (len(c) < len(labels) / num_clients) for q, c in zip(p, per_client)])
        p = p / p.sum()
        cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
        for c, chunk in zip(per_client, np.split(idx, cuts)):
            c.extend(chunk.tolist())
    return [sorted(c) for c in per_client]


@pytest.mark.parametrize("alpha", [0.2, 0.5, 5.0])
def test_same_cut_as_the_reference_loop(alpha):
    labels = np.repeat(np.arange(10), 30)
    props = np.random.default_rng(7).dirichlet(np.full(40, alpha), size=10)
    ours = dirichlet(labels, 40, ScriptedRng(props), alpha=alpha, min_partition_size=0,
                     self_balancing=True)
    assert [p.tolist() for p in ours] == _niid_bench_owners(labels, 40, props)


FMNIST = np.repeat(np.arange(10), 6000)                 # Fashion-MNIST's training labels


@pytest.mark.parametrize("c", [2, 5])
def test_shards_give_sixty_samples_of_at_most_c_classes(c):
    parts = partition(FMNIST, 1000, "shard", np.random.default_rng(0),
                      num_shards_per_partition=c)
    counts = partition_stats(parts, FMNIST, 10)
    assert (counts.sum(1) == 60).all()
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(60000))
    assert ((counts > 0).sum(1) <= c).all()
    assert (counts % (60 // c) == 0).all()               # whole shards of 60 / C samples
    # two shards of one class are rare for C = 2 (about 10% of clients) and common for
    # C = 5 (about 70%): "most clients" hold exactly C classes only for C = 2
    exactly = ((counts > 0).sum(1) == c).mean()
    assert exactly > 0.8 if c == 2 else 0.2 < exactly < 0.45


def test_dirichlet_half_at_paper_scale_is_unbalanced_with_min_ten():
    parts = partition(FMNIST, 1000, "dirichlet", np.random.default_rng(0), alpha=0.5,
                      self_balancing=True, min_partition_size=10, max_tries=100)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == 60000 and sizes.min() >= 10 and sizes.max() > 60


def test_dirichlet_point_two_cannot_reach_ten_per_client():
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match=r"smallest client held [0-9]\)"):
        partition(FMNIST, 1000, "dirichlet", rng, alpha=0.2, self_balancing=True,
                  min_partition_size=10, max_tries=20)
    parts = partition(FMNIST, 1000, "dirichlet", rng, alpha=0.2, self_balancing=True,
                      min_partition_size=1, max_tries=100)
    assert min(len(p) for p in parts) >= 1
