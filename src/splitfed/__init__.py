"""splitfed: split learning, split federated learning and federated learning.

Plugins register their own components with :func:`register_algorithm`,
:func:`register_model`, :func:`register_dataset`, :func:`register_partitioner` and
:func:`register_clock_profile` (:mod:`splitfed.registry`, docs/extending.md).
"""

__version__ = "0.1.0"

from splitfed.registry import (register_algorithm, register_clock_profile,  # noqa: E402
                               register_dataset, register_model, register_partitioner)

__all__ = ["register_algorithm", "register_clock_profile", "register_dataset",
           "register_model", "register_partitioner"]
