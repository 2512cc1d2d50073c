"""Reusing finished runs: a run directory is reused only when it holds a finished run of
the identical config (:func:`config_identity`) made by the same code
(:func:`compare_code`: the splitfed version, and the digest of the package's files or,
where a side has none, the git commit when both sides know it).

:func:`run_dir_state` says what a run directory holds: ``new`` (absent or empty),
``done`` (reusable), ``unfinished`` (the identical config, not finished: resumed from
its checkpoint or rerun), ``stale`` (finished, identical config, other code: rerun, or
kept and marked when the study is told to keep stale runs). Anything else (another
config, files that are not a run, damaged files such as a ``summary.json`` that is not a
JSON object) raises, naming the directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from splitfed.config import RunConfig, build_config
from splitfed.configtools import load_yaml, to_dict, yaml_round_trip
from splitfed.errors import ConfigError, FormatError
from splitfed.experiment import FINISHED_STATUSES, RUN_FILES, UNFINISHED_STATUSES
from splitfed.locking import LOCK_NAME
from splitfed.files import (MAX_SUMMARY_BYTES, is_temp_file, json_object_or_why,
                            read_json_object)
from splitfed.study.spec import StudyRun

FINISHED = FINISHED_STATUSES                   # rerunning gives the same run
#: config keys that have no effect on the numbers
_NOT_COMPARED = ("out_dir", "progress", "checkpoint_every", "tracking")
#: section keys that do not change a run's numbers either: evaluation's metrics are the
#: same at every batch size (splitfed.engine.evaluate; tests/engine/test_evaluate.py)
_NOT_COMPARED_IN = {"engine": ("eval_batch_size",)}


# ------------------------------------------------------------------------ config


def config_identity(cfg: RunConfig | Mapping) -> dict:
    """A run's config as compared for reuse: YAML-normalised, without the keys that do
    not change its numbers (out_dir, progress, checkpoint_every, tracking,
    engine.eval_batch_size).

    A saved config is rebuilt first, so that fields added to the config schema since it
    was written take their defaults instead of counting as a difference.
    """
    if not isinstance(cfg, RunConfig):
        try:
            cfg = build_config(dict(cfg))
        except ConfigError:
            pass
    data = to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg)
    data = yaml_round_trip(data)
    out = {k: v for k, v in data.items() if k not in _NOT_COMPARED}
    for section, keys in _NOT_COMPARED_IN.items():
        if isinstance(out.get(section), Mapping):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    return out


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


# -------------------------------------------------------------------------- code


def current_code() -> dict:
    """The provenance of this process (:func:`splitfed.provenance.provenance`)."""
    from splitfed.provenance import provenance

    return provenance()


def _commit(prov: Mapping) -> str | None:
    commit = prov.get("commit")
    return commit if isinstance(commit, str) and commit else None


def code_version(prov: Mapping | None) -> str:
    """``splitfed 0.1.0 (commit 47ed5fb0c1)``, ``splitfed 0.1.0 (commit unknown)``, or
    ``an unknown code version`` when nothing is recorded."""
    if not isinstance(prov, Mapping) or not isinstance(prov.get("splitfed"), str):
        return "an unknown code version (no provenance in summary.json)"
    commit = _commit(prov)
    where = f"commit {commit[:10]}" if commit else "commit unknown"
    if commit and prov.get("dirty"):
        where += ", uncommitted changes"
    source = _source(prov)
    if source:
        where += f", source {source[:10]}"
    return f"splitfed {prov['splitfed']} ({where})"


def _source(prov: Mapping) -> str | None:
    source = prov.get("source")
    return source if isinstance(source, str) and source else None


def _plugins(prov: Mapping) -> dict:
    plugins = prov.get("plugins")
    return dict(plugins) if isinstance(plugins, Mapping) else {}


def _plugins_changed(recorded: Mapping, current: Mapping) -> str | None:
    """The first plugin that the run recorded and this process imported whose files
    differ (or cannot be read); None when every such plugin is the same. Plugins only
    one side imported are not compared: a study's process imports the plugins of all of
    its runs, a run's own process those of its config."""
    old = _plugins(recorded)
    for name, digest in _plugins(current).items():
        if name in old and (old[name] != digest or digest == "unknown"):
            return name
    return None


