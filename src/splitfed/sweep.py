"""Sweeps: ``splitfed sweep CONFIG key=v1,v2,... [key2=a,b ...]``, a grid from the command line.

A sweep is a study (:mod:`splitfed.study`) whose grid is written on the command line:
every ``key=v1,v2,...`` with several values is an axis, the run is every combination
(cartesian product, axes in the order given, the first outermost), and a ``key=value``
with one value is an override applied to every run. Values are YAML, split at top-level
commas: ``train.lr=0.01,0.1`` gives two floats, ``model.hidden=[64,32],[128]`` two lists,
``model.hidden=[64,32]`` one list.

The study machinery does the work: every run is validated and built (data, partition,
model and cut, algorithm checks) before anything runs or is written, the sweep
directory is locked against a second process for the whole sweep, each run goes to
``<sweep dir>/runs/<key-value slug>-s<seed>/`` (a deterministic name), finished runs are
skipped, interrupted ones are resumed from their checkpoint (``checkpoint_every``), and
``results.md``/``results.json`` (and plots when matplotlib is installed) are written
once every run has finished. The runs go side by side in worker processes (``jobs``,
default the usable cores) or on a Dask cluster (:mod:`splitfed.study.parallel`); a run
that fails does not stop the others.
On top of that a sweep writes one row per run with the swept values in their own
columns: ``sweep.md``, ``sweep.csv`` and ``sweep.json`` (status ``completed`` or
``diverged``, final and best test accuracy, rounds run, the round a diverged run
diverged at, total bytes up and down, simulated time, the code version that made the
run). A finished run is reused only when its config and code version match (see
:mod:`splitfed.study.reuse`); the tables carry a provenance line.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitfed.config import MAX_SEED, MIN_SEED
from splitfed.errors import ConfigError
from splitfed.files import atomic_write_text
from splitfed.provenance import redact
from splitfed.grid import parse_axes  # noqa: F401 - part of this module's interface
from splitfed.study import (StudyResult, execute_study, open_study, publish,
                            read_records, run_numbers, study_from_mapping, value_text,
                            write_results)
from splitfed.study.parallel import check_options, check_scheduler, resolve_jobs
from splitfed.study.report import check_publish, provenance_line
from splitfed.study.runner import parallel_options
from splitfed.study.spec import check_run_count

DEFAULT_OUT_DIR = "runs/sweeps"
#: the columns of sweep.csv after the swept keys and the seed (``run_dir`` last)
COLUMNS = ("status", "final_test_acc", "best_test_acc", "rounds", "diverged_round",
           "bytes_up", "bytes_down", "sim_time_s", "splitfed", "commit", "stale")
OUTPUTS = ("sweep.md", "sweep.csv", "sweep.json")


def default_name(config: str) -> str:
    """``<config stem>-sweep`` as a plain directory name."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(config).stem).strip("-.") or "config"
    return f"{stem}-sweep"


@dataclass
class SweepResult:
    study: StudyResult
    axes: dict[str, list[Any]]
    rows: list[dict]
    table: str

    @property
    def completed(self) -> bool:
        return self.study.completed


def sweep_study(config: str, items: list[str], *, name: str | None = None,
                seeds: list[int] | None = None, out_dir: str | Path | None = None,
                group_by: str | None = None, plugins: list[str] | None = None) -> dict:
    """The study mapping of a sweep (validated by :func:`run_sweep`); ``plugins`` are
    imported and added to every run's config."""
    axes, overrides = parse_axes(items)
    if not axes:
        raise ConfigError("sweep: give at least one key with several values, "
                          "e.g. train.lr=0.01,0.1")
    if name is not None and not name.strip():
        raise ConfigError("sweep: --name is empty; give a name, or leave --name out for "
                          f"{default_name(config)!r}")
    study = {"name": default_name(config) if name is None else name, "base": str(config),
             "overrides": overrides, "grid": axes,
             "out_dir": str(out_dir if out_dir is not None else DEFAULT_OUT_DIR)}
    if seeds is not None:
        study["seeds"] = _check_seeds(seeds)
        given = [*axes, *(o.partition("=")[0].strip() for o in overrides)]
        if "seed" in given:
            raise ConfigError("sweep: 'seed' is given both as seed=... and by --seeds "
                              "(which gives every run its seed); give the seeds once: "
                              "seed=1,2 or --seeds 1,2")
    check_run_count(math.prod(len(v) for v in axes.values()) * len(seeds or [None]),
                    "sweep")
    if plugins:
        study["plugins"] = list(plugins)
    if group_by is not None:
        if group_by not in axes:
            raise ConfigError(f"sweep: --group-by {group_by!r} is not a swept key; swept: "
                              f"{', '.join(axes)}")
        study["group_by"] = group_by
    return study


