"""Paper 003 Table 8 (E = 1, Fashion-MNIST) side by side with ours.

    python studies/paper003/table8_report.py [STUDY_DIR]   # default runs/studies/paper003_table8_e1

reads the run directories of ``studies/paper003/table8_e1.yaml`` (``STUDY_DIR/runs/``,
named ``<fl|sl>-<partition>-train.lr-<lr>-s<seed>``; the runs finished so far, so it
also reports a study still running) or of ``table8_e1_threshold.yaml`` (``...-lr-<lr>-s<seed>``,
three seeds) and prints two markdown tables, and a third for cells with several seeds:

1. every cell: the paper's test accuracy and ours, both the mean over the last 100
   rounds (``splitfed.study.analysis.last_rounds_accuracy``), in %, and the difference;
2. per partition and method, the "best" learning rate (highest accuracy on the grid) and
   the "threshold" learning rate (the smallest one at which training dies), paper 003
   Sec. 5.3, the paper's and ours.

Training died: the run diverged (its training loss became non-finite; it stopped there),
or its last-100 accuracy is below ``DEAD`` (chance is 10% on Fashion-MNIST; the paper's
dead cells read 10.0, and its 15.6 for SL, alpha = 0.5, lr = 0.05 counts as alive, as
the paper's Table 2 has SL's threshold there at 0.1).

The paper's numbers are transcribed from its Table 8 (E = 1, Fashion-MNIST).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from splitfed.metrics import read_records, record_summary
from splitfed.study.analysis import last_rounds_accuracy

DEAD = 0.15
LAST = 100
LRS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1)
PARTITIONS = {"iid": "IID", "dir0.5": "alpha = 0.5", "dir0.2": "alpha = 0.2",
              "c5": "C = 5", "c2": "C = 2"}
#: paper 003, Table 8, E = 1, Fashion-MNIST: partition -> method -> accuracy (%) per LRS
PAPER = {
    "iid": {"fl": (54.4, 68.8, 83.7, 86.1, 88.1, 87.8),
            "sl": (75.0, 85.9, 88.4, 88.2, 82.4, 10.0)},
    "dir0.5": {"fl": (59.3, 72.9, 83.0, 85.2, 86.7, 85.2),
               "sl": (83.4, 85.4, 87.6, 87.3, 15.6, 10.0)},
    "dir0.2": {"fl": (60.8, 71.3, 80.8, 83.5, 83.4, 10.0),
               "sl": (81.6, 84.3, 85.9, 84.9, 10.0, 10.0)},
    "c5": {"fl": (53.8, 67.0, 81.7, 84.6, 87.5, 86.8),
           "sl": (82.4, 85.6, 88.0, 88.1, 10.0, 10.0)},
    "c2": {"fl": (50.9, 62.6, 77.5, 76.5, 81.1, 83.0),
           "sl": (80.4, 83.9, 87.3, 86.6, 10.0, 10.0)},
}
#: run directory names of table8_e1.yaml (grid: "train.lr-0.05") and
#: table8_e1_threshold.yaml (labels: "lr-0.05")
_NAME = re.compile(
    r"(fl|sl)-(iid|dir0\.5|dir0\.2|c5|c2)-(?:train\.)?lr-([0-9.e-]+)-s([0-9]+)")


def read_cells(study_dir: Path) -> dict[tuple[str, str, float], dict]:
    """(method, partition, lr) -> {"acc": last-100 mean or None, "diverged": round or
    None, "seeds": n, "per_seed": {seed: {"acc", "diverged"}}} of the finished runs
    (several seeds: the mean of the seeds' means; a cell is diverged only when every
    seed diverged)."""
    found: dict[tuple[str, str, float], list[dict]] = {}
    for run in sorted((study_dir / "runs").glob("*")):
        m = _NAME.fullmatch(run.name)
        summary = run / "summary.json"
        if m is None or not summary.is_file():
            continue
        info = json.loads(summary.read_text())
        if info.get("status") not in ("completed", "diverged"):
            continue
        records = read_records(run / "metrics.jsonl")
        rounds = int(info.get("rounds") or max(r.get("round", 0) for r in records))
        got = last_rounds_accuracy(records, LAST, rounds, info["status"])
        diverged = record_summary(records, info["status"])["diverged_round"]
        key = (m.group(1), m.group(2), float(m.group(3)))
        found.setdefault(key, []).append({"acc": got["mean"], "diverged": diverged,
                                          "seed": int(m.group(4))})
    cells = {}
    for key, seeds in found.items():
        accs = [s["acc"] for s in seeds if s["acc"] is not None]
        cells[key] = {"acc": sum(accs) / len(accs) if accs else None,
                      "diverged": (min(s["diverged"] for s in seeds)
                                   if all(s["diverged"] is not None for s in seeds)
                                   else None),
                      "seeds": len(seeds),
                      "per_seed": {x["seed"]: {"acc": x["acc"], "diverged": x["diverged"]}
                                   for x in seeds}}
    return cells


def _dead(cell: dict | None) -> bool | None:
    if cell is None:
        return None
    return cell["diverged"] is not None or cell["acc"] is None or cell["acc"] < DEAD


def _ours(cell: dict | None) -> str:
    if cell is None:
        return "pending"
    if cell["diverged"] is not None:
        return f"diverged (round {cell['diverged']})"
    return "n/a" if cell["acc"] is None else f"{100 * cell['acc']:.1f}"


def _diff(paper: float, cell: dict | None) -> str:
    if cell is None:
        return ""
    ours = 10.0 if _dead(cell) else 100 * cell["acc"]      # a dead run reads ~10%
    return f"{ours - paper:+.1f}"


def cell_table(cells: dict) -> str:
    lines = ["| partition | lr | FL paper | FL ours | FL diff | SL paper | SL ours | SL diff |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for part, name in PARTITIONS.items():
        for i, lr in enumerate(LRS):
            row = [name, f"{lr:g}"]
            for method in ("fl", "sl"):
                paper = PAPER[part][method][i]
                cell = cells.get((method, part, lr))
                row += [f"{paper:.1f}", _ours(cell), _diff(paper, cell)]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def best_and_threshold(values: list[tuple[float, float | None, bool | None]]
                       ) -> tuple[str, str]:
    """(best, threshold) of (lr, accuracy, dead) triples in lr order: "acc (lr)" of the
    highest accuracy, and the smallest lr that is dead ("> max lr" when none is; "?"
    when a cell is missing)."""
    if any(dead is None for _, _, dead in values):
        return "pending", "pending"
    alive = [(acc, lr) for lr, acc, dead in values if not dead and acc is not None]
    best = max(alive, default=None)
    dead_lrs = [lr for lr, _, dead in values if dead]
    threshold = f"{min(dead_lrs):g}" if dead_lrs else f"> {max(LRS):g}"
    return (f"{100 * best[0]:.1f} ({best[1]:g})" if best else "none"), threshold


def summary_table(cells: dict) -> str:
    lines = ["| partition | method | best lr, paper | best lr, ours | threshold, paper | "
             "threshold, ours |", "|---|---|---|---|---|---|"]
    for part, name in PARTITIONS.items():
        for method in ("fl", "sl"):
            paper = [(lr, PAPER[part][method][i] / 100, PAPER[part][method][i] < 100 * DEAD)
                     for i, lr in enumerate(LRS)]
            ours = []
            for lr in LRS:
                cell = cells.get((method, part, lr))
                ours.append((lr, None if cell is None else cell["acc"], _dead(cell)))
            pb, pt = best_and_threshold(paper)
            ob, ot = best_and_threshold(ours)
            lines.append(f"| {name} | {method.upper()} | {pb} | {ob} | {pt} | {ot} |")
    return "\n".join(lines)


def _seed_value(seed: dict) -> float:
    """One seed's accuracy in %: a diverged or dead seed reads 10.0, as the paper's dead
    cells do."""
    return 10.0 if _dead(seed) else 100 * seed["acc"]


def seed_table(cells: dict) -> str:
    """The cells run with several seeds (table8_e1_threshold.yaml): the paper's accuracy,
    ours as mean +- sample std over the seeds, each seed's, and how many seeds died."""
    lines = ["| method | partition | lr | paper | ours (mean ± std) | per seed | seeds dead |",
             "|---|---|--:|--:|--:|---|--:|"]
    for part, name in PARTITIONS.items():
        for method in ("sl", "fl"):
            for i, lr in enumerate(LRS):
                cell = cells.get((method, part, lr))
                if cell is None or cell["seeds"] < 2:
                    continue
                seeds = dict(sorted(cell["per_seed"].items()))
                values = [_seed_value(x) for x in seeds.values()]
                per = ", ".join(f"{v:.1f} (s{k})" for k, v in zip(seeds, values))
                dead = sum(_dead(x) for x in seeds.values())
                lines.append(f"| {method.upper()} | {name} | {lr:g} | "
                             f"{PAPER[part][method][i]:.1f} | {statistics.mean(values):.1f} ± "
                             f"{statistics.stdev(values):.1f} | {per} | {dead}/{len(values)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str]) -> int:
    study_dir = Path(argv[0] if argv else "runs/studies/paper003_table8_e1")
    if not (study_dir / "runs").is_dir():
        print(f"no runs under {study_dir / 'runs'}: run "
              "splitfed study studies/paper003/table8_e1.yaml first", file=sys.stderr)
        return 2
    cells = read_cells(study_dir)
    print(f"{len(cells)} of {2 * len(PARTITIONS) * len(LRS)} cells finished "
          f"({study_dir}); accuracy in %, mean over the last {LAST} rounds.\n")
    print(cell_table(cells))
    print()
    print(summary_table(cells))
    seeds = seed_table(cells)
    if seeds:
        print(f"\nCells with several seeds (a dead seed reads 10.0):\n\n{seeds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
