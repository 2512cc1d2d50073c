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

The hooks ``grad_hook`` (a correction of the local gradient), ``client_results`` (what
the server does with each chunk of clients' final states) and ``server_update`` (what the
server does with the aggregated delta) are where FedProx, SCAFFOLD and FedOpt plug in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.algorithm import Algorithm


@dataclass
class FedAvgOptions:
    global_lr: float = field(default=1.0, metadata={"gt": 0, "help": "eta_g"})


class FedAvg(Algorithm):
    name = "fedavg"
    reference = "McMahan et al. 2017; paper 002 eq. 3 for bernoulli weights"
    Options = FedAvgOptions
    distributed = True

    def grad_hook(self, env, state, cohort):
        """A local-gradient correction, or None (plain local SGD)."""
        return

    def client_results(self, env, state: dict, t: int, cohort, chunk) -> None:
        """Sees each chunk's final client states after upload (SCAFFOLD's controls)."""
        return

    def server_update(self, env, state: dict, acc: DeltaAccumulator) -> dict:
        """The new global model from the aggregated client deltas."""
        return acc.result(self.options.global_lr)

    def communicated(self, env, state: dict) -> dict:
        """The part of the global model sent to and trained by the clients (all of it;
        FedLoRA: the adapters and the head)."""
        return state["model"]

    def round(self, env, state, t, cohort):
        if cohort.is_empty():
            return state, {}
        tr = env.config.train
        executor = env.executor(env.model)
        sent = self.communicated(env, state)
        received = env.transport.broadcast("model", cohort.ids, sent)
        received = {**state["model"], **received}  # clients already hold the rest
        # the hooks see the model as the clients received it (on the multi-process
        # runtime a client rank's own state["model"] is not the global model)
        local = {**state, "model": received}
        acc = DeltaAccumulator(sent, renormalise=env.clock.renormalise)
        losses = torch.zeros(cohort.size, dtype=torch.float64)
        weights = torch.tensor(cohort.weights, dtype=torch.float64)
        steps = env.local_steps(cohort.ids)
        samples = int(steps.sum()) * tr.batch_size
        for chunk in executor.train(received, cohort.ids, steps,
                                    lr=env.lr(t), momentum=tr.momentum,
                                    weight_decay=tr.weight_decay,
                                    rng=env.streams.numpy("batches"),
                                    grad_hook=self.grad_hook(env, local, cohort)):
            uploaded = env.transport.upload("model", chunk.client_ids,
                                            {k: chunk.state[k] for k in sent})
            acc.add(weights[torch.from_numpy(chunk.slots)], uploaded,
                    keep=env.clock.on_time(chunk.client_ids))
            losses[torch.from_numpy(chunk.slots)] = chunk.loss.to(torch.float64).cpu()
            self.client_results(env, local, t, cohort, chunk)
        new_state = {**state, "model": {**state["model"],
                                        **self.server_update(env, state, acc)}}
        return new_state, {"train_loss": float(losses.mean()), "samples": samples}
