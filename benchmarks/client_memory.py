"""Client peak memory of one local training step, measured in a fresh process.

A measurement, not part of the library (nothing in ``splitfed`` imports it): run it from
the repository root with the project's environment,
``.venv/bin/python -m benchmarks.client_memory ...``.

Paper 001 Fig. 4 compares the client's peak memory when fine-tuning OPT-1.3B with FedAvg
(full fine-tuning), FedLoRA and MU-SplitFed. :func:`client_peak_memory` reproduces that
measurement for any model of the registry: it starts a fresh Python process
(``python -m benchmarks.client_memory`` in the repository root), which

1. imports torch and builds nothing yet, and reads its resident set size (RSS);
2. builds what the client holds: the whole model (``fedavg``), the whole model with LoRA
   adapters and everything else frozen (``fedlora``), or only the client part, the
   embeddings and the first ``cut`` decoder blocks (``musplitfed``; built alone, the
   server part is never allocated), and a random batch;
3. resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) and runs ``steps``
   client steps exactly as the engine computes them for one client:
   first-order methods a forward, the gradients of the trainable parameters
   (``torch.autograd.grad``) and an SGD step (momentum buffers when ``momentum`` > 0);
   MU-SplitFed the unperturbed forward, a direction u on the sphere, the two perturbed
   forwards (``zo.directions`` / ``zo.perturb``, as the algorithm) and the update from
   the scalar the server returns (here a constant: the server's work is not the client's);
   ``zo_mode="inplace"`` measures the step of MU-SplitFed's ``in_place`` option: the
   parameters perturbed in place and the direction regenerated in chunks of 2^20
   elements (MeZO's trick, ``engine/zo.py``);
4. reports ``peak_mb`` = peak RSS (``VmHWM``) - RSS before the model existed: parameters,
   gradients, optimizer state, activations and every temporary of the step, as the OS
   sees them. glibc is told to return large blocks to the OS at once
   (``MALLOC_MMAP_THRESHOLD_``), so freed memory is not counted twice.

On CUDA the same steps are measured with torch's allocator statistics
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), which count
tensors only. The report also gives the analytic parts: ``params_mb`` (what the client
stores), ``grads_mb`` (one gradient per trainable parameter; 0 for zeroth order),
``optimizer_mb`` (momentum buffers) and ``other_mb`` = peak - those three (activations
and temporaries; for MU-SplitFed the direction u and one perturbed copy of the
parameters, which this implementation materialises).

``python -m benchmarks.client_memory --method fedavg --model opt --option preset=opt-1.3b
--option dtype=bfloat16 --seq-len 64 --batch-size 8`` prints one JSON line;
``--tensor-mb 128`` measures a known allocation instead (a check of the measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent      # the fresh process runs here
METHODS = ("fedavg", "fedlora", "musplitfed")
MB = 2 ** 20


# ---------------------------------------------------------------- RSS (Linux /proc)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or the last :func:`reset_peak`."""
    return _status_kb("VmHWM") * 1024


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


# ---------------------------------------------------------------- the client workloads


def _parse_value(text: str):
    import yaml
    return yaml.safe_load(text)


def build_client(method: str, model: str, options: dict, seq_len: int, num_classes: int,
                 cut: int | None, lora_rank: int):
    """(module the client holds, its trainable parameter names) for ``method``."""
    import torch

    from splitfed.models import build_model, split

    from splitfed.errors import ConfigError

    if method == "musplitfed":
        if cut is None:
            raise ConfigError("--cut: musplitfed needs the number of client blocks")
        if model == "opt":       # build only embeddings + cut blocks (+ the tiny head)
            layers = _opt_layers(options)
            if layers is not None and not 1 <= cut <= layers:
                raise ConfigError(f"--cut {cut}: model opt has {layers} decoder blocks; "
                                  f"give 1..{layers}")
            options = {**options, "num_layers": cut}
        full = build_model(model, (2, seq_len), num_classes, **options)
        client, _ = split(full, cut)
        del full
        for p in client.parameters():
            p.requires_grad_(False)
        return client, []
    full = build_model(model, (2, seq_len), num_classes, **options)
    if method == "fedlora":
        from splitfed.models.lora import add_lora
        with torch.random.fork_rng(devices=[]):
            add_lora(full, rank=lora_rank)
    return full, [n for n, p in full.named_parameters() if p.requires_grad]


def _opt_layers(options: dict) -> int | None:
    """The decoder blocks of the OPT model ``options`` describe (its ``num_layers``, else
    its preset's), without building it; None when only building it can tell (a
    pretrained directory, a preset that does not exist: building it reports that)."""
    from splitfed.models.transformer import PRESETS

    if options.get("pretrained") is not None:
        return None
    layers = options.get("num_layers")
    if layers is not None:
        return layers if isinstance(layers, int) and not isinstance(layers, bool) else None
    preset = options.get("preset") or "tiny"
    return PRESETS[preset]["num_hidden_layers"] if preset in PRESETS else None


