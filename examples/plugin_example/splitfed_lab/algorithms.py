"""``fedavgm``: FedAvg with server momentum (Hsu et al. 2019).

The server keeps a momentum buffer of the aggregated client deltas:
``v = beta v + Delta_t``, ``x_{t+1} = x_t + global_lr v``; ``beta = 0`` is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitfed import register_algorithm
from splitfed.algorithms.fedavg import FedAvg, FedAvgOptions


@dataclass
class FedAvgMOptions(FedAvgOptions):
    server_momentum: float = field(default=0.9, metadata={"ge": 0, "lt": 1,
                                                          "help": "beta"})


@register_algorithm("fedavgm")
class FedAvgM(FedAvg):
    name = "fedavgm"
    reference = "Hsu et al. 2019, FedAvg with server momentum (splitfed_lab plugin)"
    Options = FedAvgMOptions
    distributed = True            # clients train through the engine (FedAvg's round)

    def init_state(self, env) -> dict:
        state = super().init_state(env)
        names = [n for n, _ in env.model.named_parameters()]
        state["momentum"] = {n: torch.zeros_like(state["model"][n]) for n in names}
        return state

    def round(self, env, state, t, cohort):
        # server_update writes this round's own copy; the incoming state stays intact
        return super().round(env, {**state, "momentum": dict(state["momentum"])}, t,
                             cohort)

    @torch.no_grad()
    def server_update(self, env, state, acc):
        new = acc.result(1.0)                  # buffers: FedAvg's aggregate
        delta = acc.delta()
        beta, lr = self.options.server_momentum, self.options.global_lr
        momentum = state["momentum"]
        for name in list(momentum):
            momentum[name] = beta * momentum[name] + delta[name]
            new[name] = state["model"][name] + lr * momentum[name]
        return new
