"""Cohort forward: one architecture, C clients with their own parameters, one batched pass.

``cohort_forward(module, state, x, training=...)`` equals, for every client c,
``torch.func.functional_call(module, unstack_state(state, c), x[c])`` with ``module`` in
the same train/eval mode, and autograd flows into the stacked tensors of ``state``.
``module`` is only a template (structure, strides, eps, momentum ...); its own parameter
and buffer values are never read. ``training`` applies to every submodule, as
``module.train(training)`` would.

Layouts. ``x`` is ``[C, B, *in_shape]`` and the result ``[C, B, *out_shape]`` (possibly a
non-contiguous view). Inside, activations live in one of two layouts, chosen by rank:

- folded, 4-D ``[B, C*Ch, H, W]`` in channels_last memory: client c owns channels
  ``c*Ch .. (c+1)*Ch - 1``. A Conv2d becomes one grouped convolution with ``C * groups``
  groups; pooling, activations and dropout act on it directly; BatchNorm2d / GroupNorm
  use ``C*Ch`` channels / ``C*G`` groups, so statistics stay per client.
- stacked, 3-D ``[C, B, F]``: Linear is ``baddbmm``; Flatten maps folded to stacked with
  the feature order of flattening one client's ``[B, Ch, H, W]``.

On a 2-core CPU this is about 1.7-2x faster than a per-client loop (docs/performance.md; run
``python -m benchmarks.cohort_forward``); callers should feed chunks of about 5-10 clients.
Results agree with the per-client computation to float32 rounding (exactly, up to
1e-15, in float64). Over several SGD steps the different kernels' rounding can put an
activation on the other side of a ReLU kink, so float32 trajectories of BatchNorm nets
trained on tiny batches may drift apart by more than rounding: compare those in float64.

BatchNorm in training uses per-client batch statistics and updates ``running_mean`` /
``running_var`` of ``state`` in place (views of the stacked buffers, so they must be
contiguous) and increments ``num_batches_tracked``; in eval it uses the stacked running
statistics. Dropout draws independent masks per client and sample.

Layout is kept channels_last end to end, gradients included: Flatten and the final
unfold go through the channels_last memory order, so the gradients flowing back into the
folded layers are channels_last too (an NCHW gradient made every pooling and convolution
backward convert its tensors). In a Sequential, a ReLU / ReLU6 / LeakyReLU directly followed
by a MaxPool2d runs after the pool instead: max-pooling commutes with monotone activations
(identical values; identical gradients except at exact ties), and the activation and its
backward then touch a quarter of the elements. Together about +15% samples/s for
LeNet-5 cohort training (docs/performance.md).

Dispatch: ``nn.Sequential`` runs its children; known leaf layers use the rules above; a
composite module may define ``forward_cohort(self, ctx, x)`` that mirrors its ``forward``
but calls ``ctx.run(self.child, x)`` for each child and works on folded / stacked
tensors (residual additions need nothing special); one that draws random numbers
itself (other than through dropout children) sets ``cohort_draws_random = True`` on its
class, so that :func:`cohort_forward_chunked` keeps it in one call. Any other module,
and inputs of other ranks than ``[C, B, F]`` / ``[C, B, Ch, H, W]``, fall back to
``torch.func.vmap`` of ``functional_call`` with ``randomness="different"``: correct but
slow. A template with any
submodule whose class sets ``cohort_per_client = True`` (transformer blocks) runs as one
``functional_call`` per client on views of the stacked state.

The per-template plan (qualified names, handlers, expected shapes) is cached on first use;
do not change a template's structure after passing it here.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from splitfed.errors import SplitfedError
from splitfed.models.sequential import commutes_with_max, strided_1x1, strided_samples

#: Samples per batched call where a 2-core CPU is fastest (about 160-640; docs/design.md,
#: Speed): the default number of clients per call is this over the batch size.
SAMPLES_PER_CALL = 320
#: The same for forward passes without autograd (zeroth-order copies): one call up to
#: about this many samples, then calls of about this many (LeNet-5 and AlexNet client
#: parts, docs/performance.md: a grouped convolution over 100 clients of 32 samples is
#: about 2x slower in one call than in calls of 16-32 clients; splitting 500 samples
#: costs more per call than it saves).
FORWARD_SAMPLES_PER_CALL = 512
#: The fewest clients in one call of :func:`cohort_forward_chunked` (its docstring: why).
MIN_CLIENTS_PER_CALL = 8


class CohortStateError(SplitfedError, ValueError):
    """A stacked state does not match the template (missing key, wrong shape)."""


def stack_states(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Per-client state dicts -> ``{name: tensor [C, ...]}`` (new contiguous tensors)."""
    if not states:
        raise CohortStateError("stack_states needs at least one state")
    keys = list(states[0])
    for i, s in enumerate(states):
        if set(s) != set(keys):
            raise CohortStateError(f"state {i} has keys {sorted(set(s) ^ set(keys))} differing")
    return {k: torch.stack([s[k] for s in states]) for k in keys}


