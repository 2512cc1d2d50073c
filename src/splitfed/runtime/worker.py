"""The process of one rank: ``python -m splitfed.runtime.worker CONFIG [key=value ...]``.

Started by ``splitfed launch`` (spawn or torchrun), or by hand with torchrun on several
hosts (``--store HOST:PORT``: rank 0 hosts the run's store there). Reads ``RANK`` and
``WORLD_SIZE`` from the environment, joins the gloo process group through the run's
authenticated store (:mod:`splitfed.runtime.secure`; torch's ``MASTER_ADDR`` and
``MASTER_PORT`` are not used), and serves (rank 0) or hosts clients (the other ranks).
Only rank 0 reads CONFIG and writes the run directory; it sends the config to the other
ranks (plain data, :mod:`splitfed.safeio`, with an HMAC under the run's secret).
A rank dies with its parent process and exits when ``splitfed launch`` is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from splitfed.errors import ConfigError, SplitfedError
from splitfed.runtime.options import MIN_SECRET


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitfed.runtime.worker",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    add_network_arguments(p, worker=True)
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
                        "seconds (> 0; default 60)")
    p.add_argument("--client-timeout", type=float, default=1800.0, metavar="S",
                   help="a client rank gives up after waiting S seconds for rank 0 "
                        "(gloo's process-group timeout; > 0; default 1800)")
    p.add_argument("--real-delays", type=float, default=None, metavar="SCALE",
                   help="client ranks sleep SCALE (>= 0) wall seconds per simulated second "
                        "of their clients' compute and transfers (docs/clock.md profiles)")
    from splitfed.registry import add_plugin_argument

    add_plugin_argument(p)


def add_network_arguments(p: argparse.ArgumentParser, worker: bool = False) -> None:
    """Where the run listens and the shared secret (docs/distributed.md, Security)."""
    p.add_argument("--listen", metavar="ADDR", default=None,
                   help="IPv4 address the run's store and gloo bind to (default "
                        "127.0.0.1); an address that is not loopback needs a secret")
    p.add_argument("--secret-file", metavar="FILE", default=None,
                   help="file holding the run's shared secret (at least "
                        f"{MIN_SECRET} characters, mode 600); default: $SPLITFED_SECRET"
                        + ("; a rank started by hand needs one of them" if worker
                           else ", else a random secret per launch"))
    if worker:
        p.add_argument("--store", metavar="HOST:PORT", default=None,
                       help="the run's store, hosted by rank 0 on --listen ADDR and PORT "
                            "(ranks started by hand: torchrun on several hosts); default: "
                            "$SPLITFED_STORE, set by splitfed launch")


def join(rank: int, world: int, timeout_s: float, *, listen: str | None = None,
         store: str | None = None, secret_file: str | None = None):
    """Join the gloo process group through the run's authenticated store; returns the
    secret and the store server rank 0 hosts (None elsewhere). Without a secret
    (``$SPLITFED_SECRET``, ``--secret-file``; ``splitfed launch`` always gives one) a
    rank refuses to start, before it binds or connects anything: the store and the
    ranks' messages are never run with an empty key."""
    import torch.distributed as dist

    from splitfed.runtime import secure

    secret = secure.read_secret(secret_file)
    addr = secure.parse_address(listen or os.environ.get(secure.LISTEN_ENV) or "127.0.0.1")
    secure.require_secret(addr, secret)
    if store is not None:
        host_name, port = secure.parse_endpoint(store)
    elif os.environ.get(secure.STORE_ENV):
        host_name, port = secure.parse_endpoint(os.environ[secure.STORE_ENV],
                                                f"${secure.STORE_ENV}")
    else:
        raise ConfigError("give the run's store with --store HOST:PORT (rank 0 hosts it), "
                          "or start the ranks with splitfed launch")
    if secret is None:
        raise ConfigError(f"rank {rank}: no shared secret: every rank of a run proves it to "
                          f"the run's store and signs its messages with it; "
                          f"{secure.SECRET_HINT}")
    server = None
    if store is not None and rank == 0:
        server = secure.StoreServer(secret, addr, port)
    os.environ["GLOO_SOCKET_IFNAME"] = secure.interface_of(addr)
    timeout = timedelta(seconds=timeout_s)
    auth = secure.AuthStore(host_name, port, secret, timeout=timeout)
    dist.init_process_group("gloo", store=auth, rank=rank, world_size=world,
                            timeout=timeout)
    return secret, server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def guard(launcher_pid: int | None) -> None:
    """Die with the parent (``PR_SET_PDEATHSIG``) and, when ``launcher_pid`` is given,
    exit as soon as that process is gone (a watchdog thread)."""
    from splitfed.runtime.launch import die_with_parent

    die_with_parent(signal.SIGKILL)
    if launcher_pid is None:
        return

    def watch():
        while True:
            if not _alive(launcher_pid):
                os._exit(137)
            time.sleep(0.5)

    if not _alive(launcher_pid):
        os._exit(137)
    threading.Thread(target=watch, daemon=True, name="splitfed-watchdog").start()


