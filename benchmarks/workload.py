"""The benchmark workload: LeNet-5 on Fashion-MNIST-shaped data, shared by every variant.

``Workload(clients=C, local_steps=K)`` holds ``C * K * batch`` training samples (random
N(0, 1) images 1x28x28 with uniform labels from a fixed seed, or a random subset of real
Fashion-MNIST with ``real=True``), so one round of any variant trains on exactly
``C * K * batch`` samples. ``parts`` split them evenly among the clients (K * batch each)
for the hand-written variants; splitfed partitions them with its own ``iid`` scheme.

``device="cuda"`` keeps the samples and the models on the GPU (splitfed variants run with
``engine.device`` set to it).

``population=P`` (default: C) makes the data ``P * K * batch`` samples, split evenly among
P users, of which a round trains a cohort of C: ``samples_per_round`` stays
``C * K * batch`` and ``parts`` has P entries.

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
FASHION_TRAIN = 60_000  # Fashion-MNIST's training images
INPUT_SHAPE = (1, 28, 28)
#: the models the benchmark runs and their input shapes (Fashion-MNIST's, CIFAR-10's)
MODEL_SHAPES = {"lenet5": INPUT_SHAPE, "alexnet": INPUT_SHAPE, "resnet18": (3, 32, 32),
                "vgg11": (3, 32, 32)}
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
    population: int | None = None
    model_name: str = "lenet5"
    width: float | None = None
    device: str = "cpu"
    x: torch.Tensor = field(init=False, repr=False)
    y: torch.Tensor = field(init=False, repr=False)
    parts: list[np.ndarray] = field(init=False, repr=False)

    def __post_init__(self):
        if self.population is None:
            self.population = self.clients
        if self.population < self.clients:
            raise ValueError(f"population {self.population} < clients {self.clients}")
        if self.model_name not in MODEL_SHAPES:
            raise ValueError(f"model {self.model_name!r}: one of {', '.join(MODEL_SHAPES)}")
        if self.real and self.input_shape != INPUT_SHAPE:
            raise ValueError(f"real Fashion-MNIST samples are 1x28x28, not {self.model_name}'s "
                             f"{self.input_shape}")
        n = self.population * self.local_steps * self.batch
        if self.real:
            bundle = load_dataset("fashion_mnist", FASHION_DIR,
                                  rng=np.random.default_rng(self.seed), limit_train=n,
                                  limit_test=TEST_SAMPLES)
            self.x, self.y = bundle.train.x, bundle.train.y
        else:
            g = torch.Generator().manual_seed(self.seed)
            self.x = torch.randn(n, *self.input_shape, generator=g)
            self.y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        self.x, self.y = self.x.to(self.device), self.y.to(self.device)
        perm = np.random.default_rng(self.seed).permutation(n)
        self.parts = [np.sort(p) for p in np.array_split(perm, self.population)]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return MODEL_SHAPES[self.model_name]

    @property
    def model_options(self) -> dict:
        return model_options(self.model_name, self.width)

    @property
    def samples_per_round(self) -> int:
        return self.clients * self.local_steps * self.batch

    def describe(self) -> dict:
        return {"model": self.model_name, **self.model_options,
                "input_shape": list(self.input_shape), "classes": NUM_CLASSES,
                "data": "fashion_mnist (real subset)" if self.real else "random N(0,1)",
                "clients": self.clients, "population": self.population,
                "local_steps": self.local_steps,
                "batch": self.batch, "lr": self.lr, "optimizer": "plain SGD",
                "seed": self.seed, "samples_per_round": self.samples_per_round,
                "device": self.device}

    def model(self) -> torch.nn.Module:
        """A freshly initialised model (the same initial weights for every variant)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return build_model(self.model_name, self.input_shape, NUM_CLASSES,
                               **self.model_options).to(self.device)

    def bundle(self) -> DataBundle:
        g = torch.Generator().manual_seed(self.seed + 1)
        test = ArrayDataset(torch.randn(TEST_SAMPLES, *self.input_shape, generator=g),
                            torch.randint(0, NUM_CLASSES, (TEST_SAMPLES,), generator=g))
        return DataBundle(name=DATASET_NAME, train=ArrayDataset(self.x, self.y), test=test,
                          num_classes=NUM_CLASSES, input_shape=self.input_shape)

    def save(self, path: str | os.PathLike) -> None:
        """Write the samples and parts for a variant that runs in another interpreter
        (``parts``: one index tensor per user of the population; ``clients``: the cohort
        trained per round)."""
        torch.save({"x": self.x.cpu(), "y": self.y.cpu(),
                    "parts": [torch.from_numpy(p) for p in self.parts],
                    "population": self.population, "clients": self.clients,
                    "local_steps": self.local_steps, "batch": self.batch, "lr": self.lr,
                    "seed": self.seed}, path)


def model_options(model_name: str, width: float | None) -> dict:
    """The model's options for ``width``: resnet18's base channels (an integer), the
    channel multiplier of the others."""
    if width is None:
        return {}
    return {"width": int(width) if model_name == "resnet18" else width}


def register(workload: Workload) -> None:
    """Make ``data.name=bench_workload`` load ``workload``'s samples (this process only)."""

    def load_bench_workload(data_dir, rng):
        return workload.bundle()

    DATASETS[DATASET_NAME] = load_bench_workload
