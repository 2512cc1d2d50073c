"""Studies: a set of configured runs, run once each, summarised in a table and plots.

A study file (YAML) names a base config, overrides applied to every run, and the runs:
an explicit list of labelled variants and/or a grid (cartesian product of key -> values);
with both, every explicit run is combined with every grid point. Each variant is repeated
for every seed. ``splitfed study STUDY.yaml`` (or :func:`run_study`) then

1. builds and validates every run's config before any run starts: the schema, then
   everything a run builds before it writes (data, partition, model and cut, sampler,
   algorithm checks), so a typo or an impossible value in the last run fails at once,
   naming the run, before anything is written;
2. runs each one with :func:`~splitfed.experiment.run_experiment` into the deterministic
   directory ``<study dir>/runs/<slug of label>-s<seed>/``; a directory that already
   holds a finished run of the identical config is reused (its metrics are reloaded),
   so an interrupted study resumes where it stopped;
3. holds an exclusive lock on the study directory (:mod:`splitfed.locking`) from the
   first write to the last: a second process on the same study is refused at once;
4. writes ``results.md`` (a table: final and best test accuracy, rounds to a target
   accuracy, bytes up and down, wall time; mean +- sample std over seeds), ``results.json``
   (the same numbers, exact bytes, and per-run curves) and ``accuracy_vs_<axis>.png``.

The file format is described in ``docs/studies.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import shlex
import shutil
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from splitfed.checkpoint import CHECKPOINT
from splitfed.config import RunConfig, build_config, resolve_config_path
from splitfed.configtools import from_dict, load_yaml, merge, parse_overrides, to_dict
from splitfed.errors import ConfigError, FormatError, RunInterrupted, SplitfedError
from splitfed.experiment import resume_experiment, run_experiment
from splitfed.locking import LOCK_NAME, DirLock, check_free
from splitfed.metrics import read_records

DEFAULT_OUT_DIR = "docs/results"
FINISHED = ("completed", "diverged", "no_client_trained")  # rerunning gives the same run
#: the files of a run directory (splitfed.experiment, splitfed.checkpoint)
RUN_FILES = ("config.yaml", "partition.txt", "metrics.jsonl", "metrics.csv", "summary.json",
             CHECKPOINT)
_STUDY_KEYS = ("name", "out_dir", "progress")  # set by the study, not by the user
_NOT_COMPARED = ("out_dir", "progress", "checkpoint_every")  # no effect on the numbers
_AXIS_LABELS = {"round": "round", "bytes": "cumulative communication, up + down (MB)",
                "time": "cumulative time (s; simulated where recorded, else wall)"}


# ------------------------------------------------------------------ the file format


@dataclass
class RunSpec:
    """One explicit variant: a label and ``key=value`` overrides."""

    label: str
    set: list[str] = field(default_factory=list)


@dataclass
class StudySpec:
    """A study file as written (see ``docs/studies.md``)."""

    name: str | None = field(default=None, metadata={
        "help": "output goes to <out_dir>/<name>/ (default: the file's stem)"})
    base: str | None = field(default=None, metadata={
        "help": "config file (relative to the study file first) or shipped config name"})
    base_config: dict[str, Any] | None = field(default=None, metadata={
        "help": "inline base config (instead of base)"})
    overrides: list[str] = field(default_factory=list, metadata={
        "help": "key=value applied to every run"})
    seeds: list[int] | None = field(default=None, metadata={
        "help": "repeat every run per seed (default: the config's seed)"})
    runs: list[RunSpec] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict, metadata={
        "help": "key -> values; every combination is a run"})
    group_by: str | None = field(default=None, metadata={
        "help": "one plot panel per value of this dotted key"})
    x_axes: list[Literal["round", "bytes", "time"]] = field(
        default_factory=lambda: ["round", "bytes"])
    target_accuracy: float | None = field(default=None, metadata={"ge": 0, "le": 1})
    out_dir: str = DEFAULT_OUT_DIR
    plugins: list[str] = field(default_factory=list, metadata={
        "help": "plugin modules (or .py files) imported before the runs are built, and "
                "added to every run's plugins (docs/extending.md)"})


@dataclass
class StudyRun:
    """One run of a study: a variant at one seed, with its validated config."""

    label: str
    seed: int
    config: RunConfig
    run_dir: Path


@dataclass
class Variant:
    """A labelled configuration, run once per seed."""

    label: str
    line_label: str  # the label inside its plot panel (without the group_by part)
    group: str | None
    runs: list[StudyRun]


@dataclass
class Study:
    """A validated study: every run's config is built, nothing is written yet."""

    spec: StudySpec
    name: str
    dir: Path
    variants: list[Variant]
    source: Path | None  # the study file, None for a mapping
    text: str  # the study as written, for results.md

    @property
    def runs(self) -> list[StudyRun]:
        return [r for v in self.variants for r in v.runs]


