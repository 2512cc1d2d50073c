"""Paper 003's local work (Sec. 5.3, Appendix E): E = 1 epoch of batch 10 on 60 samples
is K = 6 steps that use every sample once, and FedAvg's clients run SGD with momentum
and weight decay from a fresh optimizer every round, as the paper's public code does."""

import numpy as np
import torch
from helpers import digits_config

from splitfed.engine.batches import batch_plan, local_step_counts
from splitfed.experiment import build_environment, run_experiment
from splitfed.rng import RandomStreams


def test_one_epoch_of_sixty_samples_is_six_steps_over_each_sample_once():
    assert local_step_counts(np.array([60, 59, 61]), 10, None, 1.0).tolist() == [6, 6, 7]
    indices = np.arange(1000, 1060)
    plan = batch_plan(indices, 6, 10, np.random.default_rng(0))
    assert plan.shape == (6, 10)
    assert sorted(plan.ravel().tolist()) == indices.tolist()


def _reference(cfg):
    """Unbatched FedAvg (full participation, D_n weights) with a new
    torch.optim.SGD(momentum, weight_decay) per client and round."""
    env = build_environment(cfg)
    model, tr = env.model, cfg.train
    rng = RandomStreams(cfg.seed).numpy("batches")
    w = env.data_sizes / env.data_sizes.sum()
    x, y = env.data.train.x, env.data.train.y
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(cfg.rounds):
        new = {k: torch.zeros_like(v) for k, v in glob.items()}
        for c in range(env.num_clients):
            plan = batch_plan(env.client_indices[c], tr.local_steps, tr.batch_size, rng)
            model.load_state_dict(glob)
            opt = torch.optim.SGD(model.parameters(), lr=tr.lr, momentum=tr.momentum,
                                  weight_decay=tr.weight_decay)
            for rows in torch.from_numpy(plan):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
                opt.step()
            for k, v in model.state_dict().items():
                new[k] += float(w[c]) * v
        glob = new
    return glob


def test_fedavg_momentum_and_weight_decay_restart_every_round():
    cfg = digits_config(rounds=3, train={"batch_size": 8, "local_steps": 4,
                                         "local_epochs": None, "lr": 0.05,
                                         "momentum": 0.9, "weight_decay": 1e-4})
    got = run_experiment(cfg, write=False).state["model"]
    want = _reference(cfg)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), (k, (got[k] - want[k]).abs().max())
