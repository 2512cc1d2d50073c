"""Forward passes of many clients' copies (MU-SplitFed's zeroth-order passes) in one call
or in calls of fewer clients, interleaved, one thread, medians printed:

- ``forward``: a model's client part (``--model``, cut 2) over C clients of B samples
  without autograd, through :func:`splitfed.models.cohort.cohort_forward_chunked` with
  each ``--chunks`` value (0: one call), as speed-ups over one call;
- ``musplitfed``: the benchmark's ``splitfed_musplitfed`` round (K algorithm rounds)
  with the copies' default calls and with one call per pass; the two runs end with the
  same model (checked and printed).

    python -m benchmarks.zo_chunks [-C 100] [--batch 32] [--chunks 0,8,16,32,64]
    python -m benchmarks.zo_chunks --musplitfed -C 100 -K 5 --batch 32

Run from the repository root with the project's environment. docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench import interleaved
from benchmarks.variants import VARIANTS
from benchmarks.workload import Workload, register
from splitfed.engine import stacked
from splitfed.models import build_model, split
from splitfed.models.cohort import cohort_forward_chunked

SHAPES = {"lenet5": (1, 28, 28), "alexnet": (1, 28, 28), "resnet18": (3, 32, 32),
          "vgg11": (3, 32, 32)}


def _timed(fns: dict, repeats: int) -> dict:
    """Median seconds of each function after a warm-up call each, interleaved."""
    for f in fns.values():
        f()
    return {k: statistics.median(v) for k, v in interleaved(fns, repeats).items()}


@torch.no_grad()
def forward(model: str = "lenet5", clients: int = 100, batch: int = 32,
            chunks: tuple[int, ...] = (0, 8, 16, 32, 64), repeats: int = 7,
            **options) -> dict[int, float]:
    """Seconds (median) of one pass of the client part per ``chunks`` value."""
    torch.manual_seed(0)
    client, _ = split(build_model(model, SHAPES[model], 10, **options), 2)
    x = torch.randn(clients, batch, *SHAPES[model])
    state = {k: v.detach().unsqueeze(0).expand(clients, *v.shape).clone()
             for k, v in client.state_dict().items()}
    return _timed({c: (lambda c=c: cohort_forward_chunked(client, state, x, training=True,
                                                           chunk=c or None))
                   for c in chunks}, repeats)


def musplitfed(clients: int = 100, local_steps: int = 5, batch: int = 32,
               repeats: int = 5) -> tuple[dict[str, float], bool]:
    """Seconds (median) of a benchmark round of MU-SplitFed with the default calls and in
    one call per pass, and whether both runs ended with the same model."""
    w = Workload(clients=clients, local_steps=local_steps, batch=batch)
    register(w)
    runs = {"default calls": VARIANTS["splitfed_musplitfed"](w),
            "one call": VARIANTS["splitfed_musplitfed"](w)}
    for v in runs.values():
        v.setup()
    real = stacked.ForwardCopies._chunk

    def one_call():
        stacked.ForwardCopies._chunk = lambda self, x: None
        try:
            runs["one call"].round()
        finally:
            stacked.ForwardCopies._chunk = real

    times = _timed({"default calls": runs["default calls"].round, "one call": one_call},
                   repeats)
    a, b = (v.state["model"] for v in runs.values())
    return times, all(torch.equal(a[k], b[k]) for k in a)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="lenet5", choices=sorted(SHAPES))
    ap.add_argument("--width", type=float, default=None)
    ap.add_argument("-C", "--clients", type=int, default=100)
    ap.add_argument("-K", "--local-steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chunks", default="0,8,16,32,64",
                    help="clients per call, comma-separated (0: one call)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--musplitfed", action="store_true",
                    help="time MU-SplitFed rounds instead of the client part's pass")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.musplitfed:
        times, same = musplitfed(a.clients, a.local_steps, a.batch, a.repeats)
        print(f"MU-SplitFed C={a.clients} K={a.local_steps} B={a.batch}, {a.threads} "
              f"thread(s), medians of {a.repeats}; same final model: {same}")
        for name, s in times.items():
            print(f"{name:14s} {s:7.3f} s per round  {times['one call'] / s:.2f}x one call")
        return
    chunks = tuple(int(c) for c in a.chunks.split(","))
    options = {} if a.width is None else {"width": a.width}
    times = forward(a.model, a.clients, a.batch, chunks, a.repeats, **options)
    base = times.get(0, times[chunks[0]])
    print(f"{a.model} client part, C={a.clients} B={a.batch}, {a.threads} thread(s), "
          f"medians of {a.repeats}")
    for c, s in times.items():
        print(f"{('chunk ' + str(c)) if c else 'one call':12s} {s * 1e3:8.2f} ms  "
              f"{base / s:.2f}x")


if __name__ == "__main__":
    main()
