"""Paper 004 tables from the studies' results.json: rounds to several test accuracies per
method and setting, and speed-ups (rounds of a reference method / rounds of a method).

    python studies/paper004/tables.py [RESULTS_DIR]      # default docs/results

Every number is read from docs/results/paper004_*/results.json (the per-seed curves, so
rounds are multiples of the study's eval_every); with several seeds, accuracies are means
and rounds are means over the seeds that reached the target.

The Table I analogue (table1_tuning.yaml, then table1.yaml; the finer FedCLG grid
table1_fine_tuning.yaml, then a study named paper004_table1_fine with its chosen rates at
M = 4, paper004_table1_fine_m with them at M = 6 and paper004_table1_fine_m24 at M = 24)
gets two more tables each:

- tuning: per method and (eta, gamma), the rounds to the target over the tuning seeds, and
  the rates chosen per method (every tuning seed reached the target, fewest mean rounds;
  ties: higher mean best accuracy), printed as the ``runs`` of table1.yaml;
- Table I: per M and method, rounds to the target (mean +- std over seeds), and the
  speed-up over CLG-SGD twice: the paper's way, the ratio of the mean rounds, and per
  seed, CLG-SGD's rounds over the method's with the same seed (same partition, server
  pool and cohorts), given as mean +- std [min, max] over the seeds where both reached
  the target.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

TARGETS = (0.65, 0.70, 0.75, 0.80)
TABLE1_TARGETS = (0.75, 0.78, 0.80, 0.82)      # around table1.yaml's target_accuracy
REFERENCE = "CLG-SGD"


def first_round(curve: dict, target: float) -> int | None:
    for rnd, acc in zip(curve["round"], curve["test_acc"]):
        if acc >= target:
            return rnd
    return None


def load(results_dir: Path, study: str) -> dict | None:
    path = results_dir / f"paper004_{study}" / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def rows(summary: dict, targets=TARGETS) -> list[dict]:
    """One row per run: final and best accuracy (mean over seeds) and, per target, the
    mean rounds over the seeds that reached it, with how many did."""
    out = []
    for run in summary["runs"]:
        seeds = run["per_seed"]
        # explicit labels carry their grid point, "FedAvg (participation.clients_per_round=4)"
        row = {"label": run["line_label"].split(" (")[0], "group": run["group"],
               "n": len(seeds),
               "final": _mean([s["final_test_acc"] for s in seeds]),
               "best": sum(s["best_test_acc"] for s in seeds) / len(seeds)}
        for t in targets:
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


def _mean(values) -> float | None:
    """The mean of the values that are not None (a diverged seed has no final accuracy)."""
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def table(summary: dict, targets=TARGETS) -> str:
    group_key = summary.get("group_by")
    head = ([group_key] if group_key else []) + ["method", "final acc", "best acc"]
    head += [f"rounds to {t:g}" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows(summary, targets):
        final = "diverged" if r["final"] is None else f"{r['final']:.4f}"
        row = ([str(r["group"])] if group_key else []) + [r["label"], final, f"{r['best']:.4f}"]
        row += [cell(r[t], r["n"]) for t in targets]
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


# ----------------------------------------------------------------------------- Table I


def seed_rounds(run: dict, target: float) -> dict[int, int | None]:
    """Per seed: the first evaluated round with test accuracy >= target (None: never)."""
    return {s["seed"]: first_round(s["curve"], target) for s in run["per_seed"]}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def rounds_cell(rounds: dict[int, int | None]) -> str:
    """Mean +- std of the rounds over the seeds that reached the target, (k/n) if not all."""
    got = [r for r in rounds.values() if r is not None]
    if not got:
        return "not reached"
    s = spread(got)
    text = f"{s['mean']:.1f} ± {s['std']:.1f}" if s["n"] > 1 else f"{s['mean']:g}"
    return text if len(got) == len(rounds) else f"{text} ({len(got)}/{len(rounds)} seeds)"


def speedup(ref: dict[int, int | None], own: dict[int, int | None]) -> tuple[str, str]:
    """The speed-up of a method over the reference: the ratio of the mean rounds (over
    the seeds each reached the target in), and the per-seed ratios ref/own over the seeds
    both reached it in, as mean +- std [min, max]."""
    ref_got = [r for r in ref.values() if r is not None]
    own_got = [r for r in own.values() if r is not None]
    of_means = (f"{(sum(ref_got) / len(ref_got)) / (sum(own_got) / len(own_got)):.2f}x"
                if ref_got and own_got else "-")
    pairs = [ref[s] / own[s] for s in own
             if s in ref and ref[s] is not None and own[s] is not None]
    if not pairs:
        return of_means, "-"
    s = spread(pairs)
    text = (f"{s['mean']:.2f}x ± {s['std']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"
            if s["n"] > 1 else f"{s['mean']:.2f}x")
    return of_means, text if s["n"] == len(own) else f"{text} ({s['n']}/{len(own)} seeds)"


def table1(summary: dict, targets=TABLE1_TARGETS, ref: str = REFERENCE) -> str:
    """Paper 004 Table I's layout: per M (the group), target and method, the rounds to the
    target over the seeds and the speed-ups over ``ref`` (the paper's "(1.74x)")."""
    by_group: dict = {}
    for run in summary["runs"]:
        by_group.setdefault(run["group"], {})[run["line_label"].split(" (")[0]] = run
    head = [summary.get("group_by") or "group", "target", "method", "seeds",
            "rounds (mean ± std)", f"speed-up over {ref} (ratio of means)",
            f"speed-up over {ref} per seed (mean ± std [min, max])"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, methods in by_group.items():
        for t in targets:
            base = seed_rounds(methods[ref], t) if ref in methods else None
            for label, run in methods.items():
                own = seed_rounds(run, t)
                ratio_of_means, per_seed = speedup(base, own) if base else ("-", "-")
                lines.append("| " + " | ".join([
                    str(group), f"{t:g}", label, str(len(own)), rounds_cell(own),
                    ratio_of_means, per_seed]) + " |")
    return "\n".join(lines)


RATE = re.compile(r"([\w.]+)=([^,)]+)")


def tuning(summary: dict, target: float | None = None) -> tuple[str, dict]:
    """Rounds to ``target`` (default: the study's) per method and (eta, gamma), over the
    tuning seeds, and the rates chosen per method: every seed reached the target, fewest
    mean rounds, ties to the higher mean best accuracy."""
    target = summary["target_accuracy"] if target is None else target
    head = ["method", "eta (train.lr)", "gamma (algorithm.server_lr)", "rounds to "
            f"{target:g}", "final acc", "best acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    chosen: dict[str, tuple] = {}
    for run in summary["runs"]:
        method = run["label"].split(" (")[0]
        rates = dict(RATE.findall(run["label"]))
        eta, gamma = rates.get("train.lr", "?"), rates.get("algorithm.server_lr", "?")
        rounds = seed_rounds(run, target)
        seeds = run["per_seed"]
        final = _mean([s["final_test_acc"] for s in seeds])
        best = sum(s["best_test_acc"] for s in seeds) / len(seeds)
        dead = sum(s.get("status") == "diverged" for s in seeds)
        final_cell = "diverged" if final is None else f"{final:.4f}"
        if final is not None and dead:
            final_cell += f" ({len(seeds) - dead}/{len(seeds)} seeds; {dead} diverged)"
        lines.append("| " + " | ".join([
            method, eta, gamma, rounds_cell(rounds), final_cell, f"{best:.4f}"]) + " |")
        if all(r is not None for r in rounds.values()):
            key = (sum(rounds.values()) / len(rounds), -best)
            if method not in chosen or key < chosen[method][0]:
                chosen[method] = (key, eta, gamma)
    return "\n".join(lines), {m: (eta, gamma) for m, (_, eta, gamma) in chosen.items()}


ALGORITHM = {"CLG-SGD": "clgsgd", "FedCLG-S": "fedclg_s", "FedCLG-C": "fedclg_c"}


def chosen_runs(chosen: dict) -> str:
    """The ``runs`` of table1.yaml for the chosen rates."""
    out = ["runs:"]
    for method, (eta, gamma) in chosen.items():
        sets = [f"algorithm.name={ALGORITHM.get(method, method)}", f"train.lr={eta}",
                f"algorithm.server_lr={gamma}"]
        if method.startswith("FedCLG"):
            sets.append("algorithm.server_gradient=full")
        out.append(f"  - {{label: {method}, set: [{', '.join(sets)}]}}")
    return "\n".join(out)


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
    tunings = [(study, summary) for study in ("table1_tuning", "table1_fine_tuning")
               if (summary := load(results_dir, study)) is not None]
    if not tunings:
        print("## table1_tuning: no results yet\n")
    for study, summary in tunings:
        text, chosen = tuning(summary)
        print(f"## {study} (target {summary['target_accuracy']:g})\n\n{text}\n")
        print(f"Chosen rates on {study} alone:\n\n```yaml\n" + chosen_runs(chosen)
              + "\n```\n")
        missing = sorted(set(ALGORITHM) - set(chosen))
        if missing:
            print(f"No rate reached the target in every tuning seed: {', '.join(missing)}\n")
    if len(tunings) > 1:
        merged = {**tunings[0][1], "runs": [r for _, s in tunings for r in s["runs"]]}
        _, chosen = tuning(merged)
        print("Chosen rates over both tuning grids (the FedCLG runs of paper004_table1_fine):"
              "\n\n```yaml\n" + chosen_runs(chosen) + "\n```\n")
    for study in ("table1", "table1_fine", "table1_fine_m", "table1_fine_m24"):
        summary = load(results_dir, study)
        if summary is None:
            print(f"## {study}: no results yet\n")
            continue
        print(f"## {study} (target in the study table: {summary['target_accuracy']})\n")
        print(table(summary, TABLE1_TARGETS) + "\n")
        print(table1(summary) + "\n")

if __name__ == "__main__":
    main(sys.argv)
