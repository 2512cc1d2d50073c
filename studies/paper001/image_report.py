"""Tables of the paper 001 image studies (table1.yaml, tau_lr.yaml, cut_tau.yaml,
adaptive_tau.yaml, table1_scaled.yaml) from the runs' metrics: what
docs/results/paper001.md quotes.

    .venv/bin/python studies/paper001/image_report.py [STUDIES_DIR] > /tmp/paper001_tables.md

``STUDIES_DIR`` is where ``splitfed study`` put the study directories (default
``runs/studies``; the run directories are not committed, so the studies must have been
run on this machine). Per run directory ``<STUDIES_DIR>/<study>/runs/<label>-s<seed>/``
(``metrics.jsonl`` and ``summary.json``): the final
test accuracy, the mean of the last ``LAST`` evaluations (the curves are noisy: a
zeroth-order step has a large variance), the best, the first round (and simulated time)
at which the test accuracy reached ``TARGET``, and the test loss at the end.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from splitfed.study import (diverged_round, read_records, rounds_to_target, sim_time,
                            time_to_target)

RESULTS = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/studies")
TARGET = 0.5
LAST = 5


def load(study: str) -> dict[str, dict[int, tuple[list[dict], str]]]:
    """label -> seed -> (records, status), for every finished run of ``study``."""
    runs: dict[str, dict[int, tuple[list[dict], str]]] = defaultdict(dict)
    for d in sorted((RESULTS / study / "runs").glob("*-s*")):
        summary = d / "summary.json"
        if not summary.is_file():
            continue
        label, seed = d.name.rsplit("-s", 1)
        status = json.loads(summary.read_text())["status"]
        runs[label][int(seed)] = (read_records(d / "metrics.jsonl"), status)
    return runs


def stats(run: tuple[list[dict], str]) -> dict:
    """One run's numbers; the round it diverged at by the project's one definition
    (:func:`splitfed.study.diverged_round`)."""
    records, status = run
    ev = [r for r in records if "test_acc" in r]
    acc = [r["test_acc"] for r in ev]
    return {"final": acc[-1], "last": float(np.mean(acc[-LAST:])), "best": max(acc),
            "diverged": diverged_round(records, status),
            "to_target": rounds_to_target(ev, TARGET),
            "time_to_target": time_to_target(ev, TARGET),
            "loss": ev[-1]["test_loss"], "rounds": max(r["round"] for r in records),
            "sim_s": sim_time(records) or 0.0,
            "taus": [r["tau"] for r in records if "tau" in r]}


def cell(values, fmt="{:.3f}") -> str:
    """mean (per seed) of the non-missing values; '-' where none reached. A diverged
    run's values are those of its last evaluation before the non-finite loss."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    text = fmt.format(np.mean(vals))
    if len(values) > 1:
        per = ", ".join("-" if v is None else fmt.format(v) for v in values)
        text += f" ({per})"
    if len(vals) < len(values):
        text += f" [{len(vals)}/{len(values)} reached]"
    return text


def pretty(label: str) -> str:
    """A run directory's label as the docs write it."""
    fixed = {"gas": "GAS", "vanilla-tau-1": "vanilla (tau = 1)",
             "adaptive-tau-eq.-12": "adaptive tau (eq. 12)",
             "tau-4-eta_s-tau": "tau = 4, eta_s / tau",
             "adaptive-tau-eta_s-tau": "adaptive tau, eta_s / tau"}
    if label in fixed:
        return fixed[label]
    label = label.replace("-eta_s-tau", ", eta_s / tau")
    label = label.replace("mu-splitfed-", "MU-SplitFed ").replace("model.cut-", "Lc = ")
    label = label.replace("-algorithm.tau-", ", tau = ").replace("-eta_s-", ", eta_s = ")
    return label.replace("tau-", "tau = ")


def table(study: str, order=None) -> str:
    runs = load(study)
    labels = order or sorted(runs)
    lines = [f"| run | seeds | final acc | mean of last {LAST} evals | best acc | "
             f"round to {TARGET:.0%} | sim. s to {TARGET:.0%} | final test loss | "
             "sim. s per round | diverged (round) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        if label not in runs:
            continue
        per = [stats(runs[label][s]) for s in sorted(runs[label])]
        lines.append(" | ".join([
            f"| {pretty(label)}", ",".join(map(str, sorted(runs[label]))),
            cell([p["final"] for p in per]), cell([p["last"] for p in per]),
            cell([p["best"] for p in per]),
            cell([p["to_target"] for p in per], "{:.0f}"),
            cell([p["time_to_target"] for p in per], "{:.0f}"),
            cell([p["loss"] for p in per]),
            cell([p["sim_s"] / p["rounds"] for p in per], "{:.2f}"),
            ", ".join(f"seed {s}: {p['diverged']}" for s, p in zip(sorted(runs[label]), per)
                      if p["diverged"]) or "-"]) + " |")
    return "\n".join(lines)


def tau_histogram(study: str) -> str:
    lines = []
    for label, seeds in sorted(load(study).items()):
        for seed, run in sorted(seeds.items()):
            taus = stats(run)["taus"]
            if taus and len(set(taus)) > 1:
                values, counts = np.unique(taus, return_counts=True)
                lines.append(f"- {label} (seed {seed}): tau " + ", ".join(
                    f"{v} in {c} rounds" for v, c in zip(values, counts))
                    + f"; mean {np.mean(taus):.2f}")
    return "\n".join(lines)


def main() -> None:
    out = sys.stdout
    order = ["gas", "vanilla-tau-1", "mu-splitfed-tau-2", "mu-splitfed-tau-3",
             "mu-splitfed-tau-4"]
    print("## Table 1 (paper001_table1)\n", file=out)
    print(table("paper001_table1", order), file=out)
    print("\n## Table 1 with eta_s = 0.001 / tau (paper001_tau_lr)\n", file=out)
    print(table("paper001_tau_lr"), file=out)
    print("\n## tau x cut (paper001_cut_tau)\n", file=out)
    print(table("paper001_cut_tau"), file=out)
    print("\n## adaptive tau (paper001_adaptive_tau)\n", file=out)
    print(table("paper001_adaptive_tau", ["vanilla-tau-1", "tau-2", "tau-4", "tau-4-eta_s-tau",
                                          "adaptive-tau-eq.-12", "adaptive-tau-eta_s-tau"]),
          file=out)
    print("", file=out)
    print(tau_histogram("paper001_adaptive_tau"), file=out)
    scaled = order + [f"mu-splitfed-tau-{t}-eta_s-tau" for t in (2, 3, 4)]
    print("\n## Table 1 at width 0.125, all of Fashion-MNIST (paper001_table1_scaled)\n",
          file=out)
    print(table("paper001_table1_scaled", scaled), file=out)


if __name__ == "__main__":
    main()