def _batch(model, batch_size: int, seq_len: int, num_classes: int, device):
    import torch
    vocab = 100
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            vocab = m.num_embeddings
            break
    ids = torch.randint(4, vocab, (1, batch_size, seq_len), device=device)
    x = torch.stack([ids, torch.ones_like(ids)], dim=2)         # [1, B, 2, L], no padding
    return x, torch.randint(0, num_classes, (1, batch_size), device=device)


def client_steps(method: str, module, trainable: list[str], x, y, steps: int, *,
                 lr: float = 1e-4, momentum: float = 0.0, smoothing: float = 1e-3,
                 zo_mode: str = "engine") -> None:
    """``steps`` client steps of ``method`` for one client (the module docstring)."""
    import torch

    from splitfed.engine import zo
    from splitfed.engine.optim import StackedSGD
    from splitfed.engine.split import per_client_loss
    from splitfed.models.cohort import cohort_forward

    state = {k: v.unsqueeze(0) for k, v in module.state_dict(keep_vars=True).items()}
    if method == "musplitfed" and zo_mode == "inplace":
        _inplace_zo_steps(module, state, x, steps, lr, smoothing)
        return
    if method == "musplitfed":
        names = [k for k, _ in module.named_parameters()]
        with torch.no_grad():
            for step in range(steps):
                params = [state[k] for k in names]
                sent = [cohort_forward(module, state, x, training=True)]
                u = zo.directions(step, params)
                for s in (1.0, -1.0):
                    perturbed = dict(zip(names, zo.perturb(params, u, s * smoothing)))
                    sent.append(cohort_forward(module, {**state, **perturbed}, x,
                                               training=True))
                    del perturbed
                coef = torch.full((1,), 0.01, dtype=params[0].dtype, device=x.device)
                torch._foreach_add_(params, zo.scale_directions(coef, u), alpha=-lr)
                del sent, u
        return
    opt = StackedSGD(momentum)
    for _ in range(steps):
        out = cohort_forward(module, state, x, training=True)
        loss = per_client_loss(out.float(), y).sum()
        inputs = [state[k] for k in trainable]
        grads = torch.autograd.grad(loss, inputs)
        del out, loss
        with torch.no_grad():
            opt.step([t.detach() for t in inputs], list(grads), lr)
        del grads


def _inplace_zo_steps(module, state, x, steps: int, lr: float, lam: float) -> None:
    """The same client step as MU-SplitFed with ``in_place`` runs it: the parameters
    perturbed in place and the direction regenerated chunk by chunk
    (:func:`splitfed.engine.zo.shift_`; at most ``zo.NOISE_CHUNK`` noise elements alive)."""
    import torch

    from splitfed.engine import zo
    from splitfed.models.cohort import cohort_forward
    params = [state[k].detach() for k, _ in module.named_parameters()]
    coef = torch.full((1, 1), 0.01, dtype=torch.float64)    # the scalar from the server
    with torch.no_grad():
        for step in range(steps):
            sent = [cohort_forward(module, state, x, training=True)]
            perturbed, scales = zo.probe(lambda _: cohort_forward(module, state, x,
                                                                  training=True),
                                         params, [step], lam, in_place=True)
            zo.descend_(params, [step], coef, lr, scales=scales)
            del sent, perturbed


def _warm_up(method: str, device) -> None:
    """One step of every method on a tiny model, so that the libraries' lazily loaded
    code and pools are resident before the baseline is read."""
    import torch

    from splitfed.models import build_model
    for m in ("fedavg", "musplitfed"):
        tiny = build_model("opt", (2, 8), 2, num_layers=2).to(device)
        x = torch.stack([torch.randint(4, 100, (1, 2, 8)), torch.ones(1, 2, 8).long()], 2)
        trainable = [n for n, _ in tiny.named_parameters()] if m == "fedavg" else []
        if m == "musplitfed":
            for p in tiny.parameters():
                p.requires_grad_(False)
        client_steps(m, tiny, trainable, x.to(device), torch.zeros(1, 2).long().to(device), 1)


