"""Centralized SGD: the reference every federated algorithm is compared with.

One model, plain ``torch.optim.SGD`` (momentum and weight decay from ``train``), trained
on the union of all clients' training data. A "round" is K steps with K = local_steps,
or ceil(N / B) * local_epochs over the N pooled samples. Batches come from the same
sampler as the clients' (a stream of shuffled epochs, every batch of exactly B samples),
so FedAvg with one client holding all data and one local step makes exactly the same step.
No client exists: nothing crosses the transport. Simulated time: every step runs on the
server's shared lane (docs/clock.md).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from splitfed.engine.algorithm import Algorithm
from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.engine.clock import SERVER
from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.engine.rounds import RoundResult
from splitfed.models import sequential


class Centralized(Algorithm):
    name = "centralized"
    reference = "plain minibatch SGD on the pooled data (the reference)"
    federated = False

    def init_state(self, env) -> dict:
        model, tr = copy.deepcopy(env.model), env.config.train
        opt = torch.optim.SGD(model.parameters(), lr=tr.lr, momentum=tr.momentum,
                              weight_decay=tr.weight_decay)
        return {"module": model, "optimizer": opt}

    def eval_model(self, env, state):
        return state["module"]

    def round(self, env, state, t, cohort):
        model, opt = state["module"], state["optimizer"]
        tr = env.config.train
        pool = np.sort(np.concatenate(env.client_indices))
        steps = int(local_step_counts(np.array([len(pool)]), tr.batch_size,
                                      tr.local_steps, tr.local_epochs)[0])
        plan = batch_plan(pool, steps, tr.batch_size, env.streams.numpy("batches"))
        x, y = env.data.train.x, env.data.train.y
        model.train()
        for group in opt.param_groups:
            group["lr"] = env.lr(t)
        total = 0.0
        for rows in torch.from_numpy(plan).to(x.device):
            env.clock.charge(SERVER, model, None, x[rows], passes=TRAIN_FACTOR, stacked=False)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(sequential.forward_train(model, x[rows]), y[rows])
            loss.backward()
            opt.step()
            total += float(loss.detach())
        return RoundResult(state, total / steps, steps * tr.batch_size)
