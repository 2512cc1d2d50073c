"""``splitfed plot``: test accuracy of one or more runs against rounds and simulated time.

Each argument is a run directory (what ``splitfed run`` writes: ``metrics.jsonl``,
``config.yaml``) or a ``metrics.jsonl`` file. One figure, one panel per x axis:

- ``round``: test accuracy at every evaluated round;
- ``time``: the same points against cumulative simulated seconds (the sum of the
  rounds' ``sim_round_s``, docs/clock.md; the measured ``round_time_s`` for runs that
  recorded no simulated time, and the axis label says so);
- ``bytes``: against cumulative MB sent (up + down; MB = 10^6 bytes).

Lines are labelled ``--label`` (one per run), else ``<algorithm>`` from the run's
config, else the directory name; duplicate labels get what tells their directory names
apart added (``fedavg (lr0.05)``, ``fedavg (lr0.1)``; else the whole name). A label
taken from a run is drawn as plain text (a ``$`` in it is not math, a leading ``_`` does
not hide it), and bytes that are not UTF-8 in any label or the title are drawn as U+FFFD.

A diverged run (:func:`splitfed.metrics.divergence`: its loss became non-finite) is drawn
up to its last evaluation before it diverged; an ``x`` in the line's colour marks the
round it diverged at (at the height of that last accuracy), and its legend entry says
``(diverged at round N)``.

The image format is the output's suffix (``.png``, ``.pdf``, ``.svg``, or another format
matplotlib writes; one whose tool is missing, ``.pgf`` without LaTeX, is one line). An
existing output is not overwritten unless ``--force`` is given, also one that another
process writes while this one draws; the image is written to a temporary file next to it
and then linked (renamed over it with ``--force``), so a failed write leaves the old one
intact.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Sequence
from pathlib import Path

from splitfed.configtools import yaml_load
from splitfed.errors import ConfigError
from splitfed.files import NOT_REGULAR, atomic_write, read_regular
from splitfed.metrics import divergence, is_finite_number, iter_records

AXES = ("round", "time", "bytes")


def _metrics_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        what = NOT_REGULAR if path.exists() else "no such metrics file"
        raise ConfigError(f"{path}: {what}; give a run directory (with "
                          "metrics.jsonl) or a metrics.jsonl file")
    return path


def _default_label(metrics: Path) -> str:
    """The run's ``algorithm.name``, else its directory's name, drawn as plain text:
    ``$`` is not math, and a leading ``_`` does not hide the line from the legend."""
    from splitfed.configtools import MAX_YAML_BYTES

    config, label = metrics.parent / "config.yaml", metrics.parent.name
    if config.is_file():
        try:
            text = read_regular(config, str(config), MAX_YAML_BYTES).decode("utf-8")
            raw = yaml_load(text, str(config)) or {}
            name = (raw.get("algorithm") or {}).get("name")
            if name:
                label = str(name)
        except (OSError, ValueError, AttributeError):   # ConfigError is a ValueError
            pass                       # an unreadable config: label by the directory
    label = label.replace("$", r"\$")
    return " " + label if label.startswith("_") else label


def _drawable(text: str) -> str:
    """``text`` as matplotlib can draw it: bytes that were not UTF-8 (a directory name
    from another system, an argument; Python keeps them as lone surrogates) become
    U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def load_curves(runs: Sequence[str | Path], labels: Sequence[str] | None = None
                ) -> list[dict]:
    """One curve per run (:func:`splitfed.study.curve`) with its ``label``. The records
    are read as a stream (:func:`splitfed.metrics.iter_records`) and only the points
    drawn are kept: five numbers per evaluated round (about 170 bytes, as Python lists
    and the simulated and measured time until the end says which is drawn), whatever
    else ``metrics.jsonl`` holds."""
    if not runs:
        raise ConfigError("runs: give at least one run directory")
    if labels is not None and len(labels) != len(runs):
        raise ConfigError(f"--label: got {len(labels)} labels for {len(runs)} runs; give "
                          "one per run or none")
    for label in labels or ():
        if not label.strip() or label.startswith("_"):
            raise ConfigError(f"--label: {label!r} would leave its line out of the legend "
                              "(matplotlib hides empty labels and those starting with '_'); "
                              "give a visible text")
    out = []
    for i, run in enumerate(runs):
        metrics = _metrics_file(Path(run))
        points = _Points()
        try:
            for record in iter_records(metrics):   # FormatError names the file and line
                points.add(record)
        except OSError as e:
            raise ConfigError(f"cannot read {metrics} ({e.strerror or e})") from None
        c = points.curve()
        if not c["round"] and c["diverged_round"] is None:
            raise ConfigError(f"{metrics}: no evaluated round (no test_acc) to plot")
        c["label"] = _drawable(labels[i] if labels is not None else _default_label(metrics))
        c["source"] = metrics.parent.name
        c["metrics"] = str(metrics)
        out.append(c)
    if labels is None:
        seen = [c["label"] for c in out]
        for label in set(seen):
            same = [c for c in out if c["label"] == label]
            if len(same) > 1:
                for c, tell in zip(same, _distinct([c["source"] for c in same])):
                    c["label"] = f"{label} ({tell})"
    for c in out:
        if c["diverged_round"] is not None:
            c["label"] += f" (diverged at round {c['diverged_round']})"
    return out


