"""FedOpt: FedAdam, FedYogi, FedAdagrad (Reddi et al., ICLR 2021, "Adaptive Federated
Optimization", Algorithm 2).

Clients run K local SGD steps from x_t exactly as in FedAvg. The server treats the
aggregated client delta as a pseudo-gradient (Algorithm 2, lines 10-15):

    Delta_t = sum_{n in S_t} w_n (x_n - x_t)
    m_t     = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t     = v_{t-1} + Delta_t^2                                        (FedAdagrad)
    v_t     = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)  (FedYogi)
    v_t     = beta2 v_{t-1} + (1 - beta2) Delta_t^2                      (FedAdam)
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

elementwise, with m_{-1} = 0 and v_{-1} = ``v_init`` (the paper requires v_{-1} >= tau^2;
default tau^2, which must fit float32: without ``v_init``, tau <= 1.8e19). There is no
bias correction, as in the paper; FedAdagrad ignores beta2.
The paper's Delta_t is the plain mean over S; we use FedAvg's weights w_n (data-size by
default, a_n / q_n under bernoulli participation), which is the paper's mean for
``participation.weighting=uniform`` with full or uniform participation.

Options (defaults): ``server_optimizer`` "adam" (or "yogi", "adagrad"), ``server_lr`` eta
0.01, ``beta1`` 0.9, ``beta2`` 0.99, ``tau`` 1e-3 (the adaptivity), ``v_init`` null
(= tau^2). beta1 = 0.9 and beta2 = 0.99 are the paper's experimental settings; the best
eta and tau depend on the task (the paper grid-searches both). eta is the paper's constant
server rate: ``train.lr_decay`` / ``lr_min`` schedule the clients' step size eta_l only
(as every global rate applied to a round's aggregate, ``env.lr``).

The server step is ``fedopt``, which every algorithm with clients takes
(docs/transforms.md).

Decisions (docs/design.md): the server optimizer state (m, v) lives in the algorithm state
(``state["fedopt"]``) and persists across rounds; client optimizer state is fresh
each round. The adaptive update acts on parameters only: BatchNorm buffers take FedAvg's
aggregate (weighted average; integer counters the maximum). A round with an empty cohort
keeps the model and the optimizer state. Communication is FedAvg's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from splitfed.algorithms.fedavg import FedAvg
from splitfed.configtools import FLOAT32_MAX
from splitfed.engine.algorithm import variant
from splitfed.engine.transforms import ServerStep
from splitfed.errors import ConfigError


@dataclass
class FedOptOptions:
    server_optimizer: Literal["adam", "yogi", "adagrad"] = field(
        default="adam", metadata={"help": "FedAdam, FedYogi or FedAdagrad"})
    server_lr: float = field(default=0.01, metadata={"gt": 0, "help": "server rate eta"})
    beta1: float = field(default=0.9, metadata={"ge": 0, "lt": 1, "help": "momentum"})
    beta2: float = field(default=0.99, metadata={"ge": 0, "lt": 1,
                                                 "help": "second moment (adam, yogi)"})
    tau: float = field(default=1e-3, metadata={"gt": 0, "help": "adaptivity tau"})
    v_init: float | None = field(default=None, metadata={
        "ge": 0, "help": "v_{-1} (null: tau^2)"})

    def __post_init__(self):
        if self.v_init is None and self.tau ** 2 > FLOAT32_MAX:
            raise ConfigError(f"tau={self.tau!r} gives v_{{-1}} = tau^2 = {self.tau ** 2:.3g} "
                              f"(v_init null), beyond float32's largest {FLOAT32_MAX:.3g}; "
                              f"lower tau (at most {math.sqrt(FLOAT32_MAX):.3g}) or set "
                              "v_init")


class AdaptiveStep(ServerStep):
    """Algorithm 2 lines 10-15 on the aggregated delta (module doc)."""

    name = "fedopt"
    reference = "Reddi et al. 2021 (ICLR), Algorithm 2"
    Options = FedOptOptions

    def init(self, env, params):
        o = self.options
        v0 = o.tau ** 2 if o.v_init is None else o.v_init
        return {"m": {n: torch.zeros_like(p) for n, p in params.items()},
                "v": {n: torch.full_like(p, v0) for n, p in params.items()}}

    @torch.no_grad()
    def update(self, ctx, model):
        o = self.options
        new = ctx.aggregate.result(1.0)          # buffers: FedAvg's aggregate
        delta = ctx.aggregate.delta()
        ref = ctx.aggregate.reference
        m_new, v_new = {}, {}
        for name, m in ctx.state["m"].items():
            d, v = delta[name], ctx.state["v"][name]
            d2 = d * d
            m = o.beta1 * m + (1 - o.beta1) * d
            if o.server_optimizer == "adagrad":
                v = v + d2
            elif o.server_optimizer == "yogi":
                v = v - (1 - o.beta2) * d2 * torch.sign(v - d2)
            else:
                v = o.beta2 * v + (1 - o.beta2) * d2
            new[name] = ref[name] + o.server_lr * m / (v.sqrt() + o.tau)
            m_new[name], v_new[name] = m, v
        ctx.state = {"m": m_new, "v": v_new}
        return new


def _init(self, options=None, *, client_transforms=(), server_transforms=()):
    """FedOpt's own server step is ``fedopt``: an aggregating step among
    ``server_transforms`` (which would replace it) is refused with what to write instead."""
    given = list(server_transforms)
    agg = [s for s in given if s.aggregates]
    if len(agg) == 1 and given[0] is agg[0]:
        if agg[0].name == AdaptiveStep.name:
            raise ConfigError("algorithm.server_transforms: fedopt already has its own step "
                              "'fedopt'; remove it from server_transforms and give its "
                              "options (server_optimizer, server_lr, beta1, beta2, tau, "
                              "v_init) under algorithm")
        raise ConfigError(f"algorithm.server_transforms: fedopt moves its model with its own "
                          f"step 'fedopt', which {agg[0].name!r} would replace; keep fedopt "
                          f"without it, or use fedavg with server_transforms [{agg[0].name}]")
    FedAvg.__init__(self, options, client_transforms=client_transforms,
                    server_transforms=server_transforms)


FedOpt = variant("FedOpt", FedAvg, name="fedopt", step=AdaptiveStep,
                 reference="Reddi et al. 2021 (ICLR), Algorithm 2 (FedAdagrad, FedYogi, FedAdam)",
                 __init__=_init)
