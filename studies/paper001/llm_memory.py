"""Paper 001 Fig. 4 analogue: client peak memory of FedAvg, FedLoRA and MU-SplitFed.

Measured: the OPT-125m architecture (12 blocks, hidden 768) with random weights in
float32, SST-2-like batches of 8 sequences of 64 tokens, one client step each, every
method in a fresh process (benchmarks/client_memory.py: peak RSS delta). ``--preset opt-1.3b
--dtype bfloat16 --batch-size 4`` measures OPT-1.3B (about 6 GB for FedAvg; one step takes
many CPU minutes). docs/results/paper001_llm.md adds the analytic accounting for OPT-1.3B.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python studies/paper001/llm_memory.py [--out-dir DIR]

writes ``DIR/paper001_llm_memory_<preset>_<dtype>_b<batch>.json`` (default
``runs/studies/paper001_llm``; the committed files in ``docs/results`` were made with
``--out-dir docs/results``). Each record carries the provenance of the code that measured
it (splitfed.provenance).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # the repository root
from benchmarks.client_memory import client_peak_memory  # noqa: E402
from splitfed.provenance import provenance  # noqa: E402

import argparse

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--preset", default="opt-125m")
ARGS.add_argument("--dtype", default="float32")
ARGS.add_argument("--batch-size", type=int, default=8)
ARGS.add_argument("--only", default=None, help="measure only this method")
ARGS.add_argument("--out-dir", default="runs/studies/paper001_llm")
A = ARGS.parse_args()
OUT = Path(A.out_dir) / f"paper001_llm_memory_{A.preset}_{A.dtype}_b{A.batch_size}.json"
OPTIONS = {"preset": A.preset, "dtype": A.dtype}
RUNS = [("fedavg", None, "engine"), ("fedlora", None, "engine"),
        ("musplitfed", 2, "engine"), ("musplitfed", 2, "inplace"),
        ("musplitfed", 1, "inplace"), ("musplitfed", 4, "inplace")]


def main():
    OUT.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(OUT.read_text()) if OUT.exists() else []
    done = {(r["method"], r["cut"], r["zo_mode"]) for r in results}
    for method, cut, zo_mode in RUNS:
        key = (method, cut, zo_mode if method == "musplitfed" else None)
        if key in done or A.only not in (None, method):
            continue
        t = time.time()
        r = client_peak_memory(method, "opt", OPTIONS, seq_len=64, batch_size=A.batch_size,
                               cut=cut,
                               steps=1, zo_mode=zo_mode)
        r["wall_s"] = round(time.time() - t, 1)
        r["provenance"] = provenance()
        print(json.dumps(r), flush=True, file=sys.stderr)
        results.append(r)
        OUT.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
