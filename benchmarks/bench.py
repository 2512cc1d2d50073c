"""Throughput benchmark: splitfed's algorithms against centralized training and a
per-client loop, side by side on one workload (LeNet-5, 1x28x28, 10 classes, batch 32 per
client, K local steps, C clients, plain SGD lr 0.01).

    python -m benchmarks.bench --clients 100 --local-steps 5 --out docs/results/bench.json
    python -m benchmarks.bench --scaling --out docs/results/scaling.json

Samples per round are ``C * K * 32``; samples/s is that over the median round time
(evaluation never runs). Every variant runs one warm-up round, then ``--repeats`` rounds
interleaved round-robin (the starting variant rotates each repeat), so machine noise hits
all variants alike; the training rows' ratios to ``central_b32`` and the peer loop are
also paired repeat by repeat (median and range). ``--show FILE.json`` prints the tables
of saved runs. Peak memory is measured separately: each variant is set up and
runs one round alone in a fresh subprocess, whose peak RSS (VmHWM) is reported; "+MB" is
the growth of that peak over the same process right after importing torch and making
the data, i.e. what the variant itself added.

Flower (optional): FedAvg on Flower's simulation engine runs in its own subprocess with
an interpreter that has ``flwr[simulation]`` (``--flower-python``, default: this one), after
the interleaved variants (its Ray processes would disturb them); its peak memory is the
sampled RSS sum of its whole process tree (driver, Ray daemons and workers). See
docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.pfl_fedavg import LABEL as PFL_LABEL
from benchmarks.pfl_fedavg import NAME as PFL
from benchmarks.peers import ROOT, peer_env, probe, run_script
from benchmarks.pfl_fedavg import run_pfl
from benchmarks.procstat import vm_hwm_mb
from benchmarks.variants import VARIANTS
from benchmarks.workload import (FASHION_DIR, FASHION_TRAIN, INPUT_SHAPE, MODEL_SHAPES,
                                 NUM_CLASSES, Workload, model_options)

LIMITS = ("central_big", "central_big_cl")
FLOWER = "flower_fedavg"
LABELS = {FLOWER: "FedAvg, Flower simulation engine (Ray)"}


# ---------------------------------------------------------------- machine


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: environment variables that change CPU throughput (thread wait policy, allocator, the
#: instruction sets of torch's own kernels, MKL's matrix products and oneDNN's convolutions)
PERF_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
            "MKL_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD",
            "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def machine_info() -> dict:
    """The machine and what changes its throughput: ``cpu_capability`` is the instruction
    set of the kernels torch dispatches to (AVX512, AVX2, DEFAULT...)."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform(),
            "env": {k: os.environ[k] for k in PERF_ENV if k in os.environ}}


def rss_peak_mb() -> float:
    """This process's peak RSS (VmHWM, :func:`benchmarks.procstat.vm_hwm_mb`), or
    ``ru_maxrss`` where /proc cannot tell."""
    peak = vm_hwm_mb()
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def sync(device: str = "cpu") -> None:
    """Wait for the device's queued work (a GPU runs asynchronously); nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_gflops(n: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """The machine's fp32 matmul rate at the current thread count (or the GPU's, TF32
    off, at n >= 8192): the best of ``repeats`` ``n x n @ n x n`` products after a
    warm-up, in GFLOP/s (2 n^3 FLOP each). What a dense, cache-friendly kernel reaches:
    the peak the rows are a fraction of."""
    if torch.device(device).type == "cuda":
        n = max(n, 8192)                 # a GPU needs a larger product to reach its peak
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device) for _ in range(2))
    a @ b
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds; "n/a" when not measured."""
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def flops_per_sample(w: Workload, name: str) -> float:
    """FLOPs (2 per multiply-accumulate) that variant ``name`` spends on one sample: a
    training step is a forward pass and its backward, counted as torch runs them
    (:func:`training_flops`: the weights' gradients, and the inputs' gradients of every
    layer but the first, whose input is the data); an evaluation is one forward pass;
    MU-SplitFed (tau server steps, zeroth-order) 3 client forwards and 2 tau + 2 server
    forwards (:class:`benchmarks.variants.SplitfedMU`)."""
    from splitfed.engine.flops import forward_macs
    from splitfed.models import split

    model = w.model()
    shape = tuple(w.bundle().input_shape)
    if name.startswith("eval"):
        return 2.0 * forward_macs(model, shape)
    if name == "splitfed_musplitfed":
        from splitfed.algorithms.musplitfed import MUSplitFedOptions

        client, server = split(model, model.default_cut)
        tau = MUSplitFedOptions().tau    # the variant runs the algorithm's defaults
        cut_shape = tuple(client(torch.zeros(1, *shape, device=w.device)).shape[1:])
        return 2.0 * (3 * forward_macs(client, shape)
                      + (2 * tau + 2) * forward_macs(server, cut_shape))
    return training_flops(model, shape)


