"""``eval_last``: every round of the last N rounds is evaluated, besides every
``eval_every`` rounds, round 0 and the last round."""

import pytest
from helpers import digits_config

from splitfed.engine.loop import evaluates
from splitfed.errors import ConfigError
from splitfed.experiment import run_experiment


def evaluated(**over):
    cfg = digits_config(rounds=10, **over)
    return [r["round"] for r in run_experiment(cfg, write=False).records if "test_acc" in r]


def test_without_eval_last_only_every_eval_every():
    assert evaluated(eval_every=4) == [0, 4, 8, 10]


def test_eval_last_adds_every_round_of_the_tail():
    # multiples of 4: 4, 8; the last 3 rounds: 8, 9, 10; and round 0
    assert evaluated(eval_every=4, eval_last=3) == [0, 4, 8, 9, 10]


def test_eval_last_beyond_the_run_evaluates_every_round():
    assert evaluated(eval_every=50, eval_last=100) == list(range(11))


def test_paper_003_schedule():
    # 1000 rounds, every 50th and each of the last 100: 18 + 100 rounds
    cfg = digits_config(rounds=1000, eval_every=50, eval_last=100)
    rounds = [t for t in range(1, 1001) if evaluates(cfg, t)]
    assert len(rounds) == 118
    assert rounds[:3] == [50, 100, 150] and rounds[17:20] == [900, 901, 902]


@pytest.mark.parametrize("value", [-1, 1.5, "x"])
def test_bad_eval_last(value):
    with pytest.raises(ConfigError, match="eval_last"):
        digits_config(eval_last=value)
