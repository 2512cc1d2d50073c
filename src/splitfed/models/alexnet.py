"""AlexNet-style CNN of paper 001 (8 layers: 5 conv + 3 fully connected), scaled to small
images (1x28x28, 3x32x32).

One block per layer, so ``Lc = n`` means "split after the n-th block" as in paper 001:

- ``conv1``: Conv 3x3 (pad 1) -> 64, ReLU, MaxPool 2
- ``conv2``: Conv 3x3 -> 192, ReLU, MaxPool 2
- ``conv3``: Conv 3x3 -> 384, ReLU
- ``conv4``: Conv 3x3 -> 256, ReLU
- ``conv5``: Conv 3x3 -> 256, ReLU, MaxPool 2 (256x3x3 for 28x28, 256x4x4 for 32x32)
- ``fc1``: Flatten, [Dropout], Linear -> 1024, ReLU
- ``fc2``: [Dropout], Linear 1024 -> 512, ReLU
- ``fc3``: Linear 512 -> num_classes

The channel and hidden widths are the original AlexNet's conv widths with the 4096-wide
classifier scaled down to 1024/512; ``width`` multiplies all of them. ``dropout``
(default 0: zeroth-order estimates F(x + lambda u) - F(x - lambda u) of paper 001 need a
deterministic forward pass) inserts Dropout(p) before fc1 and fc2. Default cut 2 (paper
001 uses Lc = 2 for images).

``init``: ``"kaiming"`` (default) draws every conv and linear weight from He et al.'s
N(0, 2 / fan_in) with zero biases, the initialisation for ReLU networks; ``"torch"``
keeps PyTorch's layer defaults (uniform, variance 1 / (3 fan_in)), which shrink the
signal about 3x in variance per layer: after 8 layers the logits and gradients are so
small that a narrow network sits at chance level for thousands of SGD steps (measured on
Fashion-MNIST at width 0.0625: plain SGD at lr 0.01 still at 10% after 1,500 steps of 32,
He init at 81%). Paper 001 does not state its initialisation.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from splitfed.errors import ConfigError
from splitfed.models.blocks import BlockModel, check_dropout, image_shape, output_shape, scaled

CUTS = {n: f"after block {n} (conv{n})" for n in range(1, 6)}
CUTS.update({6: "after block 6 (fc1)", 7: "after block 7 (fc2)"})
CUTS[2] = "after block 2 (conv2 + max-pool), paper 001's Lc = 2"


INITS = ("kaiming", "torch")


def alexnet(input_shape, num_classes: int, *, width: float = 1.0, dropout: float = 0.0,
            init: str = "kaiming"):
    ch, h, w = image_shape("alexnet", input_shape)
    check_dropout(dropout, "alexnet")
    if init not in INITS:
        raise ConfigError(f"model.init must be one of {list(INITS)}, got {init!r}")
    c = [scaled(n, width) for n in (64, 192, 384, 256, 256)]
    convs, prev = OrderedDict(), ch
    for i, out in enumerate(c, start=1):
        layers = [nn.Conv2d(prev, out, 3, padding=1), nn.ReLU(inplace=True)]
        convs[f"conv{i}"] = nn.Sequential(*layers, *([nn.MaxPool2d(2)] if i in (1, 2, 5) else []))
        prev = out
    flat = math.prod(output_shape(nn.Sequential(convs), (ch, h, w)))
    f1, f2 = scaled(1024, width), scaled(512, width)
    blocks = OrderedDict(
        **convs,
        fc1=nn.Sequential(
            nn.Flatten(), *_drop(dropout), nn.Linear(flat, f1), nn.ReLU(inplace=True)
        ),
        fc2=nn.Sequential(*_drop(dropout), nn.Linear(f1, f2), nn.ReLU(inplace=True)),
        fc3=nn.Linear(f2, num_classes),
    )
    model = BlockModel(blocks, name="alexnet", cut_descriptions=CUTS, default_cut=2)
    if init == "kaiming":
        for layer in model.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)
    return model


#: the options' help (``splitfed config explain alexnet``, docs/config.md)
alexnet.option_help = {
    "width": "multiplier of every layer's channels and hidden units (each rounded, at "
             "least 1; a finite number > 0)",
    "dropout": "probability of the Dropout before fc1 and fc2 (0 <= dropout < 1; 0: none, "
               "the deterministic forward pass ZO estimates need)",
    "init": "kaiming (He et al.'s N(0, 2 / fan_in) weights, zero biases) or torch "
            "(PyTorch's layer defaults)",
}


def _drop(p: float) -> list[nn.Module]:
    return [nn.Dropout(p)] if p else []
