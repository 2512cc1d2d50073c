"""Stacked copies of a model: the unit of batched client (or server-copy) training.

``StackedModel(module, start, n)`` holds ``n`` independent copies of ``module``'s state,
initialised from ``start``, with a leading copy dimension on every tensor. Parameters are
autograd leaves; a step differentiates w.r.t. them and updates them in place with
:class:`~splitfed.engine.optim.StackedSGD`. ``module`` is only a template (structure and
hyperparameters) for :func:`~splitfed.models.cohort.cohort_forward`.

Copies may run different numbers of steps: the copies still working are always a prefix
``[:a]`` (callers order them by decreasing step count), and forward/step act on prefix
views, leaving the finished copies untouched.

With a ``clock`` and the copies' client ``ids``, every forward charges B x forward MACs
per active copy and every step 2 x forward MACs (the backward pass) to the simulated
timeline of its ``role``: the clients' own devices (``"client"``) or the per-client
server lanes of server-side copies (``"server_copy"``); see :mod:`splitfed.engine.clock`.
``charged`` adds up what was charged, over every copy.

A ``StackedModel`` computes all its copies in this process. Where the run's environment
has a placement (the multi-process runtime, :mod:`splitfed.engine.placement`), stacked
copies are built with ``env.stacked`` (:func:`placed_stacked`), which returns the
placement's model for copies partly hosted elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.engine.optim import StackedSGD
from splitfed.engine.placement import Placement, cohort_forward_here
from splitfed.engine.split import per_client_loss
from splitfed.models.cohort import FORWARD_SAMPLES_PER_CALL, cohort_forward

#: ``hook(names, params, grads, slots) -> grads``: a correction of the stacked gradients of
#: the active copies before the optimizer step (a gradient transform's ``update``,
#: :mod:`splitfed.engine.transforms`: FedProx's proximal term, SCAFFOLD's control
#: variates). ``params`` are detached prefix views; ``slots`` the cohort positions of the
#: copies (what the caller passed to ``step`` as ``ids``), not client ids.
GradHook = Callable[[Sequence[str], list[torch.Tensor], list[torch.Tensor], np.ndarray],
                    list[torch.Tensor]]


def stack_copies(start: Mapping[str, torch.Tensor], n: int,
                 param_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``n`` independent copies of ``start``; parameters become leaves that need grad."""
    out = {}
    for name, v in start.items():
        t = v.detach().unsqueeze(0).expand(n, *v.shape).clone()
        out[name] = t.requires_grad_(name in param_names)
    return out