def _check_seeds(seeds: list[int]) -> list[int]:
    """``seeds`` as a list; ConfigError naming ``--seeds`` when one is not a seed or two
    are the same."""
    seeds = list(seeds)
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigError(f"--seeds: expected integers separated by commas, e.g. 0,1,2; "
                              f"got {s!r}")
        if not MIN_SEED <= s <= MAX_SEED:
            raise ConfigError(f"--seeds: seed {s} is out of range; allowed: "
                              f"{MIN_SEED}..{MAX_SEED}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds: expected distinct seeds, e.g. 0,1,2; got "
                          f"{','.join(map(str, seeds))!r}")
    return seeds


def run_sweep(config: str, items: list[str], *, name: str | None = None,
              seeds: list[int] | None = None, out_dir: str | Path | None = None,
              group_by: str | None = None, progress: bool = False,
              quiet: bool = False, plugins: list[str] | None = None,
              keep_stale: bool = False, publish_to: str | Path | None = None,
              jobs: int | None = None, threads: int = 1, executor: str | None = None,
              address: str | None = None) -> SweepResult:
    """Run (or finish) a sweep; write the study files and ``sweep.md/csv/json``.
    ``group_by``: a swept key; the plots get one panel per value of it. ``keep_stale``:
    a finished run made by other code is kept (marked stale) instead of rerun.
    ``publish_to``: copy the results and sweep tables (not the runs) to
    ``publish_to/<name>/`` (:func:`splitfed.study.publish`).

    ``jobs``, ``threads``, ``executor``, ``address``: as for
    :func:`splitfed.study.run_study` (runs side by side, PyTorch threads per run, a Dask
    cluster). With runs side by side, a line is printed when each starts and ends
    (unless ``quiet``). A run that fails does not stop the others; then
    :class:`splitfed.study.RunsFailed` names each failed run and no table is written."""
    check_options(jobs, threads, executor, address)
    if keep_stale and publish_to is not None:
        raise ConfigError("publish: not with keep_stale; published results come from one "
                          "code version")
    mapping = sweep_study(config, items, name=name, seeds=seeds, out_dir=out_dir,
                          group_by=group_by, plugins=plugins)
    study = study_from_mapping(mapping)
    command = _command(config, items, name, seeds, out_dir, group_by, plugins,
                       keep_stale, publish_to, jobs, threads, executor, address)
    if publish_to is not None:
        check_publish(publish_to, study.name)
    check_scheduler(executor, address)
    keys = list(mapping["grid"])
    quiet_say = lambda *a, **k: None  # noqa: E731
    warn = quiet_say if quiet else (lambda *a, **k: print(*a, **k, flush=True))
    with open_study(study, "sweep directory", OUTPUTS, keep_stale=keep_stale) as prepared:
        left = sum(not s.reused(keep_stale) for s in prepared.states)
        side_by_side = executor == "dask" or resolve_jobs(jobs, left) > 1
        outcomes = execute_study(prepared, progress, say=quiet_say, warn=warn, jobs=jobs,
                                 threads=threads, executor=executor, address=address,
                                 grid_say=warn if side_by_side else quiet_say)
        result = write_results(study, outcomes, command, say=quiet_say)
        rows = sweep_rows(result, mapping["grid"])
        table = markdown_table(rows, keys)
        write_sweep(result.dir, rows, keys, table, command, result.summary["provenance"])
    if not quiet:
        for o in result.outcomes:
            how = "done earlier, skipped" if o.skipped else f"{o.wall_time_s:.1f} s"
            extra = (f" [stale: {o.stale}; kept]" if o.stale
                     else f" [{o.note}]" if o.note else "")
            print(f"{o.label} (seed {o.seed}): {o.status} ({how}){extra}", flush=True)
        print(table)
        print(f"sweep: {result.dir / 'sweep.md'}", flush=True)
    if publish_to is not None:
        where = publish(result.dir, publish_to)
        if not quiet:
            print(f"published: {where}", flush=True)
    return SweepResult(result, mapping["grid"], rows, table)


def _command(config, items, name, seeds, out_dir, group_by, plugins=None,
             keep_stale=False, publish_to=None, jobs=None, threads=1, executor=None,
             address=None) -> str:
    parts = ["splitfed", "sweep", config, *items]
    if name is not None:
        parts += ["--name", name]
    if seeds is not None:
        parts += ["--seeds", ",".join(str(s) for s in seeds)]
    if out_dir is not None:
        parts += ["--out-dir", str(out_dir)]
    if group_by is not None:
        parts += ["--group-by", group_by]
    for plugin in plugins or ():
        parts += ["--plugin", plugin]
    if keep_stale:
        parts += ["--keep-stale"]
    if publish_to is not None:
        parts += ["--publish", str(publish_to)]
    for option in parallel_options(jobs, threads, executor, address):
        parts += option
    return redact(" ".join(shlex.quote(str(p)) for p in parts))