def unstack_state(stacked: Mapping[str, Tensor], i: int) -> dict[str, Tensor]:
    """Client ``i``'s state from a stacked state (views, not copies)."""
    return {k: v[i] for k, v in stacked.items()}


def cohort_forward(
    module: nn.Module, state: Mapping[str, Tensor], x: Tensor, *, training: bool
) -> Tensor:
    """Run template ``module`` for C clients at once (see the module docstring).

    ``state`` holds every key of ``module.state_dict()`` with a leading dimension C =
    ``x.shape[0]`` (extra keys are ignored, so one full-model state serves both split
    parts); ``x`` is ``[C, B, *in_shape]``. Returns ``[C, B, *out_shape]``.
    """
    plan = _plan(module)
    plan.check(state, x.shape[0])
    ctx = CohortContext(plan, state, x.shape[0], training)
    if plan.per_client:
        return _per_client(ctx, module, x)
    if x.dim() not in (3, 5):
        return _vmapped(ctx, module, x)
    y = ctx.run(module, _fold(x) if x.dim() == 5 else x)
    return _unfold(y, ctx.n) if y.dim() == 4 else y


def cohort_forward_chunked(
    module: nn.Module, state: Mapping[str, Tensor], x: Tensor, *, training: bool,
    chunk: int | None,
) -> Tensor:
    """:func:`cohort_forward` in calls of about ``chunk`` clients each (None: one call).

    The same values as one call, bit for bit: every client's arithmetic is its own (its
    groups of the grouped convolutions, its matrices of the batched products, its
    channels of the norms), and the calls are balanced so that each holds at least
    ``MIN_CLIENTS_PER_CALL`` = 8 clients. Fewer groups can round differently: oneDNN's
    convolution for one client (an ungrouped one) differs in the last bits from the
    grouped one with AVX2 kernels, and with AVX kernels any call of fewer than 8 input
    channels in all (LeNet-5's conv1 for 1-7 clients) does; with 8 or more clients the
    outputs equalled one call's for every group count tried, with AVX-512, AVX2, AVX and
    SSE4.1 kernels (``ONEDNN_MAX_CPU_ISA``; LeNet-5, AlexNet, VGG-11, ResNet-18 client
    parts). One call is kept while autograd records (the backward of a grouped
    convolution rounded differently for other group counts with AVX2 kernels) and for a
    template that may draw random numbers in this mode (dropout with p > 0 in training,
    modules run by ``vmap`` or per client), so that its random numbers are drawn as
    before. Running statistics update in place as in one call.
    """
    n = x.shape[0]
    plan = _plan(module)
    bounds = balanced_chunks(n, chunk) if chunk is not None else [(0, n)]
    if len(bounds) == 1 or torch.is_grad_enabled() or plan.draws_random(training):
        return cohort_forward(module, state, x, training=training)
    plan.check(state, n)
    return torch.cat([cohort_forward(module, {k: state[k][a:b] for k in plan.shapes},
                                     x[a:b], training=training) for a, b in bounds])


