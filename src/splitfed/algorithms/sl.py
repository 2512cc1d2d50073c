"""SL: sequential split learning with a global learning rate.

Paper 003 ("Convergence Analysis of Split Learning on Non-IID Data"), Algorithm 1.
Each round the server samples S and a random update order. Client i requests the latest
client-side model (the round's global model x_c for i = 1, the model left by client i-1
otherwise) and runs K local steps with the server:

    client i:  h = h(x_c,i; xi)                 -> activations and labels up
    server:    x_s <- x_s - eta_l g_s           -> cut-layer gradient down
    client i:  x_c,i <- x_c,i - eta_l g_c

The server model continues across clients. After the last client, both sides take the
global step of eq. (4): x^{r+1} = x^r + eta_g (x_{|S|}^{(r,K)} - x^r). eta_g = 1
(default) is vanilla SL. (The public code of paper 003 has a --global-lr flag that it never
applies; we apply it, docs/design.md.)

Decisions (docs/design.md): plain SGD by default; a client's optimizer state is fresh
(each client is its own device), the server's persists across clients and rounds. Option
``server_optimizer``: ``per_round`` makes the server's state new every round,
``per_client`` new at every client's turn, as the public code of paper 003 does (it builds
the server's optimizer inside each client's local update); with momentum, ``per_client``
is sequential training of the whole model with a fresh optimizer per client. Without
momentum and weight decay the three are the same.
Transfers per client: the client-side model down (request) and up (hand-over),
activations and labels up and cut-layer gradients down at every step. SL is sequential
by definition: the cohort is not batched, each step runs one plain forward/backward of
batch B.

Simulated time (docs/clock.md): the server's steps run on its shared lane, and client
i's turn starts when client i-1's model has reached the server. With a round deadline, a
client whose turn would start after it does not run; a client whose hand-over arrives
after it is dropped: the round keeps the client-side model of the last hand-over made in
time, while the server keeps the updates it made with the late client. Transforms
(docs/transforms.md): server steps replace eq. (4) on the whole model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

from splitfed.engine.algorithm import Algorithm
from splitfed.engine.batches import batch_plan
from splitfed.engine.rounds import Round, SingleDelta
from splitfed.engine.split import (SplitModel, sequential_turn, server_opt_template, sgd,
                                   take_turn)


@dataclass
class SLOptions:
    global_lr: float = field(default=1.0, metadata={
        "gt": 0, "help": "eta_g of eq. (4); 1 is vanilla SL"})
    server_optimizer: Literal["persistent", "per_round", "per_client"] = field(
        default="persistent", metadata={
            "help": "lifetime of the server's optimizer state (momentum buffers): "
                    "persistent: the whole run; per_round: new every round; per_client: "
                    "new at every client's turn, as paper 003's public code does"})


class SL(Algorithm):
    name = "sl"
    reference = "paper 003, Algorithm 1 (split learning with a global learning rate)"
    Options = SLOptions
    distributed = True
    split = True
    uses_transforms = True
    aggregates_all = True                 # the last hand-over and the server model
    state_keys = ("model", "server_opt")

    def init_state(self, env) -> dict:
        return {**super().init_state(env), "server_opt": None}

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """A saved ``server_opt`` is the server optimizer's state dict (or None)."""
        return server_opt_template(env, super().checkpoint_template(env, template, saved))

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        tr, start = env.config.train, state["model"]
        parts, client, server = self._modules(env, start)
        client_params = list(client.parameters())
        server_params = list(server.parameters())
        # the client module's own tensors (parameters and buffers), in state_dict order:
        # hand-overs are copied into them in place instead of through load_state_dict
        tensors = dict(client.state_dict(keep_vars=True))
        lr = env.lr(t)
        keep = self.options.server_optimizer
        stateless = tr.momentum == 0 and tr.weight_decay == 0
        server_opt = sgd(server, env, state["server_opt"] if keep == "persistent" else None, lr)
        perm = env.streams.numpy("order").permutation(cohort.size)
        order, steps = cohort.ids[perm], rnd.steps[perm]
        rng = env.streams.numpy("batches")
        x_all, y_all = env.data.train.x, env.data.train.y
        losses, samples = [], 0
        handed = parts.client_state(start)       # the last hand-over made in time
        for slot, cid, k_steps in zip(perm, order, steps):
            ids = np.array([cid])
            plan = torch.from_numpy(batch_plan(env.client_indices[cid], int(k_steps),
                                               tr.batch_size, rng)).to(env.device)
            received = take_turn(env, cid, {k: v.detach() for k, v in tensors.items()})
            if received is None:                 # the turn would start after the deadline
                continue
            _copy_into(tensors, received)
            rnd.begin(np.array([slot]), rnd.grad and {k: v.clone() for k, v in received.items()})
            # a fresh optimizer per client (its own device); plain SGD keeps no state
            client_opt = None if stateless else torch.optim.SGD(
                client_params, lr=lr, momentum=tr.momentum, weight_decay=tr.weight_decay)
            if keep == "per_client":
                server_opt = sgd(server, env, None, lr)
            batches = ((x_all.index_select(0, rows), y_all.index_select(0, rows))
                       for rows in plan)
            total = sequential_turn(env, client, client_params, client_opt, server,
                                    server_params, server_opt, int(cid), batches, lr,
                                    hook=rnd.hook, slot=slot)
            final = {k: v.detach().unsqueeze(0) for k, v in tensors.items()}
            uploaded = env.transport.upload("model", ids, final)
            rnd.collect(np.array([slot]), final)
            _copy_into(tensors, {k: v[0] for k, v in uploaded.items()})  # what arrived
            if env.clock.on_time(ids)[0]:
                handed = {k: v.detach().clone() for k, v in tensors.items()}
            losses.append(total / int(k_steps))
            samples += int(k_steps) * tr.batch_size
        rnd.aggregate_against(SingleDelta(start, {**handed, **server.state_dict()}))
        saved = server_opt.state_dict() if keep == "persistent" else None
        result = rnd.finish(state={"server_opt": saved}, samples=samples)
        return replace(result, train_loss=float(np.mean(losses)) if losses else None)

    def _modules(self, env, start):
        """The split parts and the trainable client and server modules holding
        ``start``: made (deep copies of the templates) on the first round of ``env``,
        then reused, with ``start`` copied into them in place: no round keeps a
        reference to their tensors (the round's result is new tensors, its hand-overs
        clones)."""
        cached = getattr(self, "_module_cache", None)
        if cached is not None and cached[0]() is env:
            _, parts, client, server = cached
            _copy_into(dict(client.state_dict(keep_vars=True)), parts.client_state(start))
            _copy_into(dict(server.state_dict(keep_vars=True)), parts.server_state(start))
            client.train()
            server.train()
            return parts, client, server
        parts = SplitModel.of(env)
        client = parts.client_module(parts.client_state(start))
        server = parts.server_module(parts.server_state(start))
        self._module_cache = (weakref.ref(env), parts, client, server)
        return parts, client, server


@torch.no_grad()
def _copy_into(tensors: dict[str, torch.Tensor], values) -> None:
    """``module.load_state_dict(values)`` for the module whose state tensors are
    ``tensors`` (same keys), as one fused in-place copy."""
    dst = list(tensors.values())
    src = [values[k] for k in tensors]
    if any(d.data_ptr() != v.data_ptr() for d, v in zip(dst, src)):
        torch._foreach_copy_(dst, src)
