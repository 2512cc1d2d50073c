"""Checkpoints: everything a run needs to continue where it stopped, bit for bit.

Every ``checkpoint_every`` rounds (config key, default 10; 0 turns checkpoints off), at
the last round and at the round a run diverges, the round loop hands its state to a
:class:`Checkpointer`, which writes ``checkpoint.pt`` in the run directory. The file
holds:

- ``state``: the algorithm's state dict (tensors and plain values, nested as the
  algorithm keeps them: global models, server optimizer state, SCAFFOLD's controls, ...);
- ``streams``: every named random stream of the run (numpy and torch generators);
- ``clock``: the virtual clock (simulated time, its generator, the client profiles);
- ``ledger``: the communication ledger (bytes by round, kind, direction and client);
- ``components``: the state of any other engine part that keeps one between rounds
  (the participation sampler, the server's data pool) when it has ``state()``;
- ``round`` (the last finished round: the learning-rate schedule is a function of it),
  ``records`` (how many records ``metrics.jsonl`` held, the metrics offset), ``status``,
  ``wall_time_s`` (measured so far) and ``resumed_from`` (rounds a run was resumed at).

The file is written atomically: to a temporary file in the run directory, flushed and
fsynced, then renamed over the old checkpoint with :func:`os.replace` (and the
directory fsynced), so a run killed at any instant leaves either the previous checkpoint
or the new one, never a torn file.

:func:`splitfed.experiment.resume_experiment` (``splitfed run --resume RUN_DIR``)
rebuilds the run from its ``config.yaml`` (same seed: same data, partition and initial
model), restores all of the above, cuts ``metrics.jsonl`` back to the checkpoint's
records and continues with the next round, so that the finished run equals an
uninterrupted one in its parameters and in every metric except the measured wall times
(``round_time_s``, ``wall_time_s``).

A checkpoint is a pickle (``torch.save``): load only checkpoints you wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from splitfed.errors import ConfigError

CHECKPOINT = "checkpoint.pt"
FORMAT = 1
#: engine parts whose ``state()``/``load_state()`` (when they have them) are saved
COMPONENTS = ("sampler", "server_data")


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` atomically: temp file in the same directory, fsync,
    :func:`os.replace`, fsync of the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def capture(env, state: dict, t: int, *, records: int, status: str,
            wall_time_s: float, resumed_from: list[int]) -> dict:
    """The checkpoint of a run after round ``t`` (see the module doc)."""
    components = {}
    for name in COMPONENTS:
        saver = getattr(getattr(env, name, None), "state", None)
        if callable(saver):
            components[name] = saver()
    return {"format": FORMAT, "round": int(t), "records": int(records), "status": status,
            "wall_time_s": float(wall_time_s), "resumed_from": list(resumed_from),
            "state": state, "streams": env.streams.state(), "clock": env.clock.state(),
            "ledger": env.ledger.state(), "components": components}


def restore(env, ckpt: dict) -> dict:
    """Load a checkpoint's streams, clock, ledger and components into ``env``; returns
    the algorithm state."""
    env.streams.load_state(ckpt["streams"])
    env.clock.load_state(ckpt["clock"])
    env.ledger.load_state(ckpt["ledger"])
    for name, saved in ckpt["components"].items():
        loader = getattr(getattr(env, name, None), "load_state", None)
        if not callable(loader):
            raise ConfigError(f"checkpoint: it holds the state of the run's {name}, "
                              "which this run's engine cannot load")
        loader(saved)
    return ckpt["state"]


def load_checkpoint(run_dir: str | Path) -> dict | None:
    """The checkpoint in ``run_dir``, or None when there is none."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: say which and what to do
        raise ConfigError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e}); "
                          "delete it to rerun the run from the start") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a splitfed checkpoint of format {FORMAT}; delete it "
                          "to rerun the run from the start")
    return ckpt


def truncate_metrics(run_dir: str | Path, count: int) -> list[dict]:
    """Cut ``metrics.jsonl`` back to its first ``count`` records (atomically) and return
    them; records written after the checkpoint are dropped, so none is duplicated."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    lines = [line for line in lines if line.strip()]
    if len(lines) < count:
        raise ConfigError(f"{path}: holds {len(lines)} records but the checkpoint was "
                          f"written after {count}; the run directory is damaged, rerun "
                          "it from the start")
    kept = lines[:count]
    records = [json.loads(line) for line in kept]
    fd, tmp = tempfile.mkstemp(prefix=".metrics.jsonl.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in kept))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return records


class Checkpointer:
    """Called by the round loop after each round's record is logged; writes a
    checkpoint every ``every`` rounds, at the last round and when the run stops early."""

    def __init__(self, run_dir: str | Path, env, logger, *, every: int, rounds: int,
                 wall_offset: float = 0.0, resumed_from: list[int] | None = None,
                 clock=None):
        self.path = Path(run_dir) / CHECKPOINT
        self.env, self.logger = env, logger
        self.every, self.rounds = int(every), int(rounds)
        self.wall_offset = float(wall_offset)
        self.resumed_from = list(resumed_from or [])
        self._clock = clock   # () -> seconds measured since this session's start
        self.saved: list[int] = []

    def due(self, t: int, status: str) -> bool:
        if self.every <= 0:
            return False
        return t % self.every == 0 or t >= self.rounds or status != "completed"

    def __call__(self, t: int, state: dict, status: str) -> None:
        if not self.due(t, status):
            return
        wall = self.wall_offset + (self._clock() if self._clock is not None else 0.0)
        atomic_save(capture(self.env, state, t, records=len(self.logger.records),
                            status=status, wall_time_s=wall,
                            resumed_from=self.resumed_from), self.path)
        self.saved.append(t)
