"""Parts of an algorithm's state that start empty and later hold a structure (a server
optimizer's state dict, GAS's activation buffer) are checked when a run is resumed,
like the rest of the checkpoint: a forged or foreign value is refused with one line
naming the file, before any file of the run directory changes, never a traceback in
the middle of a round or a run that silently continues with other numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitfed.checkpoint import CHECKPOINT, atomic_save, load_checkpoint
from splitfed.errors import FormatError, RunInterrupted
from splitfed.experiment import resume_experiment, run_experiment
from tests.helpers import digits_config, interrupt_round

SPLIT = {"model": {"name": "mlp", "hidden": [16, 8], "cut": 1}}
MOMENTUM = {"train": {"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.1,
                      "momentum": 0.9}}


def stopped(run_dir: Path, monkeypatch, algorithm: dict, **over) -> Path:
    """A run of 4 rounds interrupted in round 3, checkpointed at round 2."""
    cfg = digits_config(algorithm=algorithm, rounds=4, checkpoint_every=2, **SPLIT, **over)
    with monkeypatch.context() as m:
        interrupt_round(m, algorithm["name"], 3)
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, run_dir=run_dir)
    return run_dir


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def refused(run_dir: Path, mutate) -> str:
    """Resume after ``mutate(state)``; the one-line refusal, every file unchanged."""
    ckpt = load_checkpoint(run_dir)
    mutate(ckpt["state"])
    atomic_save(ckpt, run_dir / CHECKPOINT)
    before = snapshot(run_dir)
    with pytest.raises(FormatError) as e:
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before
    message = str(e.value)
    assert "\n" not in message and str(run_dir / CHECKPOINT) in message
    return message


def _buffers(state):
    return state["server_opt"]["state"].values()


SERVER_OPT = {
    "a string": (lambda s: s.update(server_opt="garbage"), "not a saved optimizer"),
    "a number": (lambda s: s.update(server_opt=5), "not a saved optimizer"),
    "groups not a list": (lambda s: s.update(server_opt={"state": {}, "param_groups": "x"}),
                          "not a saved optimizer"),
    "buffer of another shape": (
        lambda s: [b.update(momentum_buffer=torch.zeros(3)) for b in _buffers(s)],
        "momentum_buffer of shape (3,)"),
    "scalar buffer": (
        lambda s: [b.update(momentum_buffer=torch.tensor(100.0)) for b in _buffers(s)],
        "momentum_buffer of shape ()"),
    "integer buffer": (
        lambda s: [b.update(momentum_buffer=b["momentum_buffer"].long())
                   for b in _buffers(s)], "(int64)"),
    "other momentum": (lambda s: s["server_opt"]["param_groups"][0].update(momentum=0.0),
                       "momentum 0.0, the run's optimizer has 0.9"),
    "state of an unknown parameter": (
        lambda s: s["server_opt"]["state"].update({99: {"momentum_buffer": torch.zeros(1)}}),
        "unknown parameter 99"),
}


@pytest.fixture(scope="module", params=["sflv2", "sl", "csefsl"])
def split_run(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        run = stopped(tmp_path_factory.mktemp(request.param) / "run", mp,
                      {"name": request.param}, **MOMENTUM)
    finally:
        mp.undo()
    assert load_checkpoint(run)["state"]["server_opt"]["state"]     # momentum buffers
    return run


@pytest.mark.parametrize("case", sorted(SERVER_OPT))
def test_a_forged_server_optimizer_is_refused(split_run, tmp_path, case):
    run = tmp_path / "run"
    run.mkdir()
    for p in split_run.iterdir():
        (run / p.name).write_bytes(p.read_bytes())
    mutate, expect = SERVER_OPT[case]
    message = refused(run, mutate)
    assert "state.server_opt" in message and expect in message, message


def test_the_untouched_server_optimizer_resumes(split_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for p in split_run.iterdir():
        (run / p.name).write_bytes(p.read_bytes())
    assert resume_experiment(run).status == "completed"


def _gas_run(tmp_path, monkeypatch) -> Path:
    # 3 clients x 2 steps = 6 uploads a round, 12 in 2 rounds, into a buffer of 5: 2 stay
    run = stopped(tmp_path / "run", monkeypatch, {"name": "gas", "buffer_size": 5})
    buffer = load_checkpoint(run)["state"]["buffer"]
    assert buffer is not None and len(buffer["ids"]) == 2
    return run


GAS = {
    "a string": (lambda b: "garbage", "is not a dict of the tensors ids, h and y"),
    "a client that does not exist": (lambda b: {**b, "ids": torch.full_like(b["ids"], 10**6)},
                                     "client id outside 0..2"),
    "activations of another width": (lambda b: {**b, "h": b["h"][..., :3]},
                                     "activations h of shape"),
    "a label out of range": (lambda b: {**b, "y": torch.full_like(b["y"], 999)},
                             "label outside 0..9"),
    "labels of other rows": (lambda b: {**b, "y": b["y"][:, :1]}, "labels y of shape"),
    "more uploads than the buffer holds": (
        lambda b: {k: torch.cat([v, v, v]) for k, v in b.items()}, "ids of shape (6,)"),
}


@pytest.mark.parametrize("case", sorted(GAS))
def test_a_forged_gas_buffer_is_refused(tmp_path, monkeypatch, case):
    run = _gas_run(tmp_path, monkeypatch)
    mutate, expect = GAS[case]
    message = refused(run, lambda s: s.update(buffer=mutate(s["buffer"])))
    assert "state.buffer" in message and expect in message, message


def test_the_untouched_gas_buffer_resumes(tmp_path, monkeypatch):
    run = _gas_run(tmp_path, monkeypatch)
    assert resume_experiment(run).status == "completed"
