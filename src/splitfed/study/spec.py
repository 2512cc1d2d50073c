"""The study file: its format (:class:`StudySpec`), validation, and the runs it defines.

:func:`load_study` and :func:`study_from_mapping` read a study, build and validate every
run's config (the schema and :func:`preflight`) and name each run's directory; nothing is
written. The format is described in ``docs/studies.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


from splitfed.config import (
    MAX_SEED,
    MIN_SEED,
    RunConfig,
    build_config,
    key_covers,
    keys_overlap,
    merge_config,
    resolve_config_path,
)
from splitfed.configtools import (
    dump_text,
    from_dict,
    load_yaml,
    load_yaml_text,
    merge,
    parse_overrides,
    to_dict,
    value_text,
)
from splitfed.errors import ConfigError
from splitfed.grid import axis_keys, check_apart, check_axis_count, check_distinct, set_keys

#: where a study directory goes when neither ``--out-dir`` nor the file's ``out_dir`` says
#: (``runs/`` is not committed; ``docs/results`` is written only when asked, see
#: :func:`splitfed.study.publish`)
DEFAULT_OUT_DIR = "runs/studies"
_STUDY_KEYS = ("name", "out_dir", "progress")  # set by the study, not by the user
#: the most runs one study (or sweep) may define: grid points x runs x seeds, counted
#: before any run is built
MAX_RUNS = 100_000


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
        "ge": MIN_SEED, "le": MAX_SEED,
        "help": "repeat every run per seed (default: the config's seed)"})
    runs: list[RunSpec] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict, metadata={
        "help": "key -> values; every combination is a run"})
    group_by: str | None = field(default=None, metadata={
        "help": "one plot panel per value of this dotted key"})
    x_axes: list[Literal["round", "bytes", "time"]] = field(
        default_factory=lambda: ["round", "bytes"])
    target_accuracy: float | None = field(default=None, metadata={"ge": 0, "le": 1})
    average_last: int | None = field(default=None, metadata={
        "ge": 1, "le": 10**7,
        "help": "adds a column: the mean test accuracy over the evaluated rounds among "
                "each run's last N rounds (paper 003 Tables 7-9; set the runs' eval_last "
                ">= N so that every one of them is evaluated)"})
    out_dir: str = field(default=DEFAULT_OUT_DIR, metadata={
        "help": "parent of the study directory (default runs/studies; --out-dir wins)"})
    plugins: list[str] = field(default_factory=list, metadata={
        "help": "plugin modules (names, not file paths) imported before the runs are built, and "
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
    text: str  # the study as written, for results.md and study.yaml
    base_file: Path | None = None  # the YAML file ``base`` named next to the study, if any

    @property
    def runs(self) -> list[StudyRun]:
        return [r for v in self.variants for r in v.runs]


def load_study(path: str | Path, *, out_dir: str | Path | None = None,
               plugins: list[str] | None = None, overrides: list[str] | None = None
               ) -> Study:
    """Read and validate a study file; ``out_dir`` overrides the file's ``out_dir``;
    ``plugins`` are added to the file's ``plugins`` (imported, and recorded in every
    run's config); ``overrides`` (``key=value``, the command line's ``--set``) are added
    after the file's ``overrides``, so they apply to every run under each run's own
    ``set`` and grid values. With ``overrides`` the study text kept with the results is
    the file with them added (as YAML: its comments are not kept), so that it reruns
    as it ran."""
    path = Path(path)
    raw, text = load_yaml_text(path)
    if isinstance(raw, Mapping) and "name" not in raw:
        # the kept copy (study.yaml in the study directory) must name the study as this
        # file does by its name, else rerunning the copy would make a study "study"
        raw = {"name": path.stem, **raw}
        named = dump_text({"name": path.stem}, sort_keys=False)
        text = (f"# {path.name}, with the study's name, its file name, written out\n"
                + (named + text if not text.lstrip().startswith(("---", "%")) else
                   dump_text(_plain(raw), sort_keys=False)))
    if overrides:
        raw = _with_overrides(raw, overrides)
        text = (f"# {path.name} with --set {' '.join(overrides)} (the file's comments are "
                "not kept)\n" + dump_text(_plain(raw), sort_keys=False))
    try:
        return _build_study(raw, base_dir=path.parent, default_name=path.stem,
                            out_dir=out_dir, source=path, text=text, plugins=plugins)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def study_from_mapping(data: Mapping, *, out_dir: str | Path | None = None,
                       base_dir: str | Path = ".", plugins: list[str] | None = None) -> Study:
    """Validate a study given as a mapping; a ``base`` path is resolved from ``base_dir``."""
    text = dump_text(_plain(data), sort_keys=False)
    return _build_study(data, base_dir=Path(base_dir), default_name=None, out_dir=out_dir,
                        source=None, text=text, plugins=plugins)


def _with_overrides(raw: Any, overrides: list[str]) -> Any:
    """``raw`` with ``overrides`` appended to its ``overrides`` list (a new mapping).

    An override that would reach no run is refused: one that sets a key the grid sets in
    every run, or one that every run's own ``set`` sets (both win over ``--set``). Each
    is compared by the dotted keys it sets (:func:`~splitfed.grid.set_keys`): a section
    written as a mapping (``train={lr: 0.3}``) sets the keys inside it (``train.lr``),
    since it is merged into the config's section."""
    if not isinstance(raw, Mapping):
        return raw                         # from_dict reports what a study file must be
    parse_overrides(overrides)             # a malformed KEY=VALUE: its own error
    grid = raw.get("grid")
    axes = ([(a, axis_keys(a, v)) for a, v in grid.items() if isinstance(a, str)]
            if isinstance(grid, Mapping) else [])
    runs = raw.get("runs")
    runs = [r for r in runs if isinstance(r, Mapping)] if isinstance(runs, list) else []
    for item in overrides:
        written = item.partition("=")[0].strip()
        for key in _item_keys(item):
            shown = key if key == written else f"{key} (in {item!r})"
            axis = _covering(key, axes)            # the grid's values win over --set
            if axis is not None:
                raise ConfigError(f"--set {shown}: the grid sets '{axis}' in every run, so "
                                  "the override would reach none; drop it or change the "
                                  "grid")
            hidden = [_covering(key, _set_keys(r.get("set"))) for r in runs]
            if runs and all(hidden):               # each run's own `set` wins over --set
                raise ConfigError(f"--set {shown}: every run sets '{hidden[0]}' itself "
                                  f"(run {str(runs[0].get('label'))!r} and the rest), so "
                                  "the override would reach none; drop it or remove it "
                                  "from the runs' set")
    given = raw.get("overrides") or []
    if not isinstance(given, list):
        return raw
    return {**raw, "overrides": [*given, *overrides]}