class StackedModel:
    """``n`` copies of ``module`` trained in this process (module doc). Code with an
    environment builds them with ``env.stacked`` (:func:`placed_stacked`), which leaves
    out the copies that the multi-process runtime computes elsewhere."""

    def __init__(self, module: nn.Module, start: Mapping[str, torch.Tensor], n: int, *,
                 momentum: float = 0.0, weight_decay: float = 0.0, clock=None,
                 ids: np.ndarray | None = None, role: str = "client"):
        self.module = module
        self.n = int(n)
        self.clock = clock if ids is not None else None
        self.ids, self.role = ids, role
        self._macs = 0
        #: MACs charged to the clock so far, over every copy (what an algorithm reports
        #: as its clients' MACs: :attr:`~splitfed.engine.rounds.RoundResult.client_macs`)
        self.charged = 0
        # frozen parameters (requires_grad False, e.g. a LoRA base) are carried, not trained
        self.param_names = [k for k, p in module.named_parameters() if p.requires_grad]
        keys = module.state_dict().keys()
        self.state = stack_copies({k: start[k] for k in keys}, self.n, self.param_names)
        self._plain = [self.state[k].detach() for k in self.param_names]
        self.opt = StackedSGD(momentum, weight_decay)
        self._views: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, a: int | None = None, *,
                training: bool = True) -> torch.Tensor:
        """Outputs of the first ``a`` copies (all by default) on ``x`` [a, B, ...]."""
        a = self.n if a is None else a
        self._views = {k: (t if a == self.n else t[:a]) for k, t in self.state.items()}
        if self.clock is not None:
            self._macs = self.clock.charge(self.role, self.module, self.ids[:a], x)
            self.charged += a * self._macs
        return cohort_forward(self.module, self._views, x, training=training)

    def step(self, outputs: torch.Tensor, grad_outputs: torch.Tensor | None = None, *,
             lr, extra_inputs: Sequence[torch.Tensor] = (), ids: np.ndarray | None = None,
             hook: GradHook | None = None) -> list[torch.Tensor]:
        """Backpropagate from the last forward, update the copies, return extra grads.

        ``outputs`` is a scalar loss (``grad_outputs`` None) or the forward's output with
        ``grad_outputs`` (the cut-layer gradient that came back from the server).
        Gradients w.r.t. ``extra_inputs`` (e.g. received activations) are returned.
        """
        views = self._views
        a = next(iter(views.values())).shape[0] if views else self.n
        inputs = [views[k] for k in self.param_names] + list(extra_inputs)
        grads = list(torch.autograd.grad(outputs, inputs, grad_outputs))
        p_grads, extra = grads[:len(self.param_names)], grads[len(self.param_names):]
        params = self._plain if a == self.n else [p[:a] for p in self._plain]
        if hook is not None:
            p_grads = hook(self.param_names, params, p_grads, ids)
        self.opt.step(params, p_grads, lr)
        if self.clock is not None:
            self.clock.compute(self.role, self.ids[:a], (TRAIN_FACTOR - 1) * self._macs)
            self.charged += a * (TRAIN_FACTOR - 1) * self._macs
        self._views = None
        return extra

    def final(self) -> dict[str, torch.Tensor]:
        """The copies' current state, detached, [n, ...] per name."""
        return {k: t.detach() for k, t in self.state.items()}

    def load_mean(self, mean: Mapping[str, torch.Tensor]) -> None:
        """Reset every copy to ``mean`` (after an intermediate aggregation)."""
        with torch.no_grad():
            for k, t in self.state.items():
                t.copy_(mean[k].unsqueeze(0).expand_as(t))


def placed_stacked(place: Placement | None, module: nn.Module,
                   start: Mapping[str, torch.Tensor], n: int, *, role: str = "client",
                   ids: np.ndarray | None = None, momentum: float = 0.0,
                   weight_decay: float = 0.0, clock=None) -> StackedModel:
    """Stacked copies for the placement ``place`` (engine/placement.py): a
    :class:`StackedModel` when ``place`` is None (everything in this process), else the
    placement's model (:meth:`~splitfed.engine.placement.Placement.stacked`), which
    computes only the copies hosted here."""
    kw = {"role": role, "ids": ids, "momentum": momentum, "weight_decay": weight_decay,
          "clock": clock}
    if place is None:
        return StackedModel(module, start, n, **kw)
    return place.stacked(module, start, n, **kw)


