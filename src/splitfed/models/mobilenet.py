"""MobileNetV2 (Sandler et al. 2018) for 32x32 images, the backbone of paper 004.

CIFAR adaptation as in common CIFAR ports: the first conv has stride 1 and the second
bottleneck group stride 1 (instead of 2 and 2), so a 32x32 input ends at 4x4. Inverted
residual settings (expansion t, channels c, repeats n, stride s):
(1,16,1,1), (6,24,2,1), (6,32,3,2), (6,64,4,2), (6,96,3,1), (6,160,3,2), (6,320,1,1).
Channels are multiplied by ``width_mult`` and rounded to multiples of 8; the last conv has
1280 * max(1, width_mult) channels. PyTorch default initialisation, no dropout.

Blocks: ``stem`` (Conv 3x3 -> 32, BN, ReLU6), ``group1`` .. ``group7`` (the bottleneck
groups), ``head`` (Conv 1x1 -> 1280, BN, ReLU6, avgpool, flatten, linear). Paper 004 uses
the model unsplit; the default cut 1 (after the stem) is there for split algorithms.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from splitfed.models.blocks import BlockModel, check_multiplier, image_shape

SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
CUTS = {1: "after the stem"}
CUTS.update({k: f"after bottleneck group {k - 1}" for k in range(2, 9)})


def _divisible(v: float, d: int = 8) -> int:
    """Round ``v`` to a multiple of ``d``, not below 90% of ``v`` (as torchvision)."""
    out = max(d, int(v + d / 2) // d * d)
    return out + d if out < 0.9 * v else out


def _conv_bn(inp: int, out: int, k: int, stride: int = 1, groups: int = 1, act=True):
    layers = [
        nn.Conv2d(inp, out, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out),
    ]
    return layers + ([nn.ReLU6(inplace=True)] if act else [])


class InvertedResidual(nn.Module):
    """Expand 1x1 (if t > 1), depthwise 3x3, linear project 1x1; residual if shapes match."""

    def __init__(self, inp: int, out: int, stride: int, expand: int):
        super().__init__()
        hidden = inp * expand
        layers = _conv_bn(inp, hidden, 1) if expand != 1 else []
        layers += _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        layers += _conv_bn(hidden, out, 1, act=False)
        self.conv = nn.Sequential(*layers)
        self.use_res = stride == 1 and inp == out

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)

    def forward_cohort(self, ctx, x):
        """:meth:`forward` for a cohort of clients (see :mod:`splitfed.models.cohort`)."""
        y = ctx.run(self.conv, x)
        return x + y if self.use_res else y


def mobilenetv2(input_shape, num_classes: int, *, width_mult: float = 1.0) -> BlockModel:
    ch, _, _ = image_shape("mobilenetv2", input_shape)
    check_multiplier(width_mult, "width_mult", "mobilenetv2")
    prev = _divisible(32 * width_mult)
    blocks = OrderedDict(stem=nn.Sequential(*_conv_bn(ch, prev, 3)))
    for g, (t, c, n, s) in enumerate(SETTINGS, start=1):
        out = _divisible(c * width_mult)
        group = [
            InvertedResidual(prev if i == 0 else out, out, s if i == 0 else 1, t) for i in range(n)
        ]
        blocks[f"group{g}"] = nn.Sequential(*group)
        prev = out
    last = _divisible(1280 * max(1.0, width_mult))
    blocks["head"] = nn.Sequential(
        *_conv_bn(prev, last, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(last, num_classes),
    )
    return BlockModel(blocks, name="mobilenetv2", cut_descriptions=CUTS, default_cut=1)


#: the options' help (``splitfed config explain mobilenetv2``, docs/config.md)
mobilenetv2.option_help = {
    "width_mult": "multiplier of the channels, rounded to multiples of 8; the last conv has "
                  "1280 * max(1, width_mult) (a finite number > 0)",
}
