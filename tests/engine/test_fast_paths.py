"""The engine's exact fast paths leave every result bit for bit as it was: evaluation's
2x2 max-pool as four strided views (after the activation moved behind it), training's
max-pooling by the channels_last kernel (SL's client, the single server model,
centralized training), the virtual clock's scalar paths for one client (SL's steps),
and SL's turns settled once per turn in one process (``split.sequential_turn``). Each
run is compared with the same run through the plain paths (``model(x)``, the clock's
array arithmetic, every SL step through the transport and the clock): models, losses,
accuracies, bytes and simulated times all equal."""

import numpy as np
import pytest
import torch

from splitfed.config import build_config
from splitfed.engine import clock as clock_mod
from splitfed.engine import split
from splitfed.experiment import run_experiment
from splitfed.models import sequential
from tests.helpers import assert_same_run, register_images

NAME = "fast_path_images"


@pytest.fixture(autouse=True)
def images(monkeypatch):
    register_images(monkeypatch, NAME)


def _plain_paths(monkeypatch):
    monkeypatch.setattr(split, "SETTLE_TURNS", False)
    monkeypatch.setattr(sequential, "forward_eval", lambda module, x: module(x))
    monkeypatch.setattr(sequential, "forward_train", lambda module, x: module(x))
    V = clock_mod.VirtualClock
    monkeypatch.setattr(V, "_transfer_one", lambda self, kind, direction, c, n:
                        V._transfer_many(self, kind, direction, np.array([c]), n))
    monkeypatch.setattr(V, "_compute_one", lambda self, c, macs: clock_mod._add_at(
        self._t, np.array([c]), macs * self._scale[[c]] / self.profiles.compute[[c]]))
    monkeypatch.setattr(V, "_serve_one", lambda self, c, macs: V.compute(
        self, clock_mod.SERVER, np.array([c]), macs))


#: a server a thousand times slower than the fedscale clients: its lane decides the times
SLOW_SERVER = {"profile": "fixed", "deadline": None, "options": {"server_compute": 1e6}}


def _cfg(algorithm, cut, clock=None):
    return build_config(_raw(algorithm, cut, clock))


def _raw(algorithm, cut, clock=None):
    return {
        "name": "t", "rounds": 2, "progress": False, "seed": 5,
        "algorithm": {"name": algorithm}, "data": {"name": NAME},
        "partition": {"scheme": "iid", "num_clients": 4},
        "model": {"name": "lenet5", "cut": cut},
        "train": {"batch_size": 8, "local_steps": 3, "local_epochs": None, "lr": 0.05,
                  "momentum": 0.5},
        "participation": {"mode": "uniform", "clients_per_round": 3},
        "clock": clock or {"profile": "fedscale", "deadline": None}}


@pytest.mark.parametrize("algorithm,cut,clock", [
    ("sl", 1, None), ("sl", 2, None), ("sflv2", 1, None), ("fedavg", 2, None),
    ("centralized", 2, None), ("sl", 2, SLOW_SERVER), ("sflv2", 2, SLOW_SERVER)])
def test_fast_paths_change_no_result(monkeypatch, algorithm, cut, clock):
    fast = run_experiment(_cfg(algorithm, cut, clock), write=False)
    with monkeypatch.context() as m:
        _plain_paths(m)
        plain = run_experiment(_cfg(algorithm, cut, clock), write=False)
    assert_same_run(fast, plain)
    assert "sim_time_s" in fast.records[-1]         # the clock's times were compared too


def _sl_cfg(deadline, momentum, options):
    cfg = _raw("sl", 2, {"profile": "fedscale", "deadline": deadline})
    cfg["train"]["momentum"] = momentum
    cfg["algorithm"]["options"] = options
    cfg["rounds"] = 3
    return build_config(cfg)


@pytest.mark.parametrize("momentum,options", [
    (0.5, {}), (0.0, {"server_optimizer": "per_client", "global_lr": 0.5}),
    (0.9, {"server_optimizer": "per_round"})])