def _item_keys(item: str) -> list[str]:
    """The dotted keys that a ``key=value`` item sets (:func:`~splitfed.grid.set_keys`);
    the key as written when the item cannot be parsed (reported where it is read)."""
    try:
        parsed = parse_overrides([item])
    except ConfigError:
        return [item.partition("=")[0].strip()]
    return [k for top, value in parsed.items() for k in set_keys(top, value)]


def _set_keys(items: Any) -> list[tuple[str, list[str]]]:
    """The keys of a run's ``set`` items, each as written with the dotted keys it sets
    (none when it is not a list)."""
    if not isinstance(items, list):
        return []
    return [(i.partition("=")[0].strip(), _item_keys(i)) for i in items
            if isinstance(i, str)]


def _covering(key: str, keys: list[tuple[str, list[str]]]) -> str | None:
    """The first of ``keys`` (each as written, with the dotted keys it sets) that sets all
    of what ``key`` sets (``key`` itself, or a section around it; a section around
    ``key`` still reaches its other keys), else None."""
    for written, sets in keys:
        if any(key_covers(theirs, key) for theirs in sets):
            return written
    return None


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
    base = merge_config(_base_raw(spec, base_dir), parse_overrides(spec.overrides))
    variants = [_variant(spec, base, study_dir, run, point)
                for point in _grid_points(spec.grid) for run in (spec.runs or [None])]
    _check_unique(variants)
    return Study(spec, name, study_dir, variants, source, text,
                 _sibling_base(spec, base_dir) if source is not None else None)


def _sibling_base(spec: StudySpec, base_dir: Path) -> Path | None:
    """The file ``base`` names when it is a plain ``.yaml``/``.yml`` file name next to the
    study file (``base: base.yaml``): written beside ``study.yaml`` in the results so that
    they run as they are. None for a shipped config or a path elsewhere."""
    name = spec.base
    if name is None or Path(name).name != name or Path(name).suffix not in (".yaml", ".yml"):
        return None
    local = base_dir / name
    if not local.is_file():
        return None
    if name == "study.yaml":
        raise ConfigError("study.base: a base config named study.yaml would be overwritten "
                          "by the study file in the results; rename the base config")
    return local


def _check_name(name: str | None) -> str:
    if name is None:
        raise ConfigError("missing required key 'study.name'")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name):
        raise ConfigError(f"study.name: {name!r} must be a plain directory name "
                          "(letters, digits, '.', '_', '-')")
    if len(name) > MAX_NAME:
        raise ConfigError(f"study.name: {len(name)} characters, more than the {MAX_NAME} a "
                          "directory name may have")
    return name


