"""Paper 001's image setup (studies/paper001/base.yaml) learns with zeroth-order split
training on real Fashion-MNIST, and the AlexNet initialisation is what lets it learn:
with He initialisation MU-SplitFed (tau = 4, the study's rates) leaves chance level
within 400 rounds; with PyTorch's layer defaults the 8-layer network stays there."""

from pathlib import Path

import pytest

from splitfed.config import load_config
from splitfed.experiment import run_experiment

BASE = Path(__file__).resolve().parents[1] / "studies" / "paper001" / "base.yaml"
REAL_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not REAL_FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
@pytest.mark.parametrize("init,low,high", [("kaiming", 0.3, 1.0), ("torch", 0.0, 0.2)])
def test_zeroth_order_split_training_learns_fashion_mnist(init, low, high):
    cfg = load_config(BASE, ["rounds=400", "eval_every=400", "seed=1", "progress=false",
                             "algorithm.tau=4", "data.limit_test=1000",
                             f"model.init={init}"])
    records = run_experiment(cfg, write=False).records
    assert records[0]["test_acc"] < 0.2                       # chance level at the start
    assert low < records[-1]["test_acc"] < high, records[-1]
