"""``clip_norm``: per-client gradient norm clipping, a federated-learning variant written
as one gradient transform.

Every local step of every client rescales that client's gradient (all the parameters it
trains, taken together as one vector g) to norm at most c before the optimizer step:

    g <- g * min(1, c / ||g||)

the norm clipping rule of Pascanu, Mikolov and Bengio, "On the difficulty of training
recurrent neural networks" (ICML 2013), Sec. 3.2, Algorithm 1. Applied on the clients of
FedAvg it is local SGD with local gradient clipping and periodic averaging, the CELGC
algorithm of Liu, Zhuang, Lei and Liao, "A Communication-Efficient Distributed Gradient
Clipping Algorithm for Training Deep Neural Networks" (NeurIPS 2022). On a split
algorithm (``sflv2``, ``psl``) it clips the client-side gradient only.

Config: ``algorithm.client_transforms: [{name: clip_norm, max_norm: 1.0}]`` on any
algorithm that ``uses_transforms`` (``splitfed list`` names the transforms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitfed import register_transform
from splitfed.engine.transforms import GradientTransform


@dataclass
class ClipOptions:
    max_norm: float = field(default=1.0, metadata={"gt": 0, "help": "c, the largest norm"})


@register_transform("clip_norm")
class ClipNorm(GradientTransform):
    """g <- g min(1, c / ||g||) on each client's whole gradient at every local step."""

    name = "clip_norm"
    reference = "Pascanu et al. 2013 (ICML), Sec. 3.2 Algorithm 1; CELGC (Liu et al. 2022)"
    Options = ClipOptions

    def start(self, env, state, t, cohort, round_):
        c = float(self.options.max_norm)

        def clip(names, params, grads, slots):    # grads: [clients, ...] per parameter
            norm = sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads).sqrt()
            scale = (c / norm.clamp(min=1e-12)).clamp(max=1.0)
            return [g * scale.view(-1, *[1] * (g.dim() - 1)) for g in grads]
        return clip
