"""Where SL's time goes beyond its arithmetic: samples/s of six ways of training the
same samples sequentially, interleaved round by round (medians printed):

- ``central``: the benchmark's ``central_b32`` (one plain module, ``torch.optim.SGD``);
- ``split_loop``: the split step written by hand: the client part and the server part of
  LeNet-5 at the cut, two ``autograd.grad`` calls and two fused SGD updates per batch,
  with splitfed's training forward (:func:`splitfed.models.sequential.forward_train`),
  no transport, ledger or clock;
- ``splitfed_sl``: the benchmark's ``splitfed_sl`` (the algorithm as ``splitfed run``
  runs it);
- ``sl_no_accounting``: the same with the ledger's records and the clock's charges
  replaced by no-ops (what the bookkeeping costs);
- ``sl_step_by_step``: the same with every step through the transport and the clock as
  it happens (``splitfed.engine.split.SETTLE_TURNS`` off: what settling each turn
  once saves);
- ``sl_two_passes``: splitfed SL with each settled step in two backward passes, the
  server's and then the client's from the cut-layer gradient, and two SGD updates (the
  step before it became one pass, ``splitfed.engine.split._joint_update``: what that
  saves).

    python -m benchmarks.sl_overhead [-C 10] [-K 6] [--batch 10] [--repeats 21]

Run from the repository root with the project's environment, one thread.
docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F

from benchmarks.bench import interleaved
from benchmarks.variants import VARIANTS
from benchmarks.workload import Workload, register
from splitfed.engine import split as split_engine
from splitfed.engine.clock import VirtualClock
from splitfed.models import split
from splitfed.models.sequential import forward_train
from splitfed.transport.ledger import Ledger


def _split_loop(w: Workload, lr: float = 0.01):
    client, server = (copy.deepcopy(p) for p in split(w.model(), 2))
    cp, sp = list(client.parameters()), list(server.parameters())
    gen = torch.Generator().manual_seed(w.seed)

    def round_():
        perm = torch.randperm(len(w.y), generator=gen)[:w.samples_per_round]
        for rows in perm.view(-1, w.batch):
            x = w.x[rows]
            acts = forward_train(client, x)
            h = acts.detach().requires_grad_(True)
            loss = F.cross_entropy(forward_train(server, h), w.y[rows])
            *g_server, g_h = torch.autograd.grad(loss, sp + [h])
            with torch.no_grad():
                torch._foreach_add_(sp, g_server, alpha=-lr)
            g_client = torch.autograd.grad(acts, cp, g_h)
            with torch.no_grad():
                torch._foreach_add_(cp, g_client, alpha=-lr)
            float(loss.detach())
    return round_


def run(clients: int = 10, local_steps: int = 6, batch: int = 10, repeats: int = 21
        ) -> dict[str, float]:
    """Median samples/s of each way (module docstring)."""
    w = Workload(clients=clients, local_steps=local_steps, batch=batch)
    register(w)
    central, sl = VARIANTS["central_b32"](w), VARIANTS["splitfed_sl"](w)
    for v in (central, sl):
        v.setup()
        v.round()
    loop = _split_loop(w)
    loop()
    real = (Ledger.record, VirtualClock.transfer, VirtualClock.charge, VirtualClock.replay_one)

    def no_accounting():
        Ledger.record = VirtualClock.transfer = VirtualClock.replay_one = lambda *a, **k: None
        VirtualClock.charge = lambda *a, **k: 0
        try:
            sl.round()
        finally:
            (Ledger.record, VirtualClock.transfer, VirtualClock.charge,
             VirtualClock.replay_one) = real

    def step_by_step():
        split_engine.SETTLE_TURNS = False
        try:
            sl.round()
        finally:
            split_engine.SETTLE_TURNS = True

    def two_passes():
        def step(server, server_params, server_opt, client_params, client_opt, acts, y, lr):
            loss, g_h = split_engine._server_update(server, server_params, server_opt, acts,
                                                    y, lr)
            split_engine._client_update(None, client_opt, client_params, acts, g_h, lr)
            return loss

        one_pass = split_engine._joint_update
        split_engine._joint_update = step
        try:
            sl.round()
        finally:
            split_engine._joint_update = one_pass

    ways = {"central": central.round, "split_loop": loop, "splitfed_sl": sl.round,
            "sl_no_accounting": no_accounting, "sl_step_by_step": step_by_step,
            "sl_two_passes": two_passes}
    times = interleaved(ways, repeats)
    return {k: w.samples_per_round / statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-C", "--clients", type=int, default=10)
    ap.add_argument("-K", "--local-steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = run(a.clients, a.local_steps, a.batch, a.repeats)
    print(f"C={a.clients} K={a.local_steps} B={a.batch}, {a.threads} thread(s), medians of "
          f"{a.repeats}")
    for name, sps in res.items():
        print(f"{name:18s} {sps:8,.0f} samples/s  {sps / res['central']:.2f}x central")


if __name__ == "__main__":
    main()