def training_flops(model: torch.nn.Module, shape: tuple[int, ...]) -> float:
    """FLOPs of one training sample of ``model`` on inputs of ``shape``: a forward and a
    backward pass of a batch of two, counted by ``torch.utils.flop_counter`` (the matrix
    products and convolutions, 2 FLOP per multiply-accumulate, as ``forward_macs``
    counts a forward pass), per sample. The backward computes the weights' gradients and
    the inputs' gradients of every layer but the first: about three forward passes
    (LeNet-5: 2.26 MFLOP, 2.72 forward passes)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(model).cpu().train()
    x = torch.zeros(2, *shape)
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(x)
        out.float().sum().backward()
    return counter.get_total_flops() / 2


# ---------------------------------------------------------------- timing


def interleaved(runs: dict, repeats: int, device: str = "cpu", *, collect: bool = False,
                log=None) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` calls of every function in ``runs`` (warmed up by
    the caller), called round robin with the first one rotating every repeat, so that
    machine noise hits them alike; ``collect``: a garbage collection before each call;
    ``log``: a line per repeat."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if collect:
                gc.collect()
            t0 = time.perf_counter()
            runs[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
        if log is not None:
            log(f"  repeat {r + 1}/{repeats}: "
                + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names))
    return times


def time_variants(w: Workload, names: list[str], repeats: int, log,
                  extra: dict | None = None) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """Warm-up round each, then ``repeats`` round-robin rounds; per-variant results, and
    the times of ``extra`` (name -> a warmed-up function, such as the evaluation passes
    of :func:`eval_runs`), called in the same round robin."""
    variants = {}
    for name in names:
        v = VARIANTS[name](w)
        t0 = time.perf_counter()
        v.setup()
        v.round()
        sync(w.device)
        log(f"  {name}: set up and warmed up in {time.perf_counter() - t0:.1f} s")
        variants[name] = v
    runs = {name: variants[name].round for name in names} | (extra or {})
    times = interleaved(runs, repeats, w.device, collect=True, log=log)
    del variants, runs
    gc.collect()
    return ({name: summarize(w, times[name], VARIANTS[name].label) for name in names},
            {name: times[name] for name in extra or {}})


def summarize(w: Workload, times: list[float], label: str) -> dict:
    med = statistics.median(times)
    return {"label": label, "round_s": [round(t, 4) for t in times],
            "median_round_s": round(med, 4), "samples": w.samples_per_round,
            "samples_per_s": round(w.samples_per_round / med, 1)}


EVAL_SAMPLES = 10_000
EVAL_LABELS = {
    "eval_splitfed": "evaluation as splitfed runs it (splitfed.engine.evaluate, batch {b})",
    "eval_plain_b1000": "evaluation as a plain loop: model(x) under no_grad, batch 1000",
}


def eval_runs(w: Workload, samples: int = EVAL_SAMPLES, batch: int | None = None
              ) -> tuple[dict, int]:
    """The evaluation rows' passes over ``samples`` test-shaped inputs, each warmed up
    once: splitfed's evaluation and the plain loop it replaces; and the batch size."""
    from splitfed.engine.evaluate import default_batch, evaluate

    batch = batch or default_batch(w.device)       # the engine's default, as a run has it
    g = torch.Generator().manual_seed(w.seed + 2)
    shape = tuple(w.bundle().input_shape)
    x = torch.randn(samples, *shape, generator=g).to(w.device)
    y = torch.randint(0, 10, (samples,), generator=g).to(w.device)
    model = w.model().eval()

    @torch.no_grad()
    def plain():
        for i in range(0, samples, 1000):
            model(x[i:i + 1000]).argmax(1)

    runs = {"eval_splitfed": lambda: evaluate(model, x, y, batch), "eval_plain_b1000": plain}
    for f in runs.values():
        f()
    sync(w.device)
    return runs, batch


