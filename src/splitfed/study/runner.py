"""Running a study: check everything, lock the study directory, run (or resume, or
reuse) each run, in order in this process or side by side in worker processes or on a
Dask cluster (:mod:`splitfed.study.parallel`), write the results
(:mod:`splitfed.study.report`) once every run has finished, and publish them when
asked."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from splitfed.errors import ConfigError, FormatError, RunInterrupted, SplitfedError
from splitfed.experiment import record_statuses
from splitfed.locking import DirLock, check_free
from splitfed.metrics import divergence, last_value, read_records
from splitfed.study.analysis import _num, run_numbers
from splitfed.study.outcome import RunOutcome, StudyResult
from splitfed.study.parallel import (PointResult, PointTask, check_options,
                                     check_scheduler, resolve_jobs, run_dask, run_local,
                                     run_point)
from splitfed.study.plots import _print
from splitfed.study.report import check_publish, publish, write_results
from splitfed.study.reuse import (RunDirState, config_identity, current_code, read_json,
                                  run_dir_state)
from splitfed.study.spec import Study, StudyRun, load_study, study_from_mapping


def run_study(study: str | Path | Mapping | Study, *, out_dir: str | Path | None = None,
              progress: bool = False, quiet: bool = False,
              plugins: list[str] | None = None, keep_stale: bool = False,
              publish_to: str | Path | None = None, jobs: int | None = None,
              threads: int = 1, executor: str | None = None,
              address: str | None = None, overrides: list[str] | None = None
              ) -> StudyResult:
    """Run every run of a study not already done, then write results.md/json and plots.

    ``study``: a study file path, a mapping in the same format, or a loaded :class:`Study`.
    ``out_dir`` overrides the study's ``out_dir`` (default ``runs/studies``); ``progress``
    shows each run's progress bar (runs in this process only, see below); ``quiet``
    prints nothing (by default a line per run and the table at the end); ``plugins``
    (the command line's ``--plugin``) are added to the study's ``plugins`` (not used
    with a loaded :class:`Study`); ``overrides`` (the command line's ``--set``,
    ``key=value``, a study file only) apply to every run after the file's own
    ``overrides`` (:func:`~splitfed.study.spec.load_study`).

    ``jobs``: how many runs go at the same time (None: the usable cores), at most the
    runs left to do; with one, the runs go one after the other in this process, else in
    worker processes (:func:`~splitfed.study.parallel.run_local`). ``executor="dask"``
    sends them to a Dask cluster instead: the scheduler at ``address`` (or
    ``DASK_SCHEDULER_ADDRESS``), else a local cluster of ``jobs`` worker processes on
    127.0.0.1 (:func:`~splitfed.study.parallel.run_dask`). ``threads``: PyTorch threads
    of each run, in every mode (in this process for the runs' duration, then restored),
    so that the results do not depend on ``jobs``. A run that fails does not stop the
    others: once they have ended, :class:`RunsFailed` names each failed run, and the
    results are written only when every run has finished.

    A finished run is reused only when its config and its code version match
    (:mod:`splitfed.study.reuse`); a finished run made by other code is rerun (a line
    says ``stale: recorded with ..., now ...; rerunning``), or with ``keep_stale`` kept
    and marked stale in the table. ``publish_to`` (e.g. ``docs/results``): once the
    results are written, copy them (not the runs) to ``publish_to/<name>/``
    (:func:`~splitfed.study.report.publish`); refused together with ``keep_stale``.

    Before any run starts or anything is written, the options are checked, every run
    that is not done is built as :func:`~splitfed.experiment.run_experiment` builds it
    (:func:`check_runs`) and the study directory is checked; then the directory is
    locked (:mod:`splitfed.locking`) until the results are written: a second process on
    the same study is refused.
    """
    check_options(jobs, threads, executor, address)
    if keep_stale and publish_to is not None:
        raise ConfigError("publish: not with keep_stale; published results come from one "
                          "code version")
    if overrides and not isinstance(study, (str, Path)):
        raise ConfigError("overrides: only with a study file (a mapping or a loaded study "
                          "carries its own 'overrides')")
    if isinstance(study, Study):
        command = "run_study(...)"
    elif isinstance(study, Mapping):
        study = study_from_mapping(study, out_dir=out_dir, plugins=plugins)
        command = "run_study(<mapping>)"
    else:
        command = "splitfed study " + shlex.quote(str(study))
        if out_dir is not None:
            command += " --out-dir " + shlex.quote(str(out_dir))
        for plugin in plugins or ():
            command += " --plugin " + shlex.quote(str(plugin))
        for item in overrides or ():
            command += " --set " + shlex.quote(str(item))
        if keep_stale:
            command += " --keep-stale"
        if publish_to is not None:
            command += " --publish " + shlex.quote(str(publish_to))
        command += "".join(" " + shlex.join(o) for o in
                           parallel_options(jobs, threads, executor, address))
        from splitfed.provenance import redact

        command = redact(command)
        study = load_study(study, out_dir=out_dir, plugins=plugins, overrides=overrides)
    if publish_to is not None:
        check_publish(publish_to, study.name)
    check_scheduler(executor, address)
    say = (lambda *a, **k: None) if quiet else _print
    with open_study(study, "study directory", keep_stale=keep_stale) as prepared:
        outcomes = execute_study(prepared, progress, say, jobs=jobs, threads=threads,
                                 executor=executor, address=address)
        result = write_results(study, outcomes, command, say)
    if publish_to is not None:
        say(f"published: {publish(result.dir, publish_to)}")
    return result


def parallel_options(jobs: int | None, threads: int, executor: str | None,
                     address: str | None) -> list[list[str]]:
    """The command line options that give these settings, as given (defaults left out):
    ``[["--jobs", "4"], ["--executor", "dask"], ...]``."""
    out = []
    if jobs is not None:
        out.append(["--jobs", str(jobs)])
    if threads != 1:
        out.append(["--threads", str(threads)])
    if executor is not None:
        out.append(["--executor", executor])
    if address is not None:
        out.append(["--address", address])
    return out


class RunsFailed(SplitfedError):
    """Runs of a study failed while they ran; the others ran to their end and are kept.
    ``failures``: ``(run, message)`` of each failed run, in the study's order. The
    message has a line for each."""

    def __init__(self, failures: list[tuple[StudyRun, str]], total: int):
        self.failures = failures
        lines = [f"{len(failures)} of {total} runs failed; the others are kept and the "
                 "results are written once every run has finished: run the same command "
                 "again (after fixing the cause) to run the failed ones"]
        lines += [f"  run {run.label!r} (seed {run.seed}): {' '.join(message.split())}"
                  for run, message in failures]
        super().__init__("\n".join(lines))


@dataclass
class PreparedStudy:
    """A study checked end to end and locked: what :func:`open_study` returns. The lock
    is released on exit from a ``with`` block."""

    study: Study
    states: list[RunDirState]           # of each run, in study.runs order
    records: list[list[dict] | None]    # the metrics of the runs reused
    lock: DirLock
    keep_stale: bool = False

    def __enter__(self) -> PreparedStudy:
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


def open_study(study: Study, what: str = "study directory",
               outputs: tuple[str, ...] = (), keep_stale: bool = False) -> PreparedStudy:
    """Check everything a study needs, then lock its directory; writes nothing but the
    directory and its lock file, and only once every check passed.

    1. refuses at once a study directory another process holds;
    2. reads the run directories (:func:`~splitfed.study.reuse.run_dir_state`: a run of
       another config, or a damaged finished run, is refused, naming the directory);
    3. builds every run that is not reused (:func:`check_runs`): data, partition, model
       and cut, sampler, algorithm checks; a failure names the run;
    4. checks that the result files (``outputs`` added) can be written;
    5. creates and locks the study directory (:class:`~splitfed.locking.DirLock`), and
       reads the run directories again under the lock.

    ``keep_stale``: a finished run made by other code is reused (and marked), not rerun.
    """
    check_free(study.dir, what)
    note = server_pool_mismatch(study.runs)
    if note:
        print(f"splitfed: warning: {note}", file=sys.stderr, flush=True)
    current = current_code()
    states, records = _scan(study, current, keep_stale)
    check_runs([r for r, s in zip(study.runs, states) if not s.reused(keep_stale)])
    _check_outputs(study, outputs)
    lock = DirLock.acquire(study.dir, what)
    try:
        again, records = _scan(study, current, keep_stale)   # another process may have
        check_runs([r for r, s, t in zip(study.runs, again, states)  # changed them
                    if not s.reused(keep_stale) and t.reused(keep_stale)])
        (study.dir / "runs").mkdir(exist_ok=True)
    except BaseException:
        lock.release()
        raise
    return PreparedStudy(study, again, records, lock, keep_stale)


def _scan(study: Study, current: Mapping, keep_stale: bool
          ) -> tuple[list[RunDirState], list[list[dict] | None]]:
    """Each run's state, and the records of those reused (read now, so that a damaged
    one stops the study before anything runs)."""
    states, records = [], []
    for run in study.runs:
        state = run_dir_state(run, current)
        got = None
        if state.reused(keep_stale):
            metrics = run.run_dir / "metrics.jsonl"
            try:
                got = read_records(metrics)
            except FormatError as e:
                raise FormatError(f"{e}; the finished run in {run.run_dir} is damaged: "
                                  "delete that directory to run it again") from None
            if not got:
                raise FormatError(f"{metrics} holds no record; the finished run in "
                                  f"{run.run_dir} is damaged: delete that directory to "
                                  "run it again")
            _check_complete(run, got)
        states.append(state)
        records.append(got)
    return states, records


def _check_complete(run: StudyRun, records: list[dict]) -> None:
    """A finished run's ``summary.json`` agrees with its ``metrics.jsonl``: the records
    end at the round it says the run ended at (a file cut at a line boundary, a copy
    interrupted or a disk filled, reads as valid records and would pass for the whole
    run), and its ``status`` is the one the records give
    (:func:`~splitfed.experiment.record_statuses`; the table and the exit status take it
    from there, the numbers from the records)."""
    run_dir = run.run_dir
    summary = read_json(run_dir / "summary.json")
    damaged = (f"; the finished run in {run_dir} is damaged: delete that directory to run "
               "it again")
    said, last = summary.get("rounds"), last_value(records, "round")
    if isinstance(said, int) and not isinstance(said, bool) and said != last:
        raise FormatError(f"{run_dir / 'metrics.jsonl'} ends at round {last} but "
                          f"summary.json says the run ended at round {said}{damaged}")
    status = summary.get("status")
    allowed, why = record_statuses(records, run.config)
    if status == "diverged" and divergence(records) is None:
        why = "no non-finite loss or accuracy in any round"
    if status not in allowed:
        raise FormatError(f"{run_dir / 'summary.json'} says the run ended {status!r} but "
                          f"metrics.jsonl records {why}{damaged}")


def server_pool_mismatch(runs: list[StudyRun]) -> str | None:
    """A note when runs of the same data, partition and seed train their clients on
    different data: some carve the server's pool out of the training set before it is
    partitioned (an algorithm that trains on server data, or ``server_data.always``,
    with ``server_data.disjoint``) and others do not, so that e.g. a FedAvg baseline
    holds more client data than the hybrid runs it is compared with (docs/studies.md,
    "Hybrid algorithms and their baselines"); None when they all agree. Builds nothing
    but the algorithms."""
    from splitfed.experiment import carves_server_pool

    groups: dict[str, dict[bool, list[str]]] = {}
    for run in runs:
        cfg = run.config
        try:
            carved = carves_server_pool(cfg)
        except SplitfedError:
            continue                                  # check_runs reports it
        identity = config_identity(cfg)
        key = json.dumps([cfg.seed, identity.get("data"), identity.get("partition")],
                         sort_keys=True, default=str)
        labels = groups.setdefault(key, {}).setdefault(carved, [])
        if run.label not in labels:
            labels.append(run.label)
    for by in groups.values():
        if len(by) == 2:
            return (f"runs {_some(by[True])} remove the server's pool from the training "
                    f"set before partitioning it and runs {_some(by[False])} do not, so "
                    "their clients hold different data; set server_data.always: true on "
                    "the latter to compare them on the same client data")
    return None


def _some(labels: list[str]) -> str:
    """The first three labels, and how many more."""
    more = len(labels) - 3
    return ", ".join(labels[:3]) + (f" and {more} more" if more > 0 else "")


#: seconds between the lines that :func:`check_runs` prints while it checks a large grid
CHECK_PROGRESS_S = 10.0


def check_runs(runs: list[StudyRun]) -> None:
    """Build each run as :func:`~splitfed.experiment.run_experiment` builds it before
    writing anything (algorithm, data, partition, model and cut, sampler, clock,
    the algorithm's checks), each distinct config once, runs of the same data set one
    after another (they share it, loaded once), and each MLflow store that a run's
    ``tracking.mlflow_uri`` names opened once (:func:`splitfed.tracking.preflight`); the
    first failure raises its error with the run's label (and seed) in front. Nothing is
    written. When it takes long, a line on stderr every :data:`CHECK_PROGRESS_S` seconds
    says how many are checked."""
    from splitfed.experiment import (build_algorithm, build_environment,
                                     check_algorithm_env, data_key)
    from splitfed.tracking import preflight

    seen: set[str] = set()
    seeds = {r.label: 0 for r in runs}
    for r in runs:
        seeds[r.label] += 1

    def named(run: StudyRun, e: SplitfedError) -> None:   # the run's label in front
        where = f"run {run.label!r}" + (f" (seed {run.seed})" if seeds[run.label] > 1
                                        else "")
        e.args = (f"{where}: {e}",)

    stores: set[str] = set()          # each MLflow store a run logs to, opened once
    for run in runs:
        t = run.config.tracking
        if t.mlflow and t.mlflow_uri is not None and t.mlflow_uri not in stores:
            stores.add(t.mlflow_uri)
            try:
                preflight(run.config)
            except SplitfedError as e:
                named(run, e)
                raise
    data: dict = {}                      # runs that load the same data set in a row share it
    order = sorted(runs, key=lambda r: data_key(r.config))   # a stable sort
    start = last = time.monotonic()
    for done, run in enumerate(order):
        now = time.monotonic()
        if now - last >= CHECK_PROGRESS_S:           # a large grid: say how far it is
            last = now
            print(f"splitfed: checking the runs before any starts: {done:,} of "
                  f"{len(order):,} (elapsed {now - start:.0f} s)", file=sys.stderr,
                  flush=True)
        identity = {k: v for k, v in config_identity(run.config).items() if k != "name"}
        key = json.dumps(identity, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            algorithm = build_algorithm(run.config)
            env = build_environment(run.config, data_cache=data)
            check_algorithm_env(algorithm, env)
        except RunInterrupted:
            raise
        except SplitfedError as e:
            named(run, e)
            raise
        del env, algorithm


def _check_outputs(study: Study, extra: tuple[str, ...]) -> None:
    d = study.dir
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d} exists and is not a directory; choose another name or "
                          "--out-dir")
    if (d / "runs").exists() and not (d / "runs").is_dir():
        raise ConfigError(f"{d / 'runs'} exists and is not a directory; move it away")
    base = [study.base_file.name] if study.base_file is not None else []
    names = ["results.json", "results.md", "study.yaml", *base,
             *(f"accuracy_vs_{axis}.png" for axis in study.spec.x_axes), *extra]
    for name in names:
        path = d / name
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} exists and is not a file; move it away (the study "
                              "writes its results there)")


def execute_study(prepared: PreparedStudy, progress: bool = False, say=_print,
                  warn=None, *, jobs: int | None = 1, threads: int = 1,
                  executor: str | None = None, address: str | None = None,
                  grid_say=None) -> list[RunOutcome]:
    """Run (or resume, or reuse) every run of a prepared study; the outcomes come in the
    study's order.

    With ``jobs`` (None: the usable cores; at most the runs left to do) of one and no
    ``executor``, the runs go in order in this process, with PyTorch's thread count set
    to ``threads`` for their duration (and restored after); ``say`` gets a line per run,
    ``[3/12] LABEL (seed 0) ... 0.8123 in 41.2 s``. Otherwise they go to worker
    processes, or with ``executor="dask"`` to a Dask cluster (``address``), each run
    with ``threads`` threads (:mod:`splitfed.study.parallel`); ``grid_say`` (default
    ``say``) gets a line when a run starts and when it ends, with the runs finished so
    far, ``[4/12] LABEL (seed 0) ... 0.8123 in 41.2 s (elapsed 95.0 s)``; ``progress``
    (progress bars) is then replaced by these lines, with a note. ``warn`` (default
    ``say``) gets the line of a stale run before it is rerun.

    A run that fails (an error while it runs, a worker process that dies) gets a line
    and does not stop the others; once all have ended, :class:`RunsFailed` names each.
    Ctrl-C raises :class:`~splitfed.errors.RunInterrupted`.
    """
    check_options(jobs, threads, executor, address)
    warn = say if warn is None else warn
    grid_say = say if grid_say is None else grid_say
    study = prepared.study
    runs = study.runs
    total = len(runs)
    todo = [i for i, state in enumerate(prepared.states)
            if not state.reused(prepared.keep_stale)]
    n = resolve_jobs(jobs, len(todo))
    if todo and (executor == "dask" or n > 1):
        return _execute_parallel(prepared, todo, progress, warn, grid_say, n, threads,
                                 executor, address)
    outcomes = []
    failures: list[tuple[StudyRun, str]] = []
    previous = _threads() if todo else None
    try:
        for i, (run, state, records) in enumerate(zip(runs, prepared.states,
                                                      prepared.records), 1):
            if state.reused(prepared.keep_stale):
                outcome = _reused(run, state, records)
            else:
                if state.state == "stale":
                    warn(f"[{i}/{total}] {run.label} (seed {run.seed}): stale: "
                         f"{state.note}; rerunning")
                result = run_point(_task(i - 1, run, state, threads, progress))
                if result.error is not None:
                    say(f"[{i}/{total}] {run.label} (seed {run.seed}) ... failed: "
                        f"{' '.join(result.error.split())}")
                    failures.append((run, result.error))
                    continue
                outcome = _fresh(run, result)
            say(f"[{i}/{total}] {run.label} (seed {run.seed}) ... {outcome_text(outcome)}")
            outcomes.append(outcome)
    finally:
        if previous is not None:
            _threads(previous)
    if failures:
        raise RunsFailed(failures, total)
    return outcomes


def _threads(n: int | None = None) -> int:
    """PyTorch's thread count (set to ``n`` first when given)."""
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def _task(index: int, run: StudyRun, state: RunDirState, threads: int, progress: bool,
          absolute: bool = False) -> PointTask:
    run_dir = run.run_dir.absolute() if absolute else run.run_dir
    return PointTask(index, run.label, run.seed, run.config, run_dir, state.state,
                     threads=threads, progress=progress)


def _execute_parallel(prepared: PreparedStudy, todo: list[int], progress: bool, warn,
                      say, jobs: int, threads: int, executor: str | None,
                      address: str | None) -> list[RunOutcome]:
    """The runs ``todo`` (indices into the study's runs) on worker processes or Dask;
    the others reused. See :func:`execute_study`."""
    study = prepared.study
    runs = study.runs
    total = len(runs)
    t0 = time.perf_counter()
    outcomes: dict[int, RunOutcome] = {}
    errors: dict[int, str] = {}

    def elapsed() -> str:
        return f"(elapsed {time.perf_counter() - t0:.1f} s)"

    if progress:
        warn("note: --progress shows progress bars only for runs in this process "
             "(--jobs 1); a line per run start and end instead")
    for i, (run, state, records) in enumerate(zip(runs, prepared.states, prepared.records)):
        if state.reused(prepared.keep_stale):
            outcomes[i] = _reused(run, state, records)
            say(f"[{len(outcomes)}/{total}] {run.label} (seed {run.seed}) ... "
                f"{outcome_text(outcomes[i])}")
        elif state.state == "stale":
            warn(f"{run.label} (seed {run.seed}): stale: {state.note}; rerunning")

    def done() -> int:
        return len(outcomes) + len(errors)

    def on_start(task: PointTask, again: bool) -> None:
        what = "started again (its worker died)" if again else "started"
        say(f"[{done()}/{total}] {task.label} (seed {task.seed}) ... {what} {elapsed()}")

    def on_finish(task: PointTask, result: PointResult) -> None:
        run = runs[task.index]
        if result.error is not None:
            errors[task.index] = result.error
            say(f"[{done()}/{total}] {run.label} (seed {run.seed}) ... failed: "
                f"{' '.join(result.error.split())} {elapsed()}")
            return
        outcomes[task.index] = _fresh(run, result)
        say(f"[{done()}/{total}] {run.label} (seed {run.seed}) ... "
            f"{outcome_text(outcomes[task.index])} {elapsed()}")

    tasks = [_task(i, runs[i], prepared.states[i], threads, False, absolute=True)
             for i in todo]
    if executor == "dask":
        run_dask(tasks, jobs, address, on_start, on_finish)
    else:
        run_local(tasks, jobs, on_start, on_finish)
    if errors:
        raise RunsFailed([(runs[i], errors[i]) for i in sorted(errors)], total)
    return [outcomes[i] for i in range(total)]


def outcome_text(o: RunOutcome) -> str:
    """``0.8123 in 41.2 s``, ``0.8123 (done earlier, skipped)``, ``diverged at round 3
    in 1.0 s``, ``n/a in 0.5 s [no_client_trained]``; then ``[stale: ...; kept]`` or a
    note on how the code was compared."""
    numbers = run_numbers(o.records, None, o.status)
    if numbers["diverged_round"] is not None:
        acc_text = f"diverged at round {numbers['diverged_round']}"
    else:
        acc = numbers["final_test_acc"]
        acc_text = "n/a" if acc is None else f"{acc:.4f}"
    how = "(done earlier, skipped)" if o.skipped else f"in {o.wall_time_s:.1f} s"
    text = f"{acc_text} {how}"
    text += "" if o.status in ("completed", "diverged") else f" [{o.status}]"
    if o.stale:
        text += f" [stale: {o.stale}; kept]"
    elif o.note:
        text += f" [{o.note}]"
    return text


def _reused(run: StudyRun, state: RunDirState, records: list[dict] | None) -> RunOutcome:
    """The outcome of a run taken as recorded (done, or stale and kept)."""
    summary = read_json(run.run_dir / "summary.json")
    if records is None:
        records = read_records(run.run_dir / "metrics.jsonl")
    stale = state.note if state.state == "stale" else None
    return RunOutcome(run.label, run.seed, run.run_dir, summary["status"], records,
                      _num(summary.get("wall_time_s")) or 0.0, skipped=True,
                      provenance=state.provenance, stale=stale,
                      note=None if stale else state.note)


def _fresh(run: StudyRun, result: PointResult) -> RunOutcome:
    """The outcome of a run just run (or resumed)."""
    return RunOutcome(run.label, run.seed, run.run_dir, result.status, result.records,
                      result.wall_time_s, skipped=False, provenance=result.provenance)
