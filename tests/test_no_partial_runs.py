"""A run with bad data or a bad config writes nothing: validation happens before the run
directory is created (by ``run_experiment`` and by ``splitfed run``)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers import digits_config
from tests.data.test_data_loaders import fake_cifar10, fake_idx, idx_bytes, write

from splitfed.cli import main
from splitfed.errors import ConfigError, DataError, SplitfedError
from splitfed.experiment import run_experiment


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() \
        else []


BAD_CONFIGS = {
    "cut past the model's depth": dict(model={"name": "mlp", "hidden": [16], "cut": 3},
                                       algorithm={"name": "sflv2"}),
    "bernoulli q above 1": dict(participation={"mode": "bernoulli", "q": 1.5}),
    "clients_per_round above num_clients": dict(participation={"mode": "uniform",
                                                               "clients_per_round": 9}),
    "more clients than samples": dict(partition={"scheme": "iid", "num_clients": 5000}),
    "unknown partition option": dict(partition={"scheme": "iid", "num_clients": 3,
                                                "alpha": 0.5}),
    "unknown algorithm option": dict(algorithm={"name": "fedavg", "global_lrr": 1.0}),
    "model too deep for the data": dict(model={"name": "lenet5"}),
    "unknown clock option": dict(clock={"profile": "fixed", "colour": 1}),
    "sflv1 server period": dict(algorithm={"name": "sflv1", "server_period": 3},
                                model={"name": "mlp", "hidden": [16]}),
}


@pytest.mark.parametrize("over", BAD_CONFIGS.values(), ids=list(BAD_CONFIGS))
def test_bad_config_writes_nothing(tmp_path, over):
    out = tmp_path / "runs"
    cfg = digits_config(out_dir=str(out), **over)
    with pytest.raises(ConfigError):
        run_experiment(cfg)
    assert listing(out) == [] and listing(tmp_path) == []
    fixed = tmp_path / "fixed"
    with pytest.raises(ConfigError):
        run_experiment(cfg, run_dir=fixed)
    assert not fixed.exists()


def corrupt_idx(folder):
    fake_idx(folder, gz=False, n_train=30, n_test=10)
    write(folder / "t10k-labels-idx1-ubyte", idx_bytes(np.full(10, 12)))  # labels >= 10


def corrupt_gzip(folder):
    fake_idx(folder, gz=True, n_train=30, n_test=10)
    (folder / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08\x00broken")


def truncated_cifar(folder):
    fake_cifar10(folder, n=3)
    batch = folder / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:100])


BAD_DATA = {"idx labels out of range": ("fashion_mnist", corrupt_idx),
            "corrupt gzip": ("mnist", corrupt_gzip),
            "truncated cifar pickle": ("cifar10", truncated_cifar),
            "missing files": ("mnist", lambda folder: folder.mkdir())}


@pytest.mark.parametrize("name,make", BAD_DATA.values(), ids=list(BAD_DATA))
def test_bad_data_writes_nothing(tmp_path, name, make):
    data_dir, out = tmp_path / "data", tmp_path / "runs"
    make(data_dir)
    model = {"name": "mlp", "hidden": [8]}
    cfg = digits_config(out_dir=str(out), data={"name": name, "data_dir": str(data_dir)},
                        model=model)
    with pytest.raises(DataError):
        run_experiment(cfg)
    assert not out.exists()


def test_cli_bad_inputs_write_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    config = tmp_path / "bad.yaml"
    raw = {"name": "t", "rounds": 1, "progress": False, "out_dir": str(out),
           "data": {"name": "digits"}, "model": {"name": "mlp", "hidden": [8]},
           "partition": {"scheme": "iid", "num_clients": 3}}
    config.write_text(yaml.safe_dump(raw))
    for overrides in (["participation.mode=bernoulli", "participation.q=0"],
                      ["algorithm.name=sl", "model.cut=7"],
                      ["data.name=mnist", f"data.data_dir={tmp_path / 'nowhere'}"],
                      ["train.lr=fast"], ["rounds=-1"], ["name=a/b"]):
        assert main(["run", str(config), *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith("splitfed: error:") and "Traceback" not in err
        assert not out.exists(), overrides
    config.write_bytes(b"rounds: [1,\n")
    assert main(["run", str(config)]) == 2
    assert str(config) in capsys.readouterr().err
    assert not out.exists()


def test_out_dir_that_is_a_file(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a directory")
    cfg = digits_config(out_dir=str(blocker))
    with pytest.raises(SplitfedError, match="out_dir"):
        run_experiment(cfg)
    assert blocker.read_text() == "not a directory"
