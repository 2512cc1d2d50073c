"""``trimmed_mean``: coordinate-wise trimmed-mean aggregation, a robust aggregation rule
written as one server step that reads each client's upload.

For every coordinate of every parameter, of the n uploads aggregated in a round, the
b = floor(beta n) largest and the b smallest values are dropped and the other n - 2b are
averaged (unweighted):

    x_{t+1}[j] = mean of the middle n - 2b of {x_1[j], ..., x_n[j]}

the coordinate-wise trimmed mean of Yin, Chen, Ramchandran and Bartlett, "Byzantine-
Robust Distributed Learning: Towards Optimal Statistical Rates" (ICML 2018), Definition 2
and Algorithm 1 (option II). Yin et al. aggregate gradients, one step per round; here the
rule takes the place of the average of the models the clients upload after their local
steps, as robust-aggregation baselines of federated learning use it. beta < 1/2, so at
least one value is left. Integer buffers take the plain aggregate. beta = 0 is the
unweighted mean of the uploads, i.e. FedAvg when the clients' weights are equal.

Config: ``algorithm.server_transforms: [{name: trimmed_mean, beta: 0.1}]`` on any
algorithm that ``uses_transforms``; on a split algorithm it aggregates the part the
clients upload (and SFL-V1's server copies with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from splitfed import register_transform
from splitfed.engine.transforms import ServerStep


@dataclass
class TrimmedMeanOptions:
    beta: float = field(default=0.1, metadata={
        "ge": 0, "lt": 0.5, "help": "fraction of the uploads trimmed at each end, per coordinate"})


@register_transform("trimmed_mean")
class TrimmedMean(ServerStep):
    """Coordinate-wise beta-trimmed mean of the clients' uploads (module doc)."""

    name = "trimmed_mean"
    reference = "Yin et al. 2018 (ICML), Definition 2, Algorithm 1 option II"
    Options = TrimmedMeanOptions
    needs_uploads = True          # the round keeps every upload: ctx.aggregate.uploads()

    @torch.no_grad()
    def update(self, ctx, model):
        new = ctx.aggregate.result(1.0)            # buffers: the plain aggregate
        up = ctx.aggregate.uploads()
        n = len(up)
        if n == 0:                                 # everyone dropped: x_t stays
            return new
        b = math.floor(self.options.beta * n)
        for name, values in up.values.items():
            if values.is_floating_point():
                ordered = values.to(torch.float64).sort(dim=0).values
                new[name] = ordered[b:n - b].mean(dim=0).to(values.dtype)
        ctx.metrics["trimmed"] = float(2 * b)
        return new
