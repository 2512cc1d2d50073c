"""The exact Sequential rewrites of the forward pass. Evaluation: a 2x2 max-pool as four
strided views, with the activation before it moved after it (it then sees the pooled
tensor). Training: max-pooling by the channels_last kernel on the batch's planes, with a
ReLU before it moved after it; outputs and gradients bit for bit those of the module."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
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


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_the_activation_runs_on_the_pooled_tensor(mode):
    model = build_model("lenet5", (1, 28, 28), 10).train(mode == "train")
    forward = sequential.forward_eval if mode == "eval" else sequential.forward_train
    x = torch.randn(32, 1, 28, 28)
    plain, plain_shapes = _relu_shapes(model, x)
    fast, fast_shapes = _relu_shapes(lambda z: forward(model, z), x)
    assert torch.equal(plain, fast)
    assert plain_shapes[:2] == [(6, 28, 28), (16, 10, 10)]      # conv outputs
    assert fast_shapes[:2] == [(6, 14, 14), (16, 5, 5)]         # pooled first
    assert plain_shapes[2:] == fast_shapes[2:]                  # the fc activations
    if mode == "train":
        # pools too small for the channels_last kernel keep max_pool2d, and the order
        _, small_shapes = _relu_shapes(lambda z: forward(model, z), x[:2])
        assert small_shapes == plain_shapes


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


def _with_ties(shape, gen, dtype=torch.float32):
    """Inputs as a convolution sees Fashion-MNIST: exact zeros (ties in every window of
    the background) and a few NaN and infinities."""
    x = torch.randn(*shape, generator=gen, dtype=dtype) * 3
    x[:, :, : shape[2] // 3] = 0.0
    x[0, 0, -1, -1] = float("nan")
    x[1, 1, -2, -3] = float("-inf")
    x[1, 0, -3, -2] = float("inf")
    return x


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("args", [(2, 2), (3, 2, 1, 1, True), (2, 1, 0, 2, False),
                                  (3, 3, 1, 1, False), ((2, 3), (2, 1), (1, 0), 1, True)])
def test_max_pool2d_cl_is_max_pool2d_bit_for_bit(args, dtype):
    # padding, dilation, ceil mode, overlapping windows, odd sizes; ties, NaN, infinities
    g = torch.Generator().manual_seed(1)
    x = _with_ties((12, 11, 17, 15), g, dtype).requires_grad_(True)
    assert sequential._planes_help(x)           # the channels_last path is the one tested
    ref = F.max_pool2d(x, *args)
    out = sequential.max_pool2d_cl(x, *args)
    assert out.shape == ref.shape and out.is_contiguous() and _same(out, ref)
    grad = torch.randn(ref.shape, generator=g, dtype=dtype)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    (g_out,) = torch.autograd.grad(out, x, grad)
    assert g_out.is_contiguous() and torch.equal(g_out, g_ref)


def test_max_pool2d_cl_leaves_small_and_other_inputs_to_max_pool2d():
    small = torch.randn(2, 3, 8, 8)                    # too few planes and elements
    cl = torch.randn(8, 16, 32, 32).contiguous(memory_format=torch.channels_last)
    assert not sequential._planes_help(small) and not sequential._planes_help(cl)
    for x in (small, cl):
        assert torch.equal(sequential.max_pool2d_cl(x, 2, 2), F.max_pool2d(x, 2))


def _train_step(forward, model, x, y):
    model.zero_grad(set_to_none=True)
    out = forward(x)
    F.cross_entropy(out, y).backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), nn.ReLU6(), nn.LeakyReLU(0.1),
                                 nn.LeakyReLU(0.2, inplace=True)])
@pytest.mark.parametrize("pool", [nn.MaxPool2d(2), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                                  nn.MaxPool2d(2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_train_gives_the_modules_outputs_and_gradients(act, pool, dtype):
    # a LeakyReLU stays before overlapping windows (its slope would be summed in another
    # order); a ReLU / ReLU6 moves behind every pool
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act, pool),
                          nn.Flatten(), nn.LazyLinear(5)).to(dtype)
    x = _with_ties((16, 3, 20, 20), g, dtype)
    model(x)
    y = torch.randint(0, 5, (16,), generator=g)
    for inp in (x, x.nan_to_num()):
        out, grads = _train_step(model, model, inp, y)
        fast, fast_grads = _train_step(lambda z: sequential.forward_train(model, z), model,
                                       inp, y)
        assert _same(out, fast)
        assert all(_same(a, b) for a, b in zip(grads, fast_grads))


@pytest.mark.parametrize("name,options", [("lenet5", {}), ("alexnet", {"width": 0.0625}),
                                          ("vgg11", {"width": 0.125})])
def test_forward_train_is_the_model_bit_for_bit_over_steps(name, options):
    # three SGD steps of each zoo model with pools, through module(x) and forward_train
    shape = (3, 32, 32) if name == "vgg11" else (1, 28, 28)
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    a = build_model(name, shape, 10, **options).train()
    b = copy.deepcopy(a)
    for _ in range(3):
        x = torch.randn(32, *shape, generator=g).clamp_min(0)
        y = torch.randint(0, 10, (32,), generator=g)
        for model, forward in ((a, a), (b, lambda z: sequential.forward_train(b, z))):
            torch.manual_seed(7)                       # the same dropout masks
            _train_step(forward, model, x, y)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


@pytest.mark.parametrize("size", [2, 3])
def test_forward_train_with_an_in_place_relu_behind_a_one_by_one_pool(size):
    # the pool's 1 x 1 output must be a tensor of its own: an in-place ReLU on a view made
    # inside the autograd function would be refused
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 256, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(256, 4))
    x = torch.randn(32, 3, size, size)
    assert sequential._planes_help(torch.empty(32, 256, size, size))
    y = torch.randint(0, 4, (32,))
    out, grads = _train_step(model, model, x, y)
    fast, fast_grads = _train_step(lambda z: sequential.forward_train(model, z), model, x, y)
    assert torch.equal(out, fast) and all(torch.equal(a, b) for a, b in zip(grads, fast_grads))


# -------------------------------------------- strided 1x1 convolutions, channels_last input

def _grads(module, x, y):
    x = x.detach().requires_grad_(True)
    loss = F.cross_entropy(sequential.forward_train(module, x), y)
    return torch.autograd.grad(loss, [*module.parameters(), x])


@pytest.mark.parametrize("width", [2, 4, 6, 16])
@pytest.mark.parametrize("kind", ["resnet_block", "plain"])
def test_a_strided_1x1_server_trains_right_on_channels_last_input(kind, width):
    """The server part of SFL-V2 and CSE-FSL gets the cohort's activations in channels_last
    memory. oneDNN's strided 1x1 convolution of 2-7 channels aborted the process (or gave
    wrong gradients) on such input; ResNet's block convolves the strided samples instead,
    and any other module with a strided 1x1 convolution gets a contiguous copy. Gradients
    (parameters and input) against a float64 reference, for a few steps' calls."""
    from helpers import assert_float_close
    from splitfed.models.resnet import BasicBlock

    torch.manual_seed(0)
    if kind == "resnet_block":
        body = BasicBlock(width, 2 * width, stride=2)
    else:
        body = nn.Sequential(nn.Conv2d(width, 2 * width, 1, stride=2, bias=False),
                             nn.BatchNorm2d(2 * width), nn.ReLU())
    module = nn.Sequential(body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10))
    module64 = copy.deepcopy(module).double()
    for batch in (2, 8, 2, 8):
        x = torch.randn(batch, width, 8, 8).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (batch,))
        got = _grads(module, x, y)
        x64 = x.detach().double().contiguous().requires_grad_(True)
        ref64 = torch.autograd.grad(F.cross_entropy(module64(x64), y),
                                    [*module64.parameters(), x64])
        x32 = x.detach().contiguous().requires_grad_(True)
        plain32 = torch.autograd.grad(F.cross_entropy(_nchw_forward(module, x32), y),
                                      [*module.parameters(), x32])
        for g, r32, r64 in zip(got, plain32, ref64):
            assert_float_close(g, r32, r64, terms=batch * 64, what=f"{kind} width {width}")


