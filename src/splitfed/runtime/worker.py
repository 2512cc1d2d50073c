"""The process of one rank: ``python -m splitfed.runtime.worker CONFIG [key=value ...]``.

Started by torchrun (``splitfed launch``, or ``torchrun ... -m splitfed.runtime.worker``
on several hosts) or by :func:`splitfed.runtime.launch.spawn`; reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the environment, joins the gloo
process group, and serves (rank 0) or hosts clients (the other ranks). Only rank 0
reads CONFIG and writes the run directory; it sends the config to the other ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

from splitfed.errors import SplitfedError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitfed.runtime.worker",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    return p


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of a distributed run (shared with ``splitfed launch``)."""
    p.add_argument("config", nargs="?", help="YAML file or shipped config name (rank 0)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--run-dir", default=None,
                   help="write the run into this (absent or empty) directory")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="rank 0 drops a client rank that does not answer within S "
                        "seconds (default 60)")
    p.add_argument("--client-timeout", type=float, default=1800.0, metavar="S",
                   help="a client rank gives up after waiting S seconds for rank 0 "
                        "(gloo's process-group timeout; default 1800)")
    p.add_argument("--real-delays", type=float, default=None, metavar="SCALE",
                   help="client ranks sleep SCALE wall seconds per simulated second of "
                        "their clients' compute and transfers (docs/clock.md profiles)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as e:
        print(f"splitfed worker: {e.args[0]} is not set; start the ranks with splitfed "
              "launch or torchrun (docs/distributed.md)", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from splitfed.runtime.session import RuntimeOptions, host, serve
    from splitfed.transport.distributed import Links, ServerLost

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.client_timeout))
    links = Links(rank, world, args.timeout)
    code = 0
    try:
        if rank == 0:
            code = _serve(args, links, serve, RuntimeOptions(
                timeout_s=args.timeout, delay_scale=args.real_delays))
        else:
            host(links)
    except ServerLost as e:
        print(f"splitfed worker rank {rank}: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if links.lost or code:
        os._exit(code)                # abandoned links: skip gloo's orderly shutdown
    dist.destroy_process_group()
    return code


def _serve(args, links, serve, options) -> int:
    from splitfed.config import load_config

    try:
        if args.resume is not None:
            if args.config is not None or args.overrides:
                raise SplitfedError("--resume RUN_DIR continues with RUN_DIR's own "
                                    "config.yaml; give no CONFIG or key=value with it")
            result = serve(links, options=options, resume=args.resume)
        elif args.config is None:
            raise SplitfedError("give a CONFIG (YAML file or shipped config name), or "
                                "--resume RUN_DIR")
        else:
            result = serve(links, load_config(args.config, args.overrides),
                           options=options, run_dir=args.run_dir)
    except SplitfedError as e:
        links.stop_all(f"error: {e}")
        print(f"splitfed: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        links.stop_all("error")
        raise
    acc = result.final_accuracy
    print(f"distributed run on {links.world_size} processes: status {result.status}, "
          f"test accuracy {'n/a' if acc is None else f'{acc:.4f}'}, "
          f"wall time {result.wall_time_s:.1f} s")
    print(f"run directory: {result.run_dir}")
    return 0 if result.status == "completed" else 3


if __name__ == "__main__":
    sys.exit(main())
