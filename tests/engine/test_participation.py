"""Tests of the participation samplers (splitfed.engine.participation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitfed.engine.participation import (
    SAMPLERS,
    Cohort,
    base_weights,
    make_sampler,
    sampler_names,
)
from splitfed.errors import ConfigError

SIZES = [10, 20, 30, 40]  # a = [0.1, 0.2, 0.3, 0.4]


class ScriptedRng:
    """Stands in for np.random.Generator and returns fixed draws."""

    def __init__(self, choice=None, integers=None, random=None):
        self._choice, self._integers, self._random = choice, integers, random

    def choice(self, n, size, replace):
        assert (n, size, replace) == (4, len(self._choice), False)
        return np.array(self._choice)

    def integers(self, low, high, size):
        assert (low, high, size) == (0, 4, len(self._integers))
        return np.array(self._integers)

    def random(self, size):
        assert size == 4
        return np.array(self._random)


def test_base_weights():
    np.testing.assert_allclose(base_weights(SIZES, "data_size"), [0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(base_weights(SIZES, "uniform"), [0.25] * 4)


def test_full_hand_computed():
    cohort = make_sampler("full", 4, SIZES).sample(np.random.default_rng(0))
    assert cohort.ids.tolist() == [0, 1, 2, 3] and cohort.ids.dtype == np.int64
    np.testing.assert_allclose(cohort.weights, [0.1, 0.2, 0.3, 0.4])
    uniform = make_sampler("full", 4, SIZES, weighting="uniform").sample(None)
    np.testing.assert_allclose(uniform.weights, [0.25] * 4)


def test_uniform_hand_computed():
    sampler = make_sampler("uniform", 4, SIZES, clients_per_round=2)
    cohort = sampler.sample(ScriptedRng(choice=[3, 1]))
    assert cohort.ids.tolist() == [1, 3]
    np.testing.assert_allclose(cohort.weights, [0.2 / 0.6, 0.4 / 0.6])


def test_with_replacement_hand_computed():
    sampler = make_sampler("with_replacement", 4, SIZES, clients_per_round=3)
    cohort = sampler.sample(ScriptedRng(integers=[2, 2, 0]))
    assert cohort.ids.tolist() == [2, 2, 0]
    np.testing.assert_allclose(cohort.weights, [3 / 7, 3 / 7, 1 / 7])


def test_bernoulli_hand_computed():
    sampler = make_sampler("bernoulli", 4, SIZES, q=[0.5, 0.5, 0.25, 1.0])
    cohort = sampler.sample(ScriptedRng(random=[0.05, 0.9, 0.3, 0.6]))
    assert cohort.ids.tolist() == [0, 3]
    np.testing.assert_allclose(cohort.weights, [0.1 / 0.5, 0.4 / 1.0])  # not normalised


def test_bernoulli_scalar_q_applies_to_all():
    sampler = make_sampler("bernoulli", 4, SIZES, q=0.5, weighting="uniform")
    cohort = sampler.sample(ScriptedRng(random=[0.1, 0.7, 0.2, 0.5]))
    assert cohort.ids.tolist() == [0, 2]
    np.testing.assert_allclose(cohort.weights, [0.5, 0.5])


@pytest.mark.parametrize("mode, opts", [("full", {}), ("uniform", {"clients_per_round": 2}),
                                        ("with_replacement", {"clients_per_round": 3}),
                                        ("bernoulli", {"q": [0.3, 0.5, 0.7, 0.9]})])
def test_same_seed_same_cohorts(mode, opts):
    def draws(seed):
        sampler, rng = make_sampler(mode, 4, SIZES, **opts), np.random.default_rng(seed)
        return [(c.ids.tolist(), c.weights.tolist()) for c in
                (sampler.sample(rng) for _ in range(20))]
    assert draws(7) == draws(7)
    if mode != "full":
        assert draws(7) != draws(8)


def test_uniform_gives_exactly_m_distinct_ids():
    sampler, rng = make_sampler("uniform", 10, range(1, 11), clients_per_round=4), \
        np.random.default_rng(1)
    for _ in range(200):
        cohort = sampler.sample(rng)
        assert cohort.size == 4 and len(set(cohort.ids.tolist())) == 4
        assert np.all(np.diff(cohort.ids) > 0)
        assert cohort.weights.sum() == pytest.approx(1.0)


def test_with_replacement_duplicates_counted_and_normalised():
    sampler = make_sampler("with_replacement", 4, SIZES, clients_per_round=10)
    cohort = sampler.sample(np.random.default_rng(2))
    assert cohort.size == 10 and len(set(cohort.ids.tolist())) < 10  # pigeonhole
    assert cohort.weights.sum() == pytest.approx(1.0)
    a = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(cohort.weights, a[cohort.ids] / a[cohort.ids].sum())


def test_bernoulli_is_unbiased_monte_carlo():
    q = np.array([0.2, 0.5, 0.8, 1.0])
    v = np.array([1.0, -2.0, 3.0, 0.5])
    a = np.array([0.1, 0.2, 0.3, 0.4])
    target = float(np.dot(a, v))  # 0.8
    sampler, rng = make_sampler("bernoulli", 4, SIZES, q=q), np.random.default_rng(12345)
    n = 50_000
    cohorts = [sampler.sample(rng) for _ in range(n)]
    estimates = [float(np.dot(c.weights, v[c.ids])) for c in cohorts]
    # the estimate sum_n I_n a_n v_n / q_n (independent I_n ~ Bernoulli(q_n)) has variance
    # sum a^2 v^2 (1 - q) / q (0.4025; the weights' sum: v = 1, 0.1025); the mean of n
    # draws is within 5 standard errors, sqrt(variance / n), of its expectation
    def five_se(values):
        return 5 * math.sqrt(float(np.sum(a**2 * values**2 * (1 - q) / q)) / n)
    assert abs(np.mean(estimates) - target) <= five_se(v)
    assert abs(np.mean([c.weights.sum() for c in cohorts]) - 1.0) <= five_se(np.ones(4))


def test_bernoulli_empty_cohort_possible():
    sampler, rng = make_sampler("bernoulli", 4, SIZES, q=0.01), np.random.default_rng(3)
    cohorts = [sampler.sample(rng) for _ in range(50)]
    empty = [c for c in cohorts if c.is_empty()]
    assert empty and empty[0].size == 0 and empty[0].weights.shape == (0,)


def test_cohort_is_read_only():
    cohort = make_sampler("full", 4, SIZES).sample(None)
    with pytest.raises(ValueError):
        cohort.weights[0] = 1.0


def test_cohort_construction():
    cohort = Cohort(ids=[2, 2], weights=[0.5, 0.5])
    assert cohort.ids.dtype == np.int64 and cohort.weights.dtype == np.float64
    assert cohort.size == 2 and not cohort.is_empty()
    assert Cohort(ids=[], weights=[]).is_empty()
    with pytest.raises(ValueError, match="differ in length"):
        Cohort(ids=[0, 1], weights=[1.0])


def test_registry():
    assert sampler_names() == ["full", "uniform", "with_replacement", "bernoulli"]
    assert set(SAMPLERS) == set(sampler_names())


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("mode, n, sizes, opts, words", [
    ("random", 4, SIZES, {}, ["mode", "full, uniform, with_replacement, bernoulli"]),
    ("uniform", 4, SIZES, {}, ["clients_per_round", "required", "1..4"]),
    ("uniform", 4, SIZES, {"clients_per_round": 5}, ["clients_per_round", "1..4"]),
    ("uniform", 4, SIZES, {"clients_per_round": 0}, ["clients_per_round", "1..4"]),
    ("uniform", 4, SIZES, {"clients_per_round": 2.0}, ["clients_per_round", "integer"]),
    ("uniform", 4, SIZES, {"clients_per_round": True}, ["clients_per_round"]),
    ("with_replacement", 4, SIZES, {}, ["clients_per_round", "required"]),
    ("with_replacement", 4, SIZES, {"clients_per_round": 0}, ["clients_per_round", ">= 1"]),
    ("full", 4, SIZES, {"clients_per_round": 2}, ["clients_per_round", "unused"]),
    ("bernoulli", 4, SIZES, {"q": 0.5, "clients_per_round": 2}, ["clients_per_round", "unused"]),
    ("bernoulli", 4, SIZES, {}, ["q", "required", "(0, 1]"]),
    ("bernoulli", 4, SIZES, {"q": 0.0}, ["q", "(0, 1]"]),
    ("bernoulli", 4, SIZES, {"q": 1.5}, ["q", "(0, 1]"]),
    ("bernoulli", 4, SIZES, {"q": [0.5, 0.5, 0.5, -0.1]}, ["q", "(0, 1]"]),
    ("bernoulli", 4, SIZES, {"q": float("nan")}, ["q", "(0, 1]"]),
    ("bernoulli", 4, SIZES, {"q": [0.5, 0.5]}, ["q", "list of 4"]),
    ("bernoulli", 4, SIZES, {"q": "often"}, ["q", "number"]),
    ("bernoulli", 4, SIZES, {"q": True}, ["q", "number"]),
    ("uniform", 4, SIZES, {"clients_per_round": 2, "q": 0.5}, ["q", "unused"]),
    ("full", 4, SIZES, {"q": 0.5}, ["q", "unused"]),
    ("full", 3, SIZES, {}, ["data_sizes", "expected 3"]),
    ("full", 4, [10, -1, 3, 4], {}, ["data_sizes", ">= 0"]),
    ("full", 4, [0, 0, 0, 0], {}, ["data_sizes", "zero"]),
    ("full", 4, [], {}, ["data_sizes", "non-empty"]),
    ("full", 4, [[1, 2], [3, 4]], {}, ["data_sizes"]),
    ("full", 4, ["a", 1, 2, 3], {}, ["data_sizes"]),
    ("full", 4, SIZES, {"weighting": "equal"}, ["weighting", "data_size, uniform"]),
])
def test_invalid_options(mode, n, sizes, opts, words):
    with pytest.raises(ConfigError) as info:
        make_sampler(mode, n, sizes, **opts)
    for word in words:
        assert word in str(info.value)


def test_zero_sizes_allowed_with_uniform_weighting():
    cohort = make_sampler("full", 2, [0, 0], weighting="uniform").sample(None)
    np.testing.assert_allclose(cohort.weights, [0.5, 0.5])


def test_sampled_clients_without_data_get_zero_weights():
    sampler = make_sampler("uniform", 4, [0, 0, 5, 5], clients_per_round=2)
    cohort = sampler.sample(ScriptedRng(choice=[1, 0]))
    assert cohort.weights.tolist() == [0.0, 0.0]  # delta form keeps the model


# ---------------------------------------------------------------- properties


@st.composite
def setups(draw):
    sizes = draw(st.lists(st.integers(1, 1000), min_size=1, max_size=12))
    n = len(sizes)
    mode = draw(st.sampled_from(sampler_names()))
    opts = {"weighting": draw(st.sampled_from(["data_size", "uniform"]))}
    if mode == "uniform":
        opts["clients_per_round"] = draw(st.integers(1, n))
    elif mode == "with_replacement":
        opts["clients_per_round"] = draw(st.integers(1, 3 * n))
    elif mode == "bernoulli":
        prob = st.floats(0.01, 1.0)
        opts["q"] = draw(prob | st.lists(prob, min_size=n, max_size=n))
    return mode, n, sizes, opts, draw(st.integers(0, 2**32))


@given(setups())
def test_property_cohort_invariants(setup):
    mode, n, sizes, opts, seed = setup
    cohort = make_sampler(mode, n, sizes, **opts).sample(np.random.default_rng(seed))
    assert cohort.ids.shape == cohort.weights.shape
    assert np.all(cohort.weights >= 0)
    assert np.all((cohort.ids >= 0) & (cohort.ids < n))
    if mode != "bernoulli":
        assert cohort.weights.sum() == pytest.approx(1.0)
        assert cohort.size == opts.get("clients_per_round", n)
    if mode != "with_replacement":
        assert np.all(np.diff(cohort.ids) > 0)



def test_a_deadline_is_refused_with_sampling_with_replacement():
    """A client drawn twice is one device, late or not by its last upload; the round would
    learn that only after aggregating its first slots (and chunking would decide which),
    so the two are refused together, naming both keys, before anything runs."""
    from helpers import digits_config

    from splitfed.cli import main

    with pytest.raises(ConfigError, match=r"^clock\.deadline: not with participation\.mode "
                                          r"with_replacement .*set clock\.deadline=null"):
        digits_config(participation={"mode": "with_replacement", "clients_per_round": 3},
                      clock={"deadline": 1.0})
    digits_config(participation={"mode": "with_replacement", "clients_per_round": 3})
    digits_config(participation={"mode": "uniform", "clients_per_round": 2},
                  clock={"deadline": 1.0})
    assert main(["run", "quick_digits", "participation.mode=with_replacement",
                 "participation.clients_per_round=3", "clock.deadline=1", "--dry-run"]) == 2
