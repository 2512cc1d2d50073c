"""Counts made from a config's decimals are the decimals' counts: K = ceil(ceil(D / B) * E)
and the over-selected cohort ceil((1 + o) M), where a float product lands just above an
integer (50 * 1.1 = 55.00000000000001) and a plain ceiling would add one."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from helpers import digits_config

from splitfed.config import _steps
from splitfed.engine.batches import local_step_counts
from splitfed.exact import ceil_times
from splitfed.experiment import _sampled_per_round, build_environment

DECIMALS = ["0.07", "0.1", "0.3", "0.7", "1.1", "1.2", "1.15", "2.2", "2.3", "3.3", "0.57",
            "1", "2", "0.5", "4.35"]


@pytest.mark.parametrize("text", DECIMALS)
def test_ceil_times_is_the_decimals_ceiling(text):
    exact = Fraction(text)
    for n in range(0, 301):
        want = math.ceil(n * exact)
        assert ceil_times(n, float(text)) == want, (n, text)


def test_the_float_product_would_have_been_wrong_here():
    # the cases behind this module: the float product is above the integer
    assert math.ceil(50 * 1.1) == 56 and ceil_times(50, 1.1) == 55
    assert math.ceil(100 * 0.07) == 8 and ceil_times(100, 0.07) == 7


def test_local_step_counts_take_the_decimal_epochs():
    sizes = np.array([400, 400, 100, 7, 800])
    assert local_step_counts(sizes, 8, None, 1.1).tolist() == [55, 55, 15, 2, 110]
    assert local_step_counts(np.array([100]), 1, None, 0.07).tolist() == [7]
    assert local_step_counts(np.array([3]), 8, None, 0.01).tolist() == [1]   # at least one
    # the config's own count (its checks) agrees with the engine's, client by client
    for d in range(1, 120):
        for e in (0.07, 1.1, 2.2, 0.3):
            assert _steps(d, 4, None, e) == int(local_step_counts(np.array([d]), 4, None, e)[0])


def test_the_environment_trains_ceil_of_the_decimal():
    cfg = digits_config(partition={"scheme": "iid", "num_clients": 1},
                        data={"name": "digits", "limit_train": 400},
                        train={"batch_size": 8, "local_steps": None, "local_epochs": 1.1})
    env = build_environment(cfg)
    assert env.local_steps([0]).tolist() == [55]


def test_over_selection_samples_the_decimals_ceiling():
    cfg = digits_config(partition={"scheme": "iid", "num_clients": 60},
                        participation={"mode": "uniform", "clients_per_round": 50},
                        clock={"profile": "fixed", "over_select": 0.1})
    assert (1 + 0.1) * 50 > 55                       # the float product is above 55
    assert _sampled_per_round(cfg, 60) == 55


def test_over_selection_samples_at_most_every_client():
    """ceil((1 + over_select) M) clients, but never more than the N there are."""
    cfg = digits_config(partition={"scheme": "iid", "num_clients": 60},
                        participation={"mode": "uniform", "clients_per_round": 50},
                        clock={"profile": "fixed", "over_select": 0.5})
    assert _sampled_per_round(cfg, 60) == 60            # 50 + 25 = 75 capped at 60
    assert _sampled_per_round(cfg, 80) == 75
