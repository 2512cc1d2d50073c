"""What a run checks before it writes anything, as ``--dry-run`` does: the model gives
one score per class of the data set for a sample, and the run directory's name fits the
file system (the same one-line message for a run and a dry run, long values shortened)."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from splitfed.cli import main
from splitfed.config import load_config
from splitfed.errors import ConfigError
from splitfed.experiment import run_experiment
from splitfed.models import MODELS
from splitfed.plan import build_plan
from tests.helpers import digits_config, register_images


def register(monkeypatch, name: str, extra: int = 0, shape=None) -> None:
    """Model ``name``: an MLP with ``num_classes + extra`` outputs, or, with ``shape``,
    one whose output per sample has that shape."""

    def builder(input_shape, num_classes, *, hidden=16):
        model = MODELS["mlp"](input_shape, num_classes + extra, hidden=[hidden])
        if shape is not None:
            forward = model.forward
            model.forward = lambda x: forward(x)[:, :1].expand(len(x), *shape).contiguous()
        return model

    monkeypatch.setitem(MODELS, name, builder)


def refused(cfg, tmp_path) -> str:
    """The one-line error of a dry run, which a run repeats without writing anything."""
    with pytest.raises(ConfigError) as dry:
        build_plan(cfg)
    with pytest.raises(ConfigError) as real:
        run_experiment(cfg, run_dir=tmp_path / "run")
    assert str(real.value) == str(dry.value)
    assert not (tmp_path / "run").exists()
    msg = str(real.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("extra", [2, -7, -9])
def test_a_model_with_another_output_width_is_refused(tmp_path, monkeypatch, extra):
    register(monkeypatch, "zz_width", extra)
    msg = refused(digits_config(model={"name": "zz_width"}), tmp_path)
    outputs = f"{10 + extra} output" + ("" if 10 + extra == 1 else "s")
    assert msg == (f"model.name: zz_width returns {outputs} per sample, but the data set "
                   "has 10 classes"), msg


def test_a_model_with_outputs_of_another_shape_is_refused(tmp_path, monkeypatch):
    register(monkeypatch, "zz_shape", shape=(10, 3))
    msg = refused(digits_config(model={"name": "zz_shape"}), tmp_path)
    assert msg.startswith("model.name: zz_shape returns outputs of shape (1, 10, 3) for "
                          "one sample; expected (1, 10)"), msg


def test_a_model_of_the_right_width_runs(tmp_path, monkeypatch):
    register(monkeypatch, "zz_right", 0)
    cfg = digits_config(model={"name": "zz_right"}, rounds=1)
    assert run_experiment(cfg, run_dir=tmp_path / "run").status == "completed"


@pytest.mark.parametrize("model", ["mlp", "lenet5", "resnet18", "mobilenetv2"])
def test_built_in_image_models_pass(monkeypatch, model):
    register_images(monkeypatch, "zz_images")
    build_plan(digits_config(data={"name": "zz_images"}, model={"name": model}))


def test_the_built_in_text_model_passes():
    pytest.importorskip("transformers")
    build_plan(digits_config(
        data={"name": "synthetic_text", "num_train": 64, "num_test": 32, "seq_len": 10,
              "vocab_size": 40},
        model={"name": "opt", "hidden_size": 16, "num_layers": 2, "num_heads": 2,
               "ffn_dim": 32, "vocab_size": 40, "cut": 1}))


def test_the_cli_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    register(monkeypatch, "zz_width", 2)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "c", "rounds": 1, "data": {"name": "digits"},
                                    "model": {"name": "zz_width"},
                                    "out_dir": str(tmp_path / "runs")}))
    for dry in ([], ["--dry-run"]):
        assert main(["run", str(path), *dry]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["splitfed: error: model.name: zz_width returns 12 outputs per "
                       "sample, but the data set has 10 classes"], err
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------- the run's directory


@pytest.mark.parametrize("length", [240, 500_000])
def test_a_name_too_long_gets_the_dry_runs_message(tmp_path, length):
    cfg = load_config("quick_digits", ["rounds=1", f"out_dir={tmp_path / 'runs'}"])
    cfg.name = "b" * length
    with pytest.raises(ConfigError) as dry:
        build_plan(cfg)
    with pytest.raises(ConfigError) as real:
        run_experiment(cfg)
    msg = str(real.value)
    assert msg == str(dry.value)
    assert msg.startswith("name: cannot create the run directory "), msg
    assert "longer than the 255 bytes allowed); choose a shorter name" in msg, msg
    assert "characters)" in msg and len(msg) < 400, len(msg)
    assert not (tmp_path / "runs").exists()


def test_the_cli_says_so_in_one_short_line(tmp_path, capsys):
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({"name": "b" * 500_000, "rounds": 1,
                                    "data": {"name": "digits"},
                                    "model": {"name": "mlp", "hidden": [8]},
                                    "out_dir": str(tmp_path / "runs")}))
    for dry in (["--dry-run"], []):
        assert main(["run", str(path), *dry]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and len(err[0]) < 400, (len(err), len(err[0]))
        assert re.search(r"\.\.\. \(5000\d\d characters\) \(its name would be longer "
                         r"than the 255 bytes allowed\); choose a shorter name$", err[0]), err
        assert err[0].startswith("splitfed: error: name: cannot create the run directory")
    assert not (tmp_path / "runs").exists()


def test_torch_is_left_as_it_was():
    """The output check draws no random numbers (the one-sample pass forks the RNG)."""
    state = torch.random.get_rng_state()
    build_plan(digits_config())
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("model, algorithm", [
    ({"name": "resnet18", "width": 4, "hidden": None}, "fedavg"),
    ({"name": "mobilenetv2", "hidden": None}, "sflv2"),
])
def test_one_sample_batches_through_batch_norm_are_refused(tmp_path, model, algorithm):
    # 8x8 digits reach 1x1 before a BatchNorm layer: one sample is one value per channel,
    # which PyTorch refuses in training (it crashed the first step, after writing)
    cfg = digits_config(model={k: v for k, v in model.items() if v is not None},
                        algorithm={"name": algorithm},
                        train={"batch_size": 1, "local_steps": 2, "local_epochs": None})
    msg = refused(cfg, tmp_path)
    assert msg.startswith(f"train.batch_size: 1 sample per batch cannot train {model['name']} "
                          "on digits: a batch normalisation layer would see one value per "
                          "channel"), msg
    assert msg.endswith("use a batch of at least 2 samples"), msg


RESNET = {"name": "resnet18", "width": 4}
SHARDS_OF_ONE = {"scheme": "shard", "num_clients": 8, "num_shards_per_partition": 1,
                 "shard_size": 1}


@pytest.mark.parametrize("over, key, remedy", [
    ({"algorithm": {"name": "fedavg", "server_transforms": [
        {"name": "server_train", "server_batch_size": 1, "server_steps": 2}]}},
     "algorithm.server_transforms[0].server_batch_size", "use a batch of at least 2 samples"),
    ({"algorithm": {"name": "clgsgd"},
      "server_data": {"samples_per_round": 1, "full_batch": True}},
     "server_data.samples_per_round", "give it at least 2"),
    ({"algorithm": {"name": "fedclg_s", "server_gradient": "full"},
      "server_data": {"samples_per_round": 1}},
     "server_data.samples_per_round", "give it at least 2"),
    ({"algorithm": {"name": "fedclg_c", "client_gradient": "full"},
      "partition": SHARDS_OF_ONE},
     "algorithm.client_gradient", "every client at least 2 samples"),
])
def test_every_pass_of_one_sample_through_batch_norm_is_refused(tmp_path, over, key, remedy):
    """Not only a batch size of 1: a server step's B_s, a full-batch server pass on a
    D_s^t of one sample, and FedCLG's full-data pass of a client holding one sample give
    a training pass one sample too (they crashed the first round, after writing)."""
    cfg = digits_config(model=RESNET, train={"batch_size": 4, "local_steps": 1,
                                             "local_epochs": None, "lr": 0.1}, **over)
    msg = refused(cfg, tmp_path)
    assert msg.startswith(f"{key}: 1 sample per batch cannot train resnet18 on digits: a "
                          "batch normalisation layer would see one value per channel"), msg
    assert msg.endswith(remedy), msg


@pytest.mark.parametrize("over", [
    {"algorithm": {"name": "fedavg", "server_transforms": [
        {"name": "server_train", "server_batch_size": 2, "server_steps": 1}]}},
    {"algorithm": {"name": "clgsgd"}, "server_data": {"samples_per_round": 2,
                                                       "full_batch": True}},
    {"algorithm": {"name": "fedclg_c", "client_gradient": "fresh_batch"},
     "partition": SHARDS_OF_ONE},
])
def test_the_same_passes_of_two_samples_run(tmp_path, over):
    cfg = digits_config(model=RESNET, rounds=1, train={"batch_size": 4, "local_steps": 1,
                                                       "local_epochs": None, "lr": 0.01},
                        **over)
    assert run_experiment(cfg, run_dir=tmp_path / "run").status == "completed"


def test_one_sample_batches_that_batch_norm_can_take_run(tmp_path, monkeypatch):
    # 28x28 images keep 2x2 positions at ResNet-18's last BatchNorm: batch 1 trains; the
    # check's pass leaves the model's running statistics as they were
    from splitfed.experiment import _check_single_sample_batches
    from splitfed.models import build_model

    register_images(monkeypatch, "zz_images28")
    cfg = digits_config(data={"name": "zz_images28"}, model={"name": "resnet18", "width": 4},
                        train={"batch_size": 1, "local_steps": 1, "local_epochs": None})
    model = build_model("resnet18", (1, 28, 28), 10, width=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from splitfed.data import load_dataset

    _check_single_sample_batches(cfg, model, load_dataset("zz_images28"), [5, 6], None)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training
