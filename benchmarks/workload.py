"""The benchmark workload: LeNet-5 on Fashion-MNIST-shaped data, shared by every variant.

``Workload(clients=C, local_steps=K)`` holds ``C * K * batch`` training samples (random
N(0, 1) images 1x28x28 with uniform labels from a fixed seed, or a random subset of real
Fashion-MNIST with ``real=True``), so one round of any variant trains on exactly
``C * K * batch`` samples. ``parts`` split them evenly among the clients (K * batch each)
for the hand-written variants; splitfed partitions them with its own ``iid`` scheme.

:func:`register` makes the workload loadable by name (``data.name=bench_workload``) in
splitfed's data-set registry, so splitfed variants are built by the ordinary
``build_environment`` / ``build_algorithm`` path from a config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from splitfed.data import DATASETS, load_dataset
from splitfed.data.datasets import ArrayDataset, DataBundle
from splitfed.models import build_model

DATASET_NAME = "bench_workload"
FASHION_DIR = "/usr/share/datasets/fashion-mnist"
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
TEST_SAMPLES = 64  # evaluation is excluded from the timings; a token test split


@dataclass
class Workload:
    clients: int
    local_steps: int
    batch: int = 32
    lr: float = 0.01
    seed: int = 0
    real: bool = False
    x: torch.Tensor = field(init=False, repr=False)
    y: torch.Tensor = field(init=False, repr=False)
    parts: list[np.ndarray] = field(init=False, repr=False)

    def __post_init__(self):
        n = self.samples_per_round
        if self.real:
            bundle = load_dataset("fashion_mnist", FASHION_DIR,
                                  rng=np.random.default_rng(self.seed), limit_train=n,
                                  limit_test=TEST_SAMPLES)
            self.x, self.y = bundle.train.x, bundle.train.y
        else:
            g = torch.Generator().manual_seed(self.seed)
            self.x = torch.randn(n, *INPUT_SHAPE, generator=g)
            self.y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        perm = np.random.default_rng(self.seed).permutation(n)
        self.parts = [np.sort(p) for p in np.array_split(perm, self.clients)]

    @property
    def samples_per_round(self) -> int:
        return self.clients * self.local_steps * self.batch

    def describe(self) -> dict:
        return {"model": "lenet5", "input_shape": list(INPUT_SHAPE), "classes": NUM_CLASSES,
                "data": "fashion_mnist (real subset)" if self.real else "random N(0,1)",
                "clients": self.clients, "local_steps": self.local_steps,
                "batch": self.batch, "lr": self.lr, "optimizer": "plain SGD",
                "seed": self.seed, "samples_per_round": self.samples_per_round}

    def model(self) -> torch.nn.Module:
        """A freshly initialised LeNet-5 (the same initial weights for every variant)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return build_model("lenet5", INPUT_SHAPE, NUM_CLASSES)

    def bundle(self) -> DataBundle:
        g = torch.Generator().manual_seed(self.seed + 1)
        test = ArrayDataset(torch.randn(TEST_SAMPLES, *INPUT_SHAPE, generator=g),
                            torch.randint(0, NUM_CLASSES, (TEST_SAMPLES,), generator=g))
        return DataBundle(name=DATASET_NAME, train=ArrayDataset(self.x, self.y), test=test,
                          num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)

    def save(self, path: str | os.PathLike) -> None:
        """Write the samples and parts for a variant that runs in another interpreter."""
        torch.save({"x": self.x, "y": self.y,
                    "parts": [torch.from_numpy(p) for p in self.parts],
                    "local_steps": self.local_steps, "batch": self.batch, "lr": self.lr,
                    "seed": self.seed}, path)


def register(workload: Workload) -> None:
    """Make ``data.name=bench_workload`` load ``workload``'s samples (this process only)."""

    def load_bench_workload(data_dir, rng):
        return workload.bundle()

    DATASETS[DATASET_NAME] = load_bench_workload
