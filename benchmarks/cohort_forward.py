"""Samples/s of K SGD steps on LeNet-5 (1x28x28): the batched cohort forward
(:func:`splitfed.models.cohort.cohort_forward`, one grouped pass for C clients) against
a per-client loop of plain modules.

    python -m benchmarks.cohort_forward [--clients 10] [--batch 32] [--steps 5] [--repeats 7]

Run from the repository root with the project's environment. Each variant runs once as a
warm-up (the cohort path builds its plans then); then they alternate, the first of them
rotating every repeat (so machine noise hits both alike); medians are printed.
docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from benchmarks.bench import interleaved
from splitfed.models import build_model
from splitfed.models.cohort import cohort_forward, stack_states


def run(clients: int = 10, batch: int = 32, steps: int = 5, repeats: int = 7) -> dict:
    """Median samples/s of the cohort path and of the per-client loop."""
    model = build_model("lenet5", (1, 28, 28), 10)
    x = torch.randn(clients, steps, batch, 1, 28, 28)
    y = torch.randint(0, 10, (clients, steps, batch))
    names = [n for n, _ in model.named_parameters()]

    def cohort():
        state = stack_states([model.state_dict()] * clients)
        params = [state[n].requires_grad_() for n in names]
        for k in range(steps):
            out = cohort_forward(model, state, x[:, k], training=True)
            loss = F.cross_entropy(out.reshape(-1, 10), y[:, k].reshape(-1)) * clients
            with torch.no_grad():
                torch._foreach_add_(params, torch.autograd.grad(loss, params), alpha=-0.01)

    def loop():
        for c in range(clients):
            m = copy.deepcopy(model)
            params = list(m.parameters())
            for k in range(steps):
                loss = F.cross_entropy(m(x[c, k]), y[c, k])
                with torch.no_grad():
                    torch._foreach_add_(params, torch.autograd.grad(loss, params), alpha=-0.01)

    runs = {"cohort": cohort, "loop": loop}
    for fn in runs.values():
        fn()
    times = interleaved(runs, repeats)
    return {label: clients * steps * batch / sorted(ts)[len(ts) // 2]
            for label, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cohort_forward",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"LeNet-5 1x28x28, C={a.clients} x B={a.batch}, K={a.steps}, "
          f"{torch.get_num_threads()} threads")
    for label, rate in run(a.clients, a.batch, a.steps, a.repeats).items():
        print(f"{label:>7}: {rate:9.0f} samples/s (median of {a.repeats})")


if __name__ == "__main__":
    main()
