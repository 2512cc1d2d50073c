"""Running a study: check everything, lock the study directory, run (or resume, or
reuse) each run in order, write the results (:mod:`splitfed.study.report`) and publish
them when asked."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from splitfed.checkpoint import CHECKPOINT
from splitfed.errors import ConfigError, FormatError, RunInterrupted, SplitfedError
from splitfed.locking import DirLock, check_free
from splitfed.metrics import read_records
from splitfed.study.analysis import _num, run_numbers
from splitfed.study.outcome import RunOutcome, StudyResult
from splitfed.study.plots import _print
from splitfed.study.report import check_publish, publish, write_results
from splitfed.study.reuse import (RunDirState, config_identity, current_code, read_json,
                                  run_dir_state)
from splitfed.study.spec import Study, StudyRun, load_study, study_from_mapping


def run_study(study: str | Path | Mapping | Study, *, out_dir: str | Path | None = None,
              progress: bool = False, quiet: bool = False,
              plugins: list[str] | None = None, keep_stale: bool = False,
              publish_to: str | Path | None = None) -> StudyResult:
    """Run every run of a study not already done, then write results.md/json and plots.

    ``study``: a study file path, a mapping in the same format, or a loaded :class:`Study`.
    ``out_dir`` overrides the study's ``out_dir`` (default ``runs/studies``); ``progress``
    shows each run's progress bar; ``quiet`` prints nothing (by default a line per run
    and the table at the end); ``plugins`` (the command line's ``--plugin``) are added
    to the study's ``plugins`` (not used with a loaded :class:`Study`).

    A finished run is reused only when its config and its code version match
    (:mod:`splitfed.study.reuse`); a finished run made by other code is rerun (a line
    says ``stale: recorded with ..., now ...; rerunning``), or with ``keep_stale`` kept
    and marked stale in the table. ``publish_to`` (e.g. ``docs/results``): once the
    results are written, copy them (not the runs) to ``publish_to/<name>/``
    (:func:`~splitfed.study.report.publish`); refused together with ``keep_stale``.

    Before any run starts or anything is written, every run that is not done is built
    as :func:`~splitfed.experiment.run_experiment` builds it (:func:`check_runs`) and the
    study directory is checked; then the directory is locked (:mod:`splitfed.locking`)
    until the results are written: a second process on the same study is refused.
    """
    if keep_stale and publish_to is not None:
        raise ConfigError("publish: not with keep_stale; published results come from one "
                          "code version")
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
        if keep_stale:
            command += " --keep-stale"
        if publish_to is not None:
            command += " --publish " + shlex.quote(str(publish_to))
        study = load_study(study, out_dir=out_dir, plugins=plugins)
    if publish_to is not None:
        check_publish(publish_to, study.name)
    say = (lambda *a, **k: None) if quiet else _print
    with open_study(study, "study directory", keep_stale=keep_stale) as prepared:
        outcomes = execute_study(prepared, progress, say)
        result = write_results(study, outcomes, command, say)
    if publish_to is not None:
        say(f"published: {publish(result.dir, publish_to)}")
    return result


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
        states.append(state)
        records.append(got)
    return states, records


def check_runs(runs: list[StudyRun]) -> None:
    """Build each run as :func:`~splitfed.experiment.run_experiment` builds it before
    writing anything (algorithm, data, partition, model and cut, sampler, clock,
    the algorithm's checks), each distinct config once; the first failure raises its
    error with the run's label (and seed) in front. Nothing is written."""
    from splitfed.experiment import build_algorithm, build_environment

    seen: set[str] = set()
    seeds = {r.label: 0 for r in runs}
    for r in runs:
        seeds[r.label] += 1
    for run in runs:
        identity = {k: v for k, v in config_identity(run.config).items() if k != "name"}
        key = json.dumps(identity, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            algorithm = build_algorithm(run.config)
            env = build_environment(run.config)
            algorithm.check(env)
        except RunInterrupted:
            raise
        except SplitfedError as e:
            where = f"run {run.label!r}" + (f" (seed {run.seed})" if seeds[run.label] > 1
                                            else "")
            e.args = (f"{where}: {e}",)
            raise
        del env, algorithm


def _check_outputs(study: Study, extra: tuple[str, ...]) -> None:
    d = study.dir
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d} exists and is not a directory; choose another name or "
                          "--out-dir")
    if (d / "runs").exists() and not (d / "runs").is_dir():
        raise ConfigError(f"{d / 'runs'} exists and is not a directory; move it away")
    names = ["results.json", "results.md",
             *(f"accuracy_vs_{axis}.png" for axis in study.spec.x_axes), *extra]
    for name in names:
        path = d / name
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} exists and is not a file; move it away (the study "
                              "writes its results there)")


def execute_study(prepared: PreparedStudy, progress: bool, say=_print,
                  warn=None) -> list[RunOutcome]:
    """Run (or resume, or reuse) every run of a prepared study, in order. ``say`` gets a
    line per run; ``warn`` (default ``say``) the line of a stale run before it is
    rerun."""
    warn = say if warn is None else warn
    study = prepared.study
    outcomes = []
    total = len(study.runs)
    for i, (run, state, records) in enumerate(zip(study.runs, prepared.states,
                                                  prepared.records), 1):
        if state.state == "stale" and not prepared.keep_stale:
            warn(f"[{i}/{total}] {run.label} (seed {run.seed}): stale: {state.note}; "
                 "rerunning")
        try:
            outcome = _execute(run, state, progress, records, prepared.keep_stale)
        except RunInterrupted:
            raise
        except SplitfedError as e:     # stops the study; done runs stay done for a rerun
            e.args = (f"run {run.label!r} (seed {run.seed}): {e}",)
            raise
        say(f"[{i}/{total}] {run.label} (seed {run.seed}) ... {outcome_text(outcome)}")
        outcomes.append(outcome)
    return outcomes


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


def _experiment():
    """run_experiment and resume_experiment, looked up on :mod:`splitfed.study` when
    called, so that replacing ``splitfed.study.run_experiment`` (as tests do) takes
    effect."""
    import splitfed.study as package

    return package.run_experiment, package.resume_experiment


def _execute(run: StudyRun, state: RunDirState, progress: bool,
             records: list[dict] | None = None, keep_stale: bool = False) -> RunOutcome:
    run_experiment, resume_experiment = _experiment()
    if state.reused(keep_stale):
        summary = read_json(run.run_dir / "summary.json")
        if records is None:
            records = read_records(run.run_dir / "metrics.jsonl")
        stale = state.note if state.state == "stale" else None
        return RunOutcome(run.label, run.seed, run.run_dir, summary["status"], records,
                          _num(summary.get("wall_time_s")) or 0.0, skipped=True,
                          provenance=state.provenance, stale=stale,
                          note=None if stale else state.note)
    if state.state == "unfinished" and (run.run_dir / CHECKPOINT).is_file():
        result = resume_experiment(run.run_dir)      # continue from its last checkpoint
    else:
        if state.state in ("unfinished", "stale"):
            shutil.rmtree(run.run_dir)
        cfg = dataclasses.replace(run.config, progress=progress)
        result = run_experiment(cfg, run_dir=run.run_dir)
    prov = read_json(run.run_dir / "summary.json").get("provenance")
    return RunOutcome(run.label, run.seed, run.run_dir, result.status, result.records,
                      result.wall_time_s, skipped=False,
                      provenance=prov if isinstance(prov, dict) else None)