def eval_results(times: dict[str, list[float]], batch: int, log,
                 samples: int = EVAL_SAMPLES) -> dict[str, dict]:
    """The evaluation rows from their pass times (timed in the training rows' round
    robin: ``paired_with_training``)."""
    log("  evaluation: " + ", ".join(f"{n} {statistics.median(t):.2f}s" for n, t in times.items()))
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"label": EVAL_LABELS[name].format(b=batch),
                     "round_s": [round(t, 4) for t in ts],
                     "median_round_s": round(med, 4), "samples": samples,
                     "samples_per_s": round(samples / med, 1), "paired_with_training": True}
    return out


# ---------------------------------------------------------------- memory


def workload_args(w: Workload) -> list[str]:
    args = ["--clients", str(w.clients), "--local-steps", str(w.local_steps),
            "--batch", str(w.batch), "--lr", str(w.lr), "--seed", str(w.seed),
            "--threads", str(torch.get_num_threads()), "--population", str(w.population),
            "--model", w.model_name, *(["--width", str(w.width)] if w.width else [])]
    return args + (["--real"] if w.real else [])


def memory_probe(w: Workload, name: str) -> dict:
    """Run in a fresh process: the variant's set-up and one round; peak RSS."""
    base = rss_peak_mb()
    v = VARIANTS[name](w)
    v.setup()
    v.round()
    peak = rss_peak_mb()
    return {"peak_mb": round(peak, 1), "delta_mb": round(peak - base, 1)}


