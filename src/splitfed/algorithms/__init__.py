"""The algorithm and transform registries: one line each.

Adding an algorithm: its file here, one line below, its page under ``docs/algorithms/``;
the conformance tests pick it up from this registry. Adding a transform (a gradient
correction or a server step, :mod:`splitfed.engine.transforms`): one line in
``TRANSFORMS``; every algorithm that ``uses_transforms`` takes it from the config.
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

ALGORITHMS = {
    "centralized": Centralized,
    "clgsgd": CLGSGD,
    "csefsl": CSEFSL,
    "fedavg": FedAvg,
    "fedclg_c": FedCLGC,
    "fedclg_s": FedCLGS,
    "fedlora": FedLoRA,
    "fedopt": FedOpt,
    "fedprox": FedProx,
    "gas": GAS,
    "musplitfed": MUSplitFed,
    "scaffold": Scaffold,
    "scaffold_plus": ScaffoldPlus,
    "server_only": ServerOnly,
    "sflv1": SFLV1,
    "sflv2": SFLV2,
    "sl": SL,
}


TRANSFORMS = {t.name: t for t in (
    # gradient transforms (client side)
    Proximal, ScaffoldControls, ClientCorrection, AggregateCorrection,
    # server steps: one aggregating step, then steps that train further
    Rate, Momentum, AdaptiveStep, ServerTrain)}


def get_algorithm(name: str):
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; "
                          f"available: {', '.join(sorted(ALGORITHMS))}") from None


def algorithm_names() -> list[str]:
    return sorted(ALGORITHMS)


def get_transform(name, where: str):
    try:
        return TRANSFORMS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{where}.name: unknown transform {name!r}; "
                          f"available: {', '.join(sorted(TRANSFORMS))}") from None
