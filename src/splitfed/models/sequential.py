"""Exact rewrites of a plain ``nn.Sequential``'s forward pass on a CPU: for evaluation
(:func:`forward_eval`) and for training (:func:`forward_train`).

For training (:func:`forward_train`: the sequential steps of SL's client, of the single
server model and of centralized training):

- **Max-pooling by the channels_last kernel**: an NCHW ``[N, C, H, W]`` input is copied
  to ``[H, W, N*C]`` memory, i.e. a channels_last ``[1, N*C, H, W]`` tensor, and pooled
  there by the same operator with the same arguments (:func:`max_pool2d_cl`). The CPU's
  NCHW kernel scans each window with a branch per comparison, one output at a time; the
  channels_last kernel compares whole vectors of channels, and a batch's planes are
  channels here. Values and indices (the first maximum of each window in scan order, NaN
  winning, as in the NCHW kernel) are the same, so the output is bit for bit
  ``max_pool2d``'s and so is the gradient, which is routed by those indices through the
  NCHW backward. LeNet-5's first pool at batch 32 ([32, 6, 28, 28]), one thread: 0.3 ms
  instead of 1.0 ms forward, 0.6 instead of 1.3 ms forward and backward.
- **Pool first** where that kernel pools: a ReLU / ReLU6 / LeakyReLU (slope >= 0)
  directly before such a pool runs after it, on a quarter of the elements. Values and
  gradients are identical: a window's first maximum (the element the gradient goes to)
  is the same element before and after a monotone activation wherever the activation
  passes a gradient, and where it passes none (a ReLU's non-positive side, ReLU6 at or
  above 6) the gradient is zero in both orders. A LeakyReLU's slope multiplies the
  gradient, so over overlapping windows (stride below the window) the two orders would
  sum rounded products differently: there it stays before the pool. (The NCHW kernel is
  kept where the inputs are small; there the order stays too, see below.)

For evaluation (:func:`forward_eval`):

- **2x2 max-pool as four strided views** (inference only): a 2x2
  max-pool of stride 2 (no padding, dilation 1, floor mode) is the elementwise maximum of
  the four strided views of its input: the same maximum of the same four numbers, NaN
  propagating as in ``max_pool2d``, several times faster than ``max_pool2d`` on NCHW
  tensors on a CPU. Its gradient would split ties, so training does not use it.
- **Pool first**, for such a pool: a ReLU / ReLU6 / LeakyReLU (slope >= 0) directly
  before it runs after it: max-pooling commutes with monotone non-decreasing
  activations, so the values are identical (and so would the gradients be: a window's
  first maximum is the same element before and after the activation wherever it is
  positive, and where it is not the activation's gradient is zero either way), and the
  activation touches a quarter of the elements. Not for ``max_pool2d`` itself: its NCHW
  CPU kernel branches on every comparison and ran 1.6x slower on raw than on ReLU'd
  inputs (647 vs 410 us for [10, 6, 28, 28]), far more than the activation saves. (The
  batched cohort forward, :mod:`splitfed.models.cohort`, pools first in channels_last,
  where the pooling kernel is vectorised.)

Everything else runs as the module itself (modules with hooks too, and every module on
another device than the CPU, where the pooling kernels need no help), so results are bit
for bit those of ``module(x)``, gradients included (tests/models/test_sequential.py).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

#: below this many planes (N * C) the channels_last kernel has too few to vectorise, and
#: below this many elements the layout copies and the autograd function's own cost (about
#: 0.1 ms forward and backward) outweigh what the kernel saves (measured on LeNet-5's pools
#: at batches 1-32, one thread: 0.3-0.5x as fast at 1,600-6,400 elements, 0.9x at 16,000,
#: 1.1-1.4x at 47,000, 1.4-2x at 51,000-150,000)
MIN_PLANES = 16
MIN_ELEMENTS = 32768


def commutes_with_max(m: nn.Module) -> bool:
    """Monotone non-decreasing elementwise layers: f(max(a, b)) == max(f(a), f(b))."""
    if type(m) in (nn.ReLU, nn.ReLU6):
        return True
    return type(m) is nn.LeakyReLU and m.negative_slope >= 0


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


# ------------------------------------------------- strided 1x1 convolutions on a CPU

def strided_1x1(w: torch.Tensor, stride, padding, x: torch.Tensor) -> bool:
    """A 1x1 convolution of stride > 1 that is trained on a CPU.

    oneDNN's channels_last weight gradient of such a convolution is wrong on some CPUs
    (an AMD EPYC with AVX2, PyTorch 2.13: ResNet-18's 1x1 shortcut of width 4 with one
    client per call, 2, 4 or 6 input channels, got gradients off by whole units, and the
    kernel at times wrote past its buffer and aborted the process; a plain module given
    a channels_last input with 2-7 channels aborted too), and unit-stride 1x1
    convolutions were right on every shape tried: the strided samples are taken first
    (:func:`strided_samples`) and convolved at stride 1, the same sums."""
    return (tuple(w.shape[-2:]) == (1, 1) and tuple(_pair(stride)) != (1, 1)
            and isinstance(padding, (int, tuple, list)) and x.device.type == "cpu"
            and torch.is_grad_enabled())


def strided_samples(x: torch.Tensor, stride, padding) -> torch.Tensor:
    """The pixels a 1x1 convolution of ``stride`` and zero ``padding`` reads from ``x``."""
    ph, pw = _pair(padding)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    sh, sw = _pair(stride)
    return x[:, :, ::sh, ::sw]


def conv_1x1(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)``, through :func:`strided_samples` when it is a strided 1x1 convolution
    trained on a CPU (:func:`strided_1x1`)."""
    if (type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and not _hooked(conv)
            and not _global_hooks()
            and strided_1x1(conv.weight, conv.stride, conv.padding, x)):
        return F.conv2d(strided_samples(x, conv.stride, conv.padding), conv.weight,
                        conv.bias, 1, 0, conv.dilation, conv.groups)
    return conv(x)


