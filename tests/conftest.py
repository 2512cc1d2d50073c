import os
import sys

import pytest
import torch
from hypothesis import settings

# The tests are packages (tests.<subpackage>.test_*, mirroring src/splitfed), so test files
# in different directories may share a name; tests/ itself also goes on sys.path, at the
# end, so that ``from helpers import ...`` works from every directory.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

# CI runs the property and fuzz tests on fixed examples (the same every run, no example
# database), so a submission's result does not depend on the draw; locally they explore.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Two threads, as CI's 2-core machine runs; fewer when OMP_NUM_THREADS asks for fewer (on a
# shared machine two spinning OpenMP threads per process slow down many times over as soon
# as another process wants a core: docs/performance.md).
_threads = os.environ.get("OMP_NUM_THREADS", "")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1,
                                 int(_threads) if _threads.isdigit() else 2)))

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"

requires_fmnist = pytest.mark.skipif(not os.path.isdir(FMNIST_DIR),
                                     reason="Debian package dataset-fashion-mnist not installed")


@pytest.fixture
def scratch():
    """Undo what a test registers in this process."""
    from splitfed import registry

    saved = {kind: dict(registry.registry(kind)) for kind in registry._REGISTRIES}
    origins = {kind: dict(v) for kind, v in registry._ORIGINS.items()}
    yield
    for kind, table in saved.items():
        live = registry.registry(kind)
        live.clear()
        live.update(table)
        registry._ORIGINS[kind] = origins[kind]
