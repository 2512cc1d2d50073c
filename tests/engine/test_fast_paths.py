"""The engine's exact fast paths leave every result bit for bit as it was: evaluation's
2x2 max-pool as four strided views (after the activation moved behind it), training's
max-pooling by the channels_last kernel (SL's client, the single server model,
centralized training), and the virtual clock's scalar paths for one client (SL's
steps). Each run is compared with the same run through the plain paths (``model(x)``,
the clock's array arithmetic): models, losses, accuracies, bytes and simulated times all
equal."""

import numpy as np
import pytest

from splitfed.config import build_config
from splitfed.engine import clock as clock_mod
from splitfed.experiment import run_experiment
from splitfed.models import sequential
from tests.helpers import assert_same_run, register_images

NAME = "fast_path_images"


@pytest.fixture(autouse=True)
def images(monkeypatch):
    register_images(monkeypatch, NAME)


def _plain_paths(monkeypatch):
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
    return build_config({
        "name": "t", "rounds": 2, "progress": False, "seed": 5,
        "algorithm": {"name": algorithm}, "data": {"name": NAME},
        "partition": {"scheme": "iid", "num_clients": 4},
        "model": {"name": "lenet5", "cut": cut},
        "train": {"batch_size": 8, "local_steps": 3, "local_epochs": None, "lr": 0.05,
                  "momentum": 0.5},
        "participation": {"mode": "uniform", "clients_per_round": 3},
        "clock": clock or {"profile": "fedscale", "deadline": None}})


@pytest.mark.parametrize("algorithm,cut,clock", [
    ("sl", 1, None), ("sl", 2, None), ("sflv2", 1, None), ("fedavg", 2, None),
    ("centralized", 2, None), ("sl", 2, SLOW_SERVER), ("sflv2", 2, SLOW_SERVER)])
def test_fast_paths_change_no_result(monkeypatch, algorithm, cut, clock):
    fast = run_experiment(_cfg(algorithm, cut, clock), write=False)
    with monkeypatch.context() as m:
        _plain_paths(m)
        plain = run_experiment(_cfg(algorithm, cut, clock), write=False)
    assert_same_run(fast, plain)
    assert any("sim_time" in k or "time" in k for k in fast.records[-1])
