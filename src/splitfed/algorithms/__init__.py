"""The algorithm registry: one line per algorithm.

Adding an algorithm: its file here, one line below, its page under ``docs/algorithms/``;
the conformance tests pick it up from this registry.
"""

from splitfed.algorithms.centralized import Centralized
from splitfed.algorithms.fedavg import FedAvg
from splitfed.errors import ConfigError

ALGORITHMS = {
    "centralized": Centralized,
    "fedavg": FedAvg,
}


def get_algorithm(name: str):
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; "
                          f"available: {', '.join(sorted(ALGORITHMS))}") from None


def algorithm_names() -> list[str]:
    return sorted(ALGORITHMS)
