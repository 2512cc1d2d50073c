"""The split parts of a run's model are made once: the same client and server modules
every round (so the clock's MACs and the batched forward's plan, cached per module, are
computed once per run), new ones when the model's blocks change."""

import pytest
from torch import nn

from splitfed.config import build_config
from splitfed.engine import clock as clock_mod
from splitfed.engine.split import SplitModel
from splitfed.experiment import build_environment, run_experiment


def _cfg(algorithm, rounds=3):
    return build_config({
        "name": "t", "rounds": rounds, "progress": False, "seed": 1,
        "algorithm": {"name": algorithm}, "data": {"name": "digits"},
        "partition": {"scheme": "iid", "num_clients": 4},
        "model": {"name": "mlp", "cut": 1},
        "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.05},
        "participation": {"mode": "uniform", "clients_per_round": 3}})


def test_the_parts_are_the_same_objects_while_the_blocks_are():
    env = build_environment(_cfg("sflv1"))
    a, b = SplitModel.of(env), SplitModel.of(env)
    assert a is b
    assert list(a.client.children()) == list(env.model.children())[:env.cut]
    first = next(iter(env.model.named_children()))[0]
    env.model.add_module(first, nn.Identity())           # a block replaced: new parts
    c = SplitModel.of(env)
    assert c is not a and next(iter(c.client.children())) is env.model.get_submodule(first)


@pytest.mark.parametrize("algorithm", ["sflv1", "musplitfed", "gas"])
def test_the_clock_measures_the_parts_once_per_run(monkeypatch, algorithm):
    # as many dry runs for 4 rounds as for 2: none per round (SFL-V2 and CSE-FSL train a
    # new copy of the server part each round, which the clock measures anew)
    calls = []
    real = clock_mod.forward_macs

    def counted(module, shape):
        calls.append(tuple(shape))
        return real(module, shape)
    monkeypatch.setattr(clock_mod, "forward_macs", counted)
    counts = []
    for rounds in (2, 4):
        calls.clear()
        run_experiment(_cfg(algorithm, rounds), write=False)
        counts.append(len(calls))
    assert counts[0] > 0 and counts[0] == counts[1]