class ForwardCopies:
    """Stacked copies of one side of the cut trained by forward passes (zeroth-order).

    ``n`` copies of ``module``'s state from ``start`` ([n, ...] per tensor, no autograd
    leaves), for the clients ``ids`` (one per copy). A pass evaluates every copy, or only
    copy ``slot`` (an asynchronous algorithm serving one client at a time), with the given
    parameters (a perturbation) or the current ones, and charges B x forward MACs per copy
    to ``role``'s timeline of those clients, or of ``charge_to`` (``charged`` adds them
    up). Buffers (BatchNorm statistics) change only in a pass with ``update_stats`` (the
    unperturbed client pass); every other pass reads a copy of them. Under a
    ``placement`` (the multi-process runtime's ``env.placement``; None: everything here)
    copies hosted in other processes are not computed here (engine/placement.py). A pass
    over every copy runs in calls of about ``chunk_size`` copies (``engine.chunk_size``;
    None: on a CPU, calls of about ``FORWARD_SAMPLES_PER_CALL`` = 512 samples, one call
    for fewer; on a GPU one call; never fewer than 8 copies per call), with the values of
    one call
    (:func:`~splitfed.models.cohort.cohort_forward_chunked`, which keeps passes under
    autograd, the first-order ablations, in one call).
    """

    def __init__(self, module: nn.Module, start: Mapping[str, torch.Tensor], n: int, *,
                 clock, role: str, ids, placement: Placement | None = None,
                 chunk_size: int | None = None) -> None:
        self.module, self.clock, self.role = module, clock, role
        self.placement, self.chunk_size = placement, chunk_size
        self.ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        self.names = [k for k, _ in module.named_parameters()]
        self.state = stack_copies({k: start[k] for k in module.state_dict()}, n, ())
        self.buffers = [k for k in self.state if k not in self.names]
        #: MACs charged to the clock so far, over every copy (what an algorithm reports
        #: as its server's MACs: :attr:`~splitfed.engine.rounds.RoundResult.server_macs`)
        self.charged = 0

    def params(self, slot: int | None = None) -> list[torch.Tensor]:
        """The parameters of every copy, or views of copy ``slot`` ([1, ...])."""
        if slot is None:
            return [self.state[k] for k in self.names]
        return [self.state[k][slot:slot + 1] for k in self.names]

    def _who(self, slot, charge_to) -> np.ndarray:
        if charge_to is not None:
            return np.atleast_1d(np.asarray(charge_to, dtype=np.int64))
        return self.ids if slot is None else self.ids[slot:slot + 1]

    def forward(self, x: torch.Tensor, params: Sequence[torch.Tensor] | None = None, *,
                slot: int | None = None, charge_to=None,
                update_stats: bool = False) -> torch.Tensor:
        """Outputs on ``x`` ([copies, B, ...]) with ``params`` (default: the current)."""
        who = self._who(slot, charge_to)
        self.charged += self.clock.charge(self.role, self.module, who, x) * len(who)
        params = self.params(slot) if params is None else params
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        bufs = {k: self.state[k][rows] if update_stats else self.state[k][rows].clone()
                for k in self.buffers}
        return cohort_forward_here(
            self.placement, self.role, who, self.module,
            {**dict(zip(self.names, params)), **bufs}, x,
            write_back=self.buffers if update_stats else (), chunk=self._chunk(x))

    def _chunk(self, x: torch.Tensor) -> int | None:
        """Copies per call for ``x`` [C, B, ...] (class doc; ``cohort_forward_chunked``
        keeps one call while autograd records: the first-order ablations)."""
        if self.chunk_size is not None or x.device.type != "cpu":
            return self.chunk_size
        n = x.shape[0]
        calls = max(1, round(n * x.shape[1] / FORWARD_SAMPLES_PER_CALL))
        return -(-n // calls)

    def first_order_grads(self, x: torch.Tensor, y: torch.Tensor | None = None,
                          grad_out: torch.Tensor | None = None, *, slot: int | None = None,
                          charge_to=None) -> tuple[torch.Tensor, ...]:
        """True gradients (the first-order ablations): of the summed per-copy loss on
        labels ``y``, or of the output against ``grad_out``; forward and backward charged."""
        params = [p.detach().requires_grad_(True) for p in self.params(slot)]
        with torch.enable_grad():
            out = self.forward(x, params, slot=slot, charge_to=charge_to)
            who = self._who(slot, charge_to)
            self.charged += (TRAIN_FACTOR - 1) * len(who) * self.clock.charge(
                self.role, self.module, who, x, passes=TRAIN_FACTOR - 1)
            if grad_out is None:
                return torch.autograd.grad(per_client_loss(out, y).sum(), params)
            return torch.autograd.grad(out, params, grad_out)

    def step(self, grads: Sequence[torch.Tensor], lr: float, slot: int | None = None) -> None:
        """x <- x - lr * grads (every copy, or copy ``slot``)."""
        torch._foreach_add_(self.params(slot), list(grads), alpha=-lr)