def sweep_rows(result: StudyResult, axes: dict[str, list[Any]]) -> list[dict]:
    """One row per run, in grid order: the swept values (a key that names a result
    column, ``rounds``, as ``swept.<key>``: :func:`axis_column`), seed, status,
    accuracies, rounds, the round a diverged run diverged at, total bytes up and down,
    simulated time, and the splitfed version and git commit its ``summary.json`` recorded (read
    back from each run's ``metrics.jsonl`` and ``summary.json``). A diverged run has no
    final accuracy (None); its best is the best evaluated before it diverged."""
    keys = list(axes)
    points = [dict(zip(keys, combo)) for combo in _product(axes)]
    rows = []
    for variant, point in zip(result.study.variants, points):
        for run in variant.runs:
            outcome = next(o for o in result.outcomes
                           if o.label == run.label and o.seed == run.seed)
            records = outcome.records or read_records(run.run_dir / "metrics.jsonl")
            numbers = run_numbers(records, None, outcome.status)   # diverged: final None
            prov = outcome.provenance or {}
            rows.append({**{axis_column(k): v for k, v in point.items()},
                         "seed": run.seed, "status": outcome.status,
                         "final_test_acc": numbers["final_test_acc"],
                         "best_test_acc": numbers["best_test_acc"],
                         "rounds": numbers["rounds"],
                         "diverged_round": numbers["diverged_round"],
                         "bytes_up": numbers["bytes_up"], "bytes_down": numbers["bytes_down"],
                         "sim_time_s": numbers["sim_time_s"],
                         "splitfed": prov.get("splitfed"), "commit": prov.get("commit"),
                         "stale": outcome.stale,
                         "run_dir": str(run.run_dir.relative_to(result.dir))})
    return rows


def _product(axes: dict[str, list[Any]]):
    return itertools.product(*axes.values())


def _acc(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _final(row: dict) -> str:
    if row.get("diverged_round") is not None:
        return f"diverged at round {row['diverged_round']}"
    return _acc(row["final_test_acc"])


def _mb(value) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f}"


def _status(row: dict) -> str:
    return row["status"] + (" (stale)" if row.get("stale") else "")


def axis_column(key: str) -> str:
    """The column of swept key ``key``: the key, or ``swept.<key>`` where a result column
    has its name (a sweep over ``rounds`` next to the rounds each run reached)."""
    return f"swept.{key}" if key in COLUMNS else key


def _value_columns(keys: list[str]) -> list[str]:
    """The columns of the swept keys before the ``seed`` column (a seed axis is that
    column)."""
    return [axis_column(k) for k in keys if k != "seed"]


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    """One row per run: the swept values, seed, status, final accuracy (``diverged at
    round N`` for a diverged run), best accuracy, rounds, MB up and down, and the
    simulated time when the runs record one."""
    sim = any(r.get("sim_time_s") is not None for r in rows)
    keys = _value_columns(keys)
    head = [*keys, "seed", "status", "final acc", "best acc", "rounds", "MB up", "MB down"]
    head += ["sim. time (s)"] if sim else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [value_text(r[k]) for k in keys]
        cells += [str(r["seed"]), _status(r), _final(r), _acc(r["best_test_acc"]),
                  str(r["rounds"]), _mb(r.get("bytes_up")), _mb(r.get("bytes_down"))]
        if sim:
            cells += ["n/a" if r.get("sim_time_s") is None else f"{r['sim_time_s']:.4g}"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def write_sweep(sweep_dir: Path, rows: list[dict], keys: list[str], table: str,
                command: str, provenance: dict | None = None) -> None:
    """``sweep.md`` (table, provenance line and command), ``sweep.csv`` and
    ``sweep.json`` (the command, the axes, the provenance, the rows)."""
    sweep_dir = Path(sweep_dir)
    text = ["# Sweep: " + sweep_dir.name, "", f"Swept: {', '.join(keys)}; one row per run. "
            "Accuracies are test accuracies; final = at the last evaluated round. "
            "MB = 10^6 bytes (exact bytes in sweep.csv and sweep.json).", "", table, ""]
    stale = [f"- {r['run_dir']}: stale, {r['stale']}" for r in rows if r.get("stale")]
    if stale:
        text += ["Stale runs, kept as recorded (made by other code than the rest):", "",
                 *stale, ""]
    if provenance is not None:
        text += [provenance_line(provenance), ""]
    text += ["Produced by:", "", "```bash", command, "```", ""]
    atomic_write_text(sweep_dir / "sweep.md", "\n".join(text))
    columns = [*_value_columns(keys), "seed", *COLUMNS, "run_dir"]
    table_csv = io.StringIO(newline="")
    w = csv.DictWriter(table_csv, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    swept = {*keys, *_value_columns(keys)}
    w.writerows({k: (value_text(v) if k in swept else v) for k, v in r.items()}
                for r in rows)
    atomic_write_text(sweep_dir / "sweep.csv", table_csv.getvalue())
    atomic_write_text(sweep_dir / "sweep.json", json.dumps(
        {"command": command, "axes": keys, "provenance": provenance, "runs": rows},
        indent=2, default=str) + "\n")
