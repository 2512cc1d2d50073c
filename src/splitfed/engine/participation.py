"""Which clients take part in a round, and with what aggregation weight.

Base weights (docs/design.md, "Aggregation and participation"): a_n = D_n / sum_m D_m
(``weighting="data_size"``, the default) or a_n = 1 / N (``weighting="uniform"``).
Only participating clients are averaged; a round never waits for clients that were not
sampled. A sampler draws a :class:`Cohort` from the generator it is handed and never
reseeds.

Modes (``make_sampler(mode, ...)``):

- ``full``: every client, weights a_n.
- ``uniform``: M of N without replacement, weights a_n / sum_{S} a_m.
- ``with_replacement``: M i.i.d. uniform draws (paper 000), weights normalised over slots.
- ``bernoulli``: client n joins with probability q_n, weights a_n / q_n (paper 002 eq. 3).

Engines aggregate in the delta form x <- x + sum_s w_s (x_s - x) (see :class:`Cohort`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from splitfed.configtools import as_number, check_float_range, show
from splitfed.errors import ConfigError

WEIGHTINGS = ("data_size", "uniform")


@dataclass(frozen=True, eq=False)
class Cohort:
    """The clients of one round: one slot per participation, with its aggregation weight.

    ``ids`` (int64) may repeat under ``with_replacement``; each slot then trains and is
    aggregated separately. The new global model is

        x_new = x + sum_s weights[s] * (x_s - x)
              = sum_s weights[s] * x_s + (1 - sum_s weights[s]) * x,

    where x is the round's global model and x_s the model slot s returns. For ``full``,
    ``uniform`` and ``with_replacement`` the weights sum to 1 and this is the weighted
    average sum_s weights[s] * x_s. For ``bernoulli`` they do not (see
    :class:`BernoulliSampler`). An empty cohort leaves the model unchanged. Both arrays
    are read-only.
    """

    ids: np.ndarray
    weights: np.ndarray

    def __post_init__(self):
        ids = np.array(self.ids, dtype=np.int64).reshape(-1)
        weights = np.array(self.weights, dtype=np.float64).reshape(-1)
        if ids.shape != weights.shape:
            raise ValueError(f"ids {ids.shape} and weights {weights.shape} differ in length")
        ids.setflags(write=False)
        weights.setflags(write=False)
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "weights", weights)

    @property
    def size(self) -> int:
        """Number of slots (participations), counting repeats."""
        return int(self.ids.size)

    def is_empty(self) -> bool:
        return self.size == 0


#: the cohort of a round in which the server alone trains: no client takes part
NOBODY = Cohort(np.zeros(0, dtype=np.int64), np.zeros(0))


class ParticipationSampler(Protocol):
    def sample(self, rng: np.random.Generator) -> Cohort: ...


def base_weights(data_sizes: Sequence[float] | np.ndarray, weighting: str) -> np.ndarray:
    """a_n: D_n / sum D for ``"data_size"``, 1 / N for ``"uniform"`` (float64, sums to 1).

    ConfigError if ``weighting`` is unknown, or ``data_sizes`` is empty, not 1-D, not
    finite, has a negative entry or (for ``"data_size"``) sums to zero.
    """
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"weighting: unknown value {weighting!r}; allowed: "
                          + ", ".join(WEIGHTINGS))
    sizes = _data_sizes(data_sizes)
    if weighting == "uniform":
        return np.full(sizes.size, 1.0 / sizes.size)
    if sizes.sum() <= 0:
        raise ConfigError("data_sizes: total is zero; data_size weighting needs data")
    return sizes / sizes.sum()


def _data_sizes(data_sizes) -> np.ndarray:
    try:
        sizes = np.asarray(data_sizes, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"data_sizes: expected numbers, got {data_sizes!r}") from err
    if sizes.ndim != 1 or sizes.size == 0:
        raise ConfigError(f"data_sizes: expected a non-empty list, got shape {sizes.shape}")
    if not np.all(np.isfinite(sizes)) or np.any(sizes < 0):
        raise ConfigError(f"data_sizes: must be finite and >= 0, got {sizes.tolist()}")
    return sizes


def _normalised(a: np.ndarray) -> np.ndarray:
    """``a / a.sum()``; all zeros if the sum is zero (every sampled client holds no data)."""
    total = a.sum()
    return a / total if total > 0 else np.zeros_like(a)


def _reject_unused(mode: str, **given) -> None:
    for name, value in given.items():
        if value is not None:
            raise ConfigError(f"{name}: unused by participation mode {mode!r}; "
                              "leave it unset (null)")


def _clients_per_round(value, mode: str, upper: int | None) -> int:
    bound = f"1..{upper}" if upper is not None else ">= 1"
    if value is None:
        raise ConfigError(f"clients_per_round: required by participation mode {mode!r} "
                          f"(allowed: {bound})")
    ok_type = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok_type or value < 1 or (upper is not None and value > upper):
        raise ConfigError(f"clients_per_round: must be an integer in {bound} for mode "
                          f"{mode!r}, got {value!r}")
    return int(value)


class FullSampler:
    """Every client every round, ids ascending, weights a_n. Draws nothing from ``rng``."""

    def __init__(self, base: np.ndarray):
        self.base = np.asarray(base, dtype=np.float64)

    @classmethod
    def from_options(cls, base: np.ndarray, *, clients_per_round=None, q=None) -> FullSampler:
        _reject_unused("full", clients_per_round=clients_per_round, q=q)
        return cls(base)

    def sample(self, rng: np.random.Generator) -> Cohort:
        return Cohort(np.arange(self.base.size), self.base)


class UniformSampler:
    """M of N clients without replacement, ids ascending, weights a_n / sum_{m in S} a_m."""

    def __init__(self, base: np.ndarray, clients_per_round: int):
        self.base = np.asarray(base, dtype=np.float64)
        self.m = _clients_per_round(clients_per_round, "uniform", self.base.size)

    @classmethod
    def from_options(cls, base, *, clients_per_round=None, q=None) -> UniformSampler:
        _reject_unused("uniform", q=q)
        return cls(base, clients_per_round)

    def sample(self, rng: np.random.Generator) -> Cohort:
        ids = np.sort(rng.choice(self.base.size, size=self.m, replace=False))
        return Cohort(ids, _normalised(self.base[ids]))


class WithReplacementSampler:
    """M i.i.d. uniform draws from the N clients (paper 000, Algorithm 1).

    Ids are in draw order and may repeat; every slot counts: w_s = a_{id_s} / sum_r
    a_{id_r}. Paper 000 Algorithm 1 (line 6) divides by the sample size m instead; we
    divide by the sample's weight sum so that the weights always sum to 1 (docs/design.md). M may
    exceed N.
    """

    def __init__(self, base: np.ndarray, clients_per_round: int):
        self.base = np.asarray(base, dtype=np.float64)
        self.m = _clients_per_round(clients_per_round, "with_replacement", None)

    @classmethod
    def from_options(cls, base, *, clients_per_round=None, q=None) -> WithReplacementSampler:
        _reject_unused("with_replacement", q=q)
        return cls(base, clients_per_round)

    def sample(self, rng: np.random.Generator) -> Cohort:
        ids = rng.integers(0, self.base.size, size=self.m)
        return Cohort(ids, _normalised(self.base[ids]))


class BernoulliSampler:
    """Client n joins independently with probability q_n (paper 002, Sec. 2.3).

    Weights are w_n = a_n / q_n, not normalised. Paper 002 eq. (3) writes the aggregate
    as x_new = sum_{n in P(q)} (a_n / q_n) x_n, an unbiased estimate of sum_n a_n x_n
    since E[1{n in P} / q_n] = 1. Engines should use the delta form
    x_new = x + sum_n w_n (x_n - x): it has the same expectation (E[sum_n w_n] = 1) and
    stays well-defined when the weights do not sum to 1; in particular an empty cohort
    (possible whenever some q_n < 1) keeps the model, as docs/design.md records, where eq. (3)
    taken literally would give zero. Ids ascending; one uniform draw per client per round.
    """

    def __init__(self, base: np.ndarray, q: float | Sequence[float] | np.ndarray):
        self.base = np.asarray(base, dtype=np.float64)
        self.q = _probabilities(q, self.base.size)

    @classmethod
    def from_options(cls, base, *, clients_per_round=None, q=None) -> BernoulliSampler:
        _reject_unused("bernoulli", clients_per_round=clients_per_round)
        return cls(base, q)

    def sample(self, rng: np.random.Generator) -> Cohort:
        ids = np.flatnonzero(rng.random(self.base.size) < self.q)
        return Cohort(ids, self.base[ids] / self.q[ids])


def _probabilities(q, n: int) -> np.ndarray:
    if q is None:
        raise ConfigError("q: required by participation mode 'bernoulli' (a number in (0, 1] "
                          f"or a list of {n})")
    if isinstance(q, np.ndarray):                # (a program's, not a config's)
        q = q.tolist()
    if isinstance(q, bool) or (isinstance(q, (list, tuple))
                              and any(isinstance(v, bool) for v in q)):
        raise ConfigError(f"q: expected a number or a list of numbers, got {show(q)} (true "
                          "and false are not probabilities)")
    many = isinstance(q, (list, tuple))
    items = list(q) if many else [q]
    numbers = [as_number(v) for v in items]     # a number's text too (YAML reads 1e-3 so)
    if any(v is None for v in numbers):
        raise ConfigError(f"q: expected a number or a list of numbers, got {show(q)}")
    for i, (v, given) in enumerate(zip(numbers, items)):
        check_float_range(v, f"q[{i}]" if many else "q", given)
    arr = np.asarray(numbers if many else numbers[0], dtype=np.float64)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.size != n):
        raise ConfigError(f"q: expected a number or a list of {n} numbers (one per client), "
                          f"got {show(q)}")
    if not np.all((arr > 0) & (arr <= 1)):
        raise ConfigError(f"q: every probability must be in (0, 1], got {show(q)}")
    return np.broadcast_to(arr, (n,)).copy()


SAMPLERS: dict[str, type] = {
    "full": FullSampler,
    "uniform": UniformSampler,
    "with_replacement": WithReplacementSampler,
    "bernoulli": BernoulliSampler,
}


def sampler_names() -> list[str]:
    """The participation modes, in registry order."""
    return list(SAMPLERS)


def make_sampler(
    mode: str,
    num_clients: int,
    data_sizes: Sequence[float] | np.ndarray,
    *,
    clients_per_round: int | None = None,
    q: float | Sequence[float] | None = None,
    weighting: str = "data_size",
) -> ParticipationSampler:
    """Build the sampler for ``mode`` over ``num_clients`` clients holding ``data_sizes``.

    ``clients_per_round`` (M) is required by ``uniform`` (1 <= M <= N) and
    ``with_replacement`` (M >= 1); ``q`` (a number or one per client, each in (0, 1]) by
    ``bernoulli``. An option a mode does not use must be None. Every violation raises
    ConfigError naming the option and what is allowed.
    """
    if mode not in SAMPLERS:
        raise ConfigError(f"mode: unknown participation mode {mode!r}; allowed: "
                          + ", ".join(SAMPLERS))
    base = base_weights(data_sizes, weighting)
    if base.size != num_clients:
        raise ConfigError(f"data_sizes: expected {num_clients} entries (one per client), "
                          f"got {base.size}")
    return SAMPLERS[mode].from_options(base, clients_per_round=clients_per_round, q=q)
