"""The plots of a study: ``accuracy_vs_<axis>.png`` per x axis (round, bytes, time), one
panel per ``group_by`` value, the mean over seeds with a +- std band. Drawn from the
curves of ``results.json`` (:func:`splitfed.study.results_summary`)."""

from __future__ import annotations

import math

from splitfed.files import atomic_write
from splitfed.study.spec import Study

_AXIS_LABELS = {"round": "round", "bytes": "cumulative communication, up + down (MB)",
                "time": "cumulative time (s; simulated where recorded, else wall)"}


def axis_label(axis: str, curves: list[dict]) -> str:
    """The x-axis label; for time it says whether the curves' times are simulated, wall,
    or both (a curve's ``time_kind``)."""
    if axis != "time":
        return _AXIS_LABELS[axis]
    kinds = {c.get("time_kind") for c in curves}
    if kinds == {"simulated"}:
        return "cumulative simulated time (s)"
    if kinds == {"wall"}:
        return "cumulative wall time (s)"
    return _AXIS_LABELS[axis]


def _print(*args, **kwargs) -> None:
    print(*args, **kwargs, flush=True)


def _mean_curve(per_seed: list[dict], axis: str):
    """Mean (and std) accuracy over seeds at every round some seed evaluated, over the
    seeds that evaluated it (a diverged seed's curve ends before its divergence, so the
    line goes on with the others, as the table's final accuracy does); x is the mean of
    those seeds' rounds, bytes or time. std is NaN where fewer than two seeds count."""
    import numpy as np

    curves = [s["curve"] for s in per_seed]
    rounds = sorted(set().union(*(c["round"] for c in curves)))
    where = [{r: i for i, r in enumerate(c["round"])} for c in curves]
    xs, ys, stds = [], [], []
    for t in rounds:
        x, y = [], []
        for c, at in zip(curves, where):
            if t in at:
                i = at[t]
                x.append({"round": c["round"][i], "bytes": c["bytes"][i] / 1e6,
                          "time": c["time_s"][i]}[axis])
                y.append(c["test_acc"][i])
        xs.append(float(np.mean(x)))
        ys.append(float(np.mean(y)))
        stds.append(float(np.std(y, ddof=1)) if len(y) > 1 else float("nan"))
    std = np.array(stds) if len(curves) > 1 else None
    return np.array(xs), np.array(ys), std


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
        atomic_write(study.dir / name, lambda fh, fig=fig: fig.savefig(fh, dpi=120,
                                                                       format="png"))
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
    ax.set_xlabel(axis_label(axis, [s["curve"] for r in runs for s in r["per_seed"]]))
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
