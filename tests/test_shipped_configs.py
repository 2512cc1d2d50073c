"""Every shipped config (``splitfed list``, src/splitfed/configs) learns: run for a few
rounds as shipped, shrunk only where a full-size round would be slow (a training subset,
a test subset, fewer local steps), its training loss falls, every loss is finite and the
run completes.

Fashion-MNIST configs need the Debian package dataset-fashion-mnist
(/usr/share/datasets/fashion-mnist, installed on CI); the CIFAR configs need the
python-pickle CIFAR-10 batches, which no package provides: they run when
``SPLITFED_CIFAR10_DIR`` (or the config's ``data.data_dir``, relative to the working
directory) holds them and are skipped otherwise, naming where they looked
(tests/test_cifar_configs.py runs them on tiny fake files either way).

MU-SplitFed takes one zeroth-order step of 32 samples per client and round, so its loss
falls visibly only after a few hundred rounds: the fast tier runs musplitfed_fmnist for
20 rounds (finite losses, completed: the config used to be NaN by round 2), the slow
tier (``pytest -m slow``) for 300 (the loss falls; about 5 s on one thread).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
from tests.conftest import FMNIST_DIR

from splitfed.config import load_config, shipped_configs
from splitfed.engine.flops import forward_macs
from splitfed.experiment import run_experiment
from splitfed.models import build_model

FMNIST_MISSING = ("Fashion-MNIST not installed (Debian package dataset-fashion-mnist, "
                  f"{FMNIST_DIR})")
SMALL_FMNIST = ["data.limit_train=3000", "data.limit_test=1000"]

# config -> (overrides that keep it fast, rounds, the drop of the training loss its run
# must show): the mean training loss of the last quarter of the rounds (at least one
# round) is at least `drop` below that of the first quarter; None: finite losses only.
FAST: dict[str, tuple[list[str], int, float | None]] = {
    "quick_digits": ([], 5, 0.3),
    "centralized_fmnist": (SMALL_FMNIST, 3, 0.2),
    "fedavg_fmnist": (SMALL_FMNIST, 3, 0.2),
    "sflv1_fmnist": (SMALL_FMNIST, 3, 0.2),
    "sflv2_fmnist": (SMALL_FMNIST, 3, 0.2),
    "sl_fmnist": (SMALL_FMNIST, 3, 0.2),
    "csefsl_fmnist": (SMALL_FMNIST, 3, 0.2),
    "fedclg_fmnist": (["data.limit_test=1000"], 10, 0.2),
    # one zeroth-order step of 32 samples per client and round: too few rounds to see the
    # loss fall, enough to catch rates or a model that diverge (the full-width model at
    # Table 6's rates was non-finite at round 2); the slow tier checks that it learns
    "musplitfed_fmnist": (["data.limit_test=1000"], 20, None),
}
SLOW: dict[str, tuple[list[str], int, float | None]] = {
    "musplitfed_fmnist": (["data.limit_test=1000"], 300, 0.1),
}
# the CIFAR configs (ResNet-18) at width 8 on a 2,000-sample subset, 5 steps of 32 a round
CIFAR: dict[str, tuple[list[str], int, float | None]] = {
    name: (["model.width=8", "data.limit_train=2000", "data.limit_test=500",
            "train.batch_size=32", "train.local_epochs=null", "train.local_steps=5"], 3, 0.1)
    for name in ("fedavg_cifar10", "sflv1_cifar10", "sflv2_cifar10")}


def test_every_shipped_config_is_covered():
    assert set(shipped_configs()) == set(FAST) | set(CIFAR)


def test_musplitfed_fmnist_model_evaluates_in_seconds():
    # The full-width AlexNet (130 M MACs per image, 1.3 T per evaluation of the 10,000 test
    # images: 20-45 s on a 2-core CPU) made each evaluation of this config slow; at width
    # 0.0625 it is 0.53 M (docs/algorithms/musplitfed.md).
    cfg = load_config("musplitfed_fmnist")
    model = build_model(cfg.model.name, (1, 28, 28), 10, **cfg.model.options)
    assert forward_macs(model, (1, 28, 28)) < 2 * 10**6


def _missing_data(name: str, cfg) -> str | None:
    """Why ``name`` cannot run on this machine (its data are absent), or None."""
    if cfg.data.name == "fashion_mnist" and not os.path.isdir(FMNIST_DIR):
        return FMNIST_MISSING
    if cfg.data.name == "digits" and importlib.util.find_spec("sklearn") is None:
        return "scikit-learn not installed (the test extra installs it)"
    if cfg.data.name == "cifar10":
        d = Path(cfg.data.data_dir or ".")
        if not ((d / "cifar-10-batches-py" / "data_batch_1").is_file()
                or (d / "data_batch_1").is_file()):
            return (f"{name}: no CIFAR-10 python batches in {d.resolve()} (set "
                    "SPLITFED_CIFAR10_DIR to the directory holding cifar-10-batches-py)")
    return None


def _run(name: str, overrides: list[str], rounds: int):
    extra = [f"rounds={rounds}", f"eval_every={rounds}", "progress=false",
             "checkpoint_every=0"]
    if name in CIFAR and os.environ.get("SPLITFED_CIFAR10_DIR"):
        extra.append(f"data.data_dir={os.environ['SPLITFED_CIFAR10_DIR']}")
    cfg = load_config(name, [*overrides, *extra])
    why = _missing_data(name, cfg)
    if why:
        pytest.skip(why)
    return run_experiment(cfg, write=False)


def _check_learns(name: str, res, rounds: int, drop: float | None) -> None:
    assert res.status == "completed", (name, res.status)
    losses = [r["train_loss"] for r in res.records if "train_loss" in r]
    assert len(losses) == rounds, name
    assert all(math.isfinite(v) for v in losses), (name, losses)
    tests = [r["test_loss"] for r in res.records if "test_loss" in r]
    assert tests and all(math.isfinite(v) for v in tests), (name, tests)
    if drop is None:
        return
    k = max(1, rounds // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert first - last >= drop, (f"{name}: mean training loss of the first {k} rounds "
                                  f"{first:.4f}, of the last {k} {last:.4f}; want a drop of "
                                  f"{drop}")


def _params(table: dict, suffix: str = "", *marks):
    return [pytest.param(name, *table[name], id=name + suffix, marks=list(marks))
            for name in sorted(table)]


@pytest.mark.parametrize("name,overrides,rounds,drop", [
    *_params(FAST), *_params(SLOW, "-learns", pytest.mark.slow), *_params(CIFAR)])
def test_shipped_config_learns(name, overrides, rounds, drop):
    _check_learns(name, _run(name, overrides, rounds), rounds, drop)