#: modules already scanned by :func:`_has_strided_1x1` (a module's layers do not change)
_SCANNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _has_strided_1x1(module: nn.Module) -> bool:
    """Whether ``module`` runs a strided 1x1 convolution itself (not one inside a module
    that takes its samples first: ``handles_strided_1x1``)."""
    found = _SCANNED.get(module)
    if found is None:
        found = _scan_strided_1x1(module)
        _SCANNED[module] = found
    return found


def _scan_strided_1x1(m: nn.Module) -> bool:
    if getattr(m, "handles_strided_1x1", False):
        return False
    if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and \
            tuple(_pair(m.stride)) != (1, 1):
        return True
    return any(_scan_strided_1x1(c) for c in m.children())


def _is_max_pool(m: nn.Module) -> bool:
    """A plain MaxPool2d (no hooks, no indices returned): the pools the rewrites compute."""
    return type(m) is nn.MaxPool2d and not _hooked(m) and not m.return_indices


def _pool_args(m: nn.MaxPool2d) -> tuple:
    """(kernel, stride, padding, dilation, ceil_mode) as pairs, as ``max_pool2d`` reads them."""
    return (_pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding),
            _pair(m.dilation), bool(m.ceil_mode))


def _is_max2x2(m: nn.Module) -> bool:
    """A MaxPool2d that is exactly the max of the four 2x2-strided views of its input."""
    return _is_max_pool(m) and _pool_args(m) == ((2, 2), (2, 2), (0, 0), (1, 1), False)


def _moves_behind_max(act: nn.Module) -> bool:
    """An activation that may run behind a max-pool instead of before it (same values)."""
    return commutes_with_max(act) and not _hooked(act)


