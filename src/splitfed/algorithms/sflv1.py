"""SFL-V1: split federated learning with one server-side copy per client.

Paper 002 (Han et al., NeurIPS 2024), Appendix B, Algorithm 1. Each participating client
n holds the client-side model x_c,n and the main server holds a copy x_s,n of the
server-side model for it, both initialised from the global models. Every iteration i:

    client n:  h = h(x_c,n; zeta_n)             -> activations and labels up
    server:    g_s,n = grad_{x_s} F_n(h, x_s,n),  r_c,n = grad_h F_n(h, x_s,n)
               x_s,n <- x_s,n - eta g_s,n        -> r_c,n down (cut-layer gradient)
    client n:  x_c,n <- x_c,n - eta g_c,n       (chain rule through h with r_c,n)

Client models are aggregated every tau iterations (the round: tau = K local steps),
x_c <- sum_n (a_n / q_n) x_c,n (eq. 3; the engine's delta form); the server copies every
tau_tilde iterations, x_s <- sum_n (a_n / q_n) x_s,n, after which every copy restarts from
x_s (lines 20-23).

Decisions (docs/design.md): tau_tilde = tau by default, and then SFL-V1 equals FedAvg on the whole
model (tested). ``server_period`` sets tau_tilde; it must divide K (uniform
``local_steps``), so server aggregations fall inside a round. The client copies run
batched (stacked parameters, grouped convolutions), and so do the server copies: each
chunk of clients is served by one batched pass over its stacked server copies.
Server step size: ``server_lr`` (default: the client rate ``train.lr``).

Simulated time (docs/clock.md): each server copy runs on its client's own server lane.
With a round deadline, a client whose model arrives late is left out of the final
aggregation of both sides (its server copy too); the mid-round server averages of
``server_period`` include every copy.

Transforms (:mod:`splitfed.engine.transforms`): a gradient transform corrects the
clients' local steps on the client-side model; the server steps act on the whole
aggregate, client-side and server-side copies together (SFL-V1 with a FedAdam server
step is FedAdam on the whole model when tau_tilde = tau).

Recipe (docs/design.md, SFL training recipes): ``recipe="paper"`` (default) trains both
sides with ``train.momentum`` and ``train.weight_decay``, each client's optimizer and
each server copy's optimizer living for the round (a mid-round average of
``server_period`` resets the copies' weights, not their momentum buffers).
``recipe="released_code"`` is the authors' released code: the client side as before,
but the server copy's optimizer is re-created for every batch, so its momentum buffer
never builds; a fresh SGD's first step is x - eta (g + wd x), i.e. SGD without
momentum, and that is how the server copies step (still batched). With tau_tilde = tau
this recipe alone makes the result depend on the cut: the part of the model trained with
momentum grows with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.algorithm import Algorithm
from splitfed.engine.batches import gather
from splitfed.engine.clock import SERVER_COPY
from splitfed.engine.rounds import Round
from splitfed.engine.split import SplitModel, per_client_loss, return_gradients, send_activations
from splitfed.errors import ConfigError


@dataclass
class SFLV1Options:
    server_period: Optional[int] = field(default=None, metadata={
        "ge": 1, "le": 10**6,
        "help": "tau_tilde: server copies are averaged every this many iterations "
                "(null: once per round, tau_tilde = tau)"})
    server_lr: Optional[float] = field(default=None, metadata={
        "gt": 0, "help": "server step size (null: train.lr)"})
    recipe: Literal["paper", "released_code"] = field(default="paper", metadata={
        "help": "paper: Algorithm 1 as written, server copies keep their optimizer state "
                "for the round; released_code: the authors' released code, server "
                "copies' optimizer re-created every batch (no server momentum)"})


class _Chunk:
    """One chunk of the cohort: stacked client models and their stacked server copies."""

    def __init__(self, parts: SplitModel, client_start, server_start, slots, ids, steps,
                 plans, tr, env, recipe: str = "paper"):
        n = len(slots)
        self.slots, self.ids, self.steps, self.plans = slots, ids, steps, plans
        kw = {"momentum": tr.momentum, "weight_decay": tr.weight_decay, "ids": ids}
        self.client = env.stacked(parts.client, client_start, n, **kw)
        if recipe == "released_code":     # an optimizer per batch: SGD without momentum
            kw = {**kw, "momentum": 0.0}
        self.server = env.stacked(parts.server, server_start, n, role=SERVER_COPY, **kw)
        self.loss_sum = torch.zeros(n, dtype=torch.float64)

    def iterate(self, env, k: int, lr: float, server_lr: float, hook=None) -> None:
        """Local iteration ``k`` of every client in the chunk that is still working."""
        a = int((self.steps > k).sum())
        if a == 0:
            return
        ids = self.ids[:a]
        rows = torch.from_numpy(np.stack([p[k] for p in self.plans[:a]])).to(env.device)
        x, y = gather(env.data.train.x, rows), gather(env.data.train.y, rows)
        acts = self.client.forward(x, a)
        h, y_server = send_activations(env, ids, acts, y)
        losses = per_client_loss(self.server.forward(h, a), y_server)
        (grad_h,) = self.server.step(losses.sum(), lr=server_lr, extra_inputs=[h])
        self.client.step(acts, return_gradients(env, ids, grad_h), lr=lr,
                         ids=self.slots[:a], hook=hook)
        self.loss_sum[:a] += losses.detach().to(torch.float64).cpu()


class SFLV1(Algorithm):
    name = "sflv1"
    reference = "paper 002 (Han et al. 2024), Appendix B Algorithm 1"
    Options = SFLV1Options
    distributed = True
    split = True
    uses_transforms = True
    aggregates_all = True                 # client-side and server-side copies alike

    def server_copies(self, env, cohort) -> int:
        return cohort.size                # one server-side copy per participating slot

    def check(self, env) -> None:
        """server_period must divide every client's K, and the K of any two clients that
        can share a round must be equal (the condition ``round`` enforces per cohort)."""
        period = self.options.server_period
        if period is None:
            return
        steps = env.local_steps(np.arange(len(env.client_indices)))
        pc = env.config.participation
        single = pc.mode in ("uniform", "with_replacement") and pc.clients_per_round == 1
        if np.any(steps % period) or (not single and len(set(steps.tolist())) > 1):
            raise ConfigError(f"algorithm.server_period={period} must divide the number of "
                              f"local steps, which must be equal for all clients (got "
                              f"{sorted(set(steps.tolist()))}); use train.local_steps")

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        lr, server_lr = env.lr(t), env.lr(t, self.options.server_lr)
        parts = SplitModel.of(env)
        steps = rnd.steps
        period = self.options.server_period
        if period is not None and (len(set(steps.tolist())) > 1 or steps[0] % period):
            raise ConfigError(f"algorithm.server_period={period} must divide the number of "
                              f"local steps, which must be equal for all clients "
                              f"(got {sorted(set(steps.tolist()))}); use train.local_steps")
        server_global = parts.server_state(state["model"])
        executor = env.executor(parts.client)
        plans = executor.plans(cohort.ids, steps, env.streams.numpy("batches"))
        client_start = rnd.send(parts.client_state(state["model"]))
        chunks = (_Chunk(parts, client_start, server_global, slots, cohort.ids[slots],
                         steps[slots], [plans[s] for s in slots], env.config.train, env,
                         self.options.recipe)
                  for slots in executor.chunks(steps))
        hook = rnd.hook
        if period is None or period >= steps[0]:
            done = []
            for chunk in chunks:          # one chunk at a time: bounded memory
                for k in range(int(chunk.steps[0])):
                    chunk.iterate(env, k, lr, server_lr, hook)
                done.append(self._finish_chunk(env, chunk))
        else:
            chunks = list(chunks)         # lockstep: server copies averaged mid-round
            for k in range(int(steps[0])):
                for chunk in chunks:
                    chunk.iterate(env, k, lr, server_lr, hook)
                if (k + 1) % period == 0 and k + 1 < steps[0]:
                    server_global = self._average_servers(chunks, rnd.weights, server_global)
            done = [self._finish_chunk(env, c) for c in chunks]
        # the server part's delta is taken from its last average (x_t without mid-round ones)
        rnd.aggregate_against({**parts.client_state(state["model"]), **server_global})
        for chunk, uploaded in done:
            rnd.add(chunk.slots, {**uploaded, **chunk.server.final()},
                    chunk.loss_sum / torch.from_numpy(chunk.steps).to(torch.float64))
            rnd.collect(chunk.slots, chunk.client.final())
        return rnd.finish()

    @staticmethod
    def _finish_chunk(env, chunk):
        return chunk, env.transport.upload("model", chunk.ids, chunk.client.final())

    @staticmethod
    def _average_servers(chunks, weights, server_global):
        acc = DeltaAccumulator(server_global)
        for chunk in chunks:
            acc.add(weights[torch.from_numpy(chunk.slots)], chunk.server.final())
        mean = acc.result()
        for chunk in chunks:
            chunk.server.load_mean(mean)
        return mean
