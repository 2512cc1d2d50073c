"""The named random streams of :mod:`splitfed.rng`: one master seed, independent streams
per name, and torch's default generator seeded per round."""

from __future__ import annotations

import torch

from splitfed.rng import RandomStreams


def _round_draws(seed: int, t: int) -> torch.Tensor:
    RandomStreams(seed).seed_global(t)
    return torch.rand(8)


def test_the_default_generator_draws_what_the_round_and_seed_give():
    """Dropout draws from torch's default generator, seeded per round: the same round of
    the same seed draws the same numbers, whatever was drawn before; another round, or
    another master seed, draws others (a run whose rounds all drew one dropout mask would
    train on the same mask every round)."""
    first = _round_draws(0, 1)
    torch.rand(100)                                   # draws in between change nothing
    assert torch.equal(_round_draws(0, 1), first)
    assert not torch.equal(_round_draws(0, 2), first)
    assert not torch.equal(_round_draws(1, 1), first)
    rounds = torch.stack([_round_draws(0, t) for t in range(1, 6)])
    assert len({tuple(r.tolist()) for r in rounds}) == 5


def test_streams_of_one_name_repeat_and_streams_of_two_names_differ():
    a, b = RandomStreams(7), RandomStreams(7)
    assert a.numpy("partition").integers(0, 2**62) == b.numpy("partition").integers(0, 2**62)
    assert torch.equal(torch.rand(4, generator=a.torch("init")),
                       torch.rand(4, generator=b.torch("init")))
    assert not torch.equal(torch.rand(4, generator=a.torch("x")),
                           torch.rand(4, generator=a.torch("y")))