def _distinct(names: list[str]) -> list[str]:
    """What tells run directory names apart: without their time (``-YYYYmmdd-HHMMSS``)
    and the words all of them begin with (``quick_digits-fedavg-``); the whole names
    when that leaves two alike or one empty."""
    bare = [re.sub(r"-\d{8}-\d{6}(-\d+)?$", "", n) for n in names]
    words = [b.split("-") for b in bare]
    k = 0
    while all(len(w) > k + 1 and w[k] == words[0][k] for w in words):
        k += 1
    short = ["-".join(w[k:]) for w in words]
    return short if all(short) and len(set(short)) == len(short) else list(names)


def _num(value) -> float | None:
    """A finite number as a float; None for anything else (as :func:`splitfed.study.curve`
    reads a record)."""
    return float(value) if is_finite_number(value) else None


class _Points:
    """The curve :func:`load_curves` draws of records given one at a time (:meth:`add`):
    :func:`splitfed.study.curve`'s points before the run diverged, ``diverged_round``
    and, for a diverged run, ``diverged_at``, the marker's position on each axis
    (``round``, ``time_s``, ``bytes``, ``test_acc``). It keeps only the points it draws;
    as :func:`splitfed.study.curve` sums simulated time when every round after round 0
    records it, else the measured time, which is known at the last record, both sums
    are kept (as arrays of doubles) until then."""

    def __init__(self) -> None:
        self.round: list[int] = []
        self.test_acc: list[float] = []
        self.bytes: list[int] = []
        self.sim, self.wall = array("d"), array("d")
        self.rounds = False                 # a record of a round after round 0
        self.all_sim = True                 # every one of them with sim_round_s
        self.total_bytes, self.total_sim, self.total_wall = 0, 0.0, 0.0
        self.diverged: int | None = None
        self.at: dict | None = None
        self.at_acc = None

    def add(self, r: dict) -> None:
        if r.get("round", 0) > 0:
            self.rounds = True
            self.all_sim = self.all_sim and _num(r.get("sim_round_s")) is not None
        if self.diverged is not None:       # the points stop at the divergence
            return
        self.total_bytes += (int(_num(r.get("bytes_up")) or 0)
                             + int(_num(r.get("bytes_down")) or 0))
        self.total_sim += _num(r.get("sim_round_s")) or 0.0
        self.total_wall += _num(r.get("round_time_s")) or 0.0
        diverged = divergence([r])
        if diverged is not None:            # the marker: curve() of the records to here
            self.diverged = diverged
            total = self.total_sim if self.rounds and self.all_sim else self.total_wall
            self.at = {"round": int(r["round"]), "time_s": float(f"{total:.12g}"),
                       "bytes": self.total_bytes}
            self.at_acc = r.get("test_acc")
            return
        acc = _num(r.get("test_acc"))
        if acc is not None:
            self.round.append(int(r["round"]))
            self.test_acc.append(acc)
            self.bytes.append(self.total_bytes)
            self.sim.append(float(f"{self.total_sim:.12g}"))    # 12 significant digits
            self.wall.append(float(f"{self.total_wall:.12g}"))

    def curve(self) -> dict:
        sim = self.rounds and self.all_sim
        c = {"round": self.round, "test_acc": self.test_acc, "bytes": self.bytes,
             "time_s": (self.sim if sim else self.wall).tolist(),
             "time_kind": "simulated" if sim else "wall",
             "diverged_round": self.diverged, "diverged_at": None}
        self.sim = self.wall = array("d")
        if self.at is not None:
            acc = c["test_acc"][-1] if c["test_acc"] else self.at_acc
            acc = float(acc) if is_finite_number(acc) else 0.0
            c["diverged_at"] = {**self.at, "test_acc": acc}
        return c


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
    for c in curves:
        for axis in axes:
            _check_drawable(c, axis)
    fig = Figure(figsize=(5.2 * len(axes), 3.9), layout="constrained")
    panels = fig.subplots(1, len(axes), squeeze=False, sharey=True)[0]
    for ax, axis in zip(panels, axes):
        for c in curves:
            x = {"round": c["round"], "time": c["time_s"],
                 "bytes": [b / 1e6 for b in c["bytes"]]}[axis]
            (line,) = ax.plot(x, c["test_acc"], marker="o" if len(x) < 15 else None,
                              markersize=3, label=c["label"])
            at = c["diverged_at"]
            if at is not None:
                xd = {"round": at["round"], "time": at["time_s"],
                      "bytes": at["bytes"] / 1e6}[axis]
                if len(x):                     # dotted from the last evaluation to the x
                    ax.plot([x[-1], xd], [c["test_acc"][-1], at["test_acc"]],
                            linestyle=":", color=line.get_color())
                ax.plot([xd], [at["test_acc"]], marker="x", markersize=9,
                        markeredgewidth=2, linestyle="none", color=line.get_color())
        ax.set_xlabel(_axis_label(axis, curves))
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(_drawable(title))
    _save(fig, out, force)
    return out


