"""Evaluation of a global model on a held-out set (docs/design.md, Evaluation: the
aggregated global client model composed with the global server model, on the global test
set)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = 1000) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` (in eval mode) on ``(x, y)``."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for i in range(0, len(y), batch_size):
        out = model(x[i:i + batch_size])
        yb = y[i:i + batch_size]
        loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train(was_training)
    n = max(1, len(y))
    return {"test_acc": correct / n, "test_loss": loss_sum / n}
