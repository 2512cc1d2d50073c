"""``tiny_cnn``: a small CNN with three cut points."""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from splitfed import register_model
from splitfed.models.blocks import BlockModel, output_shape

CUTS = {1: "after the first conv block", 2: "after the second conv block",
        3: "after the hidden linear layer"}


@register_model("tiny_cnn")
def tiny_cnn(input_shape, num_classes, *, width=8, hidden=32):
    """Two conv blocks and two linear layers; ``width`` channels, ``hidden`` units.

    The options are keyword-only: the config's ``model.width`` and ``model.hidden``."""
    channels = input_shape[0]
    convs = OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()),
        conv2=nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
                            nn.MaxPool2d(2)),
    )
    flat = math.prod(output_shape(nn.Sequential(convs), tuple(input_shape)))
    blocks = OrderedDict(
        **convs,
        fc1=nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU()),
        fc2=nn.Linear(hidden, num_classes),
    )
    return BlockModel(blocks, name="tiny_cnn", cut_descriptions=CUTS, default_cut=2)
