"""FedLoRA's ``targets`` are checked against the model before anything is written: a
name that matches no linear layer is one error naming ``algorithm.targets`` and the
model's linear layers (``splitfed run --dry-run`` included), never peft's own error
after the run directory exists."""

import pytest
import torch
from helpers import assert_float_close, digits_config

from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment

pytest.importorskip("peft")


def check(targets):
    cfg = digits_config(rounds=1, algorithm={"name": "fedlora", "rank": 2,
                                             "targets": targets})
    algorithm = build_algorithm(cfg)
    algorithm.check(build_environment(cfg))
    return cfg


@pytest.mark.parametrize("targets, what", [
    (["nosuch"], "'nosuch' matches no module"),
    ([], "empty"),
    (["fc1"], "'fc1' matches fc1, not a linear layer"),       # a block, not a layer
    (["out", "fc2"], "'fc2' matches no module"),
])
def test_targets_that_name_no_linear_layer_are_refused_with_the_valid_names(targets, what):
    with pytest.raises(ConfigError) as err:
        check(targets)
    message = str(err.value)
    assert message.startswith("algorithm.targets: ") and what in message
    assert "fc1.1, out" in message and "\n" not in message


@pytest.mark.parametrize("targets", [["out"], ["fc1.1"], ["1"], ["fc1.1", "out"], None])
def test_targets_that_name_linear_layers_are_accepted_and_train(targets):
    cfg = check(targets)
    res = run_experiment(cfg, write=False)
    assert res.status == "completed"
    assert any("lora_A" in k for k in res.state["model"])


@pytest.mark.parametrize("value", ["[nosuch]", "[]"])
def test_dry_run_and_run_refuse_them_before_writing(tmp_path, capsys, value):
    args = ["quick_digits", "rounds=1", "algorithm.name=fedlora",
            f"algorithm.targets={value}", f"out_dir={tmp_path / 'runs'}"]
    assert main(["run", *args, "--dry-run"]) == 2
    assert main(["run", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(li.startswith("splitfed: error: algorithm.targets: ")
                                   for li in lines), lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name, shape", [("mlp", (1, 8, 8)), ("lenet5", (1, 28, 28)),
                                         ("alexnet", (1, 28, 28))])
def test_default_targets_leave_out_the_head_also_when_it_is_a_bare_linear_layer(name, shape):
    """The head (the last block) gets no adapter by default, whether it is a container
    (``fc3.0``) or a linear layer itself (mlp's ``out``): it is trained in full instead
    (``train_head``)."""
    from splitfed.models import build_model
    from splitfed.models.lora import default_targets

    model = build_model(name, shape, 10, **({"width": 0.125} if name == "alexnet" else {}))
    head = [n for n, _ in model.named_children()][-1]
    targets = default_targets(model)
    assert targets and all(t != head and not t.startswith(head + ".") for t in targets)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(targets) == {n for n in linear if n != head and not n.startswith(head + ".")}


def test_a_model_whose_only_linear_layer_is_the_head_is_refused_before_writing(
        tmp_path, capsys):
    """mlp with no hidden layer: the default targets (every linear layer but the head)
    are none, which peft would refuse after the run directory exists."""
    args = ["quick_digits", "rounds=1", "algorithm.name=fedlora", "model.hidden=[]",
            f"out_dir={tmp_path / 'runs'}"]
    assert main(["run", *args, "--dry-run"]) == 2
    assert main(["run", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(
        li.startswith("splitfed: error: algorithm.targets: null (the default) finds no "
                      "linear layer outside the head of model 'mlp'") for li in lines), lines
    assert not (tmp_path / "runs").exists()


def test_a_model_without_blocks_has_no_default_targets():
    from splitfed.models.lora import default_targets

    assert default_targets(torch.nn.Linear(4, 2)) == []
    assert default_targets(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                               torch.nn.Linear(4, 2))) == ["0"]


@pytest.mark.parametrize("values, message", [
    ({"rank": 0}, "algorithm.rank: must be >= 1, got 0"),
    ({"rank": 2.5}, "algorithm.rank: expected an integer, got 2.5 (float)"),
    ({"rank": 10**5}, "algorithm.rank: must be <= 10000, got 100000"),
    ({"alpha": 0}, "algorithm.alpha: must be > 0, got 0"),
    ({"alpha": -1.0}, "algorithm.alpha: must be > 0, got -1.0"),
    ({"dropout": 1.0}, "algorithm.lora_dropout: must be < 1, got 1.0"),
    ({"dropout": -0.5}, "algorithm.lora_dropout: must be >= 0, got -0.5"),
    ({"targets": "fc1.1"}, "algorithm.targets: expected a list of module names"),
    ({"targets": [1]}, "algorithm.targets: expected a list of module names"),
])
def test_add_lora_names_the_option_whose_value_is_refused(values, message):
    """add_lora (also called outside a config, as by benchmarks/client_memory.py) checks
    rank, alpha and dropout as FedLoRA's options are checked: the error names the option
    the value belongs to, not algorithm.targets, and the model is left as it was."""
    from splitfed.models import build_model
    from splitfed.models.lora import add_lora

    model = build_model("mlp", (1, 8, 8), 10)
    with pytest.raises(ConfigError) as err:
        add_lora(model, **values)
    assert str(err.value).startswith(message), str(err.value)
    assert not getattr(model, "lora_injected", False)
    assert not any("lora_" in n for n, _ in model.named_parameters())


def test_add_lora_reports_targets_peft_cannot_find_as_targets():
    from splitfed.models import build_model
    from splitfed.models.lora import add_lora

    with pytest.raises(ConfigError, match=r"^algorithm\.targets: .*nosuch"):
        add_lora(build_model("mlp", (1, 8, 8), 10), targets=["nosuch"])


def test_fedlora_options_and_add_lora_share_their_bounds():
    from splitfed.algorithms.fedlora import FedLoRAOptions
    from splitfed.models.lora import BOUNDS

    fields = {f.name: f for f in __import__("dataclasses").fields(FedLoRAOptions)}
    for key, bounds in BOUNDS.items():
        assert {k: v for k, v in fields[key].metadata.items() if k != "help"} == bounds


def test_adapters_add_alpha_over_rank_times_b_a():
    """LoRA (Hu et al. 2022): an adapted linear layer computes W x + b + (alpha / r) B A x,
    with the base frozen and A, B trained."""
    from collections import OrderedDict

    from torch import nn

    from splitfed.models.lora import add_lora

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(body=nn.Linear(6, 5), head=nn.Linear(5, 2)))
    w, b = model.body.weight.detach().clone(), model.body.bias.detach().clone()
    add_lora(model, rank=2, alpha=6.0)
    a_w, b_w = model.body.lora_A["default"].weight, model.body.lora_B["default"].weight
    with torch.no_grad():
        b_w.copy_(torch.randn(b_w.shape))
    x = torch.randn(3, 6)

    def want(dt):
        xd, ad, bd = x.to(dt), a_w.detach().to(dt), b_w.detach().to(dt)
        return xd @ w.to(dt).T + b.to(dt) + (6.0 / 2) * (xd @ ad.T @ bd.T)
    with torch.no_grad():
        assert_float_close(model.body(x), want(torch.float32), want(torch.float64), terms=6)
    assert a_w.requires_grad and b_w.requires_grad
    assert not model.body.base_layer.weight.requires_grad
