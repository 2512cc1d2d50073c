"""SL's ``server_optimizer``: how long the server's SGD state (momentum buffers) lives,
against plain sequential training with torch.optim.SGD. Clients always start a fresh
optimizer at their turn; ``per_client`` also restarts the server's, as paper 003's public
code does, and is then sequential training of the whole model with a fresh optimizer per
client."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_float_close, digits_config

from splitfed.engine.batches import batch_plan
from splitfed.experiment import build_environment, run_experiment
from splitfed.models import split
from splitfed.rng import RandomStreams

OPT = {"momentum": 0.9, "weight_decay": 1e-3}
SPLIT = dict(model={"name": "mlp", "hidden": [32, 16], "cut": 1},
             partition={"scheme": "iid", "num_clients": 3})


def config(mode=None, rounds=2, momentum=0.9, weight_decay=1e-3):
    algorithm = {"name": "sl", **({"server_optimizer": mode} if mode else {})}
    train = {"batch_size": 8, "local_steps": 3, "local_epochs": None, "lr": 0.05,
             "momentum": momentum, "weight_decay": weight_decay}
    return digits_config(algorithm=algorithm, rounds=rounds, train=train, **SPLIT)


def final(cfg):
    return run_experiment(cfg, write=False).state["model"]


def reference(cfg, mode, dtype=torch.float32):
    """Sequential SL with torch.optim.SGD: a new client optimizer at every turn, the
    server's new per ``mode`` (whole run, round, client; "whole" = one optimizer for the
    whole model, new at every turn); in ``dtype`` from the float32 model and data."""
    env = build_environment(cfg)
    client, server = split(copy.deepcopy(env.model).to(dtype), env.cut)
    streams = RandomStreams(cfg.seed)
    x, y = env.data.train.x.to(dtype), env.data.train.y

    def sgd(module):
        return torch.optim.SGD(module.parameters(), lr=cfg.train.lr, **OPT)

    server_opt = sgd(server)
    for _ in range(cfg.rounds):
        streams.numpy("participation")              # full participation draws nothing
        order = streams.numpy("order").permutation(env.num_clients)
        if mode == "per_round":
            server_opt = sgd(server)
        for cid in order:
            plan = batch_plan(env.client_indices[cid], 3, 8, streams.numpy("batches"))
            if mode == "whole":
                opts = [sgd(torch.nn.Sequential(client, server))]
            else:
                server_opt = sgd(server) if mode == "per_client" else server_opt
                opts = [sgd(client), server_opt]
            for rows in torch.from_numpy(plan):
                for opt in opts:
                    opt.zero_grad()
                F.cross_entropy(server(client(x[rows])), y[rows]).backward()
                for opt in opts:
                    opt.step()
    return {**client.state_dict(), **server.state_dict()}


def close(got, cfg, mode):
    """``got`` matches :func:`reference` run in float32 and in float64 within the
    rounding bound of tests/helpers.py."""
    want32, want64 = reference(cfg, mode), reference(cfg, mode, torch.float64)
    assert got.keys() == want64.keys()
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=k)


def same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


@pytest.mark.parametrize("mode", ["persistent", "per_round", "per_client"])
def test_server_optimizer_lifetime_matches_sequential_sgd(mode):
    close(final(config(mode)), config(mode), mode)


def test_default_is_persistent():
    same(final(config()), final(config("persistent")))


def test_per_client_is_whole_model_training_with_a_fresh_optimizer_per_client():
    close(final(config("per_client")), config("per_client"), "whole")


def test_the_lifetime_matters_only_with_optimizer_state():
    with_state = [final(config(m)) for m in ("persistent", "per_client")]
    diff = max((with_state[0][k] - with_state[1][k]).abs().max() for k in with_state[0])
    assert diff > 1e-4
    plain = [final(config(m, momentum=0.0, weight_decay=0.0))
             for m in ("persistent", "per_round", "per_client")]
    for other in plain[1:]:          # plain SGD steps are the same whatever their lifetime
        same(other, plain[0])