def measure_memory(w: Workload, name: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench", "--memory-probe", name, *workload_args(w)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=peer_env())
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- Flower


def flower_python(choice: str | None) -> tuple[str | None, str]:
    """The interpreter to run Flower with, or None and why not."""
    python, said = probe(choice or sys.executable,
                         "import flwr, ray, torch; print(flwr.__version__)",
                         "install flwr[simulation] with `pip install -e .[bench]` or pass "
                         "--flower-python")
    if python is None:
        return None, f"flwr[simulation] is {said}"
    return python, f"flwr {said} ({python})"


def run_flower(w: Workload, python: str, repeats: int, num_cpus: float, log) -> dict:
    done = run_script(w, python, "benchmarks.flower_fedavg",
                      ["--rounds", str(repeats + 1), "--num-cpus", str(num_cpus)],
                      tree_memory=True)
    if "error" in done:
        return {"label": LABELS[FLOWER], "error": done["error"]}
    res = done["result"]
    rounds = [res["round_s"][k] for k in sorted(res["round_s"], key=int)]
    log(f"  {FLOWER}: {len(rounds)} rounds in {done['wall_s']:.1f} s "
        f"(warm-up {rounds[0]:.2f} s)")
    summary = summarize(w, rounds[1:], LABELS[FLOWER])
    summary.update({"peak_mb": round(done["peak_mb"], 1), "flwr": res["flwr"],
                    "num_cpus_per_client": res["num_cpus_per_client"],
                    "cpus": flower_cpus(w.clients, num_cpus),
                    "note": "run after the interleaved variants; peak_mb is the process tree"})
    return summary


def flower_cpus(clients: int, num_cpus: float) -> float:
    """The CPUs Flower's client actors train on at once: ``num_cpus`` each, as many in
    parallel as Ray's CPUs (the machine's) hold."""
    return min(float(os.cpu_count() or 1), clients * num_cpus)


# ---------------------------------------------------------------- tables


def add_ratios(results: dict[str, dict], w: Workload | None = None,
               peak: float | None = None) -> dict:
    """Ratios to the limit (best centralized big batch), to batch 32, to the peer loop;
    with ``w`` and ``peak``, GFLOP/s of every row and its fraction of the matmul peak (not
    Flower's: its actors run on other CPUs than the peak's threads, in parallel); the
    evaluation rows' ratio to the fastest training row timed in the same round robin
    (splitfed's and the in-process baselines: not Flower or pfl, which run afterwards in
    their own processes, nor MU-SplitFed, whose arithmetic differs)."""
    if w is not None:
        for name, r in results.items():
            if "samples_per_s" in r:
                r["flops_per_sample"] = flops_per_sample(w, name)
                r["gflops"] = round(r["samples_per_s"] * r["flops_per_sample"] / 1e9, 2)
                if peak and name != FLOWER:
                    r["x_peak"] = round(r["gflops"] / peak, 3)
    train = {n: r["samples_per_s"] for n, r in results.items()
             if "samples_per_s" in r and n in VARIANTS and n != "splitfed_musplitfed"}
    if train:
        fastest = max(train, key=train.get)
        for name, r in results.items():
            if name.startswith("eval") and "samples_per_s" in r:
                r["x_train"] = round(r["samples_per_s"] / train[fastest], 3)
                r["train_reference"] = fastest
    sps = {n: r["samples_per_s"] for n, r in results.items()
           if "samples_per_s" in r and not n.startswith("eval")}
    limits = [n for n in LIMITS if n in sps]
    refs = {"x_limit": max((sps[n] for n in limits), default=None),
            "x_b32": sps.get("central_b32"), "x_peer": sps.get("peer_loop")}
    for name, r in results.items():
        for key, ref in refs.items():
            if "samples_per_s" in r and ref and not name.startswith("eval"):
                r[key] = round(r["samples_per_s"] / ref, 3)
    paired_ratios(results)
    return {"limit_variant": max(limits, key=sps.get) if limits else None}


#: the paired ratios: key -> the reference row (both timed in one interleaved run)
PAIRED = {"x_b32_paired": "central_b32", "x_peer_paired": "peer_loop"}
SHOWN = (*PAIRED, "x_train_paired")


def paired_ratios(results: dict[str, dict]) -> None:
    """Per-repeat ratios of every training row to ``central_b32`` and ``peer_loop``: in
    repeat r both ran within seconds of each other, so ``ref_round_s[r] / round_s[r]``
    cancels the machine's slower drifts that the ratio of two medians (``x_b32``,
    ``x_peer``) still carries; recorded as their median, min and max. Only rows of the
    same interleaved timing (splitfed's and the in-process baselines, not Flower or pfl)
    with as many round times as the reference are paired; the evaluation rows, where
    they ran in that round robin, to their ``train_reference`` (``x_train_paired``:
    samples/s over the reference's samples/s in the same repeat)."""
    for key, ref in PAIRED.items():
        base = results.get(ref, {}).get("round_s")
        if not base:
            continue
        for name, r in results.items():
            times = r.get("round_s")
            if name not in VARIANTS or name == ref or not times or len(times) != len(base):
                continue
            r[key] = _spread([b / t for b, t in zip(base, times)])
    for r in results.values():
        name = r.get("train_reference")
        ref = results.get(name, {}) if name in VARIANTS else {}     # timed in the round robin
        base, times = ref.get("round_s"), r.get("round_s")
        if (r.get("paired_with_training") and base and times and len(times) == len(base)
                and ref.get("samples") and r.get("samples")):
            r["x_train_paired"] = _spread([r["samples"] / t / (ref["samples"] / b)
                                           for b, t in zip(base, times)])


def _spread(ratios: list[float]) -> dict[str, float]:
    ratios = sorted(ratios)
    return {"median": round(statistics.median(ratios), 3), "min": round(ratios[0], 3),
            "max": round(ratios[-1], 3)}


def table(workload: dict, results: dict[str, dict], peak: float | None = None,
          threads: int | None = None) -> str:
    threads = torch.get_num_threads() if threads is None else threads
    head = (f"C={workload['clients']} K={workload['local_steps']} B={workload['batch']}: "
            f"{workload['samples_per_round']} samples/round, {threads} threads"
            + (f"; fp32 matmul peak {peak:.1f} GFLOP/s" if peak else ""))
    rows = [("variant", "samples/s", "GFLOP/s", "x peak", "x limit", "x b32", "x peer",
             "x train", "peak MB", "+MB")]
    notes = []
    for name, r in results.items():
        if "samples_per_s" not in r:
            status = "error" if "error" in r else "skipped"
            rows.append((name, status, *[""] * 8))
            notes.append(f"{name} {status}: {r.get('error') or r.get('skipped')}")
            continue
        rows.append((name, f"{r['samples_per_s']:,.0f}",
                     f"{r['gflops']:.1f}" if "gflops" in r else "-",
                     *(f"{r[k]:.2f}" if k in r else "-"
                       for k in ("x_peak", "x_limit", "x_b32", "x_peer", "x_train")),
                     *(f"{r[k]:.0f}" if k in r else "-" for k in ("peak_mb", "delta_mb"))))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = [head]
    for i, row in enumerate(rows):
        cells = [str(c).ljust(widths[0]) if j == 0 else str(c).rjust(widths[j])
                 for j, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * n for n in widths))
    paired = [f"  {name:<20}  " + "  ".join(
        f"{key[:-7].replace('_', ' ')} {r[key]['median']:.2f} "
        f"[{r[key]['min']:.2f}-{r[key]['max']:.2f}]" for key in SHOWN if key in r)
        for name, r in results.items() if any(key in r for key in SHOWN)]
    if paired:
        lines += ["paired per repeat (median [min-max] of the repeats' ratios):", *paired]
    if results.get(FLOWER, {}).get("cpus"):
        notes.append(f"{FLOWER} trained on {results[FLOWER]['cpus']:g} CPUs (Ray actors in "
                     f"parallel), the other rows on {threads} threads: no x peak")
    fed, pfl = results.get("splitfed_fedavg", {}), results.get(PFL, {})
    if fed.get("samples_per_s") and pfl.get("samples_per_s"):
        notes.append(f"splitfed_fedavg / {PFL}: "
                     f"{fed['samples_per_s'] / pfl['samples_per_s']:.2f}x")
    return "\n".join(lines + notes)


