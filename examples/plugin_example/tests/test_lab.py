"""The plugin's own tests: splitfed's conformance checks on its split algorithm and on
FedAvg and SFL-V2 with its gradient transform (docs/extending.md). From this directory:
``python -m pytest`` (pyproject.toml puts the package on the path)."""

from splitfed.testing import check_algorithm
from splitfed_lab.psl import ParallelSplitLearning

CLIPPED = {"algorithm": {"client_transforms": [{"name": "clip_norm", "max_norm": 1.0}]}}


def test_psl_conforms():
    check_algorithm(ParallelSplitLearning)     # or by name: check_algorithm("psl")


def test_clip_norm_conforms_on_fedavg_and_sflv2():
    check_algorithm("fedavg", base=CLIPPED)    # base: a config change of every check
    check_algorithm("sflv2", base=CLIPPED, checks=["learns", "deterministic"])
