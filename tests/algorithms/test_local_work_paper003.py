"""Paper 003's local work (Sec. 5.3, Appendix E): E = 1 epoch of batch 10 on 60 samples
is K = 6 steps that use every sample once, and FedAvg's clients run SGD with momentum
and weight decay from a fresh optimizer every round, as the paper's public code does."""

import numpy as np
import torch
from helpers import assert_float_close, digits_config

from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.experiment import run_experiment
from tests.algorithms.test_fedavg import _reference_fedavg


def test_one_epoch_of_sixty_samples_is_six_steps_over_each_sample_once():
    assert local_step_counts(np.array([60, 59, 61]), 10, None, 1.0).tolist() == [6, 6, 7]
    indices = np.arange(1000, 1060)
    plan = batch_plan(indices, 6, 10, np.random.default_rng(0))
    assert plan.shape == (6, 10)
    assert sorted(plan.ravel().tolist()) == indices.tolist()


def test_fedavg_momentum_and_weight_decay_restart_every_round():
    cfg = digits_config(rounds=3, train={"batch_size": 8, "local_steps": 4,
                                         "local_epochs": None, "lr": 0.05,
                                         "momentum": 0.9, "weight_decay": 1e-4})
    got = run_experiment(cfg, write=False).state["model"]
    # a new SGD(momentum, weight decay) per client and round, in float32 and in float64
    want32 = _reference_fedavg(cfg, cfg.rounds)
    want64 = _reference_fedavg(cfg, cfg.rounds, torch.float64)
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)
