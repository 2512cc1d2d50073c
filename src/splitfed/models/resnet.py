"""ResNet-18 (He et al. 2016) with the CIFAR stem, as in paper 002.

Stem: Conv 3x3 stride 1 -> w, BatchNorm, ReLU (no max-pool). Four residual stages of two
:class:`BasicBlock` each, widths w, 2w, 4w, 8w (w = ``width``, default 64), strides
1, 2, 2, 2; then global average pooling and a Linear classifier. PyTorch default
initialisation. 11,173,962 parameters for w = 64 and 10 classes.

Blocks: ``stage1`` (stem + layer1), ``stage2``, ``stage3``, ``stage4``, ``head`` (avgpool,
flatten, linear), so cut ``Lc = 1..4`` means "after residual stage Lc" (paper 002).
Default cut 2.
"""

from __future__ import annotations

from collections import OrderedDict

import torch.nn.functional as F
from torch import nn

from splitfed.errors import ConfigError
from splitfed.models.blocks import BlockModel, image_shape
from splitfed.models.sequential import conv_1x1

CUTS = {k: f"after residual stage {k}, paper 002's Lc = {k}" for k in range(1, 5)}


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers with an identity (or 1x1 conv + BN) shortcut. A strided
    1x1 shortcut trained on a CPU convolves its strided samples at stride 1
    (:func:`splitfed.models.sequential.strided_1x1`: the same sums, not oneDNN's faulty
    kernel), as the batched cohort forward does."""

    handles_strided_1x1 = True

    def __init__(self, inp: int, out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = nn.Sequential()
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x), inplace=True)

    def _shortcut(self, x):
        if len(self.shortcut) == 2 and not (self.shortcut._forward_hooks
                                            or self.shortcut._forward_pre_hooks):
            conv, bn = self.shortcut
            return bn(conv_1x1(conv, x))
        return self.shortcut(x)

    def forward_cohort(self, ctx, x):
        """:meth:`forward` for a cohort of clients (see :mod:`splitfed.models.cohort`)."""
        out = F.relu(ctx.run(self.bn1, ctx.run(self.conv1, x)), inplace=True)
        out = ctx.run(self.bn2, ctx.run(self.conv2, out))
        return F.relu(out + ctx.run(self.shortcut, x), inplace=True)


def resnet18(input_shape, num_classes: int, *, width: int = 64) -> BlockModel:
    ch, _, _ = image_shape("resnet18", input_shape)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ConfigError(f"model.width: must be a positive integer (resnet18: the "
                          f"first stage's channels), got {width!r}")
    widths = [width, 2 * width, 4 * width, 8 * width]
    stem = [
        ("conv", nn.Conv2d(ch, width, 3, padding=1, bias=False)),
        ("bn", nn.BatchNorm2d(width)),
        ("relu", nn.ReLU(inplace=True)),
    ]
    blocks, prev = OrderedDict(), width
    for i, out in enumerate(widths, start=1):
        layer = [BasicBlock(prev, out, 1 if i == 1 else 2), BasicBlock(out, out)]
        named = [(f"block{j}", b) for j, b in enumerate(layer, start=1)]
        blocks[f"stage{i}"] = nn.Sequential(OrderedDict((stem if i == 1 else []) + named))
        prev = out
    blocks["head"] = nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(prev, num_classes)
    )
    return BlockModel(blocks, name="resnet18", cut_descriptions=CUTS, default_cut=2)


#: the options' help (``splitfed config explain resnet18``, docs/config.md)
resnet18.option_help = {
    "width": "w, the first stage's channels: the stages have w, 2w, 4w, 8w (an integer "
             ">= 1; paper 002: 64)",
}
