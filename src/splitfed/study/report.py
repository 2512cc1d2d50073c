"""What a study writes: ``results.json`` (every number, per-seed curves, provenance),
``results.md`` (the table, the plots, a provenance line, the command and the study file),
and :func:`publish`, which copies them (never the run directories) to a results page
directory such as ``docs/results``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from splitfed.errors import ConfigError
from splitfed.files import atomic_write, atomic_write_text
from splitfed.locking import check_free
from splitfed.study.analysis import curve, last_rounds_accuracy, run_numbers, summarize
from splitfed.study.outcome import RunOutcome, StudyResult
from splitfed.study.plots import _print, write_plots
from splitfed.study.reuse import config_hash, read_json
from splitfed.study.spec import Study

#: the largest ``results.json`` :func:`publish` reads (every run's curves, per seed)
MAX_RESULTS_BYTES = 1 << 30
#: the provenance fields whose values over the runs results.json lists (``runs``)
PROVENANCE_FIELDS = ("splitfed", "commit", "dirty", "source", "torch", "threads",
                     "cpu_capability")
#: the files :func:`publish` copies, besides the plots
PUBLISHED = ("results.md", "results.json", "sweep.md", "sweep.csv", "sweep.json",
             "study.yaml")
#: the study file as written, in the study directory and its published copy
STUDY_FILE = "study.yaml"


def write_results(study: Study, outcomes: list[RunOutcome], command: str,
                  say=_print) -> StudyResult:
    """Write results.json, results.md, the plots, ``study.yaml`` (the study as written)
    and, when ``base`` names a YAML file next to the study file, a copy of it under the
    same name (so that ``splitfed study <dir>/study.yaml`` runs the same study again)."""

    study.dir.mkdir(parents=True, exist_ok=True)
    summary = results_summary(study, outcomes, command)
    atomic_write_text(study.dir / STUDY_FILE, study.text)
    if study.base_file is not None and study.base_file.name not in reserved_names(summary):
        _copy(study.base_file, study.dir / study.base_file.name)
        summary["base_file"] = study.base_file.name
    atomic_write_text(study.dir / "results.json", json.dumps(summary, indent=2) + "\n")
    plots = write_plots(study, summary, say)
    table = markdown_table(summary)
    atomic_write_text(study.dir / "results.md", results_markdown(study, summary, table, plots))
    say(table)
    say(f"results: {study.dir / 'results.md'}")
    return StudyResult(study, study.dir, outcomes, table, summary)


# ------------------------------------------------------------------- provenance


def provenance_summary(command: str, recorded: list[Mapping | None]) -> dict:
    """results.json's ``provenance``: this process's (:func:`splitfed.provenance.provenance`,
    the one that wrote the table, with the study's ``command``), and in ``runs`` the
    distinct values of :data:`PROVENANCE_FIELDS` the runs' ``summary.json`` recorded
    (one value each when one code version on one machine made every run); ``unrecorded``
    counts runs whose summary.json has no provenance."""
    from splitfed.provenance import provenance

    table = provenance()
    table["command"] = command
    return {**table, **recorded_provenance(recorded)}


def recorded_provenance(recorded: list[Mapping | None]) -> dict:
    """What runs recorded: ``runs``, the distinct values of each of
    :data:`PROVENANCE_FIELDS` over the provenance records ``recorded``, and
    ``unrecorded``, how many of them are None (made before provenance was recorded).
    :func:`provenance_line` reads it alone too (a field no run recorded reads
    ``unknown``)."""
    runs: dict[str, list] = {key: [] for key in PROVENANCE_FIELDS}
    for prov in recorded:
        if not isinstance(prov, Mapping):
            continue
        for key in PROVENANCE_FIELDS:
            if prov.get(key) not in runs[key]:
                runs[key].append(prov.get(key))
    return {"runs": runs, "unrecorded": sum(not isinstance(p, Mapping) for p in recorded)}


def provenance_line(prov: Mapping) -> str:
    """One line for a table: the code, PyTorch, threads and CPU kernels the runs were
    made with (several values joined with ``/`` when the runs differ)."""
    runs = prov.get("runs") or {}

    def values(key: str) -> list:
        got = runs.get(key) or []
        return got if got else [prov.get(key)]

    def show(key: str, fmt=str) -> str:
        return " / ".join("unknown" if v is None else fmt(v) for v in values(key))

    commit = show("commit", lambda c: c[:10] if c else "unknown")
    dirty = " (uncommitted changes)" if any(v is True for v in values("dirty")) else ""
    source = (f", source {show('source', lambda s: s[:10])}"
              if any(v is not None for v in values("source")) else "")
    text = (f"Provenance: splitfed {show('splitfed')}, commit {commit}{dirty}{source}, "
            f"torch {show('torch')}, {show('threads')} threads, "
            f"CPU {show('cpu_capability')}")
    if prov.get("unrecorded"):
        text += f"; {prov['unrecorded']} run(s) recorded no provenance"
    return text + "."


# ---------------------------------------------------------------------- numbers


def results_summary(study: Study, outcomes: list[RunOutcome], command: str) -> dict:
    """The content of results.json."""
    target = study.spec.target_accuracy
    by_label: dict[str, list[RunOutcome]] = {}
    for o in outcomes:
        by_label.setdefault(o.label, []).append(o)
    runs = []
    for v in study.variants:
        per_seed = [_seed_entry(study, o, target) for o in by_label[v.label]]
        entry = {"label": v.label, "line_label": v.line_label, "group": v.group,
                 "seeds": [s["seed"] for s in per_seed],
                 "status": [s["status"] for s in per_seed],
                 "diverged_round": [s["diverged_round"] for s in per_seed],
                 "stale": [s["stale"] for s in per_seed]}
        for key in ("final_test_acc", "best_test_acc", "rounds_to_target", "bytes_up",
                    "bytes_down", "sim_time_s", "wall_time_s"):
            entry[key] = summarize([s[key] for s in per_seed])
        if study.spec.average_last is not None:
            entry["mean_last_acc"] = summarize([s["mean_last_acc"] for s in per_seed])
        entry["per_seed"] = per_seed
        runs.append(entry)
    out = {"study": study.name, "command": command,
           "source": str(study.source) if study.source else None,
           "group_by": study.spec.group_by, "x_axes": list(study.spec.x_axes),
           "target_accuracy": target}
    if study.spec.average_last is not None:
        out["average_last"] = study.spec.average_last
    return {**out,
            "provenance": provenance_summary(command, [o.provenance for o in outcomes]),
            "runs": runs}


def _seed_entry(study: Study, o: RunOutcome, target: float | None) -> dict:
    run = next(r for r in study.runs if r.label == o.label and r.seed == o.seed)
    numbers = run_numbers(o.records, target, o.status)   # a diverged run: final None
    last = study.spec.average_last
    if last is not None:                                 # paper 003: last 10% of rounds
        got = last_rounds_accuracy(o.records, last, run.config.rounds, o.status)
        numbers.update(mean_last_acc=got["mean"], mean_last_evaluated=got["evaluated"],
                       mean_last_window=got["window"])
    return {"seed": o.seed, "run_dir": str(o.run_dir.relative_to(study.dir)),
            "status": o.status, "skipped": o.skipped, "stale": o.stale,
            "config_hash": config_hash(run.config), "wall_time_s": round(o.wall_time_s, 3),
            **numbers, "provenance": o.provenance, "curve": curve(o.records, o.status)}


# ------------------------------------------------------------------------ table


def _mean_std(stat: dict, fmt: str, scale: float = 1.0) -> str:
    if stat["mean"] is None:
        return "n/a"
    text = format(stat["mean"] / scale, fmt)
    if stat["n"] > 1:
        text += " ± " + format(stat["std"] / scale, fmt)
    return text


def _rounds_cell(stat: dict) -> str:
    total = len(stat["values"])
    if stat["n"] == 0:
        return "not reached"
    text = _mean_std(stat, ".0f" if total == 1 else ".1f")
    return text if stat["n"] == total else f"{text} ({stat['n']}/{total} seeds)"


def diverged_text(per_seed: list[dict]) -> str | None:
    """``diverged at round 7`` (one seed), ``diverged at round 7 (seeds 0, 2)``,
    ``diverged at round 7 (seed 0), round 9 (seed 2)``; None when no seed diverged."""
    by_round: dict[int, list[int]] = {}
    for s in per_seed:
        if s.get("diverged_round") is not None:
            by_round.setdefault(s["diverged_round"], []).append(s["seed"])
    if not by_round:
        return None
    if len(per_seed) == 1:
        return f"diverged at round {next(iter(by_round))}"
    return "diverged at " + ", ".join(
        f"round {r} (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
        for r, seeds in sorted(by_round.items()))


def _final_cell(r: dict) -> str:
    """Mean final accuracy over the seeds that did not diverge, and where the others
    diverged."""
    div = diverged_text(r["per_seed"])
    if div is None:
        return _mean_std(r["final_test_acc"], ".4f")
    if r["final_test_acc"]["n"] == 0:
        return div
    return f"{_mean_std(r['final_test_acc'], '.4f')}; {div}"


def _last_cell(r: dict) -> str:
    """Mean over seeds of the mean accuracy over the last rounds, where the seeds that
    diverged did, and how many rounds of the window were evaluated when not all."""
    stat = r["mean_last_acc"]
    div = diverged_text(r["per_seed"])
    text = _mean_std(stat, ".4f") if stat["n"] else (div or "n/a")
    if stat["n"] and div is not None:
        text += f"; {div}"
    short = [s for s in r["per_seed"] if s.get("mean_last_acc") is not None
             and s["mean_last_evaluated"] < s["mean_last_window"]]
    if short:
        worst = min(short, key=lambda s: s["mean_last_evaluated"])
        text += (f" ({worst['mean_last_evaluated']} of {worst['mean_last_window']} "
                 "rounds evaluated)")
    return text


def _status_cell(r: dict) -> str:
    text = ", ".join(sorted(set(r["status"])))
    stale = sum(1 for s in r["stale"] if s)
    if stale:
        text += " (stale)" if stale == len(r["stale"]) else f" ({stale} stale)"
    return text


def markdown_table(summary: dict) -> str:
    """One row per run: accuracies (with ``average_last``: the mean over the last N
    rounds too), rounds to target, MB up/down, wall time; a diverged run reads
    ``diverged at round N`` in the final accuracy column; a ``status`` column when a run
    did not complete or is stale."""
    target = summary["target_accuracy"]
    last = summary.get("average_last")
    head = ["run", "final acc", "best acc"]
    head += [f"mean acc (last {last} rounds)"] if last is not None else []
    head += [f"rounds to {target:g}"] if target is not None else []
    head += ["MB up", "MB down", "wall time (s)"]
    statuses = any(s != "completed" for r in summary["runs"] for s in r["status"]) or any(
        s for r in summary["runs"] for s in r.get("stale", []))
    head += ["status"] if statuses else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in summary["runs"]:
        row = [r["label"].replace("|", "\\|"), _final_cell(r),
               _mean_std(r["best_test_acc"], ".4f")]
        row += [_last_cell(r)] if last is not None else []
        row += [_rounds_cell(r["rounds_to_target"])] if target is not None else []
        row += [_mean_std(r["bytes_up"], ".2f", 1e6), _mean_std(r["bytes_down"], ".2f", 1e6),
                _mean_std(r["wall_time_s"], ".1f")]
        row += [_status_cell(r)] if statuses else []
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def stale_notes(summary: dict) -> list[str]:
    """A line per stale run kept in the table: which, and what made it."""
    return [f"- {r['label']} (seed {s['seed']}): stale, {s['stale']}"
            for r in summary["runs"] for s in r["per_seed"] if s.get("stale")]


def results_markdown(study: Study, summary: dict, table: str, plots: list[str]) -> str:
    seeds = len(study.variants[0].runs)
    note = (f"{len(study.variants)} runs x {seeds} seeds; mean ± sample standard deviation "
            "over seeds." if seeds > 1 else f"{len(study.variants)} runs, one seed each.")
    note += " MB = 10^6 bytes; exact bytes are in results.json."
    parts = [f"# Study: {study.name}", "", note, "", table, ""]
    stale = stale_notes(summary)
    if stale:
        parts += ["Stale runs, kept as recorded (made by other code than the rest; run the "
                  "study without keeping stale runs to rerun them):", "", *stale, ""]
    parts += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in plots]
    parts += ["", provenance_line(summary["provenance"]), ""]
    parts += ["Produced by:", "", "```bash", summary["command"], "```", ""]
    where = f" (`{study.source}`)" if study.source else ""
    parts += [f"Study file{where}:", "", "```yaml", study.text.rstrip("\n"), "```", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------- publish


def published_files(study_dir: Path, summary: Mapping) -> list[str]:
    """The files of ``study_dir`` that :func:`publish` copies: results.md, results.json,
    the plots, and a sweep's sweep.md/csv/json, those that exist."""
    base = summary.get("base_file")
    base = [base] if isinstance(base, str) and Path(base).name == base else []
    return [n for n in (*reserved_names(summary), *base) if (study_dir / n).is_file()]


#: the x axes a study plots accuracy against (one ``accuracy_vs_<axis>.png`` each)
PLOT_AXES = ("round", "bytes", "time")


def reserved_names(summary: Mapping) -> list[str]:
    """The files a study writes into its directory, apart from a copy of its base: the
    plots of the axes of :data:`PLOT_AXES` that ``results.json`` lists (any other name
    read back is ignored)."""
    axes = summary.get("x_axes")
    axes = axes if isinstance(axes, list) else []
    return [*PUBLISHED, *(f"accuracy_vs_{a}.png" for a in PLOT_AXES if a in axes)]


def check_publish(dest: str | Path, name: str) -> Path:
    """``dest/name``, refused (:class:`~splitfed.errors.ConfigError`) when it, or a file
    it would hold (a result or a plot), is in the way, or when it cannot be created (its
    nearest existing parent is no directory this process may write); nothing is
    written."""
    target = Path(dest) / name
    if any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in target.parts):
        raise ConfigError(f"publish: {target}: a name in it is longer than the 255 bytes a "
                          "directory name may have")
    for path in (Path(dest), target):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"publish: {path} exists and is not a directory")
    for n in (*PUBLISHED, *(f"accuracy_vs_{a}.png" for a in PLOT_AXES)):
        if (target / n).exists() and not (target / n).is_file():
            raise ConfigError(f"publish: {target / n} exists and is not a file; move it away")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise ConfigError(f"publish: {target} cannot be created: {parent} is not a "
                          "directory this process may write")
    return target


