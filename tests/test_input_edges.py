"""Inputs that were accepted and went wrong later, refused or reported as given: a run
name with control characters, booleans among Bernoulli probabilities, a cut given by a
block name that is not a cut, an absurd simulated time in the results table."""

from __future__ import annotations

import pytest

from splitfed.config import build_config
from splitfed.engine.participation import _probabilities
from splitfed.errors import ConfigError
from splitfed.models import build_model
from splitfed.models.blocks import resolve_cut
from splitfed.results import _seconds


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "nul\x00", "del\x7f", "\r"])
def test_a_run_name_with_control_characters_is_refused(name):
    with pytest.raises(ConfigError, match="must be a non-empty file name without '/', "
                                          r"'\\' or control characters"):
        build_config({"name": name})
    build_config({"name": "a name with spaces, dots. and-dashes"})


@pytest.mark.parametrize("q", [[0.5, True], [False, 0.5], True])
def test_booleans_are_not_probabilities(q):
    with pytest.raises(ConfigError, match="q: expected a number or a list of numbers"):
        _probabilities(q, 2)
    assert _probabilities([0.5, 1], 2).tolist() == [0.5, 1.0]


@pytest.mark.parametrize("q, error", [
    ("1e-300", r"^q: '1e-300' is outside float32's range"),      # text, as 1e-300 in YAML
    ([0.5, "1e-300"], r"^q\[1\]: '1e-300' is outside float32's range"),
    ([0.5, " 0.5 "], r"^q: expected a number or a list of numbers"),
    ("half", r"^q: expected a number or a list of numbers, got 'half' \(str\)"),
    ([0.5, [0.5]], r"^q: expected a number or a list of numbers"),
])
def test_probabilities_written_as_text_are_checked_as_numbers(q, error):
    """PyYAML reads 1e-3 (no dot) as text: a probability given so is converted, and
    checked like a number (a weight a_n / q_n of 1e300 would otherwise follow)."""
    with pytest.raises(ConfigError, match=error):
        _probabilities(q, 2)
    assert _probabilities(["1e-3", 0.5], 2).tolist() == [1e-3, 0.5]
    assert _probabilities("0.25", 2).tolist() == [0.25, 0.25]


def test_a_cut_by_name_that_is_no_cut_is_named_as_given():
    model = build_model("mlp", (1, 8, 8), 10, hidden=[32])
    with pytest.raises(ConfigError, match=r"^model.cut='out' is not valid for mlp"):
        resolve_cut(model, "out")
    assert resolve_cut(model, "fc1") == 1


def test_huge_simulated_times_print_short():
    assert _seconds(12.345) == "12.35"
    assert _seconds(1e308) == "1e+308"
    assert _seconds(-1e300) == "-1e+300"
