"""Tables and plots of the paper 001 LLM studies (llm_memory.py, llm_tau_cut.py).

    .venv/bin/python studies/paper001/llm_report.py [DIR]   # writes DIR/paper001_llm_*.{md,png}

reads the JSON files of llm_memory.py and llm_tau_cut.py in ``DIR`` and writes the tables
and plots there (default ``runs/studies/paper001_llm``; the committed
``docs/results/paper001_llm_*`` were made with ``DIR`` = ``docs/results``).
"""

import json
import sys
from pathlib import Path

import numpy as np

from splitfed.study import provenance_line, recorded_provenance

RESULTS = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/studies/paper001_llm")
PAPER_GB = {"fedavg": 8.02, "fedlora": 5.64, "musplitfed": 1.05}


def rounds_to(curve, target):
    return next((r for r, acc in curve if acc >= target), None)


def made_by(records) -> str:
    """Which code made ``records`` (provenance records, None where a run has none), as
    a study table says it."""
    return provenance_line(recorded_provenance(records))


def tau_cut_table(target=0.85, final=True, plot=True) -> str:
    path = RESULTS / "paper001_llm_tau_cut.json"
    if not path.exists():
        return ""
    raw = json.loads(path.read_text())
    res = raw.get("runs", raw)                # the first format held the curves alone
    keys = [tuple(int(v) for v in k.split(",")) for k in res]
    cuts, taus = sorted({k[0] for k in keys}), sorted({k[1] for k in keys})
    seeds = sorted({k[2] for k in keys})
    prov = raw.get("provenance", {}) if "runs" in raw else {}
    lines = [made_by([prov.get(k) for k in res]), "",
             f"Rounds to {target:.0%} test accuracy (mean over seeds {seeds}; '-' not reached "
             f"in 150 rounds by any seed; a seed that never reaches it counts as 150; "
             f"per seed in brackets)", "",
             "| Lc | " + " | ".join(f"tau={t}" for t in taus) + " |",
             "|---|" + "---|" * len(taus)]
    means = {}
    for c in cuts:
        cells = []
        for t in taus:
            per = [rounds_to(res[f"{c},{t},{s}"], target) for s in seeds
                   if f"{c},{t},{s}" in res]
            if not per or all(p is None for p in per):
                cells.append("-")
                continue
            mean = float(np.mean([150 if p is None else p for p in per]))
            means[(c, t)] = mean
            cells.append(f"{mean:.0f} ({', '.join('-' if p is None else str(p) for p in per)})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "Final test accuracy after 150 rounds (mean over seeds)", "",
              "| Lc | " + " | ".join(f"tau={t}" for t in taus) + " |",
              "|---|" + "---|" * len(taus)] if final else []
    for c in cuts if final else []:
        cells = []
        for t in taus:
            fin = [res[f"{c},{t},{s}"][-1][1] for s in seeds if f"{c},{t},{s}" in res]
            cells.append(f"{100 * np.mean(fin):.1f}" if fin else "")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    try:
        if not plot:
            raise ImportError
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for c in cuts:
            xs = [t for t in taus if (c, t) in means]
            ax.plot(xs, [means[(c, t)] for t in xs], marker="o", label=f"Lc={c}")
        ax.set_xlabel("tau (server steps per round)")
        ax.set_ylabel(f"rounds to {target:.0%}")
        ax.legend()
        ax.set_title(f"MU-Split, tiny OPT, marker task (mean of {len(seeds)} seeds)")
        fig.tight_layout()
        fig.savefig(RESULTS / f"paper001_llm_tau_cut_{round(100 * target)}.png", dpi=120)
    except ImportError:
        pass
    return "\n".join(lines) + "\n"


def memory_table() -> str:
    lines = []
    for path in sorted(RESULTS.glob("paper001_llm_memory_*.json")):
        rows = json.loads(path.read_text())
        base = next((r["peak_mb"] for r in rows if r["method"] == "fedavg"), None)
        r0 = rows[0]
        lines += [f"{r0['options']['preset']}, {r0['options']['dtype']}, batch "
                  f"{r0['batch_size']} x {r0['seq_len']} tokens ({path.name}). "
                  + made_by([r.get("provenance") for r in rows]), "",
                  "| method | client holds | params MB | grads MB | other MB | peak MB "
                  "| / FedAvg | paper / FedAvg |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            what = {"fedavg": "whole model", "fedlora": "whole model + LoRA r=8"}.get(
                r["method"], f"embeddings + {r['cut']} blocks, ZO {r['zo_mode']}")
            ratio = f"{r['peak_mb'] / base:.2f}" if base else ""
            paper = f"{PAPER_GB[r['method']] / PAPER_GB['fedavg']:.2f}"
            lines.append(f"| {r['method']} | {what} | {r['params_mb']:.0f} | "
                         f"{r['grads_mb']:.0f} | {r['other_mb']:.0f} | {r['peak_mb']:.0f} | "
                         f"{ratio} | {paper} |")
        lines.append("")
    return "\n".join(lines)


def main():
    text = ("<!-- generated by studies/paper001/llm_report.py -->\n\n## Client peak memory "
            "(measured)\n\n" + memory_table() + "\n## Rounds to target\n\n"
            + tau_cut_table(0.90) + "\n" + tau_cut_table(0.85, final=False))
    (RESULTS / "paper001_llm_tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
