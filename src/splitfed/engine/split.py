"""The cut layer: what split algorithms share.

A split algorithm keeps one global model state (the full model's ``state_dict``); the
client side is the first ``env.cut`` blocks, the server side the rest, and their keys
partition the model's keys. Everything that crosses the cut goes through the transport:
activations and labels up, cut-layer gradients down. Raw inputs never do.

The primitives here also keep the virtual clock (:mod:`splitfed.engine.clock`): the
single server model's step (:func:`server_step`) runs on the shared server lane, a
sequential client's passes (:func:`client_compute`) on its own timeline, and an SL turn
(:func:`take_turn`) starts only if the clock lets it.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitfed.engine import placement
from splitfed.engine.clock import CLIENT as CLOCK_CLIENT
from splitfed.engine.clock import SERVER as CLOCK_SERVER
from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.models import sequential, split
from splitfed.transport.base import DOWN, UP, InProcessTransport


@dataclass
class SplitModel:
    """The client and server templates of ``env.model`` at ``env.cut`` and their keys."""

    client: nn.Module
    server: nn.Module
    client_keys: list[str]
    server_keys: list[str]

    @classmethod
    def of(cls, env) -> SplitModel:
        """The parts of ``env.model`` at ``env.cut``: the same objects every round while
        the model's blocks are the same, so what is cached per module (the clock's MACs
        from a dry run, the batched forward's plan) is computed once per run, not once
        per round."""
        model = env.model
        blocks = tuple(id(m) for m in model.children())
        per_model = _PARTS.setdefault(model, {})
        cached = per_model.get(env.cut)
        if cached is not None and cached[0] == blocks:
            return cached[1]
        client, server = split(model, env.cut)
        parts = cls(client, server, list(client.state_dict()), list(server.state_dict()))
        per_model[env.cut] = (blocks, parts)
        return parts

    def client_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: full[k] for k in self.client_keys}

    def server_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: full[k] for k in self.server_keys}

    def client_module(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A trainable copy of the client side holding ``state``."""
        return _trainable_copy(self.client, state)

    def server_module(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A trainable copy of the server side holding ``state``."""
        return _trainable_copy(self.server, state)


#: SplitModel.of's parts per model and cut (weak: a model's entry goes with the model)
_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trainable_copy(template: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    module = copy.deepcopy(template)
    module.load_state_dict(state)
    module.train()
    return module


def send_activations(env, ids: np.ndarray, acts: torch.Tensor,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upload per-client activations [C, B, ...] and labels [C, B]; the server's copies.

    The returned activations are a fresh autograd leaf (the server's own graph starts
    there) so the server can compute the cut-layer gradient.
    """
    h = env.transport.upload("activations", ids, acts)
    y = env.transport.upload("labels", ids, labels)
    return h.requires_grad_(True), y


def return_gradients(env, ids: np.ndarray, grads: torch.Tensor) -> torch.Tensor:
    """Download the cut-layer gradients [C, B, ...] to the clients."""
    return env.transport.download("activation_grads", ids, grads)


def server_step(env, server: nn.Module, opt: torch.optim.Optimizer, h: torch.Tensor,
                y: torch.Tensor, lr: float, client_id: int, *,
                params: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the single server model on one client's batch ``h`` [B, ...] (SL,
    SFL-V2, CSE-FSL's server pass) at step size ``lr``; returns (loss, cut-layer gradient).
    ``params``: ``list(server.parameters())``, when the caller keeps it across steps.

    Charged to the shared server lane: it starts when both the lane is free and
    ``client_id``'s upload has arrived, and costs a forward and a backward pass.
    """
    env.clock.charge(CLOCK_SERVER, server, int(client_id), h, passes=TRAIN_FACTOR,
                     stacked=False)
    place = env.placement
    if place is not None and not place.serves(client_id):   # a client rank, or lost
        return torch.zeros((), dtype=h.dtype), torch.zeros_like(h)
    return _server_update(server, list(server.parameters()) if params is None else params,
                          opt, h, y, lr)


def _server_update(server: nn.Module, params: list[torch.Tensor], opt, h: torch.Tensor,
                   y: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic of :func:`server_step`: the server's forward from ``h`` (a new
    autograd leaf), its gradients and the gradient of ``h``, one SGD step."""
    h = h.detach().requires_grad_(True)
    loss = F.cross_entropy(sequential.forward_train(server, h), y)
    *g_params, g_h = torch.autograd.grad(loss, params + [h])
    sgd_step(opt, params, g_params, lr)
    return loss.detach(), g_h


def sgd_step(opt: torch.optim.Optimizer | None, params: list[torch.Tensor],
             grads: list[torch.Tensor], lr: float) -> None:
    """One step of the SGD optimizer ``opt`` over ``params`` with ``grads`` at ``lr``.

    Plain SGD (one parameter group, no momentum, weight decay, nesterov or maximize; or
    ``opt`` None) is ``p <- p - lr * g``: it runs as one fused ``torch._foreach_add_``,
    the same element-wise arithmetic as ``torch.optim.SGD.step`` (``p.add_(g,
    alpha=-lr)``) without its per-call overhead (hooks, profiler ranges, group loops),
    which matters for the sequential per-batch steps of SL and SFL-V2's server. Otherwise
    the gradients are handed to ``opt.step()``, whose state (momentum buffers) persists.
    """
    if _plain(opt):
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-float(lr))
        return
    for p, g in zip(params, grads):
        p.grad = g
    for group in opt.param_groups:
        group["lr"] = float(lr)
    opt.step()


def _plain(opt: torch.optim.Optimizer | None) -> bool:
    """Whether a step of ``opt`` is ``p <- p - lr * g``: None, or SGD with one parameter
    group and no momentum, weight decay, nesterov or maximize."""
    if opt is None:
        return True
    groups = opt.param_groups
    g0 = groups[0] if groups else None
    return (isinstance(opt, torch.optim.SGD) and len(groups) == 1 and g0["momentum"] == 0
            and g0["weight_decay"] == 0 and not g0.get("nesterov")
            and not g0.get("maximize"))


def client_compute(env, module: nn.Module, client_id: int, x: torch.Tensor,
                   passes: int = 1) -> None:
    """Charge ``passes`` forward passes of a single client's ``module`` over its batch
    ``x`` [B, ...] to that client's timeline (SL: 1 for a forward, 2 for a backward)."""
    env.clock.charge(CLOCK_CLIENT, module, int(client_id), x, passes=passes, stacked=False)


def client_forward(env, module: nn.Module, client_id: int, x: torch.Tensor) -> torch.Tensor:
    """A sequential client's forward pass over its batch ``x`` [B, ...] (SL), charged to
    its timeline. It runs where the client is hosted; elsewhere (the multi-process
    runtime) the result is a placeholder (zeros; nothing is computed)."""
    client_compute(env, module, client_id, x)
    if placement.hosted(env.placement, CLOCK_CLIENT, [client_id]) is not None:
        return placement.placeholder(module, x, stacked=False)
    return sequential.forward_train(module, x)


def client_backward(env, module: nn.Module, opt: torch.optim.Optimizer | None,
                    params: list[torch.Tensor], client_id: int, x: torch.Tensor,
                    acts: torch.Tensor, grad: torch.Tensor, lr: float, *,
                    hook=None, slot: int = 0) -> None:
    """The backward pass of :func:`client_forward` from the cut-layer gradient ``grad``
    and one step of the client's optimizer, charged to its timeline; only where the
    client is hosted. ``hook`` (a gradient transform's stacked ``update``, for the
    client at cohort position ``slot``) corrects the gradients first."""
    client_compute(env, module, client_id, x, passes=TRAIN_FACTOR - 1)
    if placement.hosted(env.placement, CLOCK_CLIENT, [client_id]) is not None:
        return
    _client_update(module, opt, params, acts, grad, lr, hook=hook, slot=slot)


def _client_update(module: nn.Module, opt, params: list[torch.Tensor], acts: torch.Tensor,
                   grad: torch.Tensor, lr: float, *, hook=None, slot: int = 0) -> None:
    """The arithmetic of :func:`client_backward`: the client's gradients from the
    cut-layer gradient ``grad``, ``hook``'s correction, one SGD step."""
    grads = torch.autograd.grad(acts, params, grad)
    if hook is not None:
        names = [n for n, _ in module.named_parameters()]
        grads = [g[0] for g in hook(names, [p.detach().unsqueeze(0) for p in params],
                                    [g.unsqueeze(0) for g in grads], np.array([slot]))]
    sgd_step(opt, params, grads, lr)


def _joint_update(server: nn.Module, server_params: list[torch.Tensor], server_opt,
                  client_params: list[torch.Tensor], client_opt, acts: torch.Tensor,
                  y: torch.Tensor, lr: float) -> torch.Tensor:
    """:func:`_server_update` then :func:`_client_update` of a settled turn's step, bit
    for bit, from one backward pass: the server's forward runs on ``acts`` itself, so the
    gradient reaching ``acts`` is the one the server would have sent (the same sums in
    the same order) and flows on into the client's parameters in the same call. Neither
    backward reads a parameter the other side's step changes, and every step comes after
    both, so the updates are the same as well. Plain SGD on both sides (optimizer None
    or stateless): one fused update of both parameter lists, element by element the same
    ``p - lr * g``. Returns the detached loss."""
    loss = F.cross_entropy(sequential.forward_train(server, acts), y)
    n = len(server_params)
    grads = torch.autograd.grad(loss, server_params + client_params)
    if _plain(server_opt) and _plain(client_opt):
        sgd_step(None, server_params + client_params, list(grads), lr)
    else:
        sgd_step(server_opt, server_params, list(grads[:n]), lr)
        sgd_step(client_opt, client_params, list(grads[n:]), lr)
    return loss.detach()


#: run SL's turns in one process as plain arithmetic, their transfers and clock charges
#: settled once per turn (:func:`sequential_turn`); False: every step through the
#: transport and the clock as it happens (the same results, tests/engine/test_fast_paths.py)
SETTLE_TURNS = True


def sequential_turn(env, client: nn.Module, client_params: list[torch.Tensor],
                    client_opt: torch.optim.Optimizer | None, server: nn.Module,
                    server_params: list[torch.Tensor], server_opt: torch.optim.Optimizer,
                    client_id: int, batches, lr: float, *, hook=None, slot: int = 0) -> float:
    """One sequential client's turn with the single server model (SL): for each batch
    ``(x, y)`` of ``batches``, the client's forward pass, activations and labels up, one
    server step (:func:`server_step`), the cut-layer gradient down and the client's
    backward pass and step (:func:`client_backward`, ``hook`` and ``slot`` as there).
    ``client_params`` / ``server_params``: the modules' parameter lists; ``client_opt``
    None: plain SGD (:func:`sgd_step`). Returns the sum of the batches' losses.

    In one process with nothing between the two sides (the plain in-process transport,
    which hands tensors over by reference, no placement, no gradient hook) the steps run
    as plain arithmetic and what crossed the cut is settled once at the end of the turn
    (:meth:`~splitfed.transport.base.Transport.settle`): the same bytes in the ledger and
    the same clock charges in the same order, so the same simulated times, at one call
    per turn instead of six per step (docs/performance.md). Otherwise every step goes
    through the transport and the clock as it happens.
    """
    tr = env.transport
    if not (SETTLE_TURNS and hook is None and env.placement is None
            and type(tr) is InProcessTransport and tr.clock is env.clock):
        ids = np.array([client_id])
        total = 0.0
        for x, y in batches:
            acts = client_forward(env, client, client_id, x)
            h, y_up = send_activations(env, ids, acts.unsqueeze(0), y.unsqueeze(0))
            loss, g_h = server_step(env, server, server_opt, h[0], y_up[0], lr, client_id,
                                    params=server_params)
            g_acts = return_gradients(env, ids, g_h.unsqueeze(0))[0]
            client_backward(env, client, client_opt, client_params, client_id, x, acts,
                            g_acts, lr, hook=hook, slot=slot)
            total += float(loss)
        return total
    total, shapes = 0.0, []
    for x, y in batches:
        acts = sequential.forward_train(client, x)    # the server receives acts itself
        loss = _joint_update(server, server_params, server_opt, client_params, client_opt,
                             acts, y, lr)
        total += float(loss)
        # the cut-layer gradient has the activations' shape and type
        shapes.append((x.shape, acts.shape, acts.element_size(),
                       y.numel() * y.element_size(), acts.numel() * acts.element_size()))
    tr.settle(client_id, _turn_events(env.clock, client, server, shapes))
    return total


def _turn_events(clock, client: nn.Module, server: nn.Module, shapes) -> list[tuple]:
    """The transfers and compute of a settled turn's steps, in the order the step-by-step
    path makes them (:func:`client_forward`, :func:`send_activations`,
    :func:`server_step`, :func:`return_gradients`, :func:`client_backward`)."""
    events = []
    for x_shape, h_shape, h_size, y_bytes, g_bytes in shapes:
        forward = clock.batch_macs(client, x_shape, stacked=False)
        events += [(CLOCK_CLIENT, forward),
                   (UP, "activations", h_shape.numel() * h_size),
                   (UP, "labels", y_bytes),
                   (CLOCK_SERVER, TRAIN_FACTOR * clock.batch_macs(server, h_shape,
                                                                  stacked=False)),
                   (DOWN, "activation_grads", g_bytes),
                   (CLOCK_CLIENT, (TRAIN_FACTOR - 1) * forward)]
    return events


def take_turn(env, client_id: int, client_state: Mapping[str, torch.Tensor]
              ) -> dict[str, torch.Tensor] | None:
    """SL: the client requests the latest client-side model and receives it; None (and
    nothing sent) when its turn would start after the round's deadline."""
    ids = np.array([client_id])
    if not env.clock.can_start(ids)[0]:
        return None
    return env.transport.broadcast("model", ids, client_state)


def per_client_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each client's batch: ``out`` [C, B, K], ``y`` [C, B] -> [C]."""
    c = out.shape[0]
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(c, -1).mean(1)


def zeroth_order_cut_bytes(env, directions: int, activation_bytes: int, label_bytes: int,
                           steps):
    """``(up, down)`` at the cut for ``steps`` zeroth-order client steps with ``directions``
    q (MU-SplitFed, GAS): per step the batch's activations h and h+-, 2 q + 1 tensors,
    and its labels up, and q loss differences down (one scalar per direction, in the
    dtype of the server side's output, its parameters')."""
    batch = env.config.train.batch_size
    server = SplitModel.of(env).server
    scalar = next((p.element_size() for p in server.parameters() if p.is_floating_point()),
                  torch.empty(()).element_size())
    return (steps * batch * ((2 * directions + 1) * activation_bytes + label_bytes),
            steps * directions * scalar)


def zeroth_order_client_macs(env, directions: int, macs_per_sample: int, steps):
    """The MACs of ``steps`` zeroth-order client steps with ``directions`` q (MU-SplitFed,
    GAS): per step the batch's forward passes for h and h+- of each direction, 2 q + 1
    of them, and no backward pass (``macs_per_sample``: a forward and a backward pass of
    one sample through the client's part, ``TRAIN_FACTOR`` forward passes)."""
    forward = macs_per_sample // TRAIN_FACTOR
    return steps * env.config.train.batch_size * (2 * directions + 1) * forward


def participation_probability(env, ids: np.ndarray) -> np.ndarray:
    """q_n of each slot: the bernoulli probabilities, or 1 for the other modes."""
    q = getattr(env.sampler, "q", None)
    if q is None:
        return np.ones(len(ids))
    return np.asarray(q, dtype=np.float64)[np.asarray(ids)]


def server_opt_template(env, template: dict, key: str = "server_opt") -> dict:
    """``template`` (a checkpoint template, ``Algorithm.checkpoint_template``) with its
    ``key`` a :func:`~splitfed.checkpoint.optimizer_rule` for :func:`sgd`'s
    ``state_dict()`` on the server side of ``template["model"]``: a saved server
    optimizer state is checked (its groups, hyperparameters and momentum buffers) before
    a resume changes any file, or None (none yet)."""
    from splitfed.checkpoint import optimizer_rule
    parts = SplitModel.of(env)
    server = parts.server_module(parts.server_state(template["model"]))
    return {**template, key: optimizer_rule(sgd(server, env, None))}


def sgd(module: nn.Module, env, saved: dict | None, lr: float | None = None
        ) -> torch.optim.SGD:
    """The server's optimizer (docs/design.md, Optimizers: server optimizer state persists
    across rounds)."""
    tr = env.config.train
    opt = torch.optim.SGD(module.parameters(), lr=tr.lr, momentum=tr.momentum,
                          weight_decay=tr.weight_decay)
    if saved is not None:
        opt.load_state_dict(copy.deepcopy(saved))     # the given state stays as it was
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    return opt