#: what each x axis draws, and how its values are named in an error
_AXIS_VALUES = {"round": ("round", "round numbers"),
                "time": ("time_s", "cumulative times (the sum of the rounds' times)"),
                "bytes": ("bytes", "cumulative bytes")}


def _check_drawable(c: dict, axis: str) -> None:
    """ConfigError naming the run's metrics file when a value it draws on ``axis`` is
    not a finite float (finite values that add up beyond a float's range)."""
    key, words = _AXIS_VALUES[axis]
    values = [*c[key], *([c["diverged_at"][key]] if c["diverged_at"] else [])]
    for v in values:
        try:
            ok = math.isfinite(float(v))
        except OverflowError:
            ok = False
        if not ok:
            others = ", ".join(a for a in AXES if a != axis)
            raise ConfigError(f"{c['metrics']}: its {words} exceed the range of a float "
                              f"and cannot be drawn against {axis}; draw against "
                              f"{others} (--x)")


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
    if out.is_symlink() and not force:          # a link to nothing: the link is replaced
        raise ConfigError(f"--out {out}: is a link to a file that does not exist; pass "
                          "--force to replace the link, or choose another --out")
    return out


def _save(fig, out: Path, force: bool = False) -> None:
    """Render to a temporary file next to ``out``, then move it to ``out``
    (:func:`splitfed.files.atomic_write`): renamed over it with ``force``, else linked,
    which fails if ``out`` has appeared meanwhile (another process wrote it while this
    one drew), so a file is never replaced without ``force``."""
    fmt = out.suffix.lower().lstrip(".")
    try:
        atomic_write(out, lambda fh: fig.savefig(fh, dpi=120, format=fmt), replace=force)
    except FileExistsError:
        raise ConfigError(f"--out {out}: it was written by another process while this "
                          "plot was drawn; pass --force to overwrite it, or choose another "
                          "--out") from None
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    except RuntimeError as e:                  # a backend's tool missing (pgf: LaTeX)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"--out {out}: cannot write this format ({first}); choose "
                          "another suffix (.png, .pdf, .svg)") from None
    except ValueError as e:                    # matplotlib: e.g. unbalanced $...$ math
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = ("; check the $...$ math in --label and --title" if _has_math(fig)
                else "")
        raise ConfigError(f"cannot draw the figure ({first}){hint}") from None


def _has_math(fig) -> bool:
    """Whether a text of ``fig`` (a legend entry, the title) holds ``$``: mathtext."""
    from matplotlib.text import Text

    return any("$" in t.get_text() for t in fig.findobj(Text))


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
