"""``psl``: parallel split learning, a split algorithm written with the round helper.

Jeon and Kim, "Privacy-Sensitive Parallel Split Learning" (ICOIN 2020). In every local
iteration all the clients of the cohort forward a batch through their client-side model
in parallel and send the activations (and labels) up; the server concatenates the
cohort's activations into one joint batch, takes ONE step of its single server-side model
on the mean loss over all the joint batch's samples, and sends each client the cut-layer
gradient of its part; the clients step. At the end of the round the client-side models
are averaged with the cohort's weights (FedAvg's aggregation, through the server steps of
:class:`~splitfed.engine.rounds.Round`); the server keeps its model.

Decisions: a client receives the cut-layer gradient of its own batch's mean loss (the
cohort size times its part of the joint mean loss's gradient), so that the mean of the
clients' steps is the joint batch's step, as in SFL-V1. The server's optimizer state
persists across rounds; ``server_lr`` defaults to ``train.lr``. Simulated time charges
the joint step to the server's lane as the clients' batches served in cohort order
(each client's reply leaves when its share is done, slightly before the joint step ends).
The server computes in this process, so the class is not ``distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from splitfed import register_algorithm
from splitfed.engine.algorithm import Algorithm
from splitfed.engine.clock import SERVER
from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.engine.rounds import Round
from splitfed.engine.split import (SplitModel, per_client_loss, return_gradients,
                                   send_activations, server_opt_template, sgd, sgd_step)


@dataclass
class PSLOptions:
    server_lr: Optional[float] = field(default=None, metadata={
        "gt": 0, "help": "the server's step size (null: train.lr)"})


@register_algorithm("psl")
class ParallelSplitLearning(Algorithm):
    name = "psl"
    reference = "Jeon and Kim 2020 (ICOIN), parallel split learning"
    Options = PSLOptions
    split = True                  # the clients hold the first model.cut blocks
    uses_transforms = True        # the clients' steps run the gradient transforms
    state_keys = ("model", "server_opt")   # no transform may take these names

    def init_state(self, env) -> dict:
        return {**super().init_state(env), "server_opt": None}

    def checkpoint_template(self, env, template, saved):
        # a resumed run's server_opt is checked against the server's SGD before any
        # file of the run directory changes (None in init_state accepts anything)
        return server_opt_template(env, super().checkpoint_template(env, template, saved))

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        tr, parts = env.config.train, SplitModel.of(env)
        order = np.argsort(-rnd.steps, kind="stable")   # the clients still working: a prefix
        steps, ids = rnd.steps[order], cohort.ids[order]
        plans = env.executor(parts.client).plans(cohort.ids, rnd.steps,
                                                 env.streams.numpy("batches"))
        start = rnd.send(parts.client_state(state["model"]))
        clients = env.stacked(parts.client, start, cohort.size, ids=ids,
                              momentum=tr.momentum, weight_decay=tr.weight_decay)
        server = parts.server_module(parts.server_state(state["model"]))
        opt = sgd(server, env, state["server_opt"])
        loss_sum = torch.zeros(cohort.size, dtype=torch.float64)
        for k in range(int(steps[0])):
            a = int((steps > k).sum())
            rows = torch.from_numpy(np.stack([plans[s][k] for s in order[:a]]))
            rows = rows.to(env.device)
            acts = clients.forward(env.data.train.x[rows], a)       # all clients at once
            h, y = send_activations(env, ids[:a], acts, env.data.train.y[rows])
            env.clock.charge(SERVER, server, ids[:a], h, passes=TRAIN_FACTOR)
            losses = per_client_loss(server(h.flatten(0, 1)).unflatten(0, (a, -1)), y)
            params = list(server.parameters())
            *g_server, g_h = torch.autograd.grad(losses.mean(), params + [h])
            sgd_step(opt, params, g_server, env.lr(t, self.options.server_lr))
            down = return_gradients(env, ids[:a], g_h * a)     # each its own mean loss's
            clients.step(acts, down, lr=env.lr(t), ids=order[:a], hook=rnd.hook)
            loss_sum[:a] += losses.detach().to(torch.float64).cpu()
        rnd.upload(order, clients.final(), loss_sum / torch.from_numpy(steps))
        server_state = {k: v.detach().clone() for k, v in server.state_dict().items()}
        return rnd.finish(state={"model": server_state, "server_opt": opt.state_dict()})
