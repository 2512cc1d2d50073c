"""The server's pool and per-round draws D_s^t (paper 004; splitfed.data.server_data)."""

import numpy as np
import pytest
from helpers import digits_config

from splitfed.config import load_config
from splitfed.data.server_data import (
    class_distribution,
    cosine,
    largest_remainder,
    shifted_distribution,
)
from splitfed.errors import ConfigError
from splitfed.experiment import build_environment
from splitfed.rng import RandomStreams

HYBRID = {"name": "clgsgd"}


def env_for(**over):
    return build_environment(digits_config(**{"algorithm": HYBRID, **over}))


def test_pool_size_is_disjoint_from_the_clients_and_deterministic():
    env = env_for(server_data={"fraction": 0.1})
    n = len(env.data.train)
    pool = env.server_data.pool
    assert len(pool) == round(0.1 * n) == len(np.unique(pool))
    clients = np.concatenate(env.client_indices)
    assert not np.intersect1d(pool, clients).size
    assert np.array_equal(np.sort(np.concatenate([pool, clients])), np.arange(n))
    again = env_for(server_data={"fraction": 0.1})
    assert np.array_equal(again.server_data.pool, pool)
    assert all(np.array_equal(a, b) for a, b in zip(again.client_indices, env.client_indices))
    other = env_for(server_data={"fraction": 0.1}, seed=4)
    assert not np.array_equal(other.server_data.pool, pool)


def test_default_pool_is_one_percent_with_a_per_class_floor():
    env = env_for()
    assert len(env.server_data.pool) == 100            # 1% of 1438 is 14 < 10 per class
    assert env.server_data.samples_per_round == 100
    plain = env_for(server_data={"min_per_class": 0})
    assert len(plain.server_data.pool) == round(0.01 * len(plain.data.train)) == 14


def test_only_hybrid_algorithms_get_a_pool_unless_asked():
    base = build_environment(digits_config())
    assert base.server_data is None
    assert sum(len(i) for i in base.client_indices) == len(base.data.train)
    kept = env_for(server_data={"disjoint": False})
    assert all(np.array_equal(a, b) for a, b in zip(kept.client_indices, base.client_indices))
    always = build_environment(digits_config(server_data={"always": True}))
    hybrid = env_for()
    assert np.array_equal(always.server_data.pool, hybrid.server_data.pool)
    assert all(np.array_equal(a, b)
               for a, b in zip(always.client_indices, hybrid.client_indices))


def test_draws_are_deterministic_for_a_seed_and_have_m_s_samples():
    env = env_for(server_data={"fraction": 0.1, "samples_per_round": 30})
    server = env.server_data

    def draws(seed):
        rng = RandomStreams(seed).numpy("server_data")
        return [server.draw(rng) for _ in range(4)]

    first, second = draws(7), draws(7)
    for a, b in zip(first, second):
        assert np.array_equal(a, b)
        assert len(a) == 30 == len(np.unique(a))
        assert np.isin(a, server.pool).all()
    assert not np.array_equal(first[0], first[1])      # D_s^t changes every round
    assert not np.array_equal(first[0], draws(8)[0])


def test_whole_pool_draw_consumes_no_randomness():
    server = env_for().server_data
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert np.array_equal(server.draw(rng), server.pool)
    assert rng.bit_generator.state == state


@pytest.mark.parametrize("target", [0.8, 0.95, 0.99])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shifted_distribution_hits_the_target_cosine(target, seed):
    p = np.array([0.05, 0.1, 0.15, 0.2, 0.1, 0.1, 0.1, 0.05, 0.1, 0.05])
    q = shifted_distribution(p, target, np.random.default_rng(seed))
    assert (q >= 0).all() and abs(q.sum() - 1) < 1e-12
    assert abs(cosine(q, p) - target) < 1e-9


@pytest.mark.parametrize("target", [0.5, 0.8, 0.95])
def test_a_shift_never_asks_for_a_class_the_training_set_lacks(target):
    """The far end of the shift is drawn over the classes present (with a class absent,
    the pool would need samples of it, and carving it failed at random)."""
    p = np.array([0.3, 0.0, 0.2, 0.0, 0.5])
    for seed in range(50):
        q = shifted_distribution(p, target, np.random.default_rng(seed))
        assert q[1] == 0 and q[3] == 0 and abs(cosine(q, p) - target) < 1e-9


def test_unreachable_shift_is_refused():
    with pytest.raises(ConfigError, match="shift_cosine"):
        shifted_distribution(np.array([0.5, 0.5]), 0.5, np.random.default_rng(0))


def test_shifted_pool_reaches_the_target_cosine():
    env = env_for(server_data={"fraction": 0.3, "shift_cosine": 0.95})
    population = class_distribution(env.data.train.y.numpy(), 10)
    got = cosine(env.server_data.class_distribution(10), population)
    assert abs(got - 0.95) < 0.005
    iid = env_for(server_data={"fraction": 0.3})
    assert cosine(iid.server_data.class_distribution(10), population) > 0.98
    # the default pool (100 samples) is shifted as well, up to rounding
    small = env_for(server_data={"shift_cosine": 0.95})
    assert abs(cosine(small.server_data.class_distribution(10), population) - 0.95) < 0.02


def test_largest_remainder_sums_to_the_total():
    counts = largest_remainder(101, np.array([0.3, 0.3, 0.4]))
    assert counts.sum() == 101 and counts.tolist() == [30, 30, 41]


@pytest.mark.parametrize("server_data,key", [
    ({"samples_per_round": 101}, "server_data.samples_per_round"),
    ({"fraction": 0.9, "min_per_class": 150}, "server_data.fraction"),
])
def test_bad_sizes_name_the_key(server_data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        env_for(server_data=server_data)


def test_server_data_section_in_configs():
    cfg = load_config("fedclg_fmnist", ["server_data.fraction=0.05",
                                        "server_data.shift_cosine=0.95"])
    assert cfg.server_data.fraction == 0.05 and cfg.server_data.shift_cosine == 0.95
    with pytest.raises(ConfigError, match="server_data.fractoin"):
        load_config("fedclg_fmnist", ["server_data.fractoin=0.05"])
    with pytest.raises(ConfigError, match="server_data.fraction"):
        load_config("fedclg_fmnist", ["server_data.fraction=1.5"])
