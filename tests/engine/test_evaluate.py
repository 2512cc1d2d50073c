"""Evaluation's forward pass: the exact rewrites (pool before a monotone activation, 2x2
max-pool as the maximum of four strided views) give bit for bit the logits of
``model(x)``, for every model of the zoo and for inputs with NaN, infinities, ties and odd
spatial sizes; modules with hooks run as they are."""

import copy
import math

import pytest
import torch
from helpers import assert_float_close
from torch import nn

from splitfed.engine.evaluate import evaluate, forward_eval
from splitfed.models import build_model

MODELS = [
    ("lenet5", (1, 28, 28), {}),
    ("lenet5", (3, 32, 32), {}),
    ("alexnet", (1, 28, 28), {"width": 0.0625}),
    ("vgg11", (3, 32, 32), {"width": 0.125}),
    ("resnet18", (3, 32, 32), {"width": 8}),
    ("mobilenetv2", (3, 32, 32), {"width_mult": 0.25}),
    ("mlp", (1, 28, 28), {}),
]


def _model(name, shape, opts):
    torch.manual_seed(0)
    return build_model(name, shape, 10, **opts).eval()   # every model listed builds


def _mean_losses(model, x, y):
    """The mean cross-entropy of ``model`` on ``x``, ``y``, in float32 and in float64 (a
    float64 copy of the model on the same inputs)."""
    with torch.no_grad():
        return tuple(nn.functional.cross_entropy(copy.deepcopy(model).eval().to(dtype)(
            x.to(dtype)), y) for dtype in (torch.float32, torch.float64))


def _loss(value):
    """A metric's loss (a Python float of a float32 computation) as a float32 tensor."""
    return torch.tensor(value, dtype=torch.float32)


@pytest.mark.parametrize("name,shape,opts", MODELS, ids=[f"{m[0]}-{m[1][1]}" for m in MODELS])
def test_forward_eval_is_model_forward_bit_for_bit(name, shape, opts):
    model = _model(name, shape, opts)
    x = torch.randn(37, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(forward_eval(model, x), model(x))


def test_max2x2_keeps_nan_inf_ties_and_odd_sizes():
    seq = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2), nn.LeakyReLU(0.1), nn.MaxPool2d(2, 2))
    x = torch.randn(3, 2, 11, 9)
    x[0, 0, 0, 0] = math.nan
    x[1, 1, 2, 3] = math.inf
    x[2, 0, 4:6, 4:6] = 0.5  # a tie inside a window
    x[2, 1] = -1.0           # all negative: ReLU makes zeros
    with torch.no_grad():
        ref, out = seq(x.clone()), forward_eval(seq, x.clone())
    assert torch.equal(torch.isnan(ref), torch.isnan(out))
    assert torch.equal(torch.nan_to_num(ref), torch.nan_to_num(out))


def test_other_pools_and_hooked_modules_run_unchanged():
    seq = nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 2, padding=1), nn.MaxPool2d(2, ceil_mode=True))
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        assert torch.equal(forward_eval(seq, x), seq(x))
    seen = []
    seq[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        forward_eval(seq, x)
    assert seen == [torch.Size([2, 3, 5, 5])]


def test_evaluate_matches_a_plain_loop():
    model = _model("lenet5", (1, 28, 28), {})
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(250, 1, 28, 28, generator=g), torch.randint(0, 10, (250,), generator=g)
    with torch.no_grad():
        out = model(x)
    res = evaluate(model.train(), x, y, batch_size=64)
    assert res["test_acc"] == int((out.argmax(1) == y).sum()) / 250
    assert_float_close(_loss(res["test_loss"]), *_mean_losses(model, x, y), what="test_loss")
    assert model.training  # mode restored


@pytest.mark.numerics
def test_metrics_do_not_depend_on_the_batch_size():
    """The same per-sample losses summed in the same order whatever the batch; only the
    logits' last bits may move, where a CPU's convolution picks another kernel for another
    batch size (at batch 1 on an AMD EPYC): every batch size's loss lies within float32
    rounding of the mean loss computed in float32 and float64, with the same
    predictions."""
    model = _model("lenet5", (1, 28, 28), {})
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(301, 1, 28, 28, generator=g), torch.randint(0, 10, (301,), generator=g)
    results = [evaluate(model, x, y, batch_size=b) for b in (1, 7, 256, 301, 10_000)]
    assert all(r["test_acc"] == results[0]["test_acc"] for r in results)
    want = _mean_losses(model, x, y)
    for b, r in zip((1, 7, 256, 301, 10_000), results):
        assert_float_close(_loss(r["test_loss"]), *want, what=f"batch {b}")
    # batches that hold the whole set are one call: the same bits
    assert results[3] == results[4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_models_loss_is_taken_from_its_logits_in_float32(dtype):
    """The per-sample losses come from the logits converted to float32: a bfloat16 model's
    loss is not rounded to 8 bits, and finite float16 logits of +-40000 give the finite
    loss 40000 (in float16 it was inf, and the run would have diverged)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Linear(8, 5).to(dtype)
    x, y = torch.randn(1000, 8).to(dtype), torch.randint(0, 5, (1000,))
    with torch.no_grad():
        logits = model(x)
    # the cross-entropy of the same logits, in float32 and in float64
    want32, want64 = (F.cross_entropy(logits.to(t), y) for t in (torch.float32, torch.float64))
    assert_float_close(_loss(evaluate(model, x, y)["test_loss"]), want32, want64)
    big = nn.Linear(1, 2, bias=False).to(dtype)
    with torch.no_grad():
        big.weight.copy_(torch.tensor([[40000.0], [-40000.0]]))
    x, y = torch.ones(4, 1, dtype=dtype), torch.tensor([1, 1, 0, 0])
    out = evaluate(big, x, y)
    with torch.no_grad():
        logits = big(x)            # +-40000 as the dtype holds it (39936 in bfloat16)
    want32, want64 = (F.cross_entropy(logits.to(t), y) for t in (torch.float32, torch.float64))
    assert out["test_acc"] == 0.5 and want64.item() == logits.abs().max().item()
    assert_float_close(_loss(out["test_loss"]), want32, want64)


class _Logits(nn.Module):
    """A model whose logits are given: ``forward`` returns the rows of ``out`` asked for."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out[x[:, 0].long()]


def test_a_sample_whose_logits_hold_a_nan_is_a_miss():
    """argmax of logits holding a NaN returns the NaN's position: a diverged model would
    score as often as its classes happen to be those positions (0.1 on balanced digits);
    such a sample is a miss, one with an infinite logit keeps its argmax."""
    nan, inf = math.nan, math.inf
    out = torch.tensor([[nan, nan, nan],     # label 0: argmax 0, but NaN -> miss
                        [0.0, nan, 1.0],     # label 1: argmax 1 (the NaN) -> miss
                        [0.0, 1.0, inf],     # label 2: argmax 2, a hit
                        [2.0, 1.0, 0.0]])    # label 0: a hit
    y = torch.tensor([0, 1, 2, 0])
    x = torch.arange(4.0).unsqueeze(1)
    for batch in (1, 3, 256):
        assert evaluate(_Logits(out), x, y, batch_size=batch)["test_acc"] == 0.5
