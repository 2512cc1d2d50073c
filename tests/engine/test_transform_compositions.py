"""The named algorithms that are FedAvg with transforms (docs/transforms.md, the chain
of each algorithm) equal FedAvg with those transforms added in the config, bit for bit:
the same model after every round and the same records. The runs use momentum and weight
decay, clients of unequal sizes and a participation that samples, so that a transform
that is applied in another place, or a state that is kept otherwise, shows."""

from __future__ import annotations

import pytest
from helpers import assert_same_run, digits_config

from splitfed.experiment import run_experiment

SERVER_DATA = {"fraction": 0.2}


def _run(algorithm: dict, server_data: dict | None = None):
    over = {"server_data": server_data} if server_data else {}
    cfg = digits_config(algorithm=algorithm, rounds=3, eval_every=1,
                        partition={"scheme": "dirichlet", "num_clients": 5, "alpha": 0.3,
                                   "min_partition_size": 10},
                        participation={"mode": "bernoulli", "q": 0.7},
                        train={"batch_size": 7, "local_steps": None, "local_epochs": 0.5,
                               "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
                        checkpoint_every=0, **over)
    return run_experiment(cfg, write=False)


PAIRS = [
    ("fedprox", {"name": "fedprox", "mu": 0.3},
     {"name": "fedavg", "client_transforms": [{"name": "prox", "mu": 0.3}]}, None),
    ("scaffold", {"name": "scaffold"},
     {"name": "fedavg", "client_transforms": [{"name": "scaffold"}]}, None),
    ("fedopt", {"name": "fedopt", "server_optimizer": "yogi", "server_lr": 0.05},
     {"name": "fedavg", "server_transforms": [{"name": "fedopt", "server_optimizer": "yogi",
                                               "server_lr": 0.05}]}, None),
    ("clgsgd", {"name": "clgsgd", "server_lr": 0.02, "server_steps": 3},
     {"name": "fedavg", "server_transforms": [{"name": "server_train", "server_lr": 0.02,
                                               "server_steps": 3}]}, SERVER_DATA),
    ("scaffold_plus", {"name": "scaffold_plus"},
     {"name": "clgsgd", "client_transforms": [{"name": "scaffold"}]}, SERVER_DATA),
    ("scaffold_plus_from_fedavg", {"name": "scaffold_plus"},
     {"name": "fedavg", "client_transforms": [{"name": "scaffold"}],
      "server_transforms": [{"name": "server_train"}]}, SERVER_DATA),
    ("fedclg_c", {"name": "fedclg_c", "client_gradient": "fresh_batch"},
     {"name": "clgsgd", "client_transforms": [{"name": "fedclg_c",
                                               "client_gradient": "fresh_batch"}]},
     SERVER_DATA),
    ("fedclg_s", {"name": "fedclg_s"},
     {"name": "clgsgd", "client_transforms": [{"name": "fedclg_s"}]}, SERVER_DATA),
]


@pytest.mark.parametrize("named, composed, server_data", [p[1:] for p in PAIRS],
                         ids=[p[0] for p in PAIRS])
def test_a_named_algorithm_is_fedavg_with_its_transforms(named, composed, server_data):
    a, b = _run(named, server_data), _run(composed, server_data)
    assert a.status == b.status == "completed"
    assert_same_run(a, b)
