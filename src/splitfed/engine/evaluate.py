"""Evaluation of a global model on a held-out set (docs/design.md, Evaluation: the
aggregated global client model composed with the global server model, on the global test
set).

The forward pass is the model's own with the exact rewrites of
:mod:`splitfed.models.sequential` (pool before a monotone activation, a 2x2 max-pool as
the maximum of four strided views): the logits are bit for bit those of ``model(x)``, at
several times the speed for pooling networks on a CPU (docs/performance.md, "Evaluation").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitfed.models import sequential

#: the logits of a model (already in eval mode), bit for bit ``model(x)``
forward_eval = sequential.forward_eval


#: samples per forward call when none is given: on a CPU larger batches leave the cache
#: (docs/performance.md, "Evaluation"); a GPU needs them to amortise its kernel launches
#: (a 10,000-sample LeNet-5 evaluation on an H200: 23 ms at 256, 3 ms at 2048)
DEFAULT_BATCH = {"cpu": 256, "cuda": 2048}


def default_batch(device: torch.device | str) -> int:
    """Evaluation's samples per call on ``device`` (:data:`DEFAULT_BATCH`; a GPU's for
    any other accelerator)."""
    return DEFAULT_BATCH.get(torch.device(device).type, DEFAULT_BATCH["cuda"])


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             batch_size: int | None = None) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` (in eval mode) on ``(x, y)``.

    Each sample's loss is computed from the logits in at least float32 (a bfloat16 or
    float16 model's logits are converted first), kept, and the losses are summed once, in
    float64, at the end, so
    neither metric depends on ``batch_size`` beyond the logits' last bits (a CPU's
    convolution may pick another kernel for another batch size: at batch 1 on an AMD
    EPYC a loss moved by a float32 ulp).
    A sample whose logits hold a NaN (a diverged model) is a miss: argmax would return
    the NaN's position, and all-NaN logits would score as often as class 0 occurs.
    ``batch_size`` None: :data:`DEFAULT_BATCH` for the device of ``x``."""
    if batch_size is None:
        batch_size = default_batch(x.device)
    was_training = model.training
    model.eval()
    n = len(y)
    losses = torch.empty(n, dtype=torch.float64, device=y.device)
    hits = torch.empty(n, dtype=torch.bool, device=y.device)
    try:
        for i in range(0, n, batch_size):
            out = sequential.forward_eval(model, x[i:i + batch_size])
            yb = y[i:i + batch_size]
            # at least float32: a bfloat16 / float16 model's per-sample losses would be
            # rounded to its 8 / 11 bits (and above 65504 be inf in float16)
            logits = out if out.dtype in (torch.float32, torch.float64) else out.float()
            losses[i:i + len(yb)] = F.cross_entropy(logits, yb, reduction="none")
            torch.eq(out.argmax(1), yb, out=hits[i:i + len(yb)])
            hits[i:i + len(yb)].logical_and_(~out.isnan().any(1))
    finally:
        model.train(was_training)
    # read once at the end: on a GPU a read per batch would wait for each batch in turn
    return {"test_acc": int(hits.sum()) / max(1, n), "test_loss": float(losses.sum()) / max(1, n)}
