"""A whole paper-scale run with and without evaluation after every round.

Paper 003's Table 8 shape (docs/results/paper003_table8.md): N = 1000 clients of 60
samples, 10 per round, batch 10, one local epoch (6 steps), SGD with momentum 0.9 and
weight decay 1e-4, LeNet-5 on Fashion-MNIST-shaped data (60,000 random N(0, 1) training
images, a 10,000-image test set, so no data files are needed). The same run is timed
twice through :func:`splitfed.engine.loop.run_rounds` (the loop of ``splitfed run``,
without the files it writes): evaluating the 10,000 test images after every round, as
the paper does, and evaluating only after the last round. Their ratio is what evaluation
costs a paper-scale study.

    python -m benchmarks.paper_run --rounds 200 --threads 1
    python -m benchmarks.bench ... --paper-run 200      # the same, as a block of the report
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from splitfed.config import build_config
from splitfed.data import DATASETS
from splitfed.data.datasets import ArrayDataset, DataBundle
from splitfed.engine.evaluate import default_batch
from splitfed.engine.flops import forward_macs
from splitfed.experiment import build_algorithm, build_environment

DATASET_NAME = "bench_paper_run"
TRAIN, TEST, SHAPE = 60_000, 10_000, (1, 28, 28)


class _Records:
    """The logger :func:`run_rounds` needs: it keeps the records in memory."""

    def __init__(self):
        self.records = []

    def log(self, record: dict) -> None:
        self.records.append(record)


def _register(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    train = ArrayDataset(torch.randn(TRAIN, *SHAPE, generator=g),
                         torch.randint(0, 10, (TRAIN,), generator=g))
    test = ArrayDataset(torch.randn(TEST, *SHAPE, generator=g),
                        torch.randint(0, 10, (TEST,), generator=g))
    bundle = DataBundle(name=DATASET_NAME, train=train, test=test, num_classes=10,
                        input_shape=SHAPE)
    DATASETS[DATASET_NAME] = lambda data_dir, rng: bundle


def overrides(rounds: int, every_round: bool, algorithm: str, seed: int,
              device: str = "cpu", eval_batch_size: int | None = None) -> list[str]:
    return [f"algorithm.name={algorithm}", f"data.name={DATASET_NAME}", "model.name=lenet5",
            "partition.scheme=iid", "partition.num_clients=1000",
            "participation.mode=uniform", "participation.clients_per_round=10",
            "train.batch_size=10", "train.local_epochs=1", "train.lr=0.01",
            "train.momentum=0.9", "train.weight_decay=0.0001", f"rounds={rounds}",
            f"eval_every={1 if every_round else rounds}", f"seed={seed}", "progress=false",
            f"engine.device={device}",
            *([f"engine.eval_batch_size={eval_batch_size}"] if eval_batch_size else [])]


def one_run(rounds: int, every_round: bool, algorithm: str = "fedavg", seed: int = 0,
            device: str = "cpu", eval_batch_size: int | None = None) -> dict:
    """Build and run; wall time of the rounds (building excluded) and evaluations made
    (the loop's last record, a metric, waits for a GPU's queued work)."""
    _register(seed)
    cfg = build_config({}, overrides(rounds, every_round, algorithm, seed, device,
                                     eval_batch_size))
    env, algo = build_environment(cfg), build_algorithm(cfg)
    from splitfed.engine.loop import run_rounds

    log = _Records()
    t0 = time.perf_counter()
    run_rounds(algo, env, log)
    wall = time.perf_counter() - t0
    evals = sum("test_acc" in r for r in log.records)
    train_s = sum(r["round_time_s"] for r in log.records if "round_time_s" in r)
    return {"wall_s": round(wall, 3), "evaluations": evals, "train_s": round(train_s, 3),
            "final_test_acc": log.records[-1].get("test_acc")}


def paper_run(rounds: int = 200, algorithm: str = "fedavg", repeats: int = 1,
              log=print, device: str = "cpu", eval_batch_size: int | None = None) -> dict:
    """Both runs, alternating, ``repeats`` times each; medians and their ratio."""
    walls = {"eval_every_round": [], "eval_last_only": []}
    runs = {}
    for r in range(repeats):
        for every in ((True, False) if r % 2 == 0 else (False, True)):
            key = "eval_every_round" if every else "eval_last_only"
            res = one_run(rounds, every, algorithm, device=device,
                          eval_batch_size=eval_batch_size)
            walls[key].append(res["wall_s"])
            runs[key] = res
            log(f"  paper run ({algorithm}, {rounds} rounds), {key}: {res['wall_s']:.1f} s, "
                f"{res['evaluations']} evaluations")
    med = {k: sorted(v)[len(v) // 2] for k, v in walls.items()}
    from splitfed.models import build_model

    macs = forward_macs(build_model("lenet5", SHAPE, 10), SHAPE)
    extra = runs["eval_every_round"]["evaluations"] - runs["eval_last_only"]["evaluations"]
    per_eval = ((med["eval_every_round"] - med["eval_last_only"]) / extra if extra > 0
                else None)                  # the runs differ by these evaluations only
    return {"algorithm": algorithm, "rounds": rounds, "clients": 1000, "per_round": 10,
            "batch": 10, "local_steps": 6, "test_samples": TEST, "device": device,
            "eval_batch_size": eval_batch_size or default_batch(device), "wall_s": walls,
            "median_wall_s": med, "runs": runs,
            "ratio": round(med["eval_every_round"] / med["eval_last_only"], 3),
            "extra_evaluations": extra,
            "eval_s_per_round": round(per_eval, 4) if per_eval is not None else None,
            "eval_samples_per_s": (round(TEST / per_eval, 1) if per_eval is not None
                                   and per_eval > 0 else None),
            "eval_forward_gflop": round(2 * macs * TEST / 1e9, 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--eval-batch-size", type=int, default=None,
                    help="engine.eval_batch_size (default: the engine's for the device)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds: at least 2 (the two runs differ by the evaluations of rounds "
                 "1 to rounds - 1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = paper_run(args.rounds, args.algorithm, args.repeats, device=args.device,
                    eval_batch_size=args.eval_batch_size)
    print(f"{args.algorithm}, {args.rounds} rounds of 10 of 1000 clients (batch 10, 6 steps): "
          f"evaluating every round {res['median_wall_s']['eval_every_round']:.1f} s, "
          f"only the last {res['median_wall_s']['eval_last_only']:.1f} s, "
          f"ratio {res['ratio']:.2f}; one evaluation of {TEST} samples "
          + ("n/a" if res["eval_s_per_round"] is None
             else f"{res['eval_s_per_round'] * 1000:.0f} ms"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