def compare_code(recorded: Mapping | None, current: Mapping) -> tuple[bool, str | None]:
    """(same code, note). Not the same: the note reads ``recorded with <code_version>,
    now <code_version>``. The same code: the same splitfed version and, when both
    provenances hold the digest of the package's files (``source``), the same digest
    (whatever the commits: a commit that changed only documentation keeps the runs, an
    uncommitted change to the code does not); else the same git commit when both name
    one; when either commit is unknown too (an installed wheel, no git) only the versions
    are compared and the note says so. No recorded provenance is never the same."""
    now = code_version(current)
    if not isinstance(recorded, Mapping) or not isinstance(recorded.get("splitfed"), str):
        return False, f"recorded with {code_version(recorded)}, now {now}"
    then = code_version(recorded)
    if recorded["splitfed"] != current.get("splitfed"):
        return False, f"recorded with {then}, now {now}"
    changed = _plugins_changed(recorded, current)
    if changed:
        return False, f"the code of plugin {changed} changed since the run was recorded"
    if _source(recorded) and _source(current):
        return (True, None) if _source(recorded) == _source(current) else (
            False, f"recorded with {then}, now {now}")
    old, new = _commit(recorded), _commit(current)
    if old and new:
        return (True, None) if old == new else (
            False, f"recorded with {then}, now {now}")
    if old or new:
        return True, ("compared the splitfed version only: the git commit is unknown "
                      + ("where the run was recorded" if new else "here"))
    return True, "compared the splitfed version only: the git commit is unknown"


# ------------------------------------------------------------------ run directories


@dataclass
class RunDirState:
    """What a run directory holds (:func:`run_dir_state`)."""

    state: str                       # new, done, unfinished or stale
    provenance: dict | None = None   # the finished run's recorded provenance
    note: str | None = None          # stale: "recorded with ..., now ..."; done: how the
    #                                  code was compared, when only the version was

    def reused(self, keep_stale: bool) -> bool:
        """Its recorded run is taken as it is (not run, not resumed)."""
        return self.state == "done" or (self.state == "stale" and keep_stale)


def run_dir_state(run: StudyRun, current: Mapping | None = None) -> RunDirState:
    """``new`` (absent or empty), ``done`` (a finished run of the identical config made by
    the same code as ``current``, default this process), ``stale`` (the same but made by
    other code, :func:`compare_code`) or ``unfinished`` (the identical config, not
    finished); anything else raises :class:`~splitfed.errors.ConfigError`."""
    d = run.run_dir
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d} is a file, not a run directory of this study; move it away")
    if not d.exists() or all(p.name == LOCK_NAME or is_temp_file(p) for p in d.iterdir()):
        return RunDirState("new")              # (a run killed as it wrote its config)
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
    summary = read_summary(d) or {}
    if not (summary.get("status") in FINISHED and (d / "metrics.jsonl").is_file()):
        return RunDirState("unfinished")
    recorded = summary.get("provenance")
    recorded = dict(recorded) if isinstance(recorded, Mapping) else None
    same, note = compare_code(recorded, current if current is not None else current_code())
    return RunDirState("done" if same else "stale", recorded, note)


def read_summary(run_dir: Path) -> dict | None:
    """``run_dir/summary.json`` as a dict; None when there is none. A run writes it once,
    whole, when it ends, so one that is there but is not a JSON object with a status a
    run writes (torn, empty, too large, unreadable, a list, ``"status": "running"``) is
    damaged: a :class:`~splitfed.errors.FormatError` names the file and the directory to
    delete. Read as it is, the run would count as unfinished and be resumed into a
    summary with no provenance."""
    path = run_dir / "summary.json"
    if not path.exists() and not path.is_symlink():
        return None
    data, why = json_object_or_why(path, MAX_SUMMARY_BYTES)
    if data is not None:
        status = data.get("status")
        if status in FINISHED_STATUSES + UNFINISHED_STATUSES:
            return data
        why = "no status" if "status" not in data else (
            f"status {str(status)[:40]!r} is none a run writes (it ends "
            f"{', '.join(FINISHED_STATUSES)}, or stops {', '.join(UNFINISHED_STATUSES)})")
    raise FormatError(f"{path}: {why}; the finished run in {run_dir} is damaged: delete "
                      "that directory to run it again")


def read_json(path: Path, max_bytes: int = MAX_SUMMARY_BYTES) -> dict:
    """A JSON object read from ``path`` (at most ``max_bytes``); ``{}`` when it is absent,
    unreadable, larger or not an object."""
    return read_json_object(path, max_bytes) or {}
