"""A rank of tests/test_distributed.py's parity check: several runs in one process group.

``python tests/distributed_worker.py OUT_DIR CONFIGS.pt``: every rank joins the gloo
group; for each config in the file rank 0 serves a run into ``OUT_DIR/<name>/`` and
saves its final state and byte counts to ``OUT_DIR/<name>.pt``, the others host clients.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from splitfed.runtime.session import RuntimeOptions, host, serve
from splitfed.transport.distributed import Links


def main(out: str, configs: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    for cfg in torch.load(configs, weights_only=False):
        links = Links(rank, world, timeout_s=60)
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


if __name__ == "__main__":
    main(*sys.argv[1:])
