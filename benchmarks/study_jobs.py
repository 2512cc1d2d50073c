"""Wall time of one sweep run three ways: one run after the other (``--jobs 1``), in two
worker processes (``--jobs 2``) and on a local Dask cluster of two workers
(``--executor dask --jobs 2``); every run single-threaded (``--threads 1``).

The sweep: FedAvg, LeNet-5 on Fashion-MNIST (the default loader, e.g.
``/usr/share/datasets/fashion-mnist/``), 10 clients, ``--local-steps`` steps of batch 32
per round, ``--rounds`` rounds, over ``train.lr`` x ``partition.alpha`` (8 runs; the
defaults are meant to give some 15-20 s per run on one thread, ``--rounds`` scales it).
Each way runs the command
``python -m splitfed sweep ...`` from scratch in a directory of its own (a fresh
temporary directory), so its wall time includes starting the processes. The script then
checks that the three give the same records (every field of every run's
``metrics.jsonl`` but the wall-clock ``round_time_s``) and prints a markdown table of the
wall times and speed-ups over ``--jobs 1``, with the machine and its load::

    python -m benchmarks.study_jobs              # the measurement (minutes; idle machine)
    python -m benchmarks.study_jobs --quick      # a tiny sweep, to check that it works

Exit status 1 when the records differ, 2 when a sweep fails. Needs Dask for the third
way (``pip install 'splitfed[cluster]'``); ``--no-dask`` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LR = "train.lr=0.02,0.05"
ALPHA = "partition.alpha=0.1,0.3,1.0,inf"


def config(rounds: int, local_steps: int) -> str:
    return (f"name: study_jobs\nseed: 0\nrounds: {rounds}\nprogress: false\n"
            "algorithm: {name: fedavg}\ndata: {name: fashion_mnist}\n"
            "partition: {scheme: dirichlet, num_clients: 10, alpha: 0.5}\n"
            "model: {name: lenet5}\n"
            f"train: {{batch_size: 32, local_epochs: null, local_steps: {local_steps}, "
            "lr: 0.05}\nparticipation: {mode: full}\n")


def run_sweep(workdir: Path, axes: list[str], options: list[str]) -> float:
    """``python -m splitfed sweep`` in ``workdir``; its wall time in seconds."""
    argv = [sys.executable, "-m", "splitfed", "sweep", "config.yaml", *axes,
            "--out-dir", "out", "--name", "bench", "--threads", "1", *options]
    print(f"$ {' '.join(argv[2:])}   (in {workdir})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=workdir, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        raise SystemExit(f"the sweep with {' '.join(options)} failed "
                         f"(exit status {proc.returncode})")
    return wall


def records(workdir: Path) -> dict[str, list[dict]]:
    """Every run's records without the wall-clock field, by run directory name."""
    out = {}
    for run in sorted((workdir / "out" / "bench" / "runs").iterdir()):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        out[run.name] = [{k: v for k, v in json.loads(x).items() if k != "round_time_s"}
                         for x in lines]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a tiny sweep (4 runs of 1 round, 2 local steps): checks that it works")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=40)
    p.add_argument("--jobs", type=int, default=2, help="workers of the parallel ways")
    p.add_argument("--no-dask", action="store_true", help="leave the Dask way out")
    args = p.parse_args(argv)
    rounds, steps, axes = args.rounds, args.local_steps, [LR, ALPHA]
    if args.quick:
        rounds, steps, axes = 1, 2, [LR, "partition.alpha=0.5,inf"]
    ways = [("one after the other", ["--jobs", "1"]),
            (f"{args.jobs} worker processes", ["--jobs", str(args.jobs)])]
    if not args.no_dask:
        ways.append((f"Dask local cluster, {args.jobs} workers",
                     ["--executor", "dask", "--jobs", str(args.jobs)]))
    load_start = [round(x, 2) for x in os.getloadavg()]
    walls, got = [], []
    with tempfile.TemporaryDirectory(prefix="study_jobs-") as tmp:
        for i, (_, options) in enumerate(ways):
            workdir = Path(tmp) / f"way{i}"
            workdir.mkdir()
            (workdir / "config.yaml").write_text(config(rounds, steps))
            walls.append(run_sweep(workdir, axes, options))
            got.append(records(workdir))
    load_end = [round(x, 2) for x in os.getloadavg()]
    same = all(g == got[0] for g in got[1:])
    runs = len(got[0])
    import torch

    from splitfed.study.parallel import usable_cores

    print(f"Sweep: {' x '.join(a.split('=')[0] for a in axes)} = {runs} runs, FedAvg "
          f"LeNet-5 Fashion-MNIST, 10 clients, {rounds} round(s) of {steps} local steps, "
          f"one thread per run. Machine: {platform.processor() or platform.machine()}, "
          f"{usable_cores()} usable cores, torch {torch.__version__}, "
          f"load average {load_start} before, {load_end} after.")
    print()
    print("| way | options | wall time (s) | speed-up |")
    print("|---|---|---|---|")
    for (name, options), wall in zip(ways, walls):
        print(f"| {name} | `{' '.join(options)}` | {wall:.1f} | {walls[0] / wall:.2f} |")
    print()
    print(f"Records of the {runs} runs identical across the ways (every field but "
          f"round_time_s): {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
