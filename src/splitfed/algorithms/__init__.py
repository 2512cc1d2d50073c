"""The algorithm and transform registries (keyed by the classes' ``name``).

Adding an algorithm: its file here, its class below, its page under ``docs/algorithms/``;
the conformance tests pick it up from this registry. A transform (docs/transforms.md):
its class in ``TRANSFORMS``; every algorithm that ``uses_transforms`` takes it.
Then regenerate the catalog ``splitfed list`` prints: ``python -m splitfed.catalog``.
"""

from splitfed.algorithms.centralized import Centralized
from splitfed.algorithms.clgsgd import CLGSGD
from splitfed.algorithms.csefsl import CSEFSL
from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.fedclg import AggregateCorrection, ClientCorrection, FedCLGC, FedCLGS
from splitfed.algorithms.fedlora import FedLoRA
from splitfed.algorithms.fedopt import AdaptiveStep, FedOpt
from splitfed.algorithms.fedprox import FedProx, Proximal
from splitfed.algorithms.gas import GAS
from splitfed.algorithms.musplitfed import MUSplitFed
from splitfed.algorithms.scaffold import Scaffold, ScaffoldControls
from splitfed.algorithms.scaffold_plus import ScaffoldPlus
from splitfed.algorithms.server_only import ServerOnly, ServerTrain
from splitfed.algorithms.sflv1 import SFLV1
from splitfed.algorithms.sflv2 import SFLV2
from splitfed.algorithms.sl import SL
from splitfed.engine.transforms import Momentum, Rate
from splitfed.errors import ConfigError

ALGORITHMS = {a.name: a for a in (
    Centralized, CLGSGD, CSEFSL, FedAvg, FedCLGC, FedCLGS, FedLoRA, FedOpt, FedProx, GAS,
    MUSplitFed, Scaffold, ScaffoldPlus, ServerOnly, SFLV1, SFLV2, SL)}

TRANSFORMS = {t.name: t for t in (
    Proximal, ScaffoldControls, ClientCorrection, AggregateCorrection,   # gradient
    Rate, Momentum, AdaptiveStep, ServerTrain)}                           # server steps


def get_algorithm(name: str):
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; "
                          f"available: {', '.join(sorted(ALGORITHMS))}") from None
