"""Paper 001 Table 4 analogue: MU-Split (MU-SplitFed with one client) rounds to 85% test
accuracy for tau in 1..6 and cut layers Lc in 1..3.

Model and task: a tiny OPT (4 decoder blocks, hidden 32, 4 heads, FFN 64, vocabulary 64)
on the synthetic marker task (label: does token 4 occur; 2,000 training and 500 test
sequences of 4..16 tokens). As the paper fine-tunes a pretrained OPT, the model is first
pretrained with first-order Adam (lr 3e-3, batch 32, 25 steps) on an independent draw of
the task, to about 70% test accuracy, saved with ``save_pretrained`` and loaded with
``model.pretrained``. MU-Split then fine-tunes it with zeroth order on both sides and
paper 001's Table 6 rates (eta_c 0.005, eta_s 0.01, eta_g 0.3, lambda 0.005), batch 32,
150 rounds, test accuracy every 5 rounds, seeds 0, 1, 2 (results are
resumed from the JSON file: ``runs`` maps "cut,tau,seed" to the (round, test accuracy)
curve, ``provenance`` the same keys to the record of the code that made each run,
splitfed.provenance).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python studies/paper001/llm_tau_cut.py [OUT_DIR]

writes ``OUT_DIR/paper001_llm_tau_cut.json`` (default ``runs/studies/paper001_llm``; the
committed ``docs/results/paper001_llm_tau_cut.json`` was made with ``OUT_DIR`` =
``docs/results``).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from splitfed.config import build_config
from splitfed.data import load_dataset
from splitfed.experiment import run_experiment
from splitfed.models import build_model
from splitfed.models.transformer import save_pretrained
from splitfed.provenance import provenance

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/studies/paper001_llm") / \
    "paper001_llm_tau_cut.json"
CHECKPOINT = Path("runs/paper001_tiny_opt_pretrained")
CUTS, TAUS, SEEDS, ROUNDS, TARGET = [1, 2, 3], [1, 2, 3, 4, 5, 6], [0, 1, 2], 150, 0.85
SIZES = {"vocab_size": 64, "num_layers": 4}


def pretrain(steps: int = 25) -> None:
    """First-order pretraining on an independent draw of the task (seed 1000)."""
    torch.manual_seed(0)
    data = load_dataset("synthetic_text", rng=np.random.default_rng(1000), vocab_size=64,
                        seq_len=16)
    model = build_model("opt", (2, 16), 2, **SIZES)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(data.train), (32,), generator=g)
        loss = F.cross_entropy(model(data.train.x[idx]), data.train.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, CHECKPOINT)


def config(cut: int, tau: int, seed: int):
    return build_config({
        "name": f"mu_split_cut{cut}_tau{tau}_seed{seed}", "seed": seed, "rounds": ROUNDS,
        "eval_every": 5, "progress": False,
        "algorithm": {"name": "musplitfed", "tau": tau, "server_lr": 0.01, "global_lr": 0.3,
                      "smoothing": 0.005},
        "data": {"name": "synthetic_text", "vocab_size": 64, "seq_len": 16},
        "partition": {"scheme": "iid", "num_clients": 1},
        "model": {"name": "opt", "pretrained": str(CHECKPOINT), "cut": cut},
        "train": {"batch_size": 32, "local_steps": 1, "local_epochs": None, "lr": 0.005},
        "participation": {"mode": "full"}})


def main():
    if not (CHECKPOINT / "config.json").exists():
        pretrain()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    if "runs" not in results:                 # the first format: the curves alone
        results = {"runs": results, "provenance": {}}
    made_by = provenance()
    for seed in SEEDS:
        for cut in CUTS:
            for tau in TAUS:
                key = f"{cut},{tau},{seed}"
                if key in results["runs"]:
                    continue
                res = run_experiment(config(cut, tau, seed), write=False)
                curve = [(r["round"], r["test_acc"]) for r in res.records if "test_acc" in r]
                results["runs"][key], results["provenance"][key] = curve, made_by
                print(key, res.status, curve[-1], file=sys.stderr, flush=True)
                OUT.write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