def publish(study_dir: str | Path, dest: str | Path) -> Path:
    """Copy a finished study's (or sweep's) results to ``dest/<study name>/``:
    results.md, results.json, the plots, study.yaml (and the base config copied beside it)
    and a sweep's sweep.md/csv/json; never the run
    directories. Each file is replaced whole (written aside, then renamed). Refused
    when results.json is missing or lists a stale run (kept although other code made
    it): published numbers come from one code version; and while a study or sweep
    process holds the directory's lock (it is rewriting those files). Returns
    ``dest/<name>``."""
    src = Path(study_dir)
    check_free(src, "study directory", hint="publish it when that study has finished")
    summary = read_json(src / "results.json", MAX_RESULTS_BYTES)
    if not summary.get("runs"):
        raise ConfigError(f"publish: {src} holds no results.json of a study; run the study "
                          "first")
    stale = stale_notes(summary)
    if stale:
        raise ConfigError(f"publish: {len(stale)} run(s) of {src} are stale (made by other "
                          "code than the rest); rerun them before publishing")
    target = check_publish(dest, src.name)
    if target.exists() and target.resolve() == src.resolve():
        return target
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in published_files(src, summary):
            _copy(src / name, target / name)
    except OSError as e:
        raise ConfigError(f"publish: cannot write {target} ({e.strerror or e})") from None
    return target


def _copy(src: Path, dst: Path) -> None:
    """Replace ``dst`` with the bytes of ``src`` at once (:func:`splitfed.files.
    atomic_write`: written aside, then renamed, with the umask's mode)."""
    data = src.read_bytes()
    atomic_write(dst, lambda fh: fh.write(data))