def test_settled_sl_turns_equal_step_by_step(monkeypatch, momentum, options):
    """SL's turns settled once per turn against every step through the transport and the
    clock as it happens, with a deadline that skips late turns and drops late hand-overs:
    the same models, losses, ledger bytes, simulated times and drops."""
    free = run_experiment(_sl_cfg(None, momentum, options), write=False)
    deadline = 0.5 * min(r["sim_round_s"] for r in free.records if "sim_round_s" in r)
    settled = run_experiment(_sl_cfg(deadline, momentum, options), write=False)
    calls = []
    with monkeypatch.context() as m:
        m.setattr(split, "SETTLE_TURNS", False)
        m.setattr(split.InProcessTransport, "settle", lambda *a: calls.append(a))
        stepped = run_experiment(_sl_cfg(deadline, momentum, options), write=False)
    assert not calls
    assert_same_run(settled, stepped)
    rounds = [r for r in settled.records if "sim_round_s" in r]
    assert len(rounds) == 3
    assert sum(r["clients_used"] for r in rounds) < 3 * 3        # the deadline bit
    assert all(r["bytes_up/activations"] > 0 for r in rounds)


def test_settle_records_and_charges_in_order():
    """``Transport.settle`` puts each kind's bytes in the ledger and charges the clock
    event by event: the same state as the calls one at a time."""
    from splitfed.engine.clock import CLIENT, SERVER, VirtualClock
    from splitfed.engine.profiles import fixed
    from splitfed.transport.base import InProcessTransport
    from splitfed.transport.ledger import Ledger

    def make():
        rng = np.random.default_rng(0)
        clock = VirtualClock(fixed(3, rng), rng)
        return InProcessTransport(Ledger(3), clock=clock), clock

    events = [(CLIENT, 1000), ("up", "activations", 640), ("up", "labels", 80),
              (SERVER, 3000), ("down", "activation_grads", 640), (CLIENT, 2000)] * 2
    a, clock_a = make()
    a.settle(1, events)
    b, clock_b = make()
    for e in events:
        if e[0] in ("up", "down"):
            b.send(e[1], e[0], [1], torch.zeros(1, e[2], dtype=torch.uint8))
        else:
            clock_b.compute(e[0], 1, e[1])
    def sent(ledger):
        return {(t, key): (s["ids"].tolist(), s["bytes"].tolist())
                for t, table in ledger.state()["rounds"].items() for key, s in table.items()}
    assert sent(a.ledger) == sent(b.ledger)
    assert a.ledger.round_totals(0) == b.ledger.round_totals(0)
    for name in ("_t", "_arrival", "_reply", "_last"):
        assert np.array_equal(getattr(clock_a, name), getattr(clock_b, name)), name
    assert clock_a._shared == clock_b._shared
    with pytest.raises(ValueError, match="unknown transfer kind"):
        a.settle(1, [("up", "weights", 4)])


@pytest.mark.parametrize("model,momentum", [
    ({"name": "resnet18", "width": 4, "cut": 1}, 0.0),
    ({"name": "resnet18", "width": 4, "cut": 2}, 0.5),
    ({"name": "mlp", "cut": 1}, 0.0)])
def test_settled_step_takes_one_backward_pass(monkeypatch, model, momentum):
    """A settled SL step differentiates the server's loss down to the client's parameters
    in one backward pass: bit for bit the two passes of the step-by-step path (the
    server's gradient of the cut-layer activations, then the client's backward from it),
    also where the server uses the activations twice (a residual block's shortcut at
    ResNet-18's cuts) and with momentum (two optimizers)."""
    cfg = _raw("sl", 1, None)
    cfg["model"] = model
    cfg["train"]["momentum"] = momentum
    settled = run_experiment(build_config(cfg), write=False)
    with monkeypatch.context() as m:
        m.setattr(split, "SETTLE_TURNS", False)
        stepped = run_experiment(build_config(cfg), write=False)
    assert_same_run(settled, stepped)
    assert settled.records[-1]["train_loss"] > 0
