"""``train.lr_decay`` / ``lr_min`` schedule every training step's size, the clients' and
the servers' (``algorithm.server_lr``), round by round (``Environment.lr``); rates applied
to a round's aggregate (``global_lr``) stay. The step sizes each side used are recorded
from the primitives that take them."""

from __future__ import annotations

import pytest
import torch
from helpers import digits_config

from splitfed.algorithms.centralized import Centralized
from splitfed.algorithms.gas import GAS
from splitfed.algorithms.musplitfed import MUSplitFed
from splitfed.engine import stacked, zo
from splitfed.experiment import run_experiment

SERVER_LR, CLIENT_LR, DECAY, FLOOR = 0.01, 0.004, 0.5, 0.0021


def _expected(base: float, rounds: int) -> list[float]:
    return [max(base * DECAY ** t, min(FLOOR, base)) for t in range(rounds)]


@pytest.mark.parametrize("cls, options", [
    (MUSplitFed, {"name": "musplitfed", "tau": 2, "global_lr": 0.7}),
    (MUSplitFed, {"name": "musplitfed", "tau": 3, "server_lr_over_tau": True}),
    (GAS, {"name": "gas", "buffer_size": 2}),
])
def test_split_zeroth_order_servers_follow_the_schedule(monkeypatch, cls, options):
    rounds, log = 4, []
    round_, server_step, descend = cls.round, stacked.ForwardCopies.step, zo.descend_

    def marked(self, env, state, t, cohort):
        log.append(("round", t))
        return round_(self, env, state, t, cohort)

    def recorded_server(self, grads, lr, slot=None):
        log.append(("server", lr))
        return server_step(self, grads, lr, slot)

    def recorded_client(params, seeds, coefs, lr, *args, **kwargs):
        log.append(("client", lr))
        return descend(params, seeds, coefs, lr, *args, **kwargs)

    monkeypatch.setattr(cls, "round", marked)
    monkeypatch.setattr(stacked.ForwardCopies, "step", recorded_server)
    monkeypatch.setattr(zo, "descend_", recorded_client)
    cfg = digits_config(rounds=rounds, algorithm={**options, "server_lr": SERVER_LR},
                        model={"name": "mlp", "hidden": [16], "cut": 1},
                        train={"batch_size": 8, "local_steps": 2, "local_epochs": None,
                               "lr": CLIENT_LR, "lr_decay": DECAY, "lr_min": FLOOR})
    run_experiment(cfg, write=False)
    per_round: dict[int, dict[str, set]] = {}
    for kind, value in log:
        if kind == "round":
            t = value
            per_round[t] = {"server": set(), "client": set()}
        else:
            per_round[t][kind].add(value)
    divisor = options["tau"] if options.get("server_lr_over_tau") else 1
    assert sorted(per_round) == list(range(1, rounds + 1))
    for t, server, client in zip(per_round, _expected(SERVER_LR, rounds),
                                 _expected(CLIENT_LR, rounds)):
        assert per_round[t]["server"] == {server / divisor}, t
        assert per_round[t]["client"] == {client}, t
    assert _expected(SERVER_LR, rounds)[-1] == FLOOR           # the floor was reached


def test_centralized_steps_follow_the_schedule(monkeypatch):
    """The centralized baseline (the curve every federated run is compared with) steps
    with ``Environment.lr(t)`` in round t: lr * lr_decay ** (t - 1), floored at lr_min
    (docs of ``train.lr_decay`` / ``lr_min``; engine/env.py ``Environment.lr``)."""
    rounds, log = 4, []
    round_, step = Centralized.round, torch.optim.SGD.step

    def marked(self, env, state, t, cohort):
        log.append(("round", t))
        return round_(self, env, state, t, cohort)

    def recorded(self, *args, **kwargs):
        log.append(("step", self.param_groups[0]["lr"]))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Centralized, "round", marked)
    monkeypatch.setattr(torch.optim.SGD, "step", recorded)
    cfg = digits_config(rounds=rounds, algorithm={"name": "centralized"}, eval_every=rounds,
                        model={"name": "mlp", "hidden": [16]},
                        train={"batch_size": 8, "local_steps": 2, "local_epochs": None,
                               "lr": CLIENT_LR, "lr_decay": DECAY, "lr_min": FLOOR})
    run_experiment(cfg, write=False)
    per_round: dict[int, list] = {}
    for kind, value in log:
        if kind == "round":
            t = value
            per_round[t] = []
        else:
            per_round[t].append(value)
    assert per_round == {t: [lr, lr] for t, lr in enumerate(_expected(CLIENT_LR, rounds),
                                                            start=1)}
    assert _expected(CLIENT_LR, rounds)[-1] == FLOOR > CLIENT_LR * DECAY ** (rounds - 1)
