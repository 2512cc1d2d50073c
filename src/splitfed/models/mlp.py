"""Multi-layer perceptron for any input shape (e.g. the 60-feature synthetic data set).

Blocks: ``fc1`` (Flatten, Linear, ReLU), ``fc2`` .. ``fcN`` (Linear, ReLU) for the
``hidden`` widths (default (200, 200)), then ``out`` (Linear -> num_classes). Cut k means
"after hidden layer k"; default cut 1. With ``hidden=()`` the model is multinomial
logistic regression: one block and no valid cut (usable unsplit only).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from splitfed.errors import ConfigError
from splitfed.models.blocks import BlockModel


def mlp(input_shape, num_classes: int, *, hidden=(200, 200)) -> BlockModel:
    if not isinstance(hidden, (list, tuple)):
        raise ConfigError(f"model.hidden: must be a list of positive integers (mlp: the "
                          f"hidden layers' widths), got {hidden!r}")
    hidden = tuple(hidden)
    if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
        raise ConfigError(f"model.hidden: must be a list of positive integers (mlp: the "
                          f"hidden layers' widths), got {list(hidden)!r}")
    prev = math.prod(int(s) for s in input_shape)
    blocks = OrderedDict()
    for i, h in enumerate(hidden, start=1):
        flat = [nn.Flatten()] if i == 1 else []
        blocks[f"fc{i}"] = nn.Sequential(*flat, nn.Linear(prev, h), nn.ReLU(inplace=True))
        prev = h
    out = nn.Linear(prev, num_classes)
    blocks["out"] = nn.Sequential(nn.Flatten(), out) if not hidden else out
    cuts = {k: f"after hidden layer {k}" for k in range(1, len(hidden) + 1)}
    return BlockModel(blocks, name="mlp", cut_descriptions=cuts, default_cut=1 if hidden else None)


#: the options' help (``splitfed config explain mlp``, docs/config.md)
mlp.option_help = {
    "hidden": "the hidden layers' widths, positive integers ([]: multinomial logistic "
              "regression, one block and no cut)",
}
