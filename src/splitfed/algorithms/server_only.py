"""Server-only training (paper 004, Bian et al., Sec. VI-A4 baseline (1)) and the server's
local training of eq. (5), shared by every hybrid algorithm.

Each round t the server holds D_s^t: m_s samples drawn from its pool
(:mod:`splitfed.data.server_data`; ``server_data.*`` in the config). Server local training
(eq. 5) starts from a model x^s and takes E SGD steps on D_s^t,

    x^s_{e+1} = x^s_e - gamma_t g^s_e,   e = 0, ..., E-1,

with g^s_e the gradient on a minibatch of D_s^t (on all of D_s^t with
``server_data.full_batch``). Server-only applies it to the global model alone, without
clients (x^s = x_t); CLG-SGD, FedCLG and SCAFFOLD+ apply it after their aggregation, as
the server step ``server_train`` (docs/transforms.md).

Options (:class:`ServerTrainingOptions`):

- ``server_lr`` gamma (default null: ``train.lr``; the paper tunes both from the same
  grid). The round's rate is ``env.lr(t, gamma)``: the Sec. VI schedule (``train.lr_decay``
  0.99 per round down to ``train.lr_min`` 0.001) applies to it as to the clients' rate.
- ``server_epochs`` E (default 1): ceil(m_s / B_s) * E steps per round (the experiments'
  "server local epoch"; one step per epoch with ``full_batch``), or ``server_steps``: E
  steps exactly (eq. 5 counts steps: e = 0, ..., E-1, one minibatch each; the prose of
  Algorithm 1 and Sec. VI calls E epochs, docs/algorithms/server_only.md). 0 turns
  server training off in the hybrid algorithms; server-only, which has nothing else to
  train, refuses it (:class:`ServerOnlyOptions`).
- ``server_batch_size`` B_s (default null: ``train.batch_size``; Sec. VI uses the same
  batch size at the server and the clients). Given, it is at most the m_s samples of
  D_s^t (as ``train.batch_size`` is at most the clients' samples;
  :func:`splitfed.config.check_against_data`); ``train.batch_size`` taken as B_s may
  exceed m_s, and a batch then repeats samples, as a client's does.

Batches: a stream of shuffled passes over D_s^t, every batch of exactly B_s samples (as
the clients', :mod:`splitfed.engine.batches`), drawn from the ``server_data`` stream.
Per round that stream gives, in this order: the D_s^t draw, the batch of FedCLG's server
gradient g_s (FedCLG only), the plan of the E server steps.

Decisions (docs/design.md): plain SGD by default; ``train.momentum`` and ``train.weight_decay`` also
apply to the server, whose momentum buffer persists across rounds
(``state["server_momentum"]``). BatchNorm layers train in training mode and their buffers
are updated by the server's forward passes. The server's compute is reported as
``server_samples`` (and ``server_loss``, the mean loss of its steps); in simulated time it
runs on the server's shared lane after the round's client models have arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from splitfed.engine.algorithm import Algorithm
from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.engine.clock import SERVER
from splitfed.engine.participation import NOBODY
from splitfed.engine.rounds import Round, RoundResult
from splitfed.engine.transforms import ServerStep
from splitfed.errors import ConfigError


@dataclass
class ServerTrainingOptions:
    server_lr: float | None = field(default=None, metadata={
        "gt": 0, "help": "gamma, the server's learning rate (null: train.lr)"})
    server_epochs: float | None = field(default=None, metadata={
        "ge": 0, "le": 10**4, "help": "E server epochs (passes over D_s^t) per round "
                                      "(default 1; 0: none, not for server_only)"})
    server_steps: int | None = field(default=None, metadata={
        "ge": 0, "le": 10**6, "help": "E server SGD steps per round, as eq. 5 counts E "
                                      "(exclusive with server_epochs; 0: none, not for "
                                      "server_only)"})
    server_batch_size: int | None = field(default=None, metadata={
        "ge": 1, "le": 10**6, "help": "B_s (null: train.batch_size); at most the samples of "
                                      "D_s^t (server_data.samples_per_round, or the pool)"})

    def __post_init__(self):
        if self.server_steps is None and self.server_epochs is None:
            self.server_epochs = 1.0
        elif self.server_steps is not None and self.server_epochs is not None:
            raise ConfigError("set only one of server_steps and server_epochs (got "
                              f"server_steps={self.server_steps}, server_epochs="
                              f"{self.server_epochs}); set the other to null")


class ServerTrain(ServerStep):
    """Eq. (5) on the round's model: E SGD steps on D_s^t at rate gamma_t (module doc)."""

    name = "server_train"
    reference = "Bian et al. (paper 004), eq. 5"
    Options = ServerTrainingOptions
    needs_server_data = True
    aggregates = False
    on_empty = True

    @property
    def key(self) -> str:
        return "server_momentum"          # the server's momentum buffers, when it has some

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """The server's momentum buffers exist from its first step with momentum on."""
        if isinstance(saved, dict) and "server_momentum" in saved and "model" in template:
            names = [k for k, p in env.model.named_parameters() if p.requires_grad]
            template = {**template, "server_momentum": {n: template["model"][n] for n in names}}
        return template

    def batch_size(self, env) -> int:
        return int(self.options.server_batch_size or env.config.train.batch_size)

    def batches(self, env, rows: np.ndarray, steps: int) -> np.ndarray:
        """[steps, B_s] minibatches of D_s^t, or D_s^t itself per step (full batch)."""
        if env.server_data.full_batch:
            return np.tile(rows, (steps, 1))
        return batch_plan(rows, steps, self.batch_size(env), env.streams.numpy("server_data"))

    def step_count(self, env, rows: np.ndarray) -> int:
        o = self.options
        if o.server_steps is not None:
            return int(o.server_steps)
        if o.server_epochs == 0:
            return 0
        batch = len(rows) if env.server_data.full_batch else self.batch_size(env)
        return int(local_step_counts(np.array([len(rows)]), batch, None, o.server_epochs)[0])

    def update(self, ctx, model):
        """E SGD steps of the global model on D_s^t at rate gamma_t (eq. 5)."""
        env, rows = ctx.env, ctx.round.server_rows
        steps = self.step_count(env, rows)
        if steps == 0:
            return model
        plan = self.batches(env, rows, steps)
        tr, server = env.config.train, env.server_data
        net = env.stacked(env.model, model, 1, momentum=tr.momentum,
                          weight_decay=tr.weight_decay, ids=np.zeros(0, dtype=np.int64),
                          role=SERVER)  # no client
        names = net.param_names
        if ctx.state is not None:
            net.opt.buffers = [ctx.state[n].unsqueeze(0).clone() for n in names]
        lr = env.lr(ctx.t, self.options.server_lr)
        x, y = server.x, server.y
        total = torch.zeros((), dtype=torch.float64)
        for batch in torch.from_numpy(plan).to(x.device):
            out = net.forward(x[batch].unsqueeze(0))
            loss = F.cross_entropy(out[0], y[batch])
            net.step(loss, lr=lr)
            total += loss.detach().double().cpu()
        if net.opt.buffers is not None:
            ctx.state = {n: b[0].clone() for n, b in zip(names, net.opt.buffers)}
        ctx.metrics["server_loss"] = float(total) / steps
        ctx.server_samples += plan.size
        return {k: v[0].clone() for k, v in net.final().items()}


@dataclass
class ServerOnlyOptions(ServerTrainingOptions):
    """Server-only's options: those of server training, with E >= 1 (the server is all
    that trains: E = 0 would train nothing)."""

    def __post_init__(self):
        super().__post_init__()
        for key in ("server_epochs", "server_steps"):
            if getattr(self, key) == 0:
                raise ConfigError(f"{key}=0 would train nothing (server_only has no clients; "
                                  f"0 turns off the server training of the hybrid "
                                  f"algorithms); give {key} > 0")




class ServerOnly(Algorithm):
    """Paper 004 Sec. VI baseline (1): the server trains on D_s^t alone (eq. 5 from x_t)."""

    name = "server_only"
    reference = "Bian et al. (paper 004), Sec. VI baseline (1); eq. 5 without clients"
    Options = ServerOnlyOptions
    federated = False
    distributed = True

    def transforms(self):
        return [], [ServerTrain(self.options)]

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, NOBODY)   # the server alone
        result = rnd.finish()
        if not result.server_model_samples:
            return result
        return RoundResult(result.state, result.metrics["server_loss"],
                           result.server_model_samples)
