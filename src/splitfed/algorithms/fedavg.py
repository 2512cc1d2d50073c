"""FedAvg (McMahan et al., 2017), the FL baseline of papers 002, 003 and 004.

Each round the server broadcasts x_t to the sampled cohort S_t; every client n runs K
local SGD steps from x_t on its own data (K = local_steps, or ceil(D_n / B) * E, paper 002
Sec. 4.1) and uploads its model x_n; the server aggregates

    x_{t+1} = x_t + eta_g * sum_{n in S_t} w_n (x_n - x_t),

with w_n = a_n / sum_{S_t} a (a_n = D_n / D by default) for full, uniform and
with-replacement participation, and w_n = a_n / q_n under bernoulli participation
(paper 002 eq. 3). eta_g = 1 (default) is plain FedAvg.

Decisions (docs/design.md): plain SGD by default (momentum/weight decay are options of ``train``);
client optimizer state is fresh each round; BatchNorm buffers are averaged like
parameters; an empty cohort keeps the model. With a round deadline (docs/clock.md) the
clients whose model arrives late are left out and the others' weights renormalised
(bernoulli: just left out).

Variants are transforms, not subclasses (:mod:`splitfed.engine.transforms`): FedProx,
SCAFFOLD and FedCLG-C correct the local gradient, FedOpt and CLG-SGD change the server
step; ``algorithm.client_transforms`` / ``server_transforms`` add any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitfed.engine.algorithm import Algorithm
from splitfed.engine.rounds import Round


@dataclass
class FedAvgOptions:
    global_lr: float = field(default=1.0, metadata={"gt": 0, "help": "eta_g"})


class FedAvg(Algorithm):
    name = "fedavg"
    reference = "McMahan et al. 2017; paper 002 eq. 3 for bernoulli weights"
    Options = FedAvgOptions
    distributed = True
    uses_transforms = True

    def communicated(self, env, state: dict) -> dict:
        """The part of the global model sent to and trained by the clients (all of it;
        FedLoRA: the adapters and the head)."""
        return state["model"]

    def client_part(self, env, model: dict) -> dict:
        return self.communicated(env, {"model": model})

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        tr = env.config.train
        received = rnd.send(self.communicated(env, state))
        start = {**state["model"], **received}      # clients already hold the rest
        for chunk in env.executor(env.model).train(
                start, cohort.ids, rnd.steps, lr=env.lr(t), momentum=tr.momentum,
                weight_decay=tr.weight_decay, rng=env.streams.numpy("batches"),
                grad_hook=rnd.hook):
            rnd.upload(chunk.slots, {k: chunk.state[k] for k in received}, chunk.loss)
        return rnd.finish()
