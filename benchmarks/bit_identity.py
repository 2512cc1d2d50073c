"""Bit-identity check for refactors: every algorithm's results, before and after.

Runs a fixed, explicit list of small cases (``cases()``: digits, mlp [32], 6 clients,
3 rounds; plus a BatchNorm resnet18 and a tiny split OPT on synthetic text) and
fingerprints each: sha256 of the final model tensors (name, dtype, shape, raw bytes),
sha256 of the per-round records without ``round_time_s`` (and of each record field, so
that a difference names its fields; floats by ``repr``: every bit
counts), the status and the final test accuracy. It uses only APIs that survive refactors
(build_config, build_environment, build_algorithm, run_rounds, MetricLogger, ALGORITHMS),
so the same script runs against the old tree and the new one (about 10 s on CPU)::

    PYTHONPATH=/path/to/old/src python -m benchmarks.bit_identity --save before.json
    python -m benchmarks.bit_identity --compare before.json    # exit 1 if any differs

``--only SUBSTRING`` keeps the cases whose name contains it; progress goes to stderr.
Single-threaded (torch.set_num_threads(1)) so that reductions run in one order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time

import numpy as np
import torch


import splitfed
from splitfed.algorithms import ALGORITHMS
from splitfed.config import build_config
from splitfed.engine.loop import run_rounds
from splitfed.experiment import build_algorithm, build_environment
from splitfed.metrics import MetricLogger

torch.set_num_threads(1)

BASE = {"name": "bitident", "rounds": 3, "progress": False, "seed": 11,
        "data": {"name": "digits"},
        "partition": {"scheme": "dirichlet", "num_clients": 6, "alpha": 1.0,
                      "min_partition_size": 5},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"batch_size": 16, "local_steps": 4, "local_epochs": None, "lr": 0.1},
        "participation": {"mode": "uniform", "clients_per_round": 3}}

# clients 2 and 5 compute 1000x slower (~thousands of simulated s against a few s):
# a 100 s deadline drops them whenever they are sampled (tests/algorithms/test_deadline_state.py)
DEADLINE = {"clock": {"profile": "fixed", "deadline": 100.0, "uplink": 1e4, "downlink": 4e4,
                      "client_compute": [1e5, 1e5, 1e2, 1e5, 1e5, 1e2],
                      "server_compute": 1e7}}

# (case name prefix, algorithm section): each gets every variant of VARIANTS
FAMILIES = [
    ("fedavg", {"name": "fedavg"}), ("fedprox", {"name": "fedprox", "mu": 0.1}),
    ("scaffold", {"name": "scaffold"}),
    ("fedopt_adam", {"name": "fedopt", "server_optimizer": "adam"}),
    ("fedopt_yogi", {"name": "fedopt", "server_optimizer": "yogi"}),
    ("fedopt_adagrad", {"name": "fedopt", "server_optimizer": "adagrad"}),
    ("clgsgd", {"name": "clgsgd"}), ("scaffold_plus", {"name": "scaffold_plus"}),
    ("fedclg_c", {"name": "fedclg_c"}),
    ("fedclg_s_first_batch", {"name": "fedclg_s", "client_gradient": "first_batch"}),
    ("fedclg_s_fresh_batch", {"name": "fedclg_s", "client_gradient": "fresh_batch"}),
    ("fedclg_s_full", {"name": "fedclg_s", "client_gradient": "full"}),
    ("server_only", {"name": "server_only"}), ("sl", {"name": "sl"}),
    ("sflv1", {"name": "sflv1"}), ("sflv2", {"name": "sflv2"}), ("csefsl", {"name": "csefsl"}),
]
HAS_GLOBAL_LR = {"fedavg", "fedprox", "scaffold", "clgsgd", "scaffold_plus", "fedclg_c",
                 "fedclg_s", "sl"}
VARIANTS = [
    ("", {}),
    ("momentum_wd", {"train": {"momentum": 0.9, "weight_decay": 1e-3}}),
    ("bernoulli", {"participation": {"mode": "bernoulli", "q": 0.5}}),
    ("with_replacement", {"participation": {"mode": "with_replacement",
                                            "clients_per_round": 4}}),
    ("local_epochs1", {"train": {"local_steps": None, "local_epochs": 1}}),
    ("deadline", DEADLINE),
]
BN_MODEL = {"model": {"name": "resnet18", "width": 4}}        # BatchNorm, fits 1x8x8
# the smallest split transformer of tests/test_llm.py, on synthetic token sequences
TEXT = {"data": {"name": "synthetic_text", "num_train": 64, "num_test": 32, "seq_len": 10,
                 "vocab_size": 40},
        "partition": {"scheme": "iid", "num_clients": 2}, "participation": {"mode": "full"},
        "model": {"name": "opt", "hidden_size": 16, "num_layers": 3, "num_heads": 2,
                  "ffn_dim": 32, "vocab_size": 40, "cut": 1},
        "train": {"batch_size": 8, "local_steps": 2, "lr": 0.05}}
NO_CLIENTS = {"server_only"}       # trains on server data only: client variants are moot


def cases() -> list[tuple[str, dict]]:
    out = []
    for prefix, algo in FAMILIES:
        for suffix, over in VARIANTS:
            if algo["name"] in NO_CLIENTS and suffix not in ("", "momentum_wd"):
                continue
            out.append((f"{prefix}__{suffix}" if suffix else prefix, {"algorithm": algo, **over}))
        if algo["name"] in HAS_GLOBAL_LR:
            out.append((f"{prefix}__global_lr", {"algorithm": {**algo, "global_lr": 0.5}}))
    out += [
        # every other algorithm, default options
        ("centralized", {"algorithm": {"name": "centralized"}}),
        ("centralized__momentum_wd", {"algorithm": {"name": "centralized"},
                                      "train": {"momentum": 0.9, "weight_decay": 1e-3}}),
        ("fedlora", {"algorithm": {"name": "fedlora", "rank": 2}}),
        ("gas", {"algorithm": {"name": "gas"}}),
        ("gas__first_order_server", {"algorithm": {"name": "gas", "server_order": "first"}}),
        ("musplitfed", {"algorithm": {"name": "musplitfed"}}),
        ("musplitfed__first_order", {"algorithm": {"name": "musplitfed", "client_order":
                                                   "first", "server_order": "first"}}),
        ("musplitfed__deadline", {"algorithm": {"name": "musplitfed"}, **DEADLINE}),
        ("fedlora__text_opt", {"algorithm": {"name": "fedlora", "rank": 2}, **TEXT}),
        ("fedavg__text_opt", {"algorithm": {"name": "fedavg"}, **TEXT}),
        ("musplitfed__text_opt", {"algorithm": {"name": "musplitfed", "tau": 3}, **TEXT}),
        # split-family options
        ("sflv1__server_period2", {"algorithm": {"name": "sflv1", "server_period": 2}}),
        ("sflv2__per_client", {"algorithm": {"name": "sflv2", "order": "per_client"}}),
        ("csefsl__options", {"rounds": 4, "algorithm": {
            "name": "csefsl", "period": 2, "server_feedback": False,
            "server_scale": "population", "order": "cohort", "aux": "mlp", "aux_hidden": 16}}),
    ]
    for name in ("fedavg", "sflv1", "sflv2", "sl"):
        out.append((f"{name}__batchnorm", {"algorithm": {"name": name}, **BN_MODEL}))
    return out


def config(over: dict):
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for key, value in over.items():
        if isinstance(value, dict) and not {"name", "scheme", "mode"} & set(value):
            value = {**raw.get(key, {}), **value}
        raw[key] = value                         # a named component replaces the section
    return build_config(raw)


def canonical(v):
    """JSON-able form of a record value in which floats keep every bit (repr)."""
    if isinstance(v, dict):
        return {str(k): canonical(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, torch.Tensor)):
        return [canonical(x) for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return "f:" + repr(float(v))
    return "?" + repr(v)


def model_hash(model: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(model):
        t = model[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def run_case(name: str, over: dict) -> dict:
    torch.manual_seed(0), np.random.seed(0), random.seed(0)   # no leak between cases
    cfg = config(over)
    env = build_environment(cfg)
    logger = MetricLogger(None)
    state, status = run_rounds(build_algorithm(cfg), env, logger)
    records = [{k: v for k, v in r.items() if k != "round_time_s"} for r in logger.records]
    blob = json.dumps(canonical(records), sort_keys=True).encode()
    accs = [r["test_acc"] for r in records if "test_acc" in r]
    dropped = int(sum(r.get("dropped", 0) for r in records))
    if name.endswith("deadline") and not dropped:
        print(f"WARNING: {name}: the deadline dropped no client", file=sys.stderr)
    model = state["model"] if "model" in state else state["module"]   # centralized: module
    model = model.state_dict() if isinstance(model, torch.nn.Module) else model
    keys = sorted({k for r in records for k in r})
    per_key = {k: hashlib.sha256(json.dumps(canonical([r.get(k) for r in records]))
                                 .encode()).hexdigest() for k in keys}
    return {"model": model_hash(model), "records": hashlib.sha256(blob).hexdigest(),
            "status": status, "final_test_acc": float(accs[-1]) if accs else None,
            "dropped": dropped, "record_keys": per_key}


def run_all(only: str | None) -> dict:
    todo = [(n, o) for n, o in cases() if only is None or only in n]
    covered = {o["algorithm"]["name"] for _, o in cases()}
    for missing in sorted(set(ALGORITHMS) - covered):
        print(f"WARNING: algorithm {missing} has no case", file=sys.stderr)
    print(f"splitfed from {splitfed.__file__}; {len(todo)} cases", file=sys.stderr)
    results, start = {}, time.perf_counter()
    for i, (name, over) in enumerate(todo, 1):
        t0 = time.perf_counter()
        try:
            results[name] = run_case(name, over)
        except Exception as e:                      # recorded: a case may break by design
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"ERROR: {name}: {results[name]['error']}", file=sys.stderr)
        print(f"[{i}/{len(todo)}] {name} {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    print(f"total {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return results


def read_saved(parser: argparse.ArgumentParser, path: str) -> dict:
    """The cases of a file written by ``--save``, or a usage error before any case runs."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        parser.error(f"--compare {path}: cannot read it ({e})")
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        parser.error(f"--compare {path}: not a file written by --save (an object of cases)")
    return saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="FILE")
    mode.add_argument("--compare", metavar="FILE")
    p.add_argument("--only", metavar="SUBSTRING")
    a = p.parse_args(argv)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "splitfed": splitfed.__file__}
    if a.save:
        results = {"_meta": meta, **run_all(a.only)}
        with open(a.save, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
        print(f"wrote {len(results) - 1} cases to {a.save}")
        return 0
    saved = read_saved(p, a.compare)
    if saved.get("_meta", {}).get("torch") != meta["torch"]:
        print(f"WARNING: saved with torch {saved.get('_meta', {}).get('torch')}, "
              f"running torch {meta['torch']}", file=sys.stderr)
    results, same = run_all(a.only), 0
    for name, got in results.items():
        want = saved.get(name, {"error": f"not in {a.compare}"})
        diff = [k for k in ("model", "records", "status") if got.get(k) != want.get(k)]
        if "records" in diff and "record_keys" in got and "record_keys" in want:
            g, w = got["record_keys"], want["record_keys"]
            keys = sorted(k for k in set(g) | set(w) if g.get(k) != w.get(k))
            diff[diff.index("records")] = "records: " + " ".join(keys)
        if "error" in got or "error" in want:      # never "same": a case that fails proves nothing
            diff = ["error: " + got.get("error", "none now; saved: " + want.get("error", ""))]
        same += not diff
        acc = f"; test_acc {want.get('final_test_acc')} -> {got.get('final_test_acc')}"
        print(f"{name:40s} " + (f"DIFFERENT ({', '.join(diff)}){acc}" if diff else "same"))
    print(f"{same} of {len(results)} cases bit-identical")
    return 0 if same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
