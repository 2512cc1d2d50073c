"""Bar chart of the client peak-memory records of ``llm_memory.py`` (Fig. 4 analogue).

    python studies/paper001/llm_memory_plot.py \
        docs/results/paper001_llm_memory_opt-1.3b_bfloat16_b2.json \
        docs/results/paper001_llm_memory_opt-1.3b_bfloat16_b2.png

Stacked bars per method: parameters, gradients and optimizer state (accounted) and the
rest of the measured peak (activations, temporaries); the ratio to FedAvg above each bar
next to paper 001 Fig. 4's ratio (FedAvg 8.02 GB, FedLoRA 5.64 GB, MU-SplitFed 1.05 GB).
"""

from __future__ import annotations

import json
import sys

from matplotlib.figure import Figure

PAPER_GB = {"fedavg": 8.02, "fedlora": 5.64, "musplitfed": 1.05}
PARTS = [("params_mb", "parameters"), ("grads_mb", "gradients"),
         ("optimizer_mb", "optimizer state"), ("other_mb", "activations and other")]


def label(r: dict) -> str:
    name = {"fedavg": "FedAvg", "fedlora": "FedLoRA", "musplitfed": "MU-SplitFed"}[r["method"]]
    if r["method"] == "musplitfed":
        name += f"\nLc={r['cut']}, " + ("in_place" if r["zo_mode"] == "inplace" else "default")
    return name


def main(src: str, out: str) -> None:
    records = json.load(open(src, encoding="utf-8"))
    base = next(r["peak_mb"] for r in records if r["method"] == "fedavg")
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    xs = range(len(records))
    bottom = [0.0] * len(records)
    for key, name in PARTS:
        vals = [max(r[key], 0.0) for r in records]
        ax.bar(xs, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in zip(xs, records):
        paper = PAPER_GB[r["method"]] / PAPER_GB["fedavg"]
        ax.text(x, r["peak_mb"], f"{r['peak_mb'] / base:.2f}x\n(paper {paper:.2f}x)",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [label(r) for r in records], fontsize=8)
    ax.set_ylabel("client peak memory (MiB)")
    ax.set_ylim(0, max(r["peak_mb"] for r in records) * 1.25)
    r0 = records[0]
    ax.set_title(f"OPT-1.3B architecture, {r0['options'].get('dtype', 'float32')}, batch "
                 f"{r0['batch_size']} x {r0['seq_len']} tokens ({r0['measured_by']})",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
