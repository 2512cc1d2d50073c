"""LeNet-5 (LeCun et al. 1998) as used by paper 003 for MNIST / Fashion-MNIST.

Blocks (ReLU activations, max-pooling):

- ``conv1``: Conv 5x5 -> 6 channels (padding 2 for 28x28 inputs, none otherwise), ReLU,
  MaxPool 2
- ``conv2``: Conv 5x5 -> 16 channels, ReLU, MaxPool 2
- ``fc1``: Flatten, Linear(flat -> 120), ReLU (flat = 16x5x5 = 400 for 1x28x28 / 3x32x32;
  derived by a dry run for other sizes)
- ``fc2``: Linear(120 -> 84), ReLU
- ``fc3``: Linear(84 -> num_classes)

Default cut 2: after the 2nd max-pool (paper 003). 61,706 parameters for 1x28x28 and 10
classes.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from splitfed.models.blocks import BlockModel, image_shape, output_shape

CUTS = {
    1: "after conv1 block (1st max-pool)",
    2: "after 2nd max-pool, paper 003",
    3: "after fc1",
    4: "after fc2",
}


def lenet5(input_shape, num_classes: int) -> BlockModel:
    ch, h, w = image_shape("lenet5", input_shape)
    pad = 2 if (h, w) == (28, 28) else 0
    convs = OrderedDict(
        conv1=nn.Sequential(
            nn.Conv2d(ch, 6, 5, padding=pad), nn.ReLU(inplace=True), nn.MaxPool2d(2)
        ),
        conv2=nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
    )
    flat = math.prod(output_shape(nn.Sequential(convs), (ch, h, w)))
    blocks = OrderedDict(
        **convs,
        fc1=nn.Sequential(nn.Flatten(), nn.Linear(flat, 120), nn.ReLU(inplace=True)),
        fc2=nn.Sequential(nn.Linear(120, 84), nn.ReLU(inplace=True)),
        fc3=nn.Linear(84, num_classes),
    )
    return BlockModel(blocks, name="lenet5", cut_descriptions=CUTS, default_cut=2)
