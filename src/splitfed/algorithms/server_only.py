"""Server-only training (paper 004, Bian et al., Sec. VI-A4 baseline (1)) and the server's
local training of eq. (5), shared by every hybrid algorithm.

Each round t the server holds D_s^t: m_s samples drawn from its pool
(:mod:`splitfed.data.server_data`; ``server_data.*`` in the config). Server local training
(eq. 5) starts from a model x^s and takes E SGD steps on D_s^t,

    x^s_{e+1} = x^s_e - gamma_t g^s_e,   e = 0, ..., E-1,

with g^s_e the gradient on a minibatch of D_s^t (on all of D_s^t with
``server_data.full_batch``). Server-only applies it to the global model alone, without
clients (x^s = x_t); CLG-SGD, FedCLG and SCAFFOLD+ apply it after their aggregation.

Options (:class:`ServerTrainingOptions`):

- ``server_lr`` gamma (default null: ``train.lr``; the paper tunes both from the same
  grid). The round's rate is ``env.lr(t, gamma)``: the Sec. VI schedule (``train.lr_decay``
  0.99 per round down to ``train.lr_min`` 0.001) applies to it as to the clients' rate.
- ``server_epochs`` E (default 1): ceil(m_s / B_s) * E steps per round (the experiments'
  "server local epoch"; one step per epoch with ``full_batch``), or ``server_steps``: E
  steps exactly (eq. 5 counts steps). 0 turns server training off.
- ``server_batch_size`` B_s (default null: ``train.batch_size``; Sec. VI uses the same
  batch size at the server and the clients).

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
from splitfed.engine.stacked import StackedModel
from splitfed.errors import ConfigError


@dataclass
class ServerTrainingOptions:
    server_lr: float | None = field(default=None, metadata={
        "gt": 0, "help": "gamma, the server's learning rate (null: train.lr)"})
    server_epochs: float | None = field(default=None, metadata={
        "ge": 0, "le": 10**4, "help": "E server epochs on D_s^t per round (default 1; 0: none)"})
    server_steps: int | None = field(default=None, metadata={
        "ge": 0, "le": 10**6, "help": "E server steps per round (exclusive with server_epochs)"})
    server_batch_size: int | None = field(default=None, metadata={
        "ge": 1, "le": 10**6, "help": "B_s (null: train.batch_size)"})

    def __post_init__(self):
        if self.server_steps is None and self.server_epochs is None:
            self.server_epochs = 1.0
        elif self.server_steps is not None and self.server_epochs is not None:
            raise ConfigError("set only one of server_steps and server_epochs (got "
                              f"server_steps={self.server_steps}, server_epochs="
                              f"{self.server_epochs}); set the other to null")


class ServerTraining:
    """Mixin: D_s^t each round, client work (the next class's ``round``), then eq. (5)."""

    #: build_environment carves the server's pool for algorithms that set this
    needs_server_data = True

    def round(self, env, state, t, cohort):
        rows = self.draw_server_data(env)
        new, metrics = self.client_round(env, state, t, cohort, rows)
        new, server = self.server_train(env, new, t, rows)
        out = {**metrics, **server}
        if "server_samples" in metrics or "server_samples" in server:
            out["server_samples"] = (metrics.get("server_samples", 0)
                                     + server.get("server_samples", 0))
        return new, out

    def client_round(self, env, state, t, cohort, rows):
        """The clients' part of the round (FedAvg's or SCAFFOLD's round by default)."""
        return super().round(env, state, t, cohort)

    # ------------------------------------------------------------------ server data

    def _server(self, env):
        if env.server_data is None:
            raise ConfigError(f"algorithm {self.name!r} needs server data, but the "
                              "environment has none (build it with build_environment)")
        return env.server_data

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """The server's momentum buffers exist from its first step with momentum on."""
        template = super().checkpoint_template(env, template, saved)
        if isinstance(saved, dict) and "server_momentum" in saved and "model" in template:
            names = [k for k, p in env.model.named_parameters() if p.requires_grad]
            template = {**template, "server_momentum": {n: template["model"][n] for n in names}}
        return template

    def draw_server_data(self, env) -> np.ndarray:
        """D_s^t: indices into the training set."""
        return self._server(env).draw(env.streams.numpy("server_data"))

    def server_batch_size(self, env) -> int:
        return int(self.options.server_batch_size or env.config.train.batch_size)

    def server_batches(self, env, rows: np.ndarray, steps: int) -> np.ndarray:
        """[steps, B_s] minibatches of D_s^t, or D_s^t itself per step (full batch)."""
        if self._server(env).full_batch:
            return np.tile(rows, (steps, 1))
        return batch_plan(rows, steps, self.server_batch_size(env),
                          env.streams.numpy("server_data"))

    def server_step_count(self, env, rows: np.ndarray) -> int:
        o = self.options
        if o.server_steps is not None:
            return int(o.server_steps)
        if o.server_epochs == 0:
            return 0
        batch = len(rows) if self._server(env).full_batch else self.server_batch_size(env)
        return int(local_step_counts(np.array([len(rows)]), batch, None, o.server_epochs)[0])

    # ------------------------------------------------------------------ eq. (5)

    def server_train(self, env, state: dict, t: int, rows: np.ndarray):
        """E SGD steps of the global model on D_s^t at rate gamma_t (eq. 5)."""
        steps = self.server_step_count(env, rows)
        if steps == 0:
            return state, {}
        plan = self.server_batches(env, rows, steps)
        tr, server = env.config.train, self._server(env)
        model = StackedModel(env.model, state["model"], 1, momentum=tr.momentum,
                             weight_decay=tr.weight_decay, clock=env.clock,
                             ids=np.zeros(0, dtype=np.int64), role=SERVER)  # no client
        names = model.param_names
        if "server_momentum" in state:
            model.opt.buffers = [state["server_momentum"][n].unsqueeze(0).clone()
                                 for n in names]
        lr = env.lr(t, self.options.server_lr)
        x, y = server.x, server.y
        total = torch.zeros((), dtype=torch.float64)
        for batch in torch.from_numpy(plan).to(x.device):
            out = model.forward(x[batch].unsqueeze(0))
            loss = F.cross_entropy(out[0], y[batch])
            model.step(loss, lr=lr)
            total += loss.detach().double().cpu()
        new = {**state, "model": {k: v[0].clone() for k, v in model.final().items()}}
        if model.opt.buffers is not None:
            new["server_momentum"] = {n: b[0].clone() for n, b in zip(names, model.opt.buffers)}
        return new, {"server_loss": float(total) / steps, "server_samples": plan.size}


class ServerOnly(ServerTraining, Algorithm):
    """Paper 004 Sec. VI baseline (1): the server trains on D_s^t alone (eq. 5 from x_t)."""

    name = "server_only"
    reference = "Bian et al. (paper 004), Sec. VI baseline (1); eq. 5 without clients"
    Options = ServerTrainingOptions
    federated = False
    distributed = True

    def round(self, env, state, t, cohort):
        rows = self.draw_server_data(env)
        new, server = self.server_train(env, state, t, rows)
        if not server:
            return new, {}
        return new, {"train_loss": server["server_loss"],
                     "samples": server["server_samples"]}
