"""The shipped CIFAR configs run when a CIFAR data directory is given (tiny fake files in
the real python-pickle format, a thin ResNet-18, one short round)."""

import pytest
from tests.data.test_data_loaders import fake_cifar10

from splitfed.config import load_config
from splitfed.errors import DataError
from splitfed.experiment import run_experiment


@pytest.mark.parametrize("name", ["fedavg_cifar10", "sflv1_cifar10", "sflv2_cifar10"])
def test_cifar_config_runs_on_a_data_dir(tmp_path, name):
    fake_cifar10(tmp_path, n=8)
    cfg = load_config(name, [f"data.data_dir={tmp_path}", "rounds=1", "progress=false",
                             "model.width=4", "train.batch_size=4", "train.local_epochs=null",
                             "train.local_steps=1", "partition.num_clients=2",
                             "partition.min_partition_size=1"])
    res = run_experiment(cfg, write=False)
    assert res.status == "completed" and res.records[-1]["round"] == 1


def test_cifar_config_without_files_says_where_it_looked(tmp_path):
    cfg = load_config("sflv2_cifar10", [f"data.data_dir={tmp_path}", "progress=false"])
    with pytest.raises(DataError, match=str(tmp_path)):
        run_experiment(cfg, write=False)
