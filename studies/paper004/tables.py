"""Paper 004 tables from the studies' results.json: rounds to several test accuracies per
method and setting, and speed-ups (rounds of a reference method / rounds of a method).

    python studies/paper004/tables.py [RESULTS_DIR]      # default docs/results

Every number is read from docs/results/paper004_*/results.json (the per-seed curves, so
rounds are multiples of the study's eval_every); with several seeds, accuracies are means
and rounds are means over the seeds that reached the target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = (0.65, 0.70, 0.75, 0.80)


def first_round(curve: dict, target: float) -> int | None:
    for rnd, acc in zip(curve["round"], curve["test_acc"]):
        if acc >= target:
            return rnd
    return None


def load(results_dir: Path, study: str) -> dict | None:
    path = results_dir / f"paper004_{study}" / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def rows(summary: dict) -> list[dict]:
    """One row per run: final and best accuracy (mean over seeds) and, per target, the
    mean rounds over the seeds that reached it, with how many did."""
    out = []
    for run in summary["runs"]:
        seeds = run["per_seed"]
        # explicit labels carry their grid point, "FedAvg (participation.clients_per_round=4)"
        row = {"label": run["line_label"].split(" (")[0], "group": run["group"],
               "n": len(seeds),
               "final": sum(s["final_test_acc"] for s in seeds) / len(seeds),
               "best": sum(s["best_test_acc"] for s in seeds) / len(seeds)}
        for t in TARGETS:
            got = [r for r in (first_round(s["curve"], t) for s in seeds) if r is not None]
            row[t] = (sum(got) / len(got), len(got)) if got else None
        out.append(row)
    return out


def cell(value, n: int = 1) -> str:
    if value is None:
        return "not reached"
    mean, k = value
    text = f"{mean:g}"
    return text if k == n else f"{text} ({k}/{n} seeds)"


def ratio(ref, value) -> str:
    if ref is None or value is None:
        return "-"
    return f"{ref[0] / value[0]:.2f}x"


def table(summary: dict) -> str:
    group_key = summary.get("group_by")
    head = ([group_key] if group_key else []) + ["method", "final acc", "best acc"]
    head += [f"rounds to {t:g}" for t in TARGETS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows(summary):
        row = ([str(r["group"])] if group_key else []) + [
            r["label"], f"{r['final']:.4f}", f"{r['best']:.4f}"]
        row += [cell(r[t], r["n"]) for t in TARGETS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def speedups(summary: dict, refs=("FedAvg", "CLG-SGD")) -> str:
    """Per group and target: rounds of each method and its speed-up over each reference."""
    by_group: dict = {}
    for r in rows(summary):
        by_group.setdefault(r["group"], {})[r["label"]] = r
    head = [summary.get("group_by") or "group", "target", "method", "rounds"]
    head += [f"speed-up over {ref}" for ref in refs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, methods in by_group.items():
        for t in TARGETS:
            for label, r in methods.items():
                row = [str(group), f"{t:g}", label, cell(r[t], r["n"])]
                row += [ratio(methods[ref][t], r[t]) if ref in methods else "-"
                        for ref in refs]
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    results_dir = Path(argv[1]) if len(argv) > 1 else Path("docs/results")
    for study in ("comparison", "participation", "server_data_size", "shift",
                  "local_steps", "server_epochs", "client_lr", "fixed_pool"):
        summary = load(results_dir, study)
        if summary is None:
            print(f"## {study}: no results yet\n")
            continue
        print(f"## {study} (target in the study table: {summary['target_accuracy']})\n")
        print(table(summary) + "\n")
        if study in ("participation", "client_lr"):
            print(speedups(summary) + "\n")


if __name__ == "__main__":
    main(sys.argv)
