"""Paper 003 Table 8 quantities from a learning-rate sweep of FL and SL.

    python studies/paper003/summarize.py [SWEEP_DIR]      # default runs/sweeps/paper003_lr

reads ``sweep.json`` and each run's ``metrics.jsonl`` (the run directories: the sweep must
have been run on this machine; they are not committed) and prints a markdown table with one
row per learning rate: for each method the test accuracy averaged over the last 10% of
the rounds (as paper 003 Table 8 reports it; at least the last round), the final and the
best accuracy, and whether the training died. Then the "best" learning rate (the one with
the highest last-10% accuracy) and the "threshold" learning rate (the smallest learning
rate at which training dies) of each method, as paper 003 Section 5.3 defines them.

Training died: the run diverged (non-finite training loss; the run stops there), or its
last-10% test accuracy is at most ``DEAD`` (chance is 0.10 on Fashion-MNIST; the paper's
dead runs read 10.0%).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

DEAD = 0.15


def last_share_accuracy(records: list[dict], rounds: int) -> float | None:
    """Mean test accuracy over the evaluated rounds in the last 10% of ``rounds``."""
    first = rounds - max(1, math.ceil(0.1 * rounds)) + 1
    accs = [r["test_acc"] for r in records
            if r.get("round", 0) >= first and isinstance(r.get("test_acc"), (int, float))]
    return sum(accs) / len(accs) if accs else None


def summarize(sweep_dir: Path) -> str:
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    table: dict[float, dict[str, dict]] = {}
    for row in sweep["runs"]:
        run = sweep_dir / row["run_dir"]
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(x) for x in lines if x.strip()]
        rounds = int(_config_rounds(run))
        acc = last_share_accuracy(records, rounds) if row["status"] == "completed" else None
        died = row["status"] == "diverged" or (acc is not None and acc <= DEAD)
        table.setdefault(float(row["train.lr"]), {})[row["algorithm.name"]] = {
            "acc": acc, "final": row["final_test_acc"], "best": row["best_test_acc"],
            "status": row["status"], "rounds": row["rounds"], "died": died,
            "diverged": row.get("diverged_round") or row["rounds"]}
    methods = ["fedavg", "sl"]
    out = ["| lr | " + " | ".join(f"{m}: last-10% acc | {m}: best acc | {m}: died"
                                   for m in methods) + " |",
           "|---|" + "---|---|---|" * len(methods)]
    for lr in sorted(table):
        cells = [f"{lr:g}"]
        for m in methods:
            e = table[lr].get(m)
            if e is None:
                cells += ["not run", "", ""]
                continue
            acc = ("diverged at round " + str(e["diverged"]) if e["status"] == "diverged"
                   else f"{e['acc']:.4f}")
            cells += [acc, f"{e['best']:.4f}" if e["best"] is not None else "n/a",
                      "yes" if e["died"] else "no"]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for m in methods:
        runs = {lr: e[m] for lr, e in table.items() if m in e}
        alive = {lr: e for lr, e in runs.items() if not e["died"] and e["acc"] is not None}
        best = max(alive, key=lambda lr: alive[lr]["acc"]) if alive else None
        dead = [lr for lr, e in runs.items() if e["died"]]
        threshold = min(dead) if dead else None
        best_text = "none" if best is None else f"{best:g} ({alive[best]['acc']:.4f})"
        thr_text = (f"> {max(runs):g}" if threshold is None else f"{threshold:g}")
        out.append(f"- {m}: best lr {best_text}; threshold lr {thr_text}")
    return "\n".join(out)


def _config_rounds(run: Path) -> int:
    for line in (run / "config.yaml").read_text().splitlines():
        if line.startswith("rounds:"):
            return int(line.split(":", 1)[1])
    raise ValueError(f"{run / 'config.yaml'}: no rounds")


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sweeps/paper003_lr")))
