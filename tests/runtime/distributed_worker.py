"""Ranks of tests/runtime/test_distributed.py and tests/runtime/test_runtime_security.py.

``python tests/runtime/distributed_worker.py OUT_DIR CONFIGS.pt``: every rank joins the gloo
group (through the run's store, :func:`splitfed.runtime.worker.join`); for each config in
the file rank 0 serves a run into ``OUT_DIR/<name>/`` and saves its final state and byte
counts to ``OUT_DIR/<name>.pt``, the others host clients.

``python tests/runtime/distributed_worker.py --forge MODE MARKER``: rank 0 is a forger: instead of
serving, it sends rank 1 (a real client rank, ``python -m splitfed.runtime.worker``) a
pickle whose ``__reduce__`` would create the file MARKER, as the run's first control
message: MODE ``unsigned`` (no HMAC: the forger does not know the secret) or ``signed``
(a valid HMAC: the forger knows it; the safe loader must still refuse it).
"""

import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from splitfed.runtime.worker import guard, join
from splitfed.transport.distributed import _CONTROL, Links


def main(out: str, configs: str) -> None:
    from splitfed.runtime.session import RuntimeOptions, host, serve

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    secret, _server = join(rank, world, 120)
    for cfg in torch.load(configs, weights_only=False):
        links = Links(rank, world, timeout_s=60, secret=secret)
        if rank != 0:
            host(links)
            continue
        result = serve(links, cfg, options=RuntimeOptions(), run_dir=Path(out) / cfg.name)
        torch.save({"state": result.state, "records": result.records,
                    "wire": dict(result.run_dir and _wire(links, result))},
                   Path(out) / f"{cfg.name}.pt")
    dist.destroy_process_group()


def _wire(links, result):
    import json
    summary = json.loads((result.run_dir / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k.startswith("wire_")}


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def forge(mode: str, marker: str) -> None:
    from splitfed.runtime.secure import sign

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    secret, _server = join(rank, world, 60)
    assert rank == 0
    links = Links(rank, world, timeout_s=30, secret=secret)
    body = pickle.dumps({"config": _Payload(marker)})
    if mode == "signed":
        body += sign(links.key, 0, 1, 0, body)
    data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    links.exchange(sends=[(1, torch.tensor([data.numel()], dtype=torch.int64))],
                   tag=_CONTROL)
    links.exchange(sends=[(1, data)], tag=_CONTROL)
    time.sleep(5)                               # rank 1 reads it (or not) meanwhile
    os._exit(0)


if __name__ == "__main__":
    guard(int(os.environ["SPLITFED_LAUNCHER_PID"]))     # die with the test process
    if sys.argv[1] == "--forge":
        if os.environ["RANK"] != "0":           # a real client rank
            from splitfed.runtime.worker import main as worker_main
            sys.exit(worker_main([]))
        forge(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