def balanced_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ceil(n / chunk) nearly equal runs covering ``range(n)``, fewer
    where that would leave a run of less than ``MIN_CLIENTS_PER_CALL`` (one run for
    n < 16)."""
    k = max(1, min(-(-n // max(chunk, 1)), n // MIN_CLIENTS_PER_CALL))
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class CohortContext:
    """Per-call context handed to ``forward_cohort``: ``run`` a child, ``get`` a tensor."""

    def __init__(self, plan: _Plan, state: Mapping[str, Tensor], n: int, training: bool):
        self.plan, self.state, self.n, self.training = plan, state, n, training

    def run(self, module: nn.Module, x: Tensor) -> Tensor:
        """Apply submodule ``module`` of the template to a folded or stacked ``x``."""
        return self.plan.handler[id(module)](self, module, x)

    def get(self, module: nn.Module, name: str) -> Tensor | None:
        """The stacked tensor ``name`` (e.g. "weight") of ``module``; None if it has none."""
        return self.state.get(self.plan.prefix[id(module)] + name)


class _Plan:
    """Qualified-name prefixes, handlers and expected per-client shapes of a template."""

    def __init__(self, module: nn.Module):
        self.prefix: dict[int, str] = {}
        self.handler: dict[int, object] = {}
        self.children: dict[int, list[nn.Module]] = {}
        self.pool_first: dict[int, set[int]] = {}
        for name, m in module.named_modules():
            self.prefix[id(m)] = name + "." if name else ""
            self.handler[id(m)] = _handler_for(m)
            if self.handler[id(m)] is _sequential:
                self.children[id(m)] = list(m)
                self.pool_first[id(m)] = _pool_first(self.children[id(m)])
        self.shapes = {k: v.shape for k, v in module.state_dict(keep_vars=True).items()}
        self.per_client = any(getattr(m, "cohort_per_client", False) for m in module.modules())
        self._dropout = any(self.handler[id(m)] is _dropout and m.p > 0
                            for m in module.modules())
        self._opaque = self.per_client or any(
            self.handler[id(m)] is _fallback or getattr(m, "cohort_draws_random", False)
            for m in module.modules())

    def draws_random(self, training: bool) -> bool:
        """Whether a pass may draw random numbers: dropout with p > 0 in training, or any
        module run as its own code (``vmap`` fallback, per client), which might."""
        return self._opaque or (training and self._dropout)

    def check(self, state: Mapping[str, Tensor], n: int) -> None:
        missing = [k for k in self.shapes if k not in state]
        wrong = [
            f"{k}: {tuple(state[k].shape)} (expected {(n, *s)})"
            for k, s in self.shapes.items()
            if k in state and state[k].shape != (n, *s)
        ]
        if missing or wrong:
            raise CohortStateError(
                f"stacked state does not match the template for C={n} clients; "
                f"missing keys: {missing or 'none'}; wrong shapes: {wrong or 'none'}"
            )

    def keys_under(self, module: nn.Module) -> list[str]:
        p = self.prefix[id(module)]
        return [k for k in self.shapes if k.startswith(p)]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(module: nn.Module) -> _Plan:
    plan = _PLANS.get(module)
    if plan is None:
        plan = _PLANS[module] = _Plan(module)
    return plan


# ---------------------------------------------------------------- layouts


def _fold(x: Tensor) -> Tensor:
    """[C, B, Ch, H, W] -> folded [B, C*Ch, H, W], channels_last (one copy)."""
    c, b, ch, h, w = x.shape
    return x.permute(1, 3, 4, 0, 2).reshape(b, h, w, c * ch).permute(0, 3, 1, 2)


def _unfold(x: Tensor, n: int) -> Tensor:
    """Folded [B, C*Ch, H, W] -> [C, B, Ch, H, W] (a view).

    For channels_last ``x`` the view is taken through its memory order [B, H, W, C, Ch],
    so that the gradient flowing back is channels_last too (the reshape-transpose view
    would hand back an NCHW gradient, and every layer below would convert it).
    """
    b, cc, h, w = x.shape
    if _is_channels_last(x):
        return x.permute(0, 2, 3, 1).view(b, h, w, n, cc // n).permute(3, 0, 4, 1, 2)
    return x.reshape(b, n, cc // n, h, w).transpose(0, 1)


def _is_channels_last(x: Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


# ---------------------------------------------------------------- handlers


def _sequential(ctx, m, x):
    children = ctx.plan.children[id(m)]
    i = 0
    while i < len(children):
        child = children[i]
        if x.dim() == 4 and i in ctx.plan.pool_first[id(m)]:
            # monotone activation then max-pool == max-pool then activation, exactly
            # (values; gradients up to ties): the activation runs on 1/4 of the elements
            x = ctx.run(child, ctx.run(children[i + 1], x))
            i += 2
        else:
            x = ctx.run(child, x)
            i += 1
    return x


def _composite(ctx, m, x):
    return m.forward_cohort(ctx, x)


def _conv2d(ctx, m, x):
    if x.dim() != 4:
        return _fallback(ctx, m, x)
    w, b = ctx.get(m, "weight"), ctx.get(m, "bias")
    w = w.reshape(-1, *w.shape[2:])
    b = b.reshape(-1) if b is not None else None
    x, padding = x.contiguous(memory_format=torch.channels_last), m.padding
    if m.padding_mode != "zeros":
        x, padding = F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode), 0
    stride = m.stride
    if strided_1x1(w, stride, padding, x):
        x, stride = strided_samples(x, stride, padding), 1
        padding = 0
    return F.conv2d(x, w, b, stride, padding, m.dilation, ctx.n * m.groups)


def _linear(ctx, m, x):
    if x.dim() != 3:
        return _fallback(ctx, m, x)
    w, b = ctx.get(m, "weight"), ctx.get(m, "bias")
    if b is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


def _batch_norm(ctx, m, x):
    if x.dim() != (4 if isinstance(m, nn.BatchNorm2d) else 3):
        return _fallback(ctx, m, x)
    folded = x if x.dim() == 4 else x.transpose(0, 1).reshape(x.shape[1], -1)
    rm, rv = _buffer(ctx, m, "running_mean"), _buffer(ctx, m, "running_var")
    momentum = m.momentum
    if ctx.training and m.track_running_stats:
        count = ctx.get(m, "num_batches_tracked")
        count.add_(1)
        momentum = _cumulative(count) if momentum is None else momentum
    w, b = _flat(ctx.get(m, "weight")), _flat(ctx.get(m, "bias"))
    batch_stats = ctx.training or rm is None
    y = F.batch_norm(folded, rm, rv, w, b, batch_stats, momentum or 0.0, m.eps)
    return y if x.dim() == 4 else y.reshape(x.shape[1], ctx.n, -1).transpose(0, 1)


def _group_norm(ctx, m, x):
    if x.dim() != 4:
        return _fallback(ctx, m, x)
    w, b = _flat(ctx.get(m, "weight")), _flat(ctx.get(m, "bias"))
    return F.group_norm(x, ctx.n * m.num_groups, w, b, m.eps)


def _layer_norm(ctx, m, x):
    if x.dim() != 3 or len(m.normalized_shape) != 1:
        return _fallback(ctx, m, x)
    y = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
    w, b = ctx.get(m, "weight"), ctx.get(m, "bias")
    y = y * w.unsqueeze(1) if w is not None else y
    return y + b.unsqueeze(1) if b is not None else y


def _flatten(ctx, m, x):
    if (m.start_dim, m.end_dim) != (1, -1) or x.dim() not in (3, 4):
        return _fallback(ctx, m, x)
    if x.dim() == 3:
        return x
    if _is_channels_last(x):  # one copy; the gradient comes back channels_last
        return _unfold(x, ctx.n).reshape(ctx.n, x.shape[0], -1)
    return x.reshape(x.shape[0], ctx.n, -1).transpose(0, 1)


def _spatial(ctx, m, x):
    """Parameter-free per-channel 2-D layers (pools): apply to the folded layout."""
    return m(x) if x.dim() == 4 else _fallback(ctx, m, x)


def _elementwise(ctx, m, x):
    return m(x)


def _dropout(ctx, m, x):
    """Independent masks per client and sample (per channel for Dropout2d)."""
    if isinstance(m, nn.Dropout2d):
        if x.dim() != 4:
            return _fallback(ctx, m, x)
        return F.dropout2d(x, m.p, ctx.training, m.inplace)
    fn = F.alpha_dropout if isinstance(m, nn.AlphaDropout) else F.dropout
    return fn(x, m.p, ctx.training, m.inplace)


def _fallback(ctx, m, x):
    """vmap of functional_call over the stacked layout (any module; slow)."""
    y = _vmapped(ctx, m, _unfold(x, ctx.n) if x.dim() == 4 else x)
    if y.dim() not in (3, 5):
        raise NotImplementedError(
            f"{type(m).__name__} inside a cohort must return "
            f"[B, F] or [B, Ch, H, W] per client, got {tuple(y.shape[1:])}"
        )
    return _fold(y) if y.dim() == 5 else y


def _per_client(ctx, m, x):
    """One ``functional_call`` per client: templates with a submodule marked
    ``cohort_per_client`` (transformer blocks, whose matrix products already fill the
    machine and whose code is not written for stacked parameters)."""
    with _mode(m, ctx.training):
        outs = [functional_call(m, {k: ctx.state[k][c] for k in ctx.plan.shapes}, (x[c],))
                for c in range(ctx.n)]
    return outs[0].unsqueeze(0) if ctx.n == 1 else torch.stack(outs)


def _vmapped(ctx, m, x):
    p = ctx.plan.prefix[id(m)]
    sub = {k[len(p) :]: ctx.state[k] for k in ctx.plan.keys_under(m)}
    with _mode(m, ctx.training):
        return vmap(lambda s, xi: functional_call(m, s, (xi,)), randomness="different")(sub, x)


# ---------------------------------------------------------------- helpers


def _flat(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1)


def _buffer(ctx, m, name):
    """A running statistic as a flat *view*, so in-place updates land in the state."""
    t = ctx.get(m, name)
    if t is not None and not t.is_contiguous():
        raise CohortStateError(f"{ctx.plan.prefix[id(m)]}{name} must be contiguous")
    return None if t is None else t.view(-1)


def _cumulative(count: Tensor) -> float:
    """Momentum None (cumulative average): 1 / num_batches_tracked, equal across clients."""
    if bool((count != count[0]).any()):
        raise CohortStateError("BatchNorm(momentum=None) needs equal num_batches_tracked")
    return 1.0 / float(count[0])


@contextmanager
def _mode(module: nn.Module, training: bool):
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


_POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ACTS = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Softplus,
)
_LEAF = {
    nn.Conv2d: _conv2d,
    nn.Linear: _linear,
    nn.BatchNorm2d: _batch_norm,
    nn.BatchNorm1d: _batch_norm,
    nn.GroupNorm: _group_norm,
    nn.LayerNorm: _layer_norm,
    nn.Flatten: _flatten,
    nn.Identity: _elementwise,
    nn.Dropout: _dropout,
    nn.Dropout2d: _dropout,
    nn.AlphaDropout: _dropout,
    **dict.fromkeys(_POOLS, _spatial),
    **dict.fromkeys(_ACTS, _elementwise),
}


def _pool_first(children: list[nn.Module]) -> set[int]:
    """Positions i of a Sequential where child i commutes with the MaxPool2d at i + 1."""
    return {i for i in range(len(children) - 1)
            if commutes_with_max(children[i]) and type(children[i + 1]) is nn.MaxPool2d
            and not children[i + 1].return_indices}


def _handler_for(m: nn.Module):
    if type(m) in _LEAF:
        return _LEAF[type(m)]
    if hasattr(m, "forward_cohort"):
        return _composite
    if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
        return _sequential
    return _fallback