def _nchw_forward(module, x):
    """The module's own forward on an NCHW input, with convolutions at stride 1 of the
    strided samples for every 1x1 (a float32 reference that avoids the faulty kernel)."""
    def run(m, z):
        if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1):
            return F.conv2d(z[:, :, ::m.stride[0], ::m.stride[1]], m.weight, m.bias)
        if isinstance(m, nn.Sequential):
            for c in m:
                z = run(c, z)
            return z
        if type(m).__name__ == "BasicBlock":
            out = F.relu(m.bn1(m.conv1(z)))
            out = m.bn2(m.conv2(out))
            return F.relu(out + run(m.shortcut, z))
        return m(z)
    return run(module, x)


@pytest.mark.parametrize("algorithm", ["sflv2", "csefsl"])
def test_sflv2_and_csefsl_train_a_narrow_resnet_cut_before_a_strided_shortcut(
        algorithm, tmp_path):
    """End to end, in a process of its own (the faulty kernel aborted the process): ResNet-18
    of width 4 cut after its first stage, whose server part starts with a strided 1x1
    shortcut of 4 channels, trains two rounds."""
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "splitfed", "run", "quick_digits",
         f"algorithm.name={algorithm}", "model.name=resnet18", "~model.hidden",
         "model.width=4", "model.cut=1", "rounds=2", "progress=false",
         f"out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "status completed" in proc.stdout, proc.stdout


