"""SCAFFOLD (Karimireddy et al., ICML 2020, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", Algorithm 1 with option II control variates).

The server holds the model x and a control variate c; every client i holds its own
control c_i (all zeros at the start). Each round the server sends (x, c) to the sampled
cohort S; client i runs K_i local steps from y_i = x with the corrected gradient

    y_i <- y_i - eta_l (g_i(y_i) - c_i + c),

then updates its control with option II,

    c_i^+ = c_i - c + (x - y_i) / (K_i eta_l),

and uploads (y_i - x, c_i^+ - c_i). The server sets

    x <- x + eta_g * sum_{i in S} w_i (y_i - x)
    c <- c + sum_{i in S} a_i (c_i^+ - c_i).

eta_l is ``train.lr``; K_i is client i's own step count (``local_steps``, or
ceil(D_i / B) * E). The model update is FedAvg's (weights w_i, ``global_lr`` eta_g,
default 1). The paper's control update c <- c + |S|/N * mean_S (c_i^+ - c_i) =
c + (1/N) sum_S Delta c_i is the case a_i = 1/N (``participation.weighting=uniform``);
with the default data-size weights a_i = D_i / D we keep the matching invariant
c = sum_n a_n c_n, so that c - c_i estimates grad f - grad f_i for the objective
f = sum_n a_n f_n that the weighted model update descends. Under bernoulli participation c
still uses a_i (not a_i / q_i): the server knows exactly which controls changed.

The controls are the gradient transform ``scaffold`` (docs/transforms.md). Decisions
(docs/design.md and what the paper leaves open):

- Controls are kept for parameters only, never for BatchNorm buffers (those are averaged
  like parameters by FedAvg's aggregation). ``state["scaffold"]["control"]`` holds c
  and ``state["scaffold"]["client_controls"]`` the stacked c_i, [N, ...] per parameter
  (the clients' own memory, simulated on the server side).
- Communication doubles: c is broadcast with the model and the control deltas are uploaded
  with it, both as ``model`` transfers, so the ledger shows 2x FedAvg's model bytes (for a
  model without buffers).
- The paper assumes plain SGD (the default). The correction c - c_i is added to the
  minibatch gradient before the optimizer: with ``train.weight_decay`` the decay is part
  of the local objective; with ``train.momentum`` the corrected gradient enters the
  momentum buffer. Option II is applied literally, so (x - y_i) / (K_i eta_l) is the mean
  applied step, which then includes decay and the momentum amplification.
- A client drawn several times in one round (``with_replacement``) trains once per slot
  from the same c_i; every slot uploads and is aggregated into x like in FedAvg, and its
  control update is the mean of its slots' control deltas, applied once (so
  c = sum_n a_n c_n still holds).
- A round with an empty cohort keeps x, c and every c_i.
- With a round deadline (docs/clock.md) a client whose model upload arrives late (its
  control delta follows it) is dropped from both: x aggregates the kept clients, and
  only their controls change (c_i and c's term of a late client stay as they were).
"""

from __future__ import annotations

import numpy as np
import torch

from splitfed.algorithms.fedavg import FedAvg
from splitfed.engine.algorithm import variant
from splitfed.engine.participation import base_weights
from splitfed.engine.transforms import GradientRound, GradientTransform


class ScaffoldControls(GradientTransform):
    """SCAFFOLD's control variates on the clients' trained part (module doc)."""

    name = "scaffold"
    reference = "Karimireddy et al. 2020 (ICML), Algorithm 1, option II"

    def init(self, env, params):
        n = env.num_clients
        return {"control": {k: torch.zeros_like(v) for k, v in params.items()},
                "client_controls": {k: v.new_zeros(n, *v.shape) for k, v in params.items()}}

    def message_bytes(self, env, part_bytes):
        """c down and Delta c_i up, each the size of the trained part."""
        return part_bytes, part_bytes

    def start(self, env, state, t, cohort, round_):
        c = env.transport.broadcast("model", cohort.ids, state["control"])
        return _ControlRound(env, state, c, t, cohort)


class _ControlRound(GradientRound):
    def __init__(self, env, state, c, t, cohort):
        self.env, self.state, self.c, self.t, self.cohort = env, state, c, t, cohort
        self.deltas = {k: v.new_zeros(cohort.size, *v.shape) for k, v in c.items()}
        self.cache: dict[bytes, list[torch.Tensor]] = {}

    def update(self, names, params, grads, slots):
        """g + c - c_i for the active clients (corrections cached per slot pattern)."""
        key = np.asarray(slots).tobytes()
        if key not in self.cache:
            ci = self.state["client_controls"]
            rows = torch.from_numpy(np.asarray(self.cohort.ids[slots], dtype=np.int64))
            self.cache[key] = [self.c[n] - ci[n].index_select(0, rows.to(ci[n].device))
                               for n in names]
        return torch._foreach_add(grads, self.cache[key])

    @torch.no_grad()
    def collect(self, slots, final):
        """Option II: c_i^+ - c_i = (x - y_i) / (K_i eta_l) - c, uploaded per slot."""
        env, ids = self.env, self.cohort.ids[slots]
        steps = env.local_steps(self.cohort.ids)[slots]
        x, scale = self.start, torch.from_numpy(1.0 / (steps * float(env.lr(self.t))))
        dc = {}
        for name, cn in self.c.items():
            s = scale.to(cn).view(-1, *([1] * cn.dim()))
            dc[name] = (x[name] - final[name]) * s - cn
        on_time = env.clock.on_time(ids)   # as decided for the model upload
        uploaded = env.transport.upload("model", ids, dc)
        rows = torch.from_numpy(np.asarray(slots)[on_time])
        for name, d in self.deltas.items():
            d[rows.to(d.device)] = uploaded[name][torch.from_numpy(on_time)]

    @torch.no_grad()
    def finish(self):
        """c_i <- c_i + Delta c_i (mean over a client's slots); c <- c + sum a_i Delta c_i."""
        env, state = self.env, self.state
        ids, inverse = np.unique(self.cohort.ids, return_inverse=True)
        counts = torch.from_numpy(np.bincount(inverse))
        a = torch.from_numpy(base_weights(env.data_sizes, env.config.participation.weighting))
        rows, inv = torch.from_numpy(ids), torch.from_numpy(inverse.reshape(-1))
        control, clients = {}, {}
        for name, d in self.deltas.items():
            per_client = d.new_zeros(len(ids), *d.shape[1:]).index_add_(0, inv.to(d.device), d)
            per_client /= counts.to(d).view(-1, *([1] * (d.dim() - 1)))
            ci = state["client_controls"][name]
            clients[name] = ci.index_add(0, rows.to(ci.device), per_client)
            w = a[rows].to(per_client)
            control[name] = state["control"][name] + torch.tensordot(w, per_client, dims=1)
        return {"control": control, "client_controls": clients}


Scaffold = variant("Scaffold", FedAvg, name="scaffold", gradient=[ScaffoldControls],
                   reference="Karimireddy et al. 2020 (ICML), Algorithm 1, option II")