def scaling_table(blocks: list[dict]) -> str:
    names = list(dict.fromkeys(n for b in blocks for n in b["results"]))
    cs = [b["workload"]["clients"] for b in blocks]
    rows = [("us/sample", *(f"C={c}" for c in cs), f"C={cs[-1]} / C={cs[0]}")]
    for name in names:
        cost = []
        for b in blocks:
            r = b["results"].get(name, {})
            cost.append(1e6 / r["samples_per_s"] if r.get("samples_per_s") else None)
        ratio = f"{cost[-1] / cost[0]:.2f}" if cost[0] and cost[-1] else "-"
        rows.append((name, *(f"{c:.1f}" if c else "-" for c in cost), ratio))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(widths[0]) if j == 0 else str(c).rjust(widths[j])
                               for j, c in enumerate(row)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * n for n in widths))
    return "\n".join(lines)


def scaling_lines(blocks: list[dict]) -> list[str]:
    """The cost-per-sample table of a --scaling report, with its heading."""
    samples = blocks[0]["workload"]["samples_per_round"]
    return [f"cost per sample (microseconds) at {samples} samples per round",
            scaling_table(blocks)]


def paper_run_line(p: dict) -> str:
    """A --paper-run block in one line."""
    return (f"paper-scale run (FedAvg, {p['rounds']} rounds, 10 of 1000 clients, batch 10): "
            f"evaluating every round {p['median_wall_s']['eval_every_round']:.1f} s, "
            f"only after the last {p['median_wall_s']['eval_last_only']:.1f} s: "
            f"x{p['ratio']:.2f}; one evaluation of {p['test_samples']:,} samples "
            f"{_ms(p['eval_s_per_round'])} ({p['eval_forward_gflop']} GFLOP)")


