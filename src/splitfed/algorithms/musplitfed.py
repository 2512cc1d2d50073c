"""MU-SplitFed: zeroth-order split federated learning with unbalanced server updates.

Paper 001 (Liang et al. 2025), Algorithm 1, eqs. (3)-(7); defaults from Table 6. Per round
each participating client m draws one minibatch xi_m (``train.batch_size``, 32 in the
paper) and a direction u_c on the sphere of radius sqrt(d_c), and sends (eq. 4)

    h = h(x_c; xi),  h+ = h(x_c + lambda u_c; xi),  h- = h(x_c - lambda u_c; xi).

The server copy x_s,m (from the global server model) takes tau ZO steps on the
unperturbed h, each with a fresh u_s (eq. 5):

    G_s = (F(x_s + lambda u_s, h) - F(x_s - lambda u_s, h)) / (2 lambda) * u_s,
    x_s <- x_s - eta_s G_s,

then returns one scalar per direction, delta_c = F(x_s^tau, h+) - F(x_s^tau, h-) (eq. 6),
and the client steps x_c <- x_c - eta_c delta_c / (2 lambda) u_c. Both sides aggregate
with the global rate (eq. 7 with its sign corrected, docs/design.md: the printed minus
would ascend):

    x <- x + eta_g sum_m w_m (x_m - x).

Decisions (docs/design.md) and options: ``directions`` q > 1 averages q estimates (the client then
sends 2q + 1 activation tensors and receives q scalars); ``direction_kind`` gaussian;
``client_order``/``server_order`` "first" replace a side's ZO estimate by the true
gradient (ablation: a first-order client receives the cut-layer gradient instead of the
scalars). tau = 1 is vanilla SplitFed with ZO (paper 001's baseline). ``adaptive_tau``
sets tau every round by eq. (12), tau = t_straggler / t_server, read from the virtual
clock (rounded down, at least 1, at most ``max_tau``; every record has ``tau``).
``server_lr_over_tau`` (not in Algorithm 1; our option) takes server steps of eta_s / tau,
the scaling the paper's Theorems 4.1 and 4.3 require (eta_s = eta_c / tau); with it the
server copy moves about as far per round for every tau (docs/results/paper001.md). eta_c is
``train.lr`` (Table 6: 0.005); eta_s ``server_lr`` (0.01); eta_g ``global_lr`` (0.3);
lambda ``smoothing`` (0.005). Under ``train.lr_decay`` / ``lr_min`` both step sizes of
round t, eta_c^t and eta_s^t, follow the schedule (``env.lr``); eta_g stays.
Aggregation weights w_m are the engine's (a_n / sum a by default; the paper uses 1/M,
which ``participation.weighting=uniform`` gives). One local
step per round by definition: ``train.local_steps``/``local_epochs`` do not apply.
Directions are regenerated from per-round seeds, never stored beyond a step. With
``in_place`` both sides perturb their parameters in place and regenerate each direction
in chunks (``engine/zo.py``, MeZO's trick): the client then holds its parameters, one
noise chunk and its activations, nothing of the size of a second model (what
``benchmarks/client_memory.py --zo-mode inplace`` measures); the numbers drawn differ from the
default's, the distribution does not. BatchNorm
buffers are not perturbed; running statistics are updated only by the unperturbed client
forward pass. The whole cohort perturbs and evaluates in batched passes (no autograd), in
calls of about ``engine.chunk_size`` clients (default: about 512 samples per call on a
CPU, at least 8 clients per call; the values of one call, bit for bit:
``cohort_forward_chunked``).

Simulated time (docs/clock.md): every forward pass is charged (B x forward MACs per copy;
a first-order ablation's backward 2 x more), the clients' on their timelines and the
server copies' on per-client server lanes; the ZO update itself costs no MACs. The
record's ``server_macs`` counts the server copies' passes: 2 tau q + 2 q per sample with
zeroth-order sides (with the adaptive tau, the round's); its ``client_macs`` the
clients': 2 q + 1 forward passes per sample with a zeroth-order client, 1 + 3 (h, then
a forward and a backward pass for the gradient) with a first-order one. With a round
deadline a client whose model arrives late is left out of both aggregations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from splitfed.engine import zo
from splitfed.engine.algorithm import Algorithm
from splitfed.engine.clock import CLIENT, SERVER_COPY
from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.engine.rounds import Round
from splitfed.engine.split import (SplitModel, per_client_loss, return_gradients,
                                   zeroth_order_client_macs, zeroth_order_cut_bytes)
from splitfed.engine.stacked import ForwardCopies
from splitfed.rng import derive_seed


@dataclass
class MUSplitFedOptions:
    tau: int = field(default=2, metadata={
        "ge": 1, "le": 10**4,
        "help": "server ZO steps per round"})
    global_lr: float = field(default=0.3, metadata={"gt": 0, "help": "eta_g (Table 6)"})
    server_lr: float = field(default=0.01, metadata={"gt": 0, "help": "eta_s (Table 6)"})
    smoothing: float = field(default=0.005, metadata={"gt": 0, "help": "lambda (Table 6)"})
    directions: int = field(default=1, metadata={
        "ge": 1, "le": 10**4,
        "help": "q directions averaged"})
    direction_kind: Literal["sphere", "gaussian"] = field(default="sphere", metadata={
        "help": "ZO directions u: uniform on the sphere of radius sqrt(d) or with N(0, 1) "
                "entries (gaussian); both have E[u u^T] = I"})
    client_order: Literal["zeroth", "first"] = field(default="zeroth", metadata={
        "help": "zeroth: the client's ZO step (eqs. 4, 6); first: its true gradient, from "
                "the cut-layer gradient the server returns (ablation)"})
    server_order: Literal["zeroth", "first"] = field(default="zeroth", metadata={
        "help": "zeroth: the server copies' ZO steps (eq. 5); first: true-gradient steps "
                "(ablation)"})
    adaptive_tau: bool = field(default=False, metadata={
        "help": "tau = t_straggler / t_server from the clock every round (eq. 12)"})
    max_tau: int = field(default=8, metadata={
        "ge": 1, "le": 10**4,
        "help": "cap of the adaptive tau"})
    server_lr_over_tau: bool = field(default=False, metadata={
        "help": "server steps of eta_s / tau (Theorems 4.1/4.3: eta_s = O(1/tau)), "
                "so that tau changes the noise of a round, not its length"})
    in_place: bool = field(default=False, metadata={
        "help": "perturb parameters in place, directions regenerated in chunks (MeZO): no "
                "direction or perturbed copy is stored (other random numbers)"})


class MUSplitFed(Algorithm):
    name = "musplitfed"
    reference = "paper 001 (Liang et al. 2025), Algorithm 1, eqs. (3)-(7), Table 6"
    Options = MUSplitFedOptions
    distributed = True
    split = True
    aggregates_all = True                 # client copies and server copies, eta_g
    fixed_local_steps = 1                 # one client step a round (module docstring)
    plain_steps = True                    # x - eta G on both sides: no momentum, no decay

    def server_copies(self, env, cohort) -> int:
        return cohort.size                # one server copy x_s,m per participant

    def cut_bytes(self, env, activation_bytes, label_bytes, steps, t=None):
        """A zeroth-order client sends h, h+ and h- of each direction (2 q + 1 tensors) and
        the labels, and receives q scalars; a first-order one (``client_order: first``)
        sends h and the labels and receives the gradient of h."""
        if self.options.client_order == "zeroth":
            return zeroth_order_cut_bytes(env, self.options.directions, activation_bytes,
                                          label_bytes, steps)
        return super().cut_bytes(env, activation_bytes, label_bytes, steps, t)

    def client_macs(self, env, macs_per_sample, steps, t=None):
        """A zeroth-order client runs 2 q + 1 forward passes of its batch (h, and h+- of
        each direction) and no backward pass; a first-order one (``client_order: first``)
        runs the forward pass for h, then a forward and a backward pass for the gradient
        of its step (1 + ``TRAIN_FACTOR`` forward passes)."""
        if self.options.client_order == "zeroth":
            return zeroth_order_client_macs(env, self.options.directions, macs_per_sample,
                                            steps)
        forward = macs_per_sample // TRAIN_FACTOR
        return steps * env.config.train.batch_size * (1 + TRAIN_FACTOR) * forward

    def _seeds(self, base: int, side: str, step: int) -> list[int]:
        return [derive_seed(base, f"{side}/{step}/{j}") for j in range(self.options.directions)]

    @torch.no_grad()
    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        o, tr = self.options, env.config.train
        parts = SplitModel.of(env)
        ids, n = cohort.ids, cohort.size
        base = int(env.streams.numpy("zo").integers(2**62))
        rows = np.stack(env.executor(parts.client).plans(ids, np.ones(n, np.int64),
                                                         env.streams.numpy("batches")))
        rows = torch.from_numpy(rows[:, 0]).to(env.device)
        x, y = env.data.train.x[rows], env.data.train.y[rows]
        start = rnd.send(parts.client_state(state["model"]))
        chunk = env.config.engine.chunk_size
        client = ForwardCopies(parts.client, start, n, clock=env.clock, role=CLIENT, ids=ids,
                               placement=env.placement, chunk_size=chunk)
        server = ForwardCopies(parts.server, parts.server_state(state["model"]), n,
                               clock=env.clock, role=SERVER_COPY, ids=ids,
                               placement=env.placement, chunk_size=chunk)
        lam, c_seeds = o.smoothing, self._seeds(base, "client", 0)
        h = client.forward(x, update_stats=True)
        sent, scales = [h], []
        if o.client_order == "zeroth":
            perturbed, scales = zo.probe(lambda p: client.forward(x, p), client.params(),
                                         c_seeds, lam, o.direction_kind, o.in_place)
            sent += perturbed
        received = [env.transport.upload("activations", ids, a) for a in sent]
        y_s = env.transport.upload("labels", ids, y)
        h_s = received[0]
        tau = self._adaptive_tau(env, ids, parts.server, h_s) if o.adaptive_tau else o.tau
        losses = self._server_steps(server, h_s, y_s, base, tau, env.lr(t, o.server_lr))
        self._client_step(env, client, server, received, y_s, ids, c_seeds, scales, x,
                          env.lr(t))
        up = env.transport.upload("model", ids, client.state)
        rnd.aggregate_against(state["model"])       # client copies and server copies
        rnd.add(np.arange(n), {**up, **server.state})
        return rnd.finish(train_loss=float(losses.mean()), samples=n * tr.batch_size,
                          server_macs=server.charged, client_macs=client.charged,
                          metrics={"tau": tau})

    def _adaptive_tau(self, env, ids, server_module, h) -> int:
        """Paper 001 eq. (12): tau = t_straggler / t_server, rounded down, in [1, max_tau].

        t_straggler: seconds from the round's start (``clock.round_start``: after any wait
        for a client to come online, which is not a straggler's time)
        until the last participant's activations and labels have reached the server;
        t_server: seconds of one server update of one client's copy on its lane (2 q
        forward passes of the batch, or a forward and a backward when first-order)."""
        o = self.options
        passes = TRAIN_FACTOR if o.server_order == "first" else 2 * o.directions
        macs = env.clock.batch_macs(server_module, h.shape)
        t_server = passes * macs / env.clock.profiles.server_compute
        t_straggler = float(env.clock.arrival_time(ids).max()) - env.clock.round_start
        return int(min(o.max_tau, max(1, np.floor(t_straggler / t_server))))

    def _server_steps(self, server: ForwardCopies, h, y, base: int, tau: int,
                      server_lr: float) -> torch.Tensor:
        """tau server updates of step ``server_lr`` (eta_s of the round, or eta_s / tau) on
        the unperturbed activations; returns the first losses."""
        o = self.options
        lr = server_lr / tau if o.server_lr_over_tau else server_lr
        first = None
        for i in range(tau):
            seeds = self._seeds(base, "server", i)
            if o.server_order == "first":
                grads = server.first_order_grads(h, y)
                loss = per_client_loss(server.forward(h), y)
                server.step(grads, lr)
            elif o.in_place:
                evals = zo.zo_step_(lambda: per_client_loss(server.forward(h), y),
                                    server.params(), o.smoothing, seeds, lr,
                                    o.direction_kind)
                loss = torch.stack(evals).mean(0)
            else:
                evals = []

                def loss_fn(params):
                    out = per_client_loss(server.forward(h, params), y)
                    evals.append(out)
                    return out
                grads = zo.zo_gradient(loss_fn, server.params(), o.smoothing, seeds,
                                       o.direction_kind)
                loss = torch.stack(evals).mean(0)
                server.step(grads, lr)
            first = loss if first is None else first
        return first

    def _client_step(self, env, client, server, received, y, ids, seeds, scales, x,
                     lr) -> None:
        o = self.options
        if o.client_order == "first":
            with torch.enable_grad():
                h = received[0].detach().requires_grad_(True)
                loss = per_client_loss(server.forward(h, [p.detach() for p in server.params()]),
                                       y)
                (g_h,) = torch.autograd.grad(loss.sum(), h)
                grads = client.first_order_grads(x, grad_out=return_gradients(env, ids, g_h))
            client.step(grads, lr)
            return
        deltas = torch.stack([per_client_loss(server.forward(received[1 + 2 * j]), y)
                              - per_client_loss(server.forward(received[2 + 2 * j]), y)
                              for j in range(len(seeds))], dim=1)          # [C, q]
        deltas = env.transport.download("scalars", ids, deltas)
        zo.descend_(client.params(), seeds, deltas / (2 * o.smoothing), lr, o.direction_kind,
                    scales)
