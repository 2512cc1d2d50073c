"""Paper 004 tables from the studies' results.json: rounds to several test accuracies per
method and setting, and speed-ups (rounds of a reference method / rounds of a method).

    python studies/paper004/tables.py [RESULTS_DIR]      # default docs/results

Every number is read from docs/results/paper004_*/results.json (the per-seed curves, so
rounds are multiples of the study's eval_every); nothing is computed from a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = (0.70, 0.75, 0.80)


def first_round(curve: dict, target: float) -> int | None:
    for rnd, acc in zip(curve["round"], curve["test_acc"]):
        if acc >= target:
            return rnd
    return None


def load(results_dir: Path, study: str) -> dict | None:
    path = results_dir / f"paper004_{study}" / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def rows(summary: dict) -> list[dict]:
    out = []
    for run in summary["runs"]:
        seed = run["per_seed"][0]  # one seed per run in these studies
        out.append({"label": run["line_label"], "group": run["group"],
                    "final": seed["final_test_acc"], "best": seed["best_test_acc"],
                    "rounds": seed["rounds"],
                    **{t: first_round(seed["curve"], t) for t in TARGETS}})
    return out


def cell(value) -> str:
    return "not reached" if value is None else str(value)


def ratio(ref, value) -> str:
    if ref is None or value is None:
        return "-"
    return f"{ref / value:.2f}x"


def table(summary: dict) -> str:
    group_key = summary.get("group_by")
    head = ([group_key] if group_key else []) + ["method", "final acc", "best acc"]
    head += [f"rounds to {t:g}" for t in TARGETS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows(summary):
        row = ([str(r["group"])] if group_key else []) + [
            r["label"], f"{r['final']:.4f}", f"{r['best']:.4f}"]
        row += [cell(r[t]) for t in TARGETS]
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
                row = [str(group), f"{t:g}", label, cell(r[t])]
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
        if study in ("participation", "comparison", "shift", "client_lr"):
            print(speedups(summary) + "\n")


if __name__ == "__main__":
    main(sys.argv)