def load_study(path: str | Path, *, out_dir: str | Path | None = None,
               plugins: list[str] | None = None) -> Study:
    """Read and validate a study file; ``out_dir`` overrides the file's ``out_dir``;
    ``plugins`` are added to the file's ``plugins`` (imported, and recorded in every
    run's config)."""
    path = Path(path)
    raw = load_yaml(path)
    try:
        return _build_study(raw, base_dir=path.parent, default_name=path.stem,
                            out_dir=out_dir, source=path,
                            text=path.read_text(encoding="utf-8"), plugins=plugins)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def study_from_mapping(data: Mapping, *, out_dir: str | Path | None = None,
                       base_dir: str | Path = ".", plugins: list[str] | None = None) -> Study:
    """Validate a study given as a mapping; a ``base`` path is resolved from ``base_dir``."""
    text = yaml.safe_dump(_plain(data), sort_keys=False)
    return _build_study(data, base_dir=Path(base_dir), default_name=None, out_dir=out_dir,
                        source=None, text=text, plugins=plugins)


def _plain(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {str(k): _plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    return data


def _build_study(raw: Mapping, *, base_dir: Path, default_name: str | None,
                 out_dir: str | Path | None, source: Path | None, text: str,
                 plugins: list[str] | None = None) -> Study:
    spec = from_dict(StudySpec, raw, path="study")
    spec.plugins = list(dict.fromkeys([*spec.plugins, *(plugins or [])]))
    name = _check_name(spec.name if spec.name is not None else default_name)
    _check_spec(spec)
    study_dir = Path(out_dir if out_dir is not None else spec.out_dir) / name
    base = _base_raw(spec, base_dir)
    variants = [_variant(spec, base, study_dir, run, point)
                for point in _grid_points(spec.grid) for run in (spec.runs or [None])]
    _check_unique(variants)
    return Study(spec, name, study_dir, variants, source, text)


def _check_name(name: str | None) -> str:
    if name is None:
        raise ConfigError("missing required key 'study.name'")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name):
        raise ConfigError(f"study.name: {name!r} must be a plain directory name "
                          "(letters, digits, '.', '_', '-')")
    return name


def _check_spec(spec: StudySpec) -> None:
    if not spec.runs and not spec.grid:
        raise ConfigError("study: give 'runs' and/or 'grid' (no run is defined)")
    if spec.base is not None and spec.base_config is not None:
        raise ConfigError("study: set only one of 'base' and 'base_config'")
    if spec.seeds is not None and (not spec.seeds or len(set(spec.seeds)) != len(spec.seeds)):
        raise ConfigError(f"study.seeds: expected a non-empty list of distinct seeds, "
                          f"got {spec.seeds}")
    if not spec.x_axes:
        raise ConfigError("study.x_axes: expected at least one of round, bytes, time")
    for key, values in spec.grid.items():
        _check_key(key, f"study.grid.{key}")
        if not values:
            raise ConfigError(f"study.grid.{key}: expected a non-empty list of values")
    if spec.group_by is not None:
        _check_key(spec.group_by, "study.group_by")
    _check_managed(parse_overrides(spec.overrides), "study.overrides")
    _check_managed({key.split(".")[0]: None for key in spec.grid}, "study.grid")


def _check_key(key: str, where: str) -> None:
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{where}: {key!r} is not a dotted config key like partition.alpha")


def _check_managed(over: Mapping, where: str) -> None:
    for key in _STUDY_KEYS:
        if key in over:
            raise ConfigError(f"{where}: '{key}' is set by the study for every run "
                              "(runs go to <out_dir>/<study name>/runs/); remove it")


def _base_raw(spec: StudySpec, base_dir: Path) -> dict:
    if spec.base_config is not None:
        return dict(spec.base_config)
    if spec.base is None:
        return {}
    local = base_dir / spec.base
    try:
        return load_yaml(local if local.is_file() else resolve_config_path(spec.base))
    except ConfigError as e:
        raise ConfigError(f"study.base: {e}") from None


def _grid_points(grid: Mapping[str, list]) -> list[list[tuple[str, Any]]]:
    keys = list(grid)
    return [list(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def value_text(value: Any) -> str:
    """How a config value reads in a label: ``0.1``, ``inf``, ``fedavg``, ``[16, 8]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix(
        "\n...").strip()


def _variant(spec: StudySpec, base: dict, study_dir: Path, run: RunSpec | None,
             point: list[tuple[str, Any]]) -> Variant:
    if run is not None and not run.label.strip():
        raise ConfigError("study.runs: every run needs a non-empty label")
    pairs = [f"{k}={value_text(v)}" for k, v in point]
    label = _join_label(run.label if run else None, pairs)
    try:
        cfg = _variant_config(spec, base, study_dir, run, point, slugify(label))
        group = _group_value(spec.group_by, point, cfg)
    except ConfigError as e:
        raise ConfigError(f"run {label!r}: {e}") from None
    rest = [f"{k}={value_text(v)}" for k, v in point if k != spec.group_by]
    line_label = _join_label(run.label if run else None, rest) or label
    seeds = spec.seeds if spec.seeds is not None else [cfg.seed]
    runs = [StudyRun(label, s, dataclasses.replace(cfg, seed=s),
                     study_dir / "runs" / f"{slugify(label)}-s{s}") for s in seeds]
    return Variant(label, line_label, group, runs)


def _join_label(run_label: str | None, pairs: list[str]) -> str:
    grid = ", ".join(pairs)
    if run_label and grid:
        return f"{run_label} ({grid})"
    return run_label or grid


def _variant_config(spec: StudySpec, base: dict, study_dir: Path, run: RunSpec | None,
                    point: list[tuple[str, Any]], slug: str) -> RunConfig:
    run_set = parse_overrides(run.set) if run else {}
    _check_managed(run_set, "set")
    grid_over: dict = {}
    for key, value in point:
        grid_over = merge(grid_over, _nested(key, value))
    if run:
        _check_overlap([i.partition("=")[0].strip() for i in run.set], [k for k, _ in point])
    raw = merge(merge(merge(base, parse_overrides(spec.overrides)), grid_over), run_set)
    raw = merge(raw, {"name": slug, "out_dir": str(study_dir / "runs"), "progress": False})
    cfg = build_config(raw, plugins=spec.plugins)
    preflight(cfg)
    return cfg


def _nested(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _check_overlap(set_keys: list[str], grid_keys: list[str]) -> None:
    for a in set_keys:
        for b in grid_keys:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                raise ConfigError(f"'{a}' is set both by the run and by the grid ('{b}')")


def preflight(cfg: RunConfig) -> None:
    """Cheap checks that need no data: algorithm and its options, option names of the
    data set, model and partition scheme, the device. ``build_config`` checks the rest
    of the schema; values that need the data (e.g. a cut) are checked when a run starts.
    """
    import inspect

    from splitfed.data import dataset_options
    from splitfed.data.partition import PARTITIONERS
    from splitfed.experiment import _device, build_algorithm
    from splitfed.models import MODELS, model_names, model_options

    build_algorithm(cfg)
    _device(cfg.engine.device)
    allowed = dataset_options(cfg.data.name)
    _unknown_options("data", cfg.data.options, allowed)
    if cfg.model.name not in MODELS:
        raise ConfigError(f"model.name: unknown model {cfg.model.name!r}; "
                          f"known models: {', '.join(model_names())}")
    _unknown_options("model", cfg.model.options, model_options(cfg.model.name))
    scheme = cfg.partition.scheme
    if scheme not in PARTITIONERS:
        raise ConfigError(f"partition.scheme: unknown scheme {scheme!r}; "
                          f"known: {', '.join(sorted(PARTITIONERS))}")
    if scheme != "natural":
        params = list(inspect.signature(PARTITIONERS[scheme]).parameters)[3:]
        _unknown_options("partition", cfg.partition.options, params)


def _unknown_options(section: str, options: Mapping, allowed) -> None:
    for key in options:
        if key not in allowed:
            raise ConfigError(f"{section}.{key}: unknown option; "
                              f"allowed: {', '.join(allowed) or 'none'}")


def lookup(config: Mapping, key: str) -> Any:
    """The value at dotted ``key`` of a config dict; options of open sections included."""
    node: Any = config
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, Mapping) and part in (node.get("options") or {}):
            node = node["options"][part]
        else:
            raise KeyError(key)
    return node


def _group_value(group_by: str | None, point: list[tuple[str, Any]],
                 cfg: RunConfig) -> str | None:
    if group_by is None:
        return None
    for key, value in point:
        if key == group_by:
            return value_text(value)
    try:
        return value_text(lookup(to_dict(cfg), group_by))
    except KeyError:
        raise ConfigError(f"group_by: {group_by!r} is not set in this run's config") from None


def slugify(label: str) -> str:
    """A directory name for ``label``: lower case, runs of other characters become '-'."""
    slug = re.sub(r"[^a-z0-9._+]+", "-", label.lower()).strip("-.") or "run"
    if len(slug) > 80:
        slug = slug[:70].rstrip("-.") + "-" + hashlib.sha1(label.encode()).hexdigest()[:8]
    return slug


def _check_unique(variants: list[Variant]) -> None:
    labels: set[str] = set()
    slugs: dict[str, str] = {}
    for v in variants:
        if v.label in labels:
            raise ConfigError(f"study: run label {v.label!r} is used twice; labels must be "
                              "unique")
        slug = slugify(v.label)
        if slug in slugs:
            raise ConfigError(f"study: labels {slugs[slug]!r} and {v.label!r} give the same "
                              f"run directory name {slug!r}; rename one")
        labels.add(v.label)
        slugs[slug] = v.label


# --------------------------------------------------------------- run directories


def config_identity(cfg: RunConfig | Mapping) -> dict:
    """A run's config as compared for reuse: YAML-normalised, without the keys that do
    not change its numbers (out_dir, progress, checkpoint_every).

    A saved config is rebuilt first, so that fields added to the config schema since it
    was written take their defaults instead of counting as a difference.
    """
    if not isinstance(cfg, RunConfig):
        try:
            cfg = build_config(dict(cfg))
        except ConfigError:
            pass
    data = to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg)
    data = yaml.safe_load(yaml.safe_dump(data, sort_keys=False))
    return {k: v for k, v in data.items() if k not in _NOT_COMPARED}


def config_hash(cfg: RunConfig | Mapping) -> str:
    text = json.dumps(config_identity(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            out += _diff(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if a == b else [path]


def run_dir_state(run: StudyRun) -> str:
    """``new`` (absent or empty), ``done`` (a finished run of the identical config) or
    ``stale`` (an unfinished run of the identical config); anything else raises."""
    d = run.run_dir
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d} is a file, not a run directory of this study; move it away")
    if not d.exists() or not any(p.name != LOCK_NAME for p in d.iterdir()):
        return "new"
    for name in RUN_FILES:
        if (d / name).exists() and not (d / name).is_file():
            raise ConfigError(f"{d} is damaged: {name} is not a file; delete the directory "
                              "to rerun that run")
    saved = d / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{d} is not empty and holds no config.yaml; it is not a run of "
                          "this study; move it away")
    try:
        old = load_yaml(saved)
    except ConfigError as e:
        raise ConfigError(f"{d} is damaged: {e}; delete the directory to rerun "
                          "that run") from None
    diff = _diff(config_identity(old), config_identity(run.config))
    if diff:
        raise ConfigError(f"{d} holds a run of a different config (differs at "
                          f"{', '.join(diff[:5])}); delete it to rerun, or use another "
                          "study name or out_dir")
    summary = _read_json(d / "summary.json")
    done = summary.get("status") in FINISHED and (d / "metrics.jsonl").is_file()
    return "done" if done else "stale"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------- numbers


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def rounds_to_target(records: list[dict], target: float) -> int | None:
    """The first round whose test accuracy is >= ``target``; None if never reached."""
    for r in records:
        acc = _num(r.get("test_acc"))
        if acc is not None and acc >= target:
            return int(r["round"])
    return None


def time_to_target(records: list[dict], target: float) -> float | None:
    """Simulated seconds (``sim_time_s``, cumulative) at the first evaluation whose test
    accuracy is >= ``target``; None if never reached or not recorded."""
    for r in records:
        acc = _num(r.get("test_acc"))
        if acc is not None and acc >= target:
            return 0.0 if r.get("round", 0) == 0 else _num(r.get("sim_time_s"))
    return None


def curve(records: list[dict]) -> dict:
    """Evaluated rounds with test accuracy, cumulative bytes (up + down) and time.

    Time sums ``sim_round_s`` (a round's simulated duration) when every training round
    records it, else the measured ``round_time_s``.
    """
    rounds = [r for r in records if r.get("round", 0) > 0]
    sim = bool(rounds) and all(_num(r.get("sim_round_s")) is not None for r in rounds)
    time_key = "sim_round_s" if sim else "round_time_s"
    out: dict = {"round": [], "test_acc": [], "bytes": [], "time_s": [],
                 "time_kind": "simulated" if sim else "wall"}
    total_bytes, total_time = 0, 0.0
    for r in records:
        total_bytes += int(_num(r.get("bytes_up")) or 0) + int(_num(r.get("bytes_down")) or 0)
        total_time += _num(r.get(time_key)) or 0.0
        acc = _num(r.get("test_acc"))
        if acc is not None:
            out["round"].append(int(r["round"]))
            out["test_acc"].append(acc)
            out["bytes"].append(total_bytes)
            out["time_s"].append(round(total_time, 6))
    return out


def run_numbers(records: list[dict], target: float | None) -> dict:
    """Final and best test accuracy, rounds to target, total bytes by direction and kind."""
    accs = [a for a in (_num(r.get("test_acc")) for r in records) if a is not None]
    totals: dict[str, int] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith(("bytes_up", "bytes_down")) and _num(value) is not None:
                totals[key] = totals.get(key, 0) + int(value)
    return {"final_test_acc": accs[-1] if accs else None,
            "best_test_acc": max(accs) if accs else None,
            "rounds_to_target": None if target is None else rounds_to_target(records, target),
            "time_to_target_s": None if target is None else time_to_target(records, target),
            "rounds": max((int(r["round"]) for r in records), default=0),
            "bytes_up": totals.pop("bytes_up", 0), "bytes_down": totals.pop("bytes_down", 0),
            "bytes_by_kind": dict(sorted(totals.items()))}


def summarize(values: list[float | None]) -> dict:
    """Mean and sample standard deviation of the values that are not None."""
    got = [float(v) for v in values if v is not None]
    return {"mean": statistics.fmean(got) if got else None,
            "std": statistics.stdev(got) if len(got) > 1 else (0.0 if got else None),
            "n": len(got), "values": list(values)}


# --------------------------------------------------------------------------- running


@dataclass
class RunOutcome:
    """What one study run gave: its records (fresh or reloaded) and where they are."""

    label: str
    seed: int
    run_dir: Path
    status: str
    records: list[dict]
    wall_time_s: float
    skipped: bool


@dataclass
class StudyResult:
    study: Study
    dir: Path
    outcomes: list[RunOutcome]
    table: str
    summary: dict  # the content of results.json

    @property
    def completed(self) -> bool:
        return all(o.status == "completed" for o in self.outcomes)


def run_study(study: str | Path | Mapping | Study, *, out_dir: str | Path | None = None,
              progress: bool = False, quiet: bool = False,
              plugins: list[str] | None = None) -> StudyResult:
    """Run every run of a study not already done, then write results.md/json and plots.

    ``study``: a study file path, a mapping in the same format, or a loaded :class:`Study`.
    ``out_dir`` overrides the study's ``out_dir``; ``progress`` shows each run's progress
    bar; ``quiet`` prints nothing (by default a line per run and the table at the end);
    ``plugins`` (the command line's ``--plugin``) are added to the study's ``plugins``
    (not used with a loaded :class:`Study`).

    Before any run starts or anything is written, every run that is not done is built
    as :func:`~splitfed.experiment.run_experiment` builds it (:func:`check_runs`) and the
    study directory is checked; then the directory is locked (:mod:`splitfed.locking`)
    until the results are written: a second process on the same study is refused.
    """
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
        study = load_study(study, out_dir=out_dir, plugins=plugins)
    say = (lambda *a, **k: None) if quiet else _print
    with open_study(study, "study directory") as prepared:
        outcomes = execute_study(prepared, progress, say)
        return write_results(study, outcomes, command, say)


def _print(*args, **kwargs) -> None:
    print(*args, **kwargs, flush=True)


@dataclass
class PreparedStudy:
    """A study checked end to end and locked: what :func:`open_study` returns. The lock
    is released on exit from a ``with`` block."""

    study: Study
    states: list[str]                   # run_dir_state of each run, in study.runs order
    records: list[list[dict] | None]    # the metrics of the runs done earlier
    lock: DirLock

    def __enter__(self) -> PreparedStudy:
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


def open_study(study: Study, what: str = "study directory",
               outputs: tuple[str, ...] = ()) -> PreparedStudy:
    """Check everything a study needs, then lock its directory; writes nothing but the
    directory and its lock file, and only once every check passed.

    1. refuses at once a study directory another process holds;
    2. reads the run directories (a run of another config, or a damaged finished run,
       is refused, naming the directory);
    3. builds every run that is not done (:func:`check_runs`): data, partition, model
       and cut, sampler, algorithm checks; a failure names the run;
    4. checks that the result files (``outputs`` added) can be written;
    5. creates and locks the study directory (:class:`~splitfed.locking.DirLock`), and
       reads the run directories again under the lock.
    """
    check_free(study.dir, what)
    states, records = _scan(study)
    check_runs([r for r, s in zip(study.runs, states) if s != "done"])
    _check_outputs(study, outputs)
    lock = DirLock.acquire(study.dir, what)
    try:
        again, records = _scan(study)   # another process may have changed them meanwhile
        check_runs([r for r, s, t in zip(study.runs, again, states) if s != "done" == t])
        (study.dir / "runs").mkdir(exist_ok=True)
    except BaseException:
        lock.release()
        raise
    return PreparedStudy(study, again, records, lock)


def _scan(study: Study) -> tuple[list[str], list[list[dict] | None]]:
    """Each run's state, and the records of those done earlier (read now, so that a
    damaged one stops the study before anything runs)."""
    states, records = [], []
    for run in study.runs:
        state = run_dir_state(run)
        got = None
        if state == "done":
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


def execute_study(prepared: PreparedStudy, progress: bool, say=_print) -> list[RunOutcome]:
    """Run (or resume, or reload) every run of a prepared study, in order."""
    study = prepared.study
    outcomes = []
    for i, (run, state, records) in enumerate(zip(study.runs, prepared.states,
                                                  prepared.records), 1):
        try:
            outcome = _execute(run, state, progress, records)
        except RunInterrupted:
            raise
        except SplitfedError as e:     # stops the study; done runs stay done for a rerun
            e.args = (f"run {run.label!r} (seed {run.seed}): {e}",)
            raise
        acc = run_numbers(outcome.records, None)["final_test_acc"]
        acc_text = "n/a" if acc is None else f"{acc:.4f}"
        how = ("(done earlier, skipped)" if outcome.skipped
               else f"in {outcome.wall_time_s:.1f} s")
        status = "" if outcome.status == "completed" else f" [{outcome.status}]"
        say(f"[{i}/{len(study.runs)}] {run.label} (seed {run.seed}) ... {acc_text} "
            f"{how}{status}")
        outcomes.append(outcome)
    return outcomes


def _execute(run: StudyRun, state: str, progress: bool,
             records: list[dict] | None = None) -> RunOutcome:
    if state == "done":
        summary = _read_json(run.run_dir / "summary.json")
        if records is None:
            records = read_records(run.run_dir / "metrics.jsonl")
        return RunOutcome(run.label, run.seed, run.run_dir, summary["status"], records,
                          _num(summary.get("wall_time_s")) or 0.0, skipped=True)
    if state == "stale" and (run.run_dir / CHECKPOINT).is_file():
        result = resume_experiment(run.run_dir)      # continue from its last checkpoint
        return RunOutcome(run.label, run.seed, run.run_dir, result.status, result.records,
                          result.wall_time_s, skipped=False)
    if state == "stale":
        shutil.rmtree(run.run_dir)
    cfg = dataclasses.replace(run.config, progress=progress)
    result = run_experiment(cfg, run_dir=run.run_dir)
    return RunOutcome(run.label, run.seed, run.run_dir, result.status, result.records,
                      result.wall_time_s, skipped=False)


# --------------------------------------------------------------------------- results


def write_results(study: Study, outcomes: list[RunOutcome], command: str,
                  say=_print) -> StudyResult:
    """Write results.json, results.md and the plots into the study directory."""
    study.dir.mkdir(parents=True, exist_ok=True)
    summary = results_summary(study, outcomes, command)
    (study.dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n",
                                            encoding="utf-8")
    plots = write_plots(study, summary, say)
    table = markdown_table(summary)
    (study.dir / "results.md").write_text(results_markdown(study, summary, table, plots),
                                          encoding="utf-8")
    say(table)
    say(f"results: {study.dir / 'results.md'}")
    return StudyResult(study, study.dir, outcomes, table, summary)


def results_summary(study: Study, outcomes: list[RunOutcome], command: str) -> dict:
    target = study.spec.target_accuracy
    by_label: dict[str, list[RunOutcome]] = {}
    for o in outcomes:
        by_label.setdefault(o.label, []).append(o)
    runs = []
    for v in study.variants:
        per_seed = [_seed_entry(study, o, target) for o in by_label[v.label]]
        entry = {"label": v.label, "line_label": v.line_label, "group": v.group,
                 "seeds": [s["seed"] for s in per_seed],
                 "status": [s["status"] for s in per_seed]}
        for key in ("final_test_acc", "best_test_acc", "rounds_to_target", "bytes_up",
                    "bytes_down", "wall_time_s"):
            entry[key] = summarize([s[key] for s in per_seed])
        entry["per_seed"] = per_seed
        runs.append(entry)
    return {"study": study.name, "command": command,
            "source": str(study.source) if study.source else None,
            "group_by": study.spec.group_by, "x_axes": list(study.spec.x_axes),
            "target_accuracy": target, "runs": runs}


def _seed_entry(study: Study, o: RunOutcome, target: float | None) -> dict:
    run = next(r for r in study.runs if r.label == o.label and r.seed == o.seed)
    return {"seed": o.seed, "run_dir": str(o.run_dir.relative_to(study.dir)),
            "status": o.status, "skipped": o.skipped,
            "config_hash": config_hash(run.config), "wall_time_s": round(o.wall_time_s, 3),
            **run_numbers(o.records, target), "curve": curve(o.records)}


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


def markdown_table(summary: dict) -> str:
    """One row per run: accuracies, rounds to target, MB up/down, wall time."""
    target = summary["target_accuracy"]
    head = ["run", "final acc", "best acc"]
    head += [f"rounds to {target:g}"] if target is not None else []
    head += ["MB up", "MB down", "wall time (s)"]
    statuses = any(s != "completed" for r in summary["runs"] for s in r["status"])
    head += ["status"] if statuses else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in summary["runs"]:
        row = [r["label"].replace("|", "\\|"), _mean_std(r["final_test_acc"], ".4f"),
               _mean_std(r["best_test_acc"], ".4f")]
        row += [_rounds_cell(r["rounds_to_target"])] if target is not None else []
        row += [_mean_std(r["bytes_up"], ".2f", 1e6), _mean_std(r["bytes_down"], ".2f", 1e6),
                _mean_std(r["wall_time_s"], ".1f")]
        row += [", ".join(sorted(set(r["status"])))] if statuses else []
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def results_markdown(study: Study, summary: dict, table: str, plots: list[str]) -> str:
    seeds = len(study.variants[0].runs)
    note = (f"{len(study.variants)} runs x {seeds} seeds; mean ± sample standard deviation "
            "over seeds." if seeds > 1 else f"{len(study.variants)} runs, one seed each.")
    note += " MB = 10^6 bytes; exact bytes are in results.json."
    parts = [f"# Study: {study.name}", "", note, "", table, ""]
    parts += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in plots]
    parts += ["", "Produced by:", "", "```bash", summary["command"], "```", ""]
    where = f" (`{study.source}`)" if study.source else ""
    parts += [f"Study file{where}:", "", "```yaml", study.text.rstrip("\n"), "```", ""]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- plots


def _mean_curve(per_seed: list[dict], axis: str):
    """Mean (and std) accuracy over seeds at the rounds every seed evaluated."""
    import numpy as np

    curves = [s["curve"] for s in per_seed]
    common = sorted(set.intersection(*(set(c["round"]) for c in curves)))
    xs, ys = [], []
    for c in curves:
        at = {r: i for i, r in enumerate(c["round"])}
        idx = [at[r] for r in common]
        x = {"round": c["round"], "bytes": [b / 1e6 for b in c["bytes"]],
             "time": c["time_s"]}[axis]
        xs.append([x[i] for i in idx])
        ys.append([c["test_acc"][i] for i in idx])
    return np.mean(xs, axis=0), np.mean(ys, axis=0), np.std(ys, axis=0, ddof=1) if len(
        ys) > 1 else None


def write_plots(study: Study, summary: dict, say=_print) -> list[str]:
    """``accuracy_vs_<axis>.png`` per x axis; one panel per group_by value. Returns the
    file names written (none when matplotlib is not installed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        say("matplotlib is not installed; no plots (pip install 'splitfed[plot]')")
        return []
    groups = list(dict.fromkeys(r["group"] for r in summary["runs"]))
    names = []
    for axis in study.spec.x_axes:
        ncols = min(len(groups), 3)
        nrows = math.ceil(len(groups) / ncols)
        fig = Figure(figsize=(5.2 * ncols, 3.9 * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
        for ax, group in zip(axes.flat, groups):
            _panel(ax, [r for r in summary["runs"] if r["group"] == group], axis, summary)
            if group is not None:
                ax.set_title(f"{summary['group_by']} = {group}", fontsize=10)
        for ax in list(axes.flat)[len(groups):]:
            ax.set_visible(False)
        fig.suptitle(f"{study.name}: test accuracy vs {axis}")
        name = f"accuracy_vs_{axis}.png"
        fig.savefig(study.dir / name, dpi=120)
        names.append(name)
    return names


def _panel(ax, runs: list[dict], axis: str, summary: dict) -> None:
    for r in runs:
        x, y, std = _mean_curve(r["per_seed"], axis)
        (line,) = ax.plot(x, y, marker="o" if len(x) < 15 else None, markersize=3,
                          label=r["line_label"])
        if std is not None:
            ax.fill_between(x, y - std, y + std, color=line.get_color(), alpha=0.2)
    if summary["target_accuracy"] is not None:
        ax.axhline(summary["target_accuracy"], color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel(_AXIS_LABELS[axis])
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