# ---------------------------------------------------------------- driver


def run_block(w: Workload, args, flower: tuple[str | None, str], log) -> dict:
    log(f"C={w.clients} K={w.local_steps}: {w.samples_per_round} samples per round")
    names = [n for n in args.variants if n in VARIANTS]
    block = {"workload": w.describe(), "load_before": load_average()}
    evals, eval_batch = eval_runs(w, batch=args.eval_batch_size) if args.eval else ({}, 0)
    results, eval_times = time_variants(w, names, args.repeats, log, evals)
    del evals
    if args.memory:
        for name in names:
            results[name].update(measure_memory(w, name))
    external = (w.model_name == "lenet5" and w.population == w.clients
                and w.device == "cpu")
    if FLOWER in args.variants and not external:
        results[FLOWER] = {"label": LABELS[FLOWER], "skipped": "LeNet-5 on the CPU with every "
                           "user training each round only (its client app's workload)"}
    elif FLOWER in args.variants:
        python, why = flower
        if python is None:
            results[FLOWER] = {"label": LABELS[FLOWER], "skipped": why}
            log(f"  {FLOWER}: skipped: {why}")
        elif w.clients > args.flower_max_clients:
            why = (f"C={w.clients} > --flower-max-clients {args.flower_max_clients}: "
                   f"Flower's per-client overhead makes one round take minutes")
            results[FLOWER] = {"label": LABELS[FLOWER], "skipped": why}
            log(f"  {FLOWER}: skipped: {why}")
        else:
            results[FLOWER] = run_flower(w, python, args.repeats, args.flower_cpus, log)
    if PFL in args.variants:
        if w.model_name != "lenet5" or w.device != "cpu":
            results[PFL] = {"label": PFL_LABEL, "skipped": "LeNet-5 on the CPU only"}
        else:
            results[PFL] = run_pfl(w, args.pfl_python or sys.executable, args.repeats, log)
    if args.eval:
        results.update(eval_results(eval_times, eval_batch, log))
    block.update(add_ratios(results, w, args.peak))
    block["peak_gflops"] = args.peak
    block["results"] = results
    block["load_after"] = load_average()
    return block


def at_least(low: int):
    """An argparse type: an integer of ``low`` or more."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return value
    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def client_counts(text: str) -> list[int]:
    """An argparse type: comma-separated integers of 1 or more."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers >= 1, got {text!r}")
    return counts