def measure(args) -> dict:
    """Run in the fresh process: build, reset the peak, step, report (module docstring)."""
    import torch

    torch.manual_seed(0)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    options = dict(args.option)
    if args.model == "opt":
        _warm_up(args.method, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_bytes()
    module, trainable = build_client(args.method, args.model, options, args.seq_len,
                                     args.num_classes, args.cut, args.lora_rank)
    module.to(device)
    x, y = _batch(module, args.batch_size, args.seq_len, args.num_classes, device)
    params = {k: p for k, p in module.named_parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    param_bytes += sum(b.numel() * b.element_size() for b in module.buffers())
    grad_bytes = sum(params[k].numel() * params[k].element_size() for k in trainable)
    optim_bytes = grad_bytes if args.momentum > 0 else 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak()
    client_steps(args.method, module, trainable, x, y, args.steps, momentum=args.momentum,
                 zo_mode=args.zo_mode)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = peak_rss_bytes() - base
    known = param_bytes + grad_bytes + optim_bytes
    return {"method": args.method, "model": args.model, "options": options,
            "cut": args.cut if args.method == "musplitfed" else None,
            "zo_mode": args.zo_mode if args.method == "musplitfed" else None,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
            "device": str(device),
            "measured_by": "cuda max_memory_allocated" if cuda else "peak RSS delta (VmHWM)",
            "num_params": sum(p.numel() for p in params.values()),
            "trainable_params": sum(params[k].numel() for k in trainable),
            "params_mb": param_bytes / MB, "grads_mb": grad_bytes / MB,
            "optimizer_mb": optim_bytes / MB, "other_mb": (peak - known) / MB,
            "peak_mb": peak / MB}


def tensor_probe(mb: float) -> dict:
    """Peak RSS delta of allocating and filling a float32 tensor of ``mb`` MiB (a check
    of the measurement itself)."""
    import torch
    base = rss_bytes()
    reset_peak()
    t = torch.ones(int(mb * MB) // 4, dtype=torch.float32)
    peak = peak_rss_bytes() - base
    del t
    return {"allocated_mb": mb, "peak_mb": peak / MB}


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")   # big blocks: mmap, freed at once
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_fresh(argv: list[str], timeout: float | None = None) -> dict:
    """Run ``python -m benchmarks.client_memory argv`` in a fresh process (in the
    repository root, so that ``benchmarks`` is importable from anywhere); its JSON."""
    cmd = [sys.executable, "-m", "benchmarks.client_memory", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                          check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def client_peak_memory(method: str, model: str = "opt", options: dict | None = None, *,
                       seq_len: int = 64, batch_size: int = 8, num_classes: int = 2,
                       cut: int | None = None, lora_rank: int = 8, steps: int = 2,
                       momentum: float = 0.0, device: str = "cpu", zo_mode: str = "engine",
                       timeout: float | None = None) -> dict:
    """Client peak memory of ``method`` measured in a fresh process (module docstring)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    argv = ["--method", method, "--model", model, "--seq-len", str(seq_len),
            "--batch-size", str(batch_size), "--num-classes", str(num_classes),
            "--lora-rank", str(lora_rank), "--steps", str(steps),
            "--momentum", str(momentum), "--device", device, "--zo-mode", zo_mode]
    if cut is not None:
        argv += ["--cut", str(cut)]
    for k, v in (options or {}).items():
        argv += ["--option", f"{k}={v}"]
    return run_fresh(argv, timeout)


def _option(text: str):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option takes key=value, got {text!r}")
    import yaml
    try:
        return key, _parse_value(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"{text!r} does not give a YAML value") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.client_memory",
                                description="client peak memory of one method, this process")
    p.add_argument("--method", choices=METHODS)
    p.add_argument("--model", default="opt")
    p.add_argument("--option", type=_option, action="append", default=[],
                   help="model option key=value (repeatable), e.g. preset=opt-1.3b")
    p.add_argument("--seq-len", type=_positive_int, default=64)
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--num-classes", type=_positive_int, default=2)
    p.add_argument("--cut", type=int, default=None)
    p.add_argument("--lora-rank", type=_positive_int, default=8)
    p.add_argument("--steps", type=_positive_int, default=2)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--zo-mode", choices=("engine", "inplace"), default="engine",
                   help="musplitfed: the engine's ZO step (u and a perturbed copy "
                        "materialised) or in-place perturbation with regenerated noise")
    p.add_argument("--tensor-mb", type=float, default=None,
                   help="instead: measure a float32 tensor of this many MiB")
    return p


def main(argv: list[str] | None = None) -> None:
    """Measure as ``argv`` asks; a value the model or the method refuses (an unknown
    ``--option``, a ``--cut`` the model does not have) is one line on stderr, exit 2."""
    from splitfed.errors import ConfigError

    p = parser()
    args = p.parse_args(argv)
    if args.tensor_mb is not None:
        result = tensor_probe(args.tensor_mb)
    elif args.method is None:
        p.error("--method is required")
    else:
        try:
            result = measure(args)
        except ConfigError as e:
            p.error(str(e))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
