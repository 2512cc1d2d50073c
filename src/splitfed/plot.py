"""``splitfed plot``: test accuracy of one or more runs against rounds and simulated time.

Each argument is a run directory (what ``splitfed run`` writes: ``metrics.jsonl``,
``config.yaml``) or a ``metrics.jsonl`` file. One figure, one panel per x axis:

- ``round``: test accuracy at every evaluated round;
- ``time``: the same points against cumulative simulated seconds (the sum of the
  rounds' ``sim_round_s``, docs/clock.md; the measured ``round_time_s`` for runs that
  recorded no simulated time, and the axis label says so);
- ``bytes``: against cumulative MB sent (up + down; MB = 10^6 bytes).

Lines are labelled ``--label`` (one per run), else ``<algorithm>`` from the run's
config, else the directory name; duplicate labels get the directory name added.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from splitfed.errors import ConfigError
from splitfed.study import curve, read_records

AXES = ("round", "time", "bytes")


def _metrics_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path}: no such metrics file; give a run directory (with "
                          "metrics.jsonl) or a metrics.jsonl file")
    return path


def _default_label(metrics: Path) -> str:
    config = metrics.parent / "config.yaml"
    if config.is_file():
        try:
            raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
            name = (raw.get("algorithm") or {}).get("name")
            if name:
                return str(name)
        except (yaml.YAMLError, AttributeError):
            pass
    return metrics.parent.name


def load_curves(runs: Sequence[str | Path], labels: Sequence[str] | None = None
                ) -> list[dict]:
    """One curve per run (:func:`splitfed.study.curve`) with its ``label``."""
    if not runs:
        raise ConfigError("runs: give at least one run directory")
    if labels is not None and len(labels) != len(runs):
        raise ConfigError(f"--label: got {len(labels)} labels for {len(runs)} runs; give "
                          "one per run or none")
    out = []
    for i, run in enumerate(runs):
        metrics = _metrics_file(Path(run))
        try:
            records = read_records(metrics)
        except ValueError as e:
            raise ConfigError(f"{metrics}: not a metrics file ({e})") from None
        c = curve(records)
        if not c["round"]:
            raise ConfigError(f"{metrics}: no evaluated round (no test_acc) to plot")
        c["label"] = labels[i] if labels is not None else _default_label(metrics)
        c["source"] = metrics.parent.name
        out.append(c)
    if labels is None:
        seen = [c["label"] for c in out]
        for c in out:
            if seen.count(c["label"]) > 1:
                c["label"] = f"{c['label']} ({c['source']})"
    return out


def plot_runs(runs: Sequence[str | Path], out: str | Path, *,
              axes: Sequence[str] = ("round", "time"), labels: Sequence[str] | None = None,
              title: str | None = None) -> Path:
    """Draw the runs' test accuracy against each of ``axes`` into ``out`` (PNG, PDF, SVG
    by suffix); returns the path written."""
    bad = [a for a in axes if a not in AXES]
    if bad or not axes:
        raise ConfigError(f"--x: unknown axis {bad[0] if bad else '(none)'}; allowed: "
                          + ", ".join(AXES))
    curves = load_curves(runs, labels)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'splitfed[plot]'") from None
    fig = Figure(figsize=(5.2 * len(axes), 3.9), layout="constrained")
    panels = fig.subplots(1, len(axes), squeeze=False, sharey=True)[0]
    for ax, axis in zip(panels, axes):
        for c in curves:
            x = {"round": c["round"], "time": c["time_s"],
                 "bytes": [b / 1e6 for b in c["bytes"]]}[axis]
            ax.plot(x, c["test_acc"], marker="o" if len(x) < 15 else None, markersize=3,
                    label=c["label"])
        ax.set_xlabel(_axis_label(axis, curves))
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(out)
    if out.parent and not out.parent.exists():
        raise ConfigError(f"--out: directory {out.parent} does not exist")
    fig.savefig(out, dpi=120)
    return out


def _axis_label(axis: str, curves: list[dict]) -> str:
    if axis == "round":
        return "round"
    if axis == "bytes":
        return "cumulative MB (up + down)"
    kinds = {c["time_kind"] for c in curves}
    if kinds == {"simulated"}:
        return "simulated time (s)"
    if kinds == {"wall"}:
        return "wall-clock time (s)"
    return "time (s): simulated, or wall-clock where not recorded"