def paper_rounds(text: str) -> int:
    """An argparse type: 0 (no paper-scale run) or 2 rounds or more (the two runs differ by
    the evaluations of rounds 1 to rounds - 1)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 0 or value == 1:
        raise argparse.ArgumentTypeError(
            f"expected 0 (none) or a whole number of rounds >= 2, got {text!r}")
    return value


def cohorts(args) -> list[tuple[int, int]]:
    """(C, K) of each block: C in --scaling-clients with K steps of --scaling-samples per
    round, or --clients and --local-steps."""
    if not args.scaling:
        return [(args.clients, args.local_steps)]
    return [(c, args.scaling_samples // (c * args.batch)) for c in args.scaling_clients]


def check_workload(ap, args) -> None:
    """Refuse, before anything is timed, a workload that cannot be built."""
    for c in args.scaling_clients if args.scaling else ():
        if args.scaling_samples % (c * args.batch):
            ap.error(f"--scaling-samples {args.scaling_samples} is not a multiple of "
                     f"C * batch = {c * args.batch} (C={c})")
    largest = max(c for c, _ in cohorts(args))
    if args.population is not None and args.population < largest:
        cohort = "the largest of --scaling-clients," if args.scaling else "--clients"
        ap.error(f"--population {args.population} is below {cohort} {largest}")
    if args.width is not None:
        from splitfed.errors import ConfigError
        from splitfed.models import build_model

        try:            # the model's own check of its options
            build_model(args.model, MODEL_SHAPES[args.model], NUM_CLASSES,
                        **model_options(args.model, args.width))
        except ConfigError as e:
            ap.error(f"--width {args.width:g}: {e}")
    if args.real and MODEL_SHAPES[args.model] != INPUT_SHAPE:
        ap.error(f"--real: Fashion-MNIST's samples are 1x28x28; --model {args.model} takes "
                 f"{'x'.join(map(str, MODEL_SHAPES[args.model]))}")
    for c, k in cohorts(args) if args.real else ():
        n = (args.population or c) * k * args.batch
        if n > FASHION_TRAIN:
            ap.error(f"--real: P * K * batch = {n} samples exceed Fashion-MNIST's "
                     f"{FASHION_TRAIN:,} training images")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", "-C", type=at_least(1), default=100)
    ap.add_argument("--local-steps", "-K", type=at_least(1), default=5)
    ap.add_argument("--batch", type=at_least(1), default=32)
    ap.add_argument("--lr", type=positive, default=0.01)
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--repeats", "-R", type=at_least(1), default=3)
    ap.add_argument("--real", action="store_true",
                    help=f"real Fashion-MNIST samples from {FASHION_DIR} (default: random)")
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="torch threads (default: torch's)")
    ap.add_argument("--population", "-P", type=at_least(1), default=None,
                    help="users in all, of which a round trains C (default: C); pfl's "
                         "shape: -P 1000 -C 50 -K 6 --batch 10")
    ap.add_argument("--model", default="lenet5", choices=sorted(MODEL_SHAPES),
                    help="lenet5 or alexnet (1x28x28), or a deeper CIFAR-shaped model "
                         "(3x32x32)")
    ap.add_argument("--width", type=positive, default=None,
                    help="model width: resnet18's base channels (default 64), the channel "
                         "multiplier of vgg11 and alexnet (default 1)")
    ap.add_argument("--variants", default=",".join([*VARIANTS, FLOWER, PFL]),
                    help="comma-separated subset of: " + ", ".join([*VARIANTS, FLOWER, PFL]))
    ap.add_argument("--no-memory", dest="memory", action="store_false",
                    help="skip the per-variant peak-memory subprocesses")
    ap.add_argument("--no-flower", action="store_true", help="skip the Flower variant")
    ap.add_argument("--no-eval", dest="eval", action="store_false",
                    help="skip the evaluation rows (forward-only throughput on 10,000 samples)")
    ap.add_argument("--no-peak", dest="measure_peak", action="store_false",
                    help="skip measuring the fp32 matmul peak (no GFLOP/s fraction column)")
    ap.add_argument("--flower-python", default=None,
                    help="interpreter with flwr[simulation] (default: this one)")
    ap.add_argument("--flower-cpus", type=positive, default=1.0,
                    help="Ray CPUs per Flower client actor")
    ap.add_argument("--flower-max-clients", type=int, default=100)
    ap.add_argument("--no-pfl", action="store_true", help="skip the pfl variant")
    ap.add_argument("--pfl-python", default=None,
                    help="interpreter with pfl[pytorch] (default: this one)")
    ap.add_argument("--scaling", action="store_true",
                    help="run C in --scaling-clients at a fixed --scaling-samples per round")
    ap.add_argument("--scaling-clients", type=client_counts, default="10,100,1000")
    ap.add_argument("--scaling-samples", type=at_least(1), default=32000)
    ap.add_argument("--paper-run", type=paper_rounds, default=0, metavar="ROUNDS",
                    help="also time a paper-scale FedAvg run (1000 clients, 10 per round, "
                         "batch 10) of ROUNDS rounds evaluating every round against only "
                         "the last (benchmarks/paper_run.py)")
    ap.add_argument("--eval-batch-size", type=at_least(1), default=None,
                    help="engine.eval_batch_size of the evaluation row and the paper-scale "
                         "run (default: the engine's for the device, 256 on a CPU, 2048 "
                         "on a GPU)")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda / cuda:N: the samples, models and splitfed's engine on "
                         "that GPU (TF32 off: fp32 arithmetic as on the CPU; implies "
                         "--no-memory, no Flower or pfl rows)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--show", nargs="+", default=None, metavar="JSON",
                    help="print the tables of results written by --out (with their paired "
                         "ratios, also for files written before those existed; a scaling "
                         "run's cost per sample, a paper-scale run's line); times nothing")
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - {*VARIANTS, FLOWER, PFL}
    if unknown or not args.variants:
        said = f"unknown {sorted(unknown)}" if unknown else "none given"
        ap.error(f"--variants: {said}; one or more of {', '.join([*VARIANTS, FLOWER, PFL])}")
    if args.no_flower and FLOWER in args.variants:
        args.variants.remove(FLOWER)
    if args.no_pfl and PFL in args.variants:
        args.variants.remove(PFL)
    if args.device != "cpu":
        from splitfed.errors import ConfigError
        from splitfed.experiment import resolve_device

        try:
            resolve_device(args.device)      # the engine's own check and message
        except ConfigError as e:
            ap.error(f"--device: {e}")
        args.memory = False
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    check_workload(ap, args)
    return args


def show(paths: list[str]) -> None:
    """Print the tables of reports written by ``--out``."""
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            blocks = report.get("scaling") or [report]
            tables = []
            for b in blocks:
                paired_ratios(b["results"])
                tables.append(table(b["workload"], b["results"],
                                    b.get("peak_gflops") or report.get("peak_gflops"),
                                    report.get("machine", {}).get("threads")))
            if report.get("scaling"):
                tables.append("\n".join(scaling_lines(blocks)))
            if report.get("paper_run"):
                tables.append(paper_run_line(report["paper_run"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"--show {path}: not a report written by --out ({e})") from None
        print(f"{path}: {report.get('command', '')}")
        for t in tables:
            print(t)
            print()


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.show:
        show(args.show)
        return None
    if args.threads:
        torch.set_num_threads(args.threads)
    def make(c, k):
        return Workload(c, k, args.batch, args.lr, args.seed, args.real,
                        population=args.population or c, model_name=args.model,
                        width=args.width, device=args.device)

    if args.memory_probe:
        print(json.dumps(memory_probe(make(args.clients, args.local_steps), args.memory_probe)))
        return None
    log = (lambda *a: None) if args.quiet else (lambda msg: print(msg, flush=True))
    report = {"command": " ".join(["python -m benchmarks.bench", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "load_start": load_average(),
              "repeats": args.repeats}
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()} "
        f"({report['machine']['cpu_capability']} kernels), load average {report['load_start']}")
    if args.device != "cpu":
        log(f"device {args.device}: {torch.cuda.get_device_name(args.device)}, TF32 off")
        report["device"] = torch.cuda.get_device_name(args.device)
    args.peak = (round(matmul_peak_gflops(device=args.device), 1) if args.measure_peak
                 else None)
    report["peak_gflops"] = args.peak
    if args.peak:
        log(f"fp32 matmul peak ({torch.get_num_threads()} threads): {args.peak} GFLOP/s")
    flower = flower_python(args.flower_python) if FLOWER in args.variants else (None, "")
    if args.scaling:
        blocks = []
        for c, k in cohorts(args):
            blocks.append(run_block(make(c, k), args, flower, log))
        report["scaling"] = blocks
    else:
        report.update(run_block(make(args.clients, args.local_steps), args, flower, log))
        blocks = [report]
    if args.paper_run:
        from benchmarks.paper_run import paper_run

        report["paper_run"] = paper_run(args.paper_run, log=log, device=args.device,
                                        eval_batch_size=args.eval_batch_size)
    report["load_end"] = load_average()
    print()
    for b in blocks:
        print(table(b["workload"], b["results"], args.peak))
        print()
    if args.scaling:
        print(*scaling_lines(blocks), sep="\n")
        print()
    if args.paper_run:
        print(paper_run_line(report["paper_run"]))
    print(f"load average: start {report['load_start']}, end {report['load_end']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