def _report(rank: int, code: int) -> int:
    """Rank 0 writes its status for splitfed launch; under torchrun an orderly end of
    the run (an error it reported, a run that did not complete) then exits 0, so that
    torchrun does not wrap the one-line report in its own."""
    from splitfed.runtime.status import write_status

    if rank != 0 or not write_status("rank0", f"{code}\n"):
        return code
    return 0 if code in (2, 3) and "TORCHELASTIC_RUN_ID" in os.environ else code


def _take_launch_command() -> None:
    """Started by ``splitfed launch``: the launcher's command line becomes this process's
    ``sys.argv``, which the run's provenance records as its command (not the worker's)."""
    from splitfed.runtime.launch import COMMAND_ENV

    try:
        command = json.loads(os.environ.get(COMMAND_ENV, "null"))
    except ValueError:
        return
    if isinstance(command, list) and command and all(isinstance(c, str) for c in command):
        sys.argv = command


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as e:
        print(f"splitfed worker: {e.args[0]} is not set; start the ranks with splitfed "
              "launch or torchrun (docs/distributed.md)", file=sys.stderr)
        return 2
    except ValueError:
        rank = world = -1
    if not 0 <= rank < world:
        print(f"splitfed worker: RANK={os.environ['RANK']!r} and WORLD_SIZE="
              f"{os.environ['WORLD_SIZE']!r} must be integers with 0 <= RANK < WORLD_SIZE",
              file=sys.stderr)
        return 2
    _take_launch_command()
    launcher = os.environ.get("SPLITFED_LAUNCHER_PID")
    if launcher or "TORCHELASTIC_RUN_ID" in os.environ:
        guard(int(launcher) if launcher else None)
    import torch.distributed as dist

    from splitfed.runtime.launch import check_run_options
    from splitfed.runtime.session import RuntimeOptions, host, serve
    from splitfed.transport.distributed import Links, ServerLost

    try:
        check_run_options(args)
        _load_plugins(args)                 # every rank, before it builds anything
        secret, _server = join(rank, world, args.client_timeout, listen=args.listen,
                               store=args.store, secret_file=args.secret_file)
    except SplitfedError as e:
        print(f"splitfed: error: {e}", file=sys.stderr, flush=True)
        return _report(rank, 2)
    links = Links(rank, world, args.timeout, secret=secret,
                  client_timeout_s=args.client_timeout)
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
    except SplitfedError as e:             # a client rank refused a message
        print(f"splitfed: error: rank {rank}: {e}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    exit_code = _report(rank, code)
    if links.lost or links.abandoned or code:
        os._exit(exit_code)           # abandoned links: skip gloo's orderly shutdown
    dist.destroy_process_group()
    return exit_code


def _load_plugins(args) -> None:
    """The entry points of the group ``splitfed.plugins`` and the ``--plugin`` modules
    (a client rank imports the config's own plugins when it builds the config)."""
    from splitfed.registry import load_entry_points, load_plugins

    load_entry_points()
    load_plugins(args.plugin)


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
            result = serve(links, load_config(args.config, args.overrides,
                                              plugins=args.plugin),
                           options=options, run_dir=args.run_dir, overrides=args.overrides)
    except SplitfedError as e:        # reported first: the stop may wait for a hung rank
        print(f"splitfed: error: {e}", file=sys.stderr, flush=True)
        links.stop_all(f"error: {e}")
        return 2
    except BaseException:
        links.stop_all("error")
        raise
    n = result.numbers
    acc = n["final_test_acc"]
    what = (f"diverged at round {n['diverged_round']}" if n["diverged_round"] is not None
            else f"test accuracy {'n/a' if acc is None else f'{acc:.4f}'}")
    print(f"distributed run on {links.world_size} processes: status {result.status}, "
          f"{what}, wall time {result.wall_time_s:.1f} s")
    print(f"run directory: {result.run_dir}")
    return 0 if result.status == "completed" else 3


if __name__ == "__main__":
    sys.exit(main())
