"""splitfed: split learning, split federated learning and federated learning.

Plugins register their own components with :func:`register_algorithm`,
:func:`register_model`, :func:`register_dataset`, :func:`register_partitioner`,
:func:`register_clock_profile` and :func:`register_transform`
(:mod:`splitfed.registry`, docs/extending.md).
"""

__version__ = "0.1.0"

from splitfed.registry import (register_algorithm, register_clock_profile,  # noqa: E402
                               register_dataset, register_model, register_partitioner,
                               register_transform)

__all__ = ["register_algorithm", "register_clock_profile", "register_dataset",
           "register_model", "register_partitioner", "register_transform"]
