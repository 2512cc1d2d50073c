"""The algorithm registry: one line per algorithm.

Adding an algorithm: its file here, one line below, its page under ``docs/algorithms/``;
the conformance tests pick it up from this registry.
"""

from splitfed.algorithms.centralized import Centralized
from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.fedopt import FedOpt
from splitfed.algorithms.fedprox import FedProx
from splitfed.algorithms.scaffold import Scaffold
from splitfed.algorithms.sflv1 import SFLV1
from splitfed.algorithms.sflv2 import SFLV2
from splitfed.algorithms.sl import SL
from splitfed.errors import ConfigError

ALGORITHMS = {
    "centralized": Centralized,
    "fedavg": FedAvg,
    "fedopt": FedOpt,
    "fedprox": FedProx,
    "scaffold": Scaffold,
    "sflv1": SFLV1,
    "sflv2": SFLV2,
    "sl": SL,
}


def get_algorithm(name: str):
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; "
                          f"available: {', '.join(sorted(ALGORITHMS))}") from None


def algorithm_names() -> list[str]:
    return sorted(ALGORITHMS)