def max2x2(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool2d(x, 2)`` of an [N, C, H, W] tensor as the maximum of four views:
    first of the even and the odd rows (whole rows, contiguous), then of the even and
    the odd columns of that. Two passes instead of three over strided quarter views:
    1.3-1.5x faster for LeNet-5's pools at batch 256 on one CPU thread."""
    if x.dim() != 4 or x.shape[-1] < 2 or x.shape[-2] < 2:
        return F.max_pool2d(x, 2)
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    x = x[..., :h, :w]
    rows = torch.maximum(x[..., 0::2, :], x[..., 1::2, :])
    return torch.maximum(rows[..., 0::2], rows[..., 1::2])


class _ChannelsLastMaxPool(torch.autograd.Function):
    """``max_pool2d`` of an NCHW tensor through the channels_last kernel (see the module
    docstring); the backward routes the gradient by the same indices as ``max_pool2d``'s."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        n, c, h, w = x.shape
        planes = x.permute(2, 3, 0, 1).contiguous().view(1, h, w, n * c).permute(0, 3, 1, 2)
        out, idx = torch.ops.aten.max_pool2d_with_indices(planes, kernel, stride, padding,
                                                          dilation, ceil_mode)
        ho, wo = out.shape[-2:]

        def nchw(t):   # [1, N*C, Ho, Wo] in channels_last memory -> contiguous [N, C, Ho, Wo]
            # always a new tensor (contiguous() would return a view for 1 x 1 outputs, and
            # an in-place ReLU on a view made inside a custom Function is an error)
            t = t.permute(0, 2, 3, 1).view(ho, wo, n, c).permute(2, 3, 0, 1)
            return t.clone(memory_format=torch.contiguous_format)

        ctx.save_for_backward(x, nchw(idx))
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        return nchw(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, idx = ctx.saved_tensors
        g = torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.args, idx)
        return g, None, None, None, None, None


def _planes_help(x: torch.Tensor) -> bool:
    """Whether :func:`max_pool2d_cl` pools ``x`` through the channels_last kernel."""
    return (x.dim() == 4 and x.device.type == "cpu" and x.is_contiguous()
            and x.shape[0] * x.shape[1] >= MIN_PLANES and x.numel() >= MIN_ELEMENTS)


def max_pool2d_cl(x: torch.Tensor, kernel, stride, padding=(0, 0), dilation=(1, 1),
                  ceil_mode: bool = False) -> torch.Tensor:
    """``F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)`` bit for bit,
    output and gradient, computed by the CPU's channels_last kernel on ``x``'s planes
    (module docstring). Inputs it does not help (not a contiguous 4-D CPU tensor, fewer
    than :data:`MIN_PLANES` planes or :data:`MIN_ELEMENTS` elements) go to
    ``F.max_pool2d``. It differentiates once (no gradient of its gradient)."""
    if not _planes_help(x):
        return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    return _ChannelsLastMaxPool.apply(x, list(_pair(kernel)), list(_pair(stride or kernel)),
                                      list(_pair(padding)), list(_pair(dilation)),
                                      bool(ceil_mode))


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _grad_commutes(act: nn.Module, pool: nn.MaxPool2d) -> bool:
    """Whether ``act`` then ``pool`` equals ``pool`` then ``act`` in gradients too, bit
    for bit: ReLU and ReLU6 pass a gradient times exactly 1 or 0; a LeakyReLU's slope
    multiplies, so a sum over overlapping windows would round differently in the two
    orders, and it is moved only over windows that do not overlap."""
    if not _moves_behind_max(act):
        return False
    if type(act) in (nn.ReLU, nn.ReLU6):
        return True
    k, s, _, d, _ = _pool_args(pool)
    return all(si >= (ki - 1) * di + 1 for ki, si, di in zip(k, s, d))


def _walk(m: nn.Module, x: torch.Tensor, pool, first) -> torch.Tensor:
    """``m(x)`` through plain Sequentials with their pools rewritten: ``pool(child)`` is
    the exact function computing a pooling child (None for any other child), and
    ``first(activation, pool_child, x)`` says whether the activation directly before it
    runs behind it."""
    rewritten = pool(m)
    if rewritten is not None:
        return rewritten(x)
    if not _is_plain_sequential(m) or _hooked(m):
        return m(x)
    children = list(m)
    i = 0
    while i < len(children):
        c = children[i]
        if i + 1 < len(children):
            rewritten = pool(children[i + 1])
            if rewritten is not None and first(c, children[i + 1], x):
                x = c(rewritten(x))                                 # pool first
                i += 2
                continue
        x = _walk(c, x, pool, first)
        i += 1
    return x


def _eval_pool(m: nn.Module):
    return max2x2 if _is_max2x2(m) else None


def _eval_first(act: nn.Module, pool: nn.Module, x: torch.Tensor) -> bool:
    return _moves_behind_max(act)


def _train_pool(m: nn.Module):
    if not _is_max_pool(m):
        return None
    args = _pool_args(m)
    return lambda x: max_pool2d_cl(x, *args)


def _train_first(act: nn.Module, pool: nn.Module, x: torch.Tensor) -> bool:
    return _planes_help(x) and _grad_commutes(act, pool)


def _global_hooks() -> bool:
    mod = torch.nn.modules.module
    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks)


# ------------------------------------------------- training's flat plan

def _linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    p = m._parameters                                       # m.weight, m.bias
    return F.linear(x, p["weight"], p["bias"])              # nn.Linear.forward


def _relu(m: nn.ReLU, x: torch.Tensor) -> torch.Tensor:
    return torch.relu_(x) if m.inplace else torch.relu(x)   # F.relu, as nn.ReLU calls it


def _flatten(m: nn.Flatten, x: torch.Tensor) -> torch.Tensor:
    return x.flatten(m.start_dim, m.end_dim)                # nn.Flatten.forward


def _call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


#: leaf layers whose forward :func:`forward_train` runs as the same operator directly
#: (their exact class: a subclass may override ``forward``)
_DIRECT = {nn.Linear: _linear, nn.ReLU: _relu, nn.Flatten: _flatten}


class _FlatPlan:
    """What :func:`_walk` runs for a plain Sequential without max-pools (nothing for
    it to rewrite): its leaves in order, each as ``fn(module, x)``, and every module the
    walk passes through. Valid while none of them has a hook (checked at each call)."""

    __slots__ = ("steps", "modules")

    def __init__(self, steps: list, modules: list) -> None:
        self.steps, self.modules = steps, modules

    def hooked(self) -> bool:
        return any(_hooked(m) or m._backward_hooks or m._backward_pre_hooks
                   for m in self.modules)


#: :func:`_flat_plan` per module (None: the walk applies; a module's layers do not change)
_FLAT_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _flat_plan(module: nn.Module) -> _FlatPlan | None:
    try:
        return _FLAT_PLANS[module]
    except KeyError:
        pass
    steps, modules = [], []

    def flatten(m: nn.Module) -> bool:
        modules.append(m)
        for c in m:
            if isinstance(c, nn.MaxPool2d):        # pools are rewritten by shape: walk
                return False
            if _is_plain_sequential(c):
                if not flatten(c):
                    return False
            else:
                fn = _DIRECT.get(type(c))
                if fn is not None:
                    modules.append(c)
                steps.append((fn or _call, c))
        return True

    plan = (_FlatPlan(steps, modules)
            if _is_plain_sequential(module) and flatten(module) else None)
    _FLAT_PLANS[module] = plan
    return plan


def _global_backward_hooks() -> bool:
    mod = torch.nn.modules.module
    return bool(mod._global_backward_hooks or mod._global_backward_pre_hooks)


def starts_with_flatten(module: nn.Module) -> bool:
    """Whether ``module`` (a split part) is plain Sequentials whose first layer is an
    ``nn.Flatten``: its output is the same contiguous tensor for any memory layout of its
    input, so the input may be made contiguous beforehand."""
    while _is_plain_sequential(module) and len(module) > 0:
        module = module[0]
    return type(module) is nn.Flatten


def forward_train(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a training step, bit for bit (outputs and gradients), with the
    max-pooling of the module docstring on a CPU. Under ``torch.no_grad`` nothing is
    kept for a backward pass either way.

    A plain Sequential without max-pools (a split model's server side: SL, SFL-V2 and
    CSE-FSL's server step) runs as a flat list of its leaves, and its linear layers,
    ReLUs and flattens as their operators (what their ``forward`` calls), without the
    recursive walk and the modules' calls: the same operators on the same tensors, while
    no module involved has a hook (else the walk, which calls them)."""
    if x.device.type != "cpu":
        return module(x)
    if (x.dim() == 4 and not x.is_contiguous() and torch.is_grad_enabled()
            and _has_strided_1x1(module)):
        x = x.contiguous()       # not channels_last for oneDNN's strided 1x1 (strided_1x1)
    if _global_hooks():
        return module(x)
    plan = _flat_plan(module)
    if plan is not None and not plan.hooked() and not _global_backward_hooks():
        for fn, m in plan.steps:
            x = fn(m, x)
        return x
    return _walk(module, x, _train_pool, _train_first)


def forward_eval(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` (in eval mode, no gradient taken), bit for bit, with the rewrites of
    the module docstring, on a CPU (a GPU's pooling kernel needs no help: there the
    rewrites only add kernel launches)."""
    if x.device.type != "cpu" or _global_hooks():
        return module(x)
    return _walk(module, x, _eval_pool, _eval_first)
