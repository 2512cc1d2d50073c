"""The exact Sequential rewrites of the engine's forward passes: pooling before a monotone
activation gives the values and the gradients of ``module(x)`` bit for bit, also where a
window holds ties (Fashion-MNIST's background is exactly 0)."""

import torch
import torch.nn.functional as F

from splitfed.models import build_model, sequential


def test_pool_first_gradients_are_bit_identical_with_ties():
    torch.manual_seed(0)
    model = build_model("lenet5", (1, 28, 28), 10)
    params = list(model.parameters())
    x = torch.randn(16, 1, 28, 28)
    x[:, :, :12] = 0.0                       # constant rows: tied windows after conv1
    x[:4] = 0.0                              # whole images of ties
    y = torch.randint(0, 10, (16,))
    ref = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    out = torch.autograd.grad(F.cross_entropy(sequential.forward(model, x), y), params)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_max2x2_only_changes_the_path_not_the_values():
    model = build_model("alexnet", (1, 28, 28), 10, width=0.0625).eval()
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(sequential.forward(model, x), ref)
        assert torch.equal(sequential.forward(model, x, max2x2=True), ref)
