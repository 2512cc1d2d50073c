import os

import pytest
import torch
from hypothesis import settings

# CI runs the property and fuzz tests on fixed examples (the same every run, no example
# database), so a submission's result does not depend on the draw; locally they explore.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

torch.set_num_threads(min(2, os.cpu_count() or 1))

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"

requires_fmnist = pytest.mark.skipif(not os.path.isdir(FMNIST_DIR),
                                     reason="Debian package dataset-fashion-mnist not installed")
