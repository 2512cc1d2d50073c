"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

Algorithm 2 of the paper: FedAvg in which client n, starting from the global model x_t,
(inexactly) minimises the proximal local objective (eq. 2)

    h_n(x; x_t) = F_n(x) + mu/2 * ||x - x_t||^2,

so every local SGD step uses the gradient g_n(x) + mu * (x - x_t):

    x <- x - eta * (g_n(x) + mu * (x - x_t)).

At the first local step x = x_t and the step is FedAvg's. The server aggregates exactly as
FedAvg (``global_lr`` = eta_g, default 1; weights and participation modes as FedAvg).

Options: ``mu`` (default 0.01, >= 0); ``mu = 0`` is FedAvg, bit for bit (no hook runs);
the term is the gradient transform ``prox`` of every algorithm (docs/transforms.md).

Decisions (docs/design.md): the proximal term acts on parameters only; BatchNorm buffers are not
parameters, are never pulled towards x_t and are averaged like parameters. The term is
added to the minibatch gradient before the optimizer, so with ``train.weight_decay`` it is
added to the decayed gradient and with ``train.momentum`` it enters the momentum buffer
(the paper assumes plain SGD, the default). Client optimizer state is fresh each round.
The paper's variable local work (gamma-inexact solutions, dropped stragglers) is not
modelled here: every client runs its K steps (``local_steps`` or ``local_epochs``).
Communication is FedAvg's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitfed.algorithms.fedavg import FedAvg
from splitfed.engine.algorithm import variant
from splitfed.engine.transforms import GradientTransform


class Proximal(GradientTransform):
    """g + mu (x - x_t) on every parameter, x_t the model the client started from."""

    name, reference = "prox", "Li et al. 2020 (MLSys), eq. 2"

    @dataclass
    class Options:
        mu: float = field(default=0.01, metadata={"ge": 0, "help": "proximal weight mu"})

    def start(self, env, state, t, cohort, round_):
        mu = float(self.options.mu)
        return None if mu == 0.0 else lambda names, params, grads, slots: [
            torch.add(g, p - round_.start[n], alpha=mu) for n, p, g in zip(names, params, grads)]


FedProx = variant("FedProx", FedAvg, name="fedprox", gradient=[Proximal],
                  reference="Li et al. 2020 (MLSys), Algorithm 2, eq. 2")