def _server_part():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(400, 120), nn.ReLU(inplace=True)),
                         nn.Sequential(nn.Linear(120, 84), nn.ReLU()), nn.Tanh(),
                         nn.Linear(84, 10))


def test_forward_train_of_a_pool_free_sequential_is_the_module_bit_for_bit():
    # the flat plan (leaves in order, Linear / ReLU / Flatten as their operators): the
    # outputs and gradients of module(x), over three SGD steps from the same weights
    a = _server_part()
    b = copy.deepcopy(a)
    x = torch.randn(32, 16, 5, 5).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    y = torch.randint(0, 10, (32,))
    assert sequential._flat_plan(b) is not None
    for _ in range(3):
        grads = []
        for model, forward in ((a, a), (b, lambda z: sequential.forward_train(b, z))):
            h = x.detach().requires_grad_(True)
            loss = F.cross_entropy(forward(h), y)
            g = torch.autograd.grad(loss, [*model.parameters(), h])
            with torch.no_grad():
                torch._foreach_add_(list(model.parameters()), list(g[:-1]), alpha=-0.1)
            grads.append(g)
        assert all(torch.equal(p, q) for p, q in zip(*grads))
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_forward_train_runs_the_hooks_added_after_its_first_call():
    model = _server_part()
    x = torch.randn(4, 16, 5, 5)
    sequential.forward_train(model, x)                      # the plan is cached now
    seen = []
    for m in (model[0], model[0][1], model[1][1], model[3]):
        handle = m.register_forward_hook(lambda mod, i, o: seen.append(type(mod)))
        out = sequential.forward_train(model, x)
        handle.remove()
        assert torch.equal(out, model(x))
    assert seen == [nn.Sequential, nn.Linear, nn.ReLU, nn.Linear]
    pre = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda mod, i: pre.append(type(mod)))
    try:
        sequential.forward_train(model, x)
    finally:
        handle.remove()
    assert nn.Linear in pre


def test_the_flat_plan_flattens_the_dimensions_each_flatten_names():
    # nn.Flatten's start_dim and end_dim are the module's, not the default (1, -1): a
    # flatten of the sequence dimension and one of the batch with it, as module(x) does
    model = nn.Sequential(nn.Flatten(2), nn.Linear(12, 5), nn.ReLU(), nn.Flatten(0, 1),
                          nn.Linear(5, 3))
    assert sequential._flat_plan(model) is not None
    x = torch.randn(4, 2, 3, 4)
    out = sequential.forward_train(model, x)
    assert out.shape == (8, 3) and torch.equal(out, model(x))
