"""The server's own data in hybrid FL (paper 004, Sec. III-A and VI): a pool, and D_s^t.

Paper 004 gives the server a small data set D_s^t of constant size m_s that approximates
the population distribution and "changes with each global round t (while remaining fixed
within the global round)"; in the experiments it holds 1% (MNIST) or 5% (CIFAR) of the
training samples each round. Decision (docs/design.md, hybrid FL): m_s samples are drawn
every round from a population pool, IID by default, with an optional class-distribution
shift at a target cosine similarity (Fig. 7: about 0.95).

- The pool: ``round(fraction * N)`` of the N training samples (``server_data.fraction``,
  default 0.01; 0.05 for CIFAR), but at least ``min_per_class`` (default 10) times the
  number of classes: Assumption 2 wants D_s^t to approximate the population, which 1% of
  a small data set cannot (digits: 14 samples for 10 classes; the floor makes it 100).
  The floor does not bind for MNIST-like data (600) or CIFAR (2500); set it to 0 for the
  plain fraction. The pool is drawn without replacement once per run from the
  ``server_pool`` stream. IID: a uniform subset. With ``shift_cosine`` = rho: per-class
  counts from a class distribution p_s with cos(p_s, p) = rho, where p is the class
  distribution of the training set (see :func:`shifted_distribution`), rounded by largest
  remainders, each class's samples uniform within the class.
- Disjoint by default: the pool is the server's own data, so it is removed from the
  training set before the clients' partition (``server_data.disjoint``).
- D_s^t: ``samples_per_round`` = m_s samples drawn from the pool without replacement every
  round (:meth:`ServerData.draw`); the default (null) is the whole pool, the paper's
  m_s = 1% of the training set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitfed.errors import ConfigError


def cosine(p: np.ndarray, q: np.ndarray) -> float:
    """The cosine similarity of two non-negative vectors (class distributions or counts)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return float(p @ q / (np.linalg.norm(p) * np.linalg.norm(q)))


def class_distribution(labels: np.ndarray, num_classes: int) -> np.ndarray:
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)
    return counts / max(1, counts.sum())


def shifted_distribution(p: np.ndarray, target: float, rng: np.random.Generator,
                         tol: float = 1e-12) -> np.ndarray:
    """A class distribution q with cos(q, p) = ``target``, on the segment from p to a
    random extreme point.

    The far end e is a Dirichlet(1) draw over the classes p holds, or, if that is still
    closer to p than ``target``, the one-hot vector of a random least frequent of them
    (a class p lacks, absent from the training set, is never asked for). Along
    q(l) = (1 - l) p + l e the angle to p grows monotonically (the segment never passes
    the origin), so bisection on l finds the target. ConfigError if even the one-hot end
    is not far enough (p concentrated on one class).
    """
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    if target >= 1.0:
        return p.copy()
    present = np.flatnonzero(p > 0)     # a class the training set lacks cannot be drawn
    end = np.zeros_like(p)
    end[present] = rng.dirichlet(np.ones(present.size))
    if cosine(end, p) > target:
        rare = present[p[present] == p[present].min()]
        end = np.zeros_like(p)
        end[rng.choice(rare)] = 1.0
    if cosine(end, p) > target:
        raise ConfigError(f"server_data.shift_cosine: {target} cannot be reached; the "
                          f"farthest class distribution has cosine {cosine(end, p):.4f}")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if cosine((1 - mid) * p + mid * end, p) > target:
            lo = mid
        else:
            hi = mid
    return (1 - hi) * p + hi * end


def largest_remainder(total: int, probs: np.ndarray) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``probs`` (Hamilton's method)."""
    exact = total * np.asarray(probs, dtype=np.float64) / np.sum(probs)
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


def carve_pool(labels: np.ndarray, size: int, rng: np.random.Generator, *,
               num_classes: int, shift_cosine: float | None = None) -> np.ndarray:
    """Sorted indices of ``size`` training samples for the server's pool."""
    labels = np.asarray(labels, dtype=np.int64)
    if shift_cosine is None:
        return np.sort(rng.choice(len(labels), size=size, replace=False))
    target = shifted_distribution(class_distribution(labels, num_classes), shift_cosine, rng)
    counts = largest_remainder(size, target)
    chosen = []
    for c in range(num_classes):
        members = np.flatnonzero(labels == c)
        if counts[c] > len(members):
            raise ConfigError(f"server_data.fraction: the shifted pool needs {counts[c]} "
                              f"samples of class {c}, the training set has {len(members)}; "
                              "lower server_data.fraction or raise server_data.shift_cosine "
                              "(the shift draws its class mix at random: another seed may "
                              "also fit)")
        chosen.append(rng.choice(members, size=int(counts[c]), replace=False))
    return np.sort(np.concatenate(chosen))


@dataclass
class ServerData:
    """The server's pool (indices into the training set) and its per-round draws."""

    pool: np.ndarray
    samples_per_round: int
    full_batch: bool
    x: torch.Tensor                  # the training inputs (the pool indexes into them)
    y: torch.Tensor

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """D_s^t: m_s pool indices drawn without replacement (sorted); the whole pool
        when m_s equals its size (nothing is drawn from ``rng`` then)."""
        if self.samples_per_round >= len(self.pool):
            return self.pool.copy()
        return np.sort(rng.choice(self.pool, size=self.samples_per_round, replace=False))

    def class_distribution(self, num_classes: int) -> np.ndarray:
        return class_distribution(self.y[torch.from_numpy(self.pool).to(self.y.device)]
                                  .cpu().numpy(), num_classes)


def build_server_data(cfg, train, num_classes: int, rng: np.random.Generator) -> ServerData:
    """The server's pool from a :class:`~splitfed.config.ServerDataConfig`."""
    n = len(train)
    size = max(int(round(cfg.fraction * n)), int(cfg.min_per_class) * num_classes)
    if not 1 <= size < n:
        raise ConfigError(f"server_data.fraction: a pool of {size} samples (fraction "
                          f"{cfg.fraction}, min_per_class {cfg.min_per_class}) out of {n} "
                          "training samples; it needs at least 1 and must leave clients data")
    m_s = size if cfg.samples_per_round is None else int(cfg.samples_per_round)
    if m_s > size:
        raise ConfigError(f"server_data.samples_per_round: {m_s} exceeds the pool of {size} "
                          f"samples (server_data.fraction={cfg.fraction} of {n})")
    labels = train.y.cpu().numpy()
    pool = carve_pool(labels, size, rng, num_classes=num_classes,
                      shift_cosine=cfg.shift_cosine)
    return ServerData(pool=pool, samples_per_round=m_s, full_batch=bool(cfg.full_batch),
                      x=train.x, y=train.y)