#: the longest study name: a directory name on common file systems
MAX_NAME = 255


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
    check_axis_count(len(spec.grid), "study.grid")
    for i, (key, values) in enumerate(spec.grid.items()):
        _check_key(key, f"study.grid.{key}")
        if not values:
            raise ConfigError(f"study.grid.{key}: expected a non-empty list of values")
        check_distinct(values, f"study.grid.{key}:")
        check_apart(key, list(spec.grid)[:i], "study.grid")
    if spec.group_by is not None:
        _check_key(spec.group_by, "study.group_by")
    overrides = parse_overrides(spec.overrides)
    _check_managed(overrides, "study.overrides")
    _check_managed({key.split(".")[0]: None for key in spec.grid}, "study.grid")
    if spec.seeds is not None:
        _check_seed("study.overrides", overrides)
        _check_seed("study.grid", {key.split(".")[0]: None for key in spec.grid})
    check_run_count(run_count(spec), "study")


def run_count(spec: StudySpec) -> int:
    """How many runs ``spec`` defines (grid points x explicit runs x seeds), from the
    lengths of its lists alone."""
    points = math.prod(len(values) for values in spec.grid.values())
    return points * max(1, len(spec.runs)) * len(spec.seeds or [None])


def check_run_count(count: int, where: str) -> None:
    """ConfigError when ``count`` runs are more than :data:`MAX_RUNS`."""
    if count > MAX_RUNS:
        raise ConfigError(f"{where}: defines {count:,} runs, more than the {MAX_RUNS:,} "
                          "allowed; use fewer values or seeds, or split it into several")


def _check_seed(where: str, over: Mapping) -> None:
    """``seeds`` gives every run its seed: refuse ``seed`` in ``over`` too, where it would
    be silently replaced."""
    if "seed" in over:
        raise ConfigError(f"{where}: 'seed' is set both here and by 'seeds' (which gives "
                          "every run its seed); set it in one place only")


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


def _variant(spec: StudySpec, base: dict, study_dir: Path, run: RunSpec | None,
             point: list[tuple[str, Any]]) -> Variant:
    if run is not None and not run.label.strip():
        raise ConfigError("study.runs: every run needs a non-empty label")
    if run is not None and not run.label.isprintable():    # also U+2028, U+0085, ...
        raise ConfigError(f"study.runs: label {run.label!r} has a control character "
                          "(newline, tab, ...); a label is one line of the table")
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
    if spec.seeds is not None:
        _check_seed("set", run_set)
    grid_over: dict = {}
    for key, value in point:
        grid_over = merge(grid_over, _nested(key, value))
    if run:
        _check_overlap([i.partition("=")[0].strip() for i in run.set], [k for k, _ in point])
    raw = merge_config(merge_config(base, grid_over), run_set)   # base: with the overrides
    raw = merge(raw, {"name": slug, "out_dir": str(study_dir / "runs"), "progress": False})
    cfg = build_config(raw, plugins=spec.plugins)
    preflight(cfg)
    return cfg


def _nested(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _overlaps(keys: list[str], grid_keys: list[str]):
    """The pairs (key, grid key) that set a common value (:func:`keys_overlap`)."""
    return [(a, b) for a in keys for b in grid_keys if keys_overlap(a, b)]


def _check_overlap(run_keys: list[str], grid_keys: list[str]) -> None:
    for a, b in _overlaps(run_keys, grid_keys)[:1]:
        raise ConfigError(f"'{a}' is set both by the run and by the grid ('{b}')")


def preflight(cfg: RunConfig) -> None:
    """Cheap checks that need no data: algorithm and its options, option names of the
    data set, model and partition scheme, the device. ``build_config`` checks the rest
    of the schema; values that need the data (e.g. a cut) are checked when a run starts.
    """
    import inspect

    from splitfed.data import dataset_options
    from splitfed.data.partition import PARTITIONERS
    from splitfed.experiment import build_algorithm, resolve_device
    from splitfed.models import MODELS, model_names, model_options

    build_algorithm(cfg)
    resolve_device(cfg.engine.device)
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
    configs: dict[str, str] = {}
    for v in variants:                 # two labels of one run: a value given twice
        record = {k: val for k, val in to_dict(v.runs[0].config).items()
                  if k not in ("name", "out_dir")}
        key = json.dumps(record, sort_keys=True, default=str)
        if key in configs:
            raise ConfigError(f"study: the runs {configs[key]!r} and {v.label!r} have the "
                              "same config (a value given twice, or written two ways, as "
                              "1e-3 and 0.001); give each once")
        configs[key] = v.label

