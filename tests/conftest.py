import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"

requires_fmnist = pytest.mark.skipif(not os.path.isdir(FMNIST_DIR),
                                     reason="Debian package dataset-fashion-mnist not installed")
