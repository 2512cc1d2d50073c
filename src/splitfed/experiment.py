"""Composition root: turn a :class:`~splitfed.config.RunConfig` into a finished run.

Everything is built and validated (data, partition, model, cut, sampler, algorithm
options) before the run directory is created, so a bad config never leaves a half-written
run behind.
"""

from __future__ import annotations

import math

import inspect
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from splitfed.algorithms import ALGORITHMS, get_algorithm
from splitfed.checkpoint import Checkpointer, load_checkpoint, restore, truncate_metrics
from splitfed.config import RunConfig, build_config
from splitfed.configtools import dump_yaml, from_dict, load_yaml
from splitfed.data import load_dataset
from splitfed.data.partition import PARTITIONERS, partition, partition_summary
from splitfed.data.server_data import build_server_data
from splitfed.engine.clock import VirtualClock
from splitfed.engine.env import Environment
from splitfed.engine.loop import run_rounds
from splitfed.engine.participation import make_sampler
from splitfed.engine.profiles import build_profiles
from splitfed.errors import ConfigError
from splitfed.metrics import MetricLogger, best_value, last_value
from splitfed.models import build_model, resolve_cut
from splitfed.rng import RandomStreams, derive_seed
from splitfed.transport import InProcessTransport, Ledger


@dataclass
class RunResult:
    status: str
    records: list[dict]
    run_dir: Path | None
    wall_time_s: float
    state: dict

    @property
    def final_accuracy(self) -> float | None:
        return last_value(self.records, "test_acc")


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"engine.device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device: 'cuda' requested but no CUDA device is available; "
                          "use engine.device=cpu")
    return dev


def load_data(cfg: RunConfig, streams: RandomStreams, device: torch.device):
    d = cfg.data
    bundle = load_dataset(d.name, d.data_dir, rng=streams.numpy("data"),
                          limit_train=d.limit_train, limit_test=d.limit_test, **d.options)
    for split in (bundle.train, bundle.test):
        split.x, split.y = split.x.to(device), split.y.to(device)
    return bundle


def make_partition(cfg: RunConfig, bundle, streams: RandomStreams,
               exclude: np.ndarray | None = None) -> list[np.ndarray]:
    """The clients' index arrays; ``exclude`` (the server's pool) is taken out first."""
    p = cfg.partition
    if p.scheme == "natural":
        if bundle.natural_partition is None:
            raise ConfigError(f"partition.scheme: 'natural' needs a data set with a natural "
                              f"partition (synthetic); {bundle.name} has none")
        parts = bundle.natural_partition
        if len(parts) != p.num_clients:
            raise ConfigError(f"partition.num_clients: the natural partition of {bundle.name} "
                              f"has {len(parts)} clients, got {p.num_clients}")
        parts = [np.asarray(i, dtype=np.int64) for i in parts]
        return parts if exclude is None else [i[~np.isin(i, exclude)] for i in parts]
    if p.scheme in PARTITIONERS:
        allowed = [n for n in inspect.signature(PARTITIONERS[p.scheme]).parameters
                   if n not in ("labels", "num_clients", "rng")]
        for key in p.options:
            if key not in allowed:
                raise ConfigError(f"partition.{key}: not an option of scheme {p.scheme!r}; "
                                  f"options: {', '.join(allowed) or 'none'}")
    labels = bundle.train.y.cpu().numpy()
    keep = np.arange(len(labels))
    if exclude is not None:
        keep = np.setdiff1d(keep, exclude)
    parts = partition(labels[keep], p.num_clients, p.scheme, streams.numpy("partition"),
                      **p.options)
    return [keep[i] for i in parts]


def _server_data(cfg: RunConfig, bundle, streams: RandomStreams):
    """The server's pool (paper 004) if the algorithm uses server data, else None."""
    algorithm = ALGORITHMS.get(cfg.algorithm.name)
    if not (getattr(algorithm, "needs_server_data", False) or cfg.server_data.always):
        return None
    return build_server_data(cfg.server_data, bundle.train, bundle.num_classes,
                             streams.numpy("server_pool"))


