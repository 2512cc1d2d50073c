"""Multiply-accumulates (MACs): what a forward pass costs, per sample.

Counted by forward hooks on a dry run: a convolution costs
``out_elements * in_channels / groups * kernel_h * kernel_w``, a linear layer
``in_features * out_features`` per output row; normalisation, activations and pooling are
ignored (they are not multiply-accumulates of weights). A training step costs about three
forward passes (forward, gradient w.r.t. inputs, gradient w.r.t. weights): the per-round
figures the round loop reports use that factor.
"""

from __future__ import annotations

import torch
from torch import nn

TRAIN_FACTOR = 3


def forward_macs(module: nn.Module, input_shape: tuple[int, ...]) -> int:
    """MACs of one sample's forward pass through ``module``."""
    total = 0

    def hook(m, inputs, output):
        nonlocal total
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1]
            total += output[0].numel() * (m.in_channels // m.groups) * k
        elif isinstance(m, nn.Linear):
            total += output[0].numel() * m.in_features

    handles = [m.register_forward_hook(hook) for m in module.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear))]
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        p = next(module.parameters(), None)
        dtype = p.dtype if p is not None else torch.get_default_dtype()
        device = p.device if p is not None else None
        with torch.no_grad():
            module(torch.zeros(1, *input_shape, dtype=dtype, device=device))
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes:
            m.train(mode)
    return int(total)
