"""FedLoRA's options reach the adapters: ``train_head``, ``lora_dropout`` and the run's
seed for the adapters' initial values (a digits MLP, adapters on its hidden layer)."""

import pytest
import torch
from helpers import digits_config

from splitfed.experiment import build_algorithm, build_environment, run_experiment

pytest.importorskip("peft")


def start_model(seed=3, **options):
    """The initial model of a FedLoRA run (adapters injected) and the run's model."""
    cfg = digits_config(rounds=1, seed=seed, algorithm={"name": "fedlora", "rank": 2,
                                                        **options})
    env = build_environment(cfg)
    state = build_algorithm(cfg).init_state(env)
    return cfg, env, state["model"]


def test_without_the_head_only_the_adapters_train_and_travel():
    """``train_head: false``: the head is frozen like the base weights, so a round moves
    and sends the adapters only."""
    cfg, env, start = start_model(train_head=False)
    head = [k for k in start if k.startswith("out.")]
    adapters = [k for k in start if "lora_" in k]
    assert head and adapters
    assert not any(p.requires_grad for n, p in env.model.named_parameters()
                   if n.startswith("out."))
    res = run_experiment(cfg, write=False)
    end = res.state["model"]
    assert all(torch.equal(end[k], start[k]) for k in start if "lora_" not in k)
    assert any(not torch.equal(end[k], start[k]) for k in adapters)
    sent = sum(start[k].numel() * start[k].element_size() for k in adapters)
    assert res.records[-1]["bytes_down/model"] == 3 * sent     # 3 clients, full
    assert res.records[-1]["bytes_up/model"] == 3 * sent


def test_lora_dropout_is_the_dropout_of_every_adapter():
    _, env, _ = start_model(lora_dropout=0.25)
    rates = [m.lora_dropout["default"].p for m in env.model.modules()
             if hasattr(m, "lora_dropout")]
    assert rates and all(p == 0.25 for p in rates)


def test_the_adapters_initial_values_come_from_the_runs_seed():
    """A random, B zero (the model is unchanged at the start); A is the same for a seed
    and differs between seeds."""
    a1 = start_model(seed=1)[2]
    b1 = start_model(seed=1)[2]
    a2 = start_model(seed=2)[2]
    keys = [k for k in a1 if "lora_A" in k]
    assert keys
    assert all(torch.equal(a1[k], b1[k]) for k in keys)
    assert all(not torch.equal(a1[k], a2[k]) for k in keys)
    assert all(torch.count_nonzero(a1[k.replace("lora_A", "lora_B")]) == 0 for k in keys)