def _build_model(cfg: RunConfig, bundle, streams: RandomStreams):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(streams.seed, "init"))
        model = build_model(cfg.model.name, bundle.input_shape, bundle.num_classes,
                            **cfg.model.options)
    unsplit = not getattr(ALGORITHMS.get(cfg.algorithm.name), "split", True)
    if unsplit and cfg.model.cut is None and not model.valid_cuts:
        return model, None  # a one-block model (mlp with hidden: []) trains unsplit only
    cut = resolve_cut(model, cfg.model.cut)
    return model, cut


def build_environment(cfg: RunConfig) -> Environment:
    """Load data, partition it, build the model and engine parts; validates everything."""
    streams = RandomStreams(cfg.seed)
    device = _device(cfg.engine.device)
    bundle = load_data(cfg, streams, device)
    server = _server_data(cfg, bundle, streams)
    pool = server.pool if server is not None and cfg.server_data.disjoint else None
    parts = make_partition(cfg, bundle, streams, exclude=pool)
    model, cut = _build_model(cfg, bundle, streams)
    model.to(device)
    pc = cfg.participation
    per_round = _sampled_per_round(cfg, len(parts))
    try:
        sampler = make_sampler(pc.mode, len(parts), [len(i) for i in parts],
                               clients_per_round=per_round, q=pc.q, weighting=pc.weighting)
    except ConfigError as e:
        raise ConfigError(f"participation.{e}") from None
    clock = build_clock(cfg, len(parts), streams)
    ledger = Ledger(len(parts))
    return Environment(config=cfg, data=bundle, client_indices=parts, model=model, cut=cut,
                       sampler=sampler, transport=InProcessTransport(ledger, clock=clock),
                       ledger=ledger, streams=streams, device=device, server_data=server,
                       clock=clock)


def _sampled_per_round(cfg: RunConfig, num_clients: int) -> int | None:
    """Clients sampled per round: M, or ceil((1 + clock.over_select) M) capped at N."""
    pc, over = cfg.participation, cfg.clock.over_select
    if not over:
        return pc.clients_per_round
    if pc.mode != "uniform":
        raise ConfigError(f"clock.over_select: needs participation.mode uniform (M of N "
                          f"clients), got {pc.mode!r}; set clock.over_select=0")
    m = pc.clients_per_round
    if isinstance(m, int) and m >= 1:
        return min(num_clients, math.ceil((1 + over) * m))
    return m                                   # the sampler reports what is wrong


def build_clock(cfg: RunConfig, num_clients: int, streams: RandomStreams) -> VirtualClock:
    """The run's virtual clock; its profiles draw only from the ``clock`` stream."""
    rng = streams.numpy("clock")
    profiles = build_profiles(cfg.clock.profile, dict(cfg.clock.options), num_clients, rng)
    keep = cfg.participation.clients_per_round if cfg.clock.over_select else None
    return VirtualClock(profiles, rng, deadline=cfg.clock.deadline,
                        renormalise=cfg.participation.mode != "bernoulli", keep=keep)


def build_algorithm(cfg: RunConfig):
    cls = get_algorithm(cfg.algorithm.name)
    return cls(from_dict(cls.Options, cfg.algorithm.options, path="algorithm"))


def _new_run_dir(cfg: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.out_dir) / f"{cfg.name}-{stamp}"
    run_dir, i = base, 1
    while run_dir.exists():
        run_dir, i = Path(f"{base}-{i}"), i + 1
    try:
        run_dir.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"out_dir: cannot create the run directory {run_dir} "
                          f"({e.strerror or e}); choose another out_dir") from e
    return run_dir


def _check_empty(run_dir: Path) -> None:
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise ConfigError(f"run directory {run_dir} exists and is not empty; "
                          "remove it or choose another")


def run_experiment(cfg: RunConfig, *, write: bool = True,
                   run_dir: Path | None = None) -> RunResult:
    """Validate, build, run every round, write metrics and a summary; returns the result.

    ``run_dir``: write into this directory (created; it must be absent or empty) instead
    of a new timestamped ``<out_dir>/<name>-<time>/``. Ignored when ``write`` is false.
    """
    if write and run_dir is not None:
        run_dir = Path(run_dir)
        _check_empty(run_dir)
    algorithm = build_algorithm(cfg)
    env = build_environment(cfg)
    algorithm.check(env)
    if not write:
        run_dir = None
    elif run_dir is None:
        run_dir = _new_run_dir(cfg)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    if run_dir is not None:
        dump_yaml(cfg, run_dir / "config.yaml")
        labels = env.data.train.y.cpu().numpy()
        (run_dir / "partition.txt").write_text(
            partition_summary(env.client_indices, labels, env.data.num_classes) + "\n")
    return _execute(cfg, algorithm, env, run_dir)


def _execute(cfg: RunConfig, algorithm, env: Environment, run_dir: Path | None, *,
             state: dict | None = None, start_round: int = 1,
             records: list[dict] | None = None, wall_offset: float = 0.0,
             resumed_from: list[int] | None = None, finished: str | None = None
             ) -> RunResult:
    """Run rounds ``start_round..`` (none when ``finished`` names the status of a run that
    already ended), checkpointing into ``run_dir``; write metrics and the summary."""
    logger = MetricLogger(run_dir)
    logger.records = list(records or [])
    t0 = time.perf_counter()
    checkpoint = None
    if run_dir is not None:
        checkpoint = Checkpointer(run_dir, env, logger, every=cfg.checkpoint_every,
                                  rounds=cfg.rounds, wall_offset=wall_offset,
                                  resumed_from=resumed_from,
                                  clock=lambda: time.perf_counter() - t0)
    try:
        if finished is None:
            state, status = run_rounds(algorithm, env, logger, state, start_round,
                                       checkpoint=checkpoint)
        else:
            status = finished
    finally:
        logger.close()
    wall = wall_offset + time.perf_counter() - t0
    result = RunResult(status, logger.records, run_dir, wall, state)
    if run_dir is not None:
        summary = {"name": cfg.name, "algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
                   "model": cfg.model.name, "status": status,
                   "rounds": last_value(logger.records, "round"),
                   "final_test_acc": result.final_accuracy,
                   "best_test_acc": best_value(logger.records, "test_acc"),
                   "wall_time_s": round(wall, 3),
                   "resumed_from": list(resumed_from or [])}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return result


def resume_experiment(run_dir: str | Path) -> RunResult:
    """Continue the run in ``run_dir`` from its last checkpoint (``checkpoint.pt``),
    rebuilding it from the directory's ``config.yaml``; see :mod:`splitfed.checkpoint`.

    Without a checkpoint the run starts again from round 0 in the same directory. A run
    that already ended (its checkpoint is at the last round, or it diverged) is not run
    again: its result is returned. Raising ``rounds`` in ``config.yaml`` extends a
    finished run. The summary's ``resumed_from`` lists the rounds the run was resumed at.
    """
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; give the directory "
                          "of a run (runs/<name>-<time>/)")
    try:
        cfg = build_config(load_yaml(saved))
    except ConfigError as e:
        raise ConfigError(f"{saved}: {e}") from None
    algorithm = build_algorithm(cfg)
    env = build_environment(cfg)
    ckpt = load_checkpoint(run_dir)
    if ckpt is None:
        for name in ("metrics.jsonl", "metrics.csv", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        return _execute(cfg, algorithm, env, run_dir)
    t = ckpt["round"]
    records = truncate_metrics(run_dir, ckpt["records"])
    state = restore(env, ckpt)
    resumed = list(ckpt["resumed_from"])
    if ckpt["status"] != "completed" or t >= cfg.rounds:
        return _execute(cfg, algorithm, env, run_dir, state=state, records=records,
                        wall_offset=ckpt["wall_time_s"], resumed_from=resumed,
                        finished=ckpt["status"])
    return _execute(cfg, algorithm, env, run_dir, state=state, start_round=t + 1,
                    records=records, wall_offset=ckpt["wall_time_s"],
                    resumed_from=resumed + [t])
