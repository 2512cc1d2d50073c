"""Auxiliary heads for client-side local losses (CSE-FSL, paper 000).

The head maps the cut-layer activation (the "smashed data") to class logits, so a client
can train on a local loss without server feedback. Default (docs/design.md, CSE-FSL):
one linear layer on the flattened cut activation.
"""

from __future__ import annotations

import math

from torch import nn

from splitfed.errors import ConfigError
from splitfed.models.blocks import output_shape

KINDS = ("linear", "mlp")


def build_aux_head(
    client_part: nn.Module, input_shape, num_classes: int, kind: str = "linear", hidden: int = 128
) -> nn.Sequential:
    """An auxiliary head for the output of ``client_part`` on inputs of ``input_shape``.

    The cut activation shape comes from a dry run (2 zero samples, no grad, eval mode).
    ``kind="linear"``: Flatten + Linear(flat, num_classes); ``kind="mlp"``: Flatten +
    Linear(flat, hidden) + ReLU + Linear(hidden, num_classes).
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown aux head kind {kind!r}; allowed: {', '.join(KINDS)}")
    flat = math.prod(output_shape(client_part, tuple(input_shape)))
    if kind == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(flat, num_classes))
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ConfigError(f"aux head hidden must be a positive int, got {hidden!r}")
    return nn.Sequential(
        nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )
