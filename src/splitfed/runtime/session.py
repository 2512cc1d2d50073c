"""One run on many processes: rank 0 serves, the other ranks host clients (SPMD).

Every rank builds the same environment from the same config (rank 0 sends it: the
client ranks need no files but the data set), puts the runtime's parts into it
(:func:`adapt`: its placement, ``env.placement``, and the runtime's clock, transport and
sampler) and runs the engine's own round loop (:func:`~splitfed.engine.loop.
run_rounds`) with the algorithm's unchanged code. The placement makes every rank compute
only its own side: client forward/backward passes on the rank that hosts the client,
server passes and aggregation results that matter on rank 0; the transport carries the
tensors in between. Rank 0 evaluates (the client ranks hold no test set), logs
(``metrics.jsonl`` and the config's trackers, :mod:`splitfed.tracking`), and
checkpoints after every round (``splitfed.checkpoint``; the same file
``splitfed run --resume`` reads), and a restarted run resumes from it: rank 0 sends the
client ranks the checkpoint's random streams and clock, so that all ranks continue in
step.

Rank 0 starts each round with a control message to every live client rank
(:class:`~splitfed.runtime.placement.RoundControl`); a client rank that is lost (its
connection closed, or it did not answer within the timeout) has its clients dropped
from the round in which it was lost (left out of the aggregation like late clients)
and from the cohorts of later rounds (like unavailable clients). A run that ends with
every client rank lost has the status ``no_client_trained`` (no client ever trained) or
``clients_lost`` (they trained in some rounds, then every client rank was lost), not
``completed``.

The messages to the client ranks are plain data (the config as
:func:`~splitfed.configtools.to_dict`, rebuilt with
:func:`~splitfed.config.build_config`; the checkpoint's state: plain data, tensors and
numpy arrays), never pickles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from splitfed.algorithms import get_algorithm
from splitfed.checkpoint import (CHECKPOINT, Checkpointer, checkpoint_records,
                                 cpu_capability, load_checkpoint, restore, thread_warnings,
                                 truncate_metrics)
from splitfed.config import RunConfig, build_config
from splitfed.configtools import load_yaml, to_dict
from splitfed.engine.loop import initial_state, run_rounds
from splitfed.errors import ConfigError
from splitfed.experiment import (RunResult, check_empty, clear_for_restart, new_run_dir,
                                 build_algorithm, build_environment, check_resume_config,
                                 check_run_files, config_data, lock_run_dir,
                                 resume_template, run_ended, tidy_for_resume, write_config,
                                 write_partition, write_summary)
from splitfed.metrics import MetricLogger, is_finite_number, record_summary
from splitfed.provenance import provenance
from splitfed.runtime.placement import (RankPlacement, RoundControl, RuntimeClock, StopRun,
                                        control_message, host_ranks)
from splitfed.tracking import open_trackers
from splitfed.transport.distributed import SERVER_RANK, DistributedTransport, Links


@dataclass
class RuntimeOptions:
    #: rank 0 gives up on a client rank that does not answer within this many seconds
    timeout_s: float = 60.0
    #: real delays: client ranks sleep this many wall seconds per simulated second of
    #: their clients' compute and transfers (None: no sleeping)
    delay_scale: float | None = None
    #: rank 0 writes checkpoint.pt every this many rounds (and at the last)
    checkpoint_every: int = 1


def supported() -> list[str]:
    """The algorithms the runtime runs: those whose class sets ``distributed = True``
    (every client computation goes through the placed engine primitives), plugins'
    included."""
    from splitfed.algorithms import ALGORITHMS

    return [name for name, cls in ALGORITHMS.items() if getattr(cls, "distributed", False)]


#: the options whose value ``first`` (MU-SplitFed's and GAS's first-order ablations) the
#: runtime does not run: a first-order step differentiates through the other side's
#: pass, of which a client rank holds only placeholders
ZEROTH_ONLY = ("client_order", "server_order")


def check_supported(cfg: RunConfig) -> None:
    """ConfigError naming the key when the runtime cannot run ``cfg``: an algorithm or
    transform that does not run here, a first-order option (:data:`ZEROTH_ONLY`), a
    device other than the CPU."""
    if not getattr(get_algorithm(cfg.algorithm.name), "distributed", False):
        raise ConfigError(f"algorithm.name: {cfg.algorithm.name!r} does not run on the "
                          f"multi-process runtime yet; supported: {', '.join(supported())} "
                          "(use splitfed run for the others)")
    from splitfed.experiment import build_algorithm

    algorithm = build_algorithm(cfg)
    if not algorithm.runs_distributed:
        local = [t.name for t in (*algorithm.gradient_transforms, *algorithm.server_steps)
                 if not t.distributed]
        raise ConfigError(f"algorithm: the transforms {', '.join(local)} do not run on the "
                          "multi-process runtime yet (use splitfed run)")
    for key in ZEROTH_ONLY:
        if getattr(algorithm.options, key, None) == "first":
            raise ConfigError(f"algorithm.{key}: 'first' (the first-order ablation) does not "
                              "run on the multi-process runtime yet; it runs "
                              f"{cfg.algorithm.name!r} with {key} 'zeroth' (the default) "
                              "only (use splitfed run for the first-order ablations)")
    if cfg.engine.device != "cpu":
        raise ConfigError("engine.device: the multi-process runtime runs on cpu (gloo)")


def adapt(env, links: Links, delay_scale: float | None) -> RoundControl:
    """Set this rank's placement (``env.placement``) and swap in the runtime's clock,
    transport and sampler; returns the round control."""
    hosts = host_ranks(env.num_clients, links.world_size)
    place = RankPlacement(links, hosts)
    env.placement = place
    clock = RuntimeClock.adopt(env.clock, place, delay_scale)
    env.clock = clock
    env.transport = DistributedTransport(env.ledger, links, hosts, clock=clock)
    env.sampler = RoundControl(env.sampler, env, links, hosts, clock.renormalise)
    if not links.is_server:                 # the server evaluates; clients hold no test set
        test = env.data.test
        test.x, test.y = test.x[:0], test.y[:0]
    return env.sampler


class _WireLogger(MetricLogger):
    """Rank 0's logger: every round's record also has the payload bytes that really
    crossed (``wire_up``, ``wire_down``, by kind) and the control/metric overhead, a
    running total over the whole run: a resumed run continues from the last record
    before the resume (``records``)."""

    def __init__(self, run_dir, transport: DistributedTransport, records):
        super().__init__(run_dir)
        self.records = list(records)
        self.transport = transport
        self.overhead0 = next((int(r["overhead_bytes"]) for r in reversed(self.records)
                               if isinstance(r.get("overhead_bytes"), (int, float))), 0)
        self.wire0 = _wire_sum(self.records)        # the rounds before a resume

    def log(self, record: dict) -> None:
        t = record.get("round")
        if t:
            record = {**record, **self.transport.wire_totals(t),
                      "overhead_bytes": self.overhead0 + self.transport.links.overhead_bytes,
                      "lost_ranks": sorted(self.transport.links.lost)}
        super().log(record)

    def wire_totals(self) -> dict[str, int]:
        """The run's wire bytes: the rounds before a resume (their records) and this
        process's."""
        out = dict(self.wire0)
        for key, n in self.transport.wire_totals().items():
            out[key] = out.get(key, 0) + n
        return out


def _wire_sum(records: list[dict]) -> dict[str, int]:
    """The ``wire_*`` fields of round records, summed by key."""
    out = {"wire_up": 0, "wire_down": 0}
    for r in records:
        if r.get("round"):
            for key, n in r.items():
                if key.startswith("wire_") and isinstance(n, (int, float)):
                    out[key] = out.get(key, 0) + int(n)
    return out


def serve(links: Links, cfg: RunConfig | None = None, *, options: RuntimeOptions,
          run_dir: str | Path | None = None, resume: str | Path | None = None,
          overrides: list[str] | None = None) -> RunResult:
    """Rank 0: run ``cfg`` (or resume the run in ``resume``) with the client ranks.

    The run directory is locked (:func:`splitfed.experiment.lock_run_dir`) while rank 0
    writes it. When resuming, the config, the checkpoint (written under this
    ``config.yaml``, :func:`splitfed.experiment.check_resume_config`) and the metrics
    records it counts are all checked (and the checkpoint restored into rank 0's
    environment) before ``metrics.jsonl`` is cut back to the checkpoint. A run without a
    checkpoint starts again from round 0 in its directory (the launcher returned the
    result of one that ended: :func:`splitfed.runtime.launch.check_config`).
    ``overrides``: the command line's ``key=value`` list, which names a new run directory
    as ``splitfed run`` names it (:func:`splitfed.experiment.run_dir_name`)."""
    if resume is None:
        return _serve(links, cfg, options=options, run_dir=run_dir, overrides=overrides)
    run_dir = Path(resume)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there")
    try:
        cfg = build_config(load_yaml(saved))
    except ConfigError as e:
        raise ConfigError(f"{saved}: {e}") from None
    with lock_run_dir(run_dir):
        check_run_files(run_dir)               # before anything is read or changed
        ckpt = load_checkpoint(run_dir, rounds=cfg.rounds)
        if ckpt is not None:
            check_resume_config(run_dir, ckpt, cfg)     # the same run: the same config
        records = None if ckpt is None else checkpoint_records(run_dir, ckpt,
                                                               rounds=cfg.rounds)
        for line in thread_warnings(ckpt) if ckpt is not None else ():
            print(f"splitfed: warning: {run_dir}: {line}", file=sys.stderr)
        return _serve(links, cfg, options=options, run_dir=run_dir, ckpt=ckpt,
                      records=records, locked=True, restart=ckpt is None)


def _serve(links: Links, cfg: RunConfig, *, options: RuntimeOptions,
           run_dir: str | Path | None, ckpt: dict | None = None,
           records: list[dict] | None = None, locked: bool = False,
           restart: bool = False, overrides: list[str] | None = None) -> RunResult:
    check_supported(cfg)
    hello = {"config": to_dict(cfg), "delay_scale": options.delay_scale,
             "resume": None if ckpt is None else {k: ckpt[k] for k in (
                 "round", "streams", "clock", "ledger", "components", "state")}}
    algorithm = build_algorithm(cfg)
    links.send_all(hello)                   # the client ranks build while rank 0 does
    env = build_environment(cfg)
    control = adapt(env, links, options.delay_scale)
    state, start, wall0, resumed, sinks = None, 1, 0.0, [], None
    started = {"threads": torch.get_num_threads(), "cpu": cpu_capability(),
               "resumed_threads": []}
    with contextlib.ExitStack() as stack:
        if ckpt is not None:
            where = Path(run_dir) / CHECKPOINT
            template = resume_template(algorithm, env, ckpt["state"])
            state = restore(env, ckpt, template, where=where)
            start, wall0 = ckpt["round"] + 1, ckpt["wall_time_s"]
            if not run_ended(ckpt, cfg):     # the trackers open before any change
                sinks = open_trackers(cfg, run_dir, start)
                stack.callback(_close_unused, sinks)
            tidy_for_resume(Path(run_dir), env)
            records = truncate_metrics(run_dir, ckpt["records"], ckpt["round"])
            resumed = list(ckpt["resumed_from"]) + [ckpt["round"]]
            started = {"threads": ckpt["threads"], "cpu": ckpt["cpu_capability"],
                       "resumed_threads": list(ckpt["resumed_threads"])
                       + [torch.get_num_threads()]}
        elif restart:                         # a resume without a checkpoint: round 0
            state = initial_state(algorithm, env)
            tidy_for_resume(Path(run_dir), env)
            clear_for_restart(Path(run_dir))
        else:
            state = initial_state(algorithm, env)   # a failing init_state leaves nothing
            if run_dir is None:
                run_dir = new_run_dir(cfg, overrides)
            else:
                run_dir = make_run_dir(Path(run_dir))
            if not locked:
                stack.enter_context(lock_run_dir(run_dir))
                check_empty(run_dir)
            write_config(cfg, run_dir / "config.yaml")
            write_partition(run_dir, env)
        tell_launcher(Path(run_dir))
        given = None
        if sinks is not None:                     # _run owns them from here on
            given = list(sinks)
            sinks.clear()
        return _run(links, cfg, algorithm, env, control, Path(run_dir), options, ckpt,
                    state=state, start=start, records=records or [], wall0=wall0,
                    resumed=resumed, started=started, sinks=given)


def make_run_dir(run_dir: Path) -> Path:
    """Create the run directory ``--run-dir`` names (absent or empty); one that cannot
    be created is a :class:`ConfigError` naming ``--run-dir``."""
    from splitfed.runtime.status import run_dir_error

    try:
        check_empty(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise run_dir_error(run_dir, e) from None
    return run_dir


def tell_launcher(run_dir: Path) -> None:
    """Rank 0 started by ``splitfed launch``: write the run directory into the launcher's
    status directory, so that the launcher can name it if the run is cut short."""
    from splitfed.runtime.status import write_status

    write_status("run_dir", str(run_dir))


def _close_unused(sinks: list | None) -> None:
    """Close trackers opened for a resume that failed before its rounds began."""
    for sink in sinks or []:
        sink.close("failed")


def _run(links, cfg, algorithm, env, control, run_dir: Path, options, ckpt, *, state,
         start, records, wall0, resumed, started, sinks=None) -> RunResult:
    logger = _WireLogger(run_dir, env.transport, records)
    finished = run_ended(ckpt, cfg)
    if sinks is not None:
        logger.sinks = sinks
    elif not finished:
        try:
            logger.sinks = open_trackers(cfg, run_dir, start)
        except BaseException:
            logger.close("failed")
            raise
    t0 = time.perf_counter()
    checkpoint = Checkpointer(run_dir, env, logger, every=options.checkpoint_every,
                              rounds=cfg.rounds, wall_offset=wall0, resumed_from=resumed,
                              clock=lambda: time.perf_counter() - t0,
                              threads=started["threads"], cpu=started["cpu"],
                              resumed_threads=started["resumed_threads"],
                              config=config_data(cfg))
    code = provenance()                       # the code this process runs, as it starts
    status = "failed"
    try:
        if finished:
            status = ckpt["status"]           # the run had already ended
        else:
            state, status = run_rounds(algorithm, env, logger, state, start,
                                       checkpoint=checkpoint, initial=ckpt is None)
        status = _clients_status(status, links, env.clock, resumed)
    finally:
        control.stop(status)
        logger.close(status)
    wall = wall0 + time.perf_counter() - t0
    summary = {"name": cfg.name, "algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
               "model": cfg.model.name, "status": status,
               **record_summary(logger.records, status),
               "wall_time_s": round(wall, 3), "resumed_from": resumed,
               "threads": started["threads"], "cpu_capability": started["cpu"],
               "resumed_threads": list(started["resumed_threads"]),
               "provenance": code, "processes": links.world_size,
               "lost_ranks": {str(r): why for r, why in sorted(links.lost.items())},
               **logger.wire_totals()}
    write_summary(run_dir, summary, finished=finished)
    return RunResult(status, logger.records, run_dir, wall, state)


def _clients_status(status: str, links: Links, clock: RuntimeClock, resumed) -> str:
    """A run that went through its rounds without any client rank left is not
    ``completed``: ``no_client_trained`` when no client trained in any round (of this
    session, and the run was not resumed), else ``clients_lost``."""
    if status != "completed" or links.live_clients():
        return status
    return "clients_lost" if clock.clients_trained or resumed else "no_client_trained"


#: the fields of rank 0's first message to a client rank
HELLO_FIELDS = {
    "config": ("a mapping", lambda v: isinstance(v, dict)),
    "delay_scale": ("null or a finite number", lambda v: v is None or is_finite_number(v)),
    "resume": ("a checkpoint or null", lambda v: v is None or isinstance(v, dict)),
}


def host(links: Links) -> str:
    """A client rank: follow rank 0's run until it stops; returns the stop reason."""
    try:                                    # a stop: rank 0 failed before the run started
        hello = control_message(links.recv_object(SERVER_RANK), HELLO_FIELDS)
    except StopRun as stop:
        return str(stop)
    cfg = dataclasses.replace(build_config(hello["config"]), progress=False)
    algorithm = build_algorithm(cfg)
    env = build_environment(cfg)
    adapt(env, links, hello["delay_scale"])
    start, state = 1, None
    if hello["resume"] is not None:     # the checkpoint's state, as rank 0 restores it:
        saved = hello["resume"]         # per-client state (SCAFFOLD's c_i) lives on here
        state = restore(env, saved, resume_template(algorithm, env, saved["state"]))
        start = saved["round"] + 1
    try:
        if state is None:
            state = algorithm.init_state(env)
        run_rounds(algorithm, env, MetricLogger(None), state, start)
        control_message(links.recv_object(SERVER_RANK), {})
        return "completed"
    except StopRun as stop:
        return str(stop)
