"""The exact Sequential rewrites of evaluation's forward pass: a 2x2 max-pool as four
strided views, with the activation before it moved after it (it then sees the pooled
tensor); the plain forward, which training uses, keeps ``max_pool2d``)."""

import torch
from torch.overrides import TorchFunctionMode

from splitfed.models import build_model, sequential


class ReluShapes(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.relu:
            self.shapes.append(tuple(args[0].shape[1:]))
        return func(*args, **(kwargs or {}))


def _relu_shapes(forward, x):
    with torch.no_grad(), ReluShapes() as mode:
        out = forward(x)
    return out, mode.shapes


def test_activation_runs_on_the_pooled_tensor_only_in_evaluation():
    model = build_model("lenet5", (1, 28, 28), 10).eval()
    x = torch.randn(4, 1, 28, 28)
    plain, plain_shapes = _relu_shapes(model, x)
    fast, fast_shapes = _relu_shapes(lambda z: sequential.forward_eval(model, z), x)
    assert torch.equal(plain, fast)
    assert plain_shapes[:2] == [(6, 28, 28), (16, 10, 10)]      # conv outputs
    assert fast_shapes[:2] == [(6, 14, 14), (16, 5, 5)]         # pooled first
    assert plain_shapes[2:] == fast_shapes[2:]                  # the fc activations


def test_max2x2_only_changes_the_path_not_the_values():
    model = build_model("alexnet", (1, 28, 28), 10, width=0.0625).eval()
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(sequential.forward_eval(model, x), ref)


def test_max2x2_is_max_pool2d_bit_for_bit():
    # odd sizes (floor mode drops the last row and column), NaN (propagates), ties,
    # infinities and a channels_last input
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 9, 7, generator=g)
    x[0, 0, 0, 0] = float("nan")
    x[1, 2, 4:6, 2:4] = 1.5                       # a window of four equal values
    x[2, 1, 0:2, 0:2] = float("-inf")
    x[2, 3, 2, 2] = float("inf")
    for inp in (x, x.contiguous(memory_format=torch.channels_last)):
        ref = torch.nn.functional.max_pool2d(inp, 2)
        out = sequential.max2x2(inp)
        assert out.shape == ref.shape == (3, 4, 4, 3)
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))
