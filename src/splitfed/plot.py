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

The image format is the output's suffix (``.png``, ``.pdf``, ``.svg``, or another format
matplotlib writes). An existing output is not overwritten unless ``--force`` is given;
the image is written to a temporary file next to it and renamed over it, so a failed
write leaves the old one intact.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from splitfed.configtools import yaml_load
from splitfed.errors import ConfigError
from splitfed.metrics import read_records
from splitfed.study import curve

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
            raw = yaml_load(config.read_text(encoding="utf-8"), str(config)) or {}
            name = (raw.get("algorithm") or {}).get("name")
            if name:
                return str(name)
        except (OSError, ValueError, AttributeError):   # ConfigError is a ValueError
            pass                       # an unreadable config: label by the directory
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
            records = read_records(metrics)   # FormatError names the file and line
        except OSError as e:
            raise ConfigError(f"cannot read {metrics} ({e.strerror or e})") from None
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
              title: str | None = None, force: bool = False) -> Path:
    """Draw the runs' test accuracy against each of ``axes`` into ``out`` (PNG, PDF, SVG
    by suffix); returns the path written. An existing ``out`` is refused unless
    ``force``."""
    bad = [a for a in axes if a not in AXES]
    if bad or not axes:
        raise ConfigError(f"--x: unknown axis {bad[0] if bad else '(none)'}; allowed: "
                          + ", ".join(AXES))
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'splitfed[plot]'") from None
    out = check_output(out, force)
    curves = load_curves(runs, labels)
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
    _save(fig, out)
    return out


def formats() -> list[str]:
    """The image suffixes matplotlib writes (without the dot)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_output(out: str | Path, force: bool) -> Path:
    """``out`` as a path to write: a known image suffix, an existing directory to put it
    in, and not an existing file unless ``force``; ConfigError otherwise."""
    out = Path(out)
    suffix = out.suffix.lower().lstrip(".")
    if not str(out).strip() or out.name in ("", ".", ".."):
        raise ConfigError("--out: give an image file name, e.g. accuracy.png")
    if suffix not in formats():
        raise ConfigError(f"--out {out}: unknown image format {out.suffix or '(no suffix)'!r}; "
                          "end the name with .png, .pdf or .svg (or "
                          + ", ".join("." + f for f in formats()) + ")")
    parent = out.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} " + ("is a file, not a directory"
                          if parent.exists() else "does not exist; create it first"))
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a directory; give an image file name")
    if out.exists() and not force:
        raise ConfigError(f"--out {out}: the file exists; pass --force to overwrite it, "
                          "or choose another --out")
    return out


def _save(fig, out: Path) -> None:
    """Render to a temporary file next to ``out``, then rename it over ``out``."""
    fd, tmp = None, None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix,
                                   dir=out.parent)
        with os.fdopen(fd, "wb") as fh:
            fd = None
            fig.savefig(fh, dpi=120, format=out.suffix.lower().lstrip("."))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)          # mkstemp makes it private
        os.replace(tmp, out)
        tmp = None
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    except ValueError as e:                    # matplotlib: e.g. unbalanced $...$ math
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot draw the figure ({first}); check the $...$ math in "
                          "--label and --title") from None
    finally:
        if fd is not None:
            os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


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
