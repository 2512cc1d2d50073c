"""VGG-11 (Simonyan & Zisserman 2014, configuration A) for 32x32 images, as in paper 003.

Blocks are the five conv stages, each ending in its max-pool, then the classifier:

- ``stage1``: 64, M;  ``stage2``: 128, M;  ``stage3``: 256, 256, M;
  ``stage4``: 512, 512, M;  ``stage5``: 512, 512, M
  (each conv is 3x3, pad 1, [BatchNorm], ReLU)
- ``classifier``: Flatten, Linear(512 -> num_classes) (the common CIFAR VGG head: with
  32x32 inputs the last stage is 512x1x1; other sizes are derived by a dry run)

``batch_norm`` (default False, as paper 003's) adds BatchNorm2d after each conv;
``width`` multiplies the channel counts (for small test models). Default cut 3: after the
3rd max-pool (paper 003: about 10% of the parameters on the client).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from splitfed.models.blocks import BlockModel, image_shape, output_shape, scaled

STAGES = ((64,), (128,), (256, 256), (512, 512), (512, 512))
_ORD = {1: "1st", 2: "2nd", 3: "3rd"}
CUTS = {k: f"after {_ORD.get(k, f'{k}th')} max-pool (stage{k})" for k in range(1, 6)}
CUTS[3] += ", paper 003"


def vgg11(input_shape, num_classes: int, *, batch_norm: bool = False, width: float = 1.0):
    ch, h, w = image_shape("vgg11", input_shape)
    blocks, prev = OrderedDict(), ch
    for i, stage in enumerate(STAGES, start=1):
        layers = []
        for out in (scaled(c, width) for c in stage):
            layers += [nn.Conv2d(prev, out, 3, padding=1)]
            layers += [nn.BatchNorm2d(out)] if batch_norm else []
            layers += [nn.ReLU(inplace=True)]
            prev = out
        blocks[f"stage{i}"] = nn.Sequential(*layers, nn.MaxPool2d(2))
    flat = math.prod(output_shape(nn.Sequential(blocks), (ch, h, w)))
    blocks["classifier"] = nn.Sequential(nn.Flatten(), nn.Linear(flat, num_classes))
    return BlockModel(blocks, name="vgg11", cut_descriptions=CUTS, default_cut=3)


#: the options' help (``splitfed config explain vgg11``, docs/config.md)
vgg11.option_help = {
    "batch_norm": "BatchNorm2d after every conv (paper 003: false)",
    "width": "multiplier of the channel counts (each rounded, at least 1; a finite number "
             "> 0)",
}
