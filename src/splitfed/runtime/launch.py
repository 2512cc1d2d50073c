"""Start a distributed run on this machine: ``splitfed launch CONFIG --nproc N``.

Two launchers, both binding to the loopback interface (``127.0.0.1``; gloo's
``GLOO_SOCKET_IFNAME=lo`` unless it is set):

- ``torchrun`` (default): ``python -m torch.distributed.run --standalone
  --nproc-per-node N -m splitfed.runtime.worker ...``. torchrun's agent stops every
  rank when one exits with an error: a client process that dies ends the run (resume
  it with ``--resume``).
- ``spawn``: starts the N processes itself and returns with rank 0: a client process
  that dies or hangs is dropped by rank 0 and the run goes on.

torch.distributed has no authentication: run it on trusted networks only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from splitfed.errors import ConfigError

WORKER = "splitfed.runtime.worker"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra or {})
    return env


def torchrun_command(nproc: int, worker_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={int(nproc)}", "-m", WORKER, *worker_args]


def spawn(nproc: int, worker_args: Sequence[str], *, port: int | None = None,
          module: str = WORKER, env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """Start ranks 0..nproc-1 of ``python -m module worker_args`` on 127.0.0.1."""
    port = port or free_port()
    procs = []
    for rank in range(int(nproc)):
        rank_env = _loopback_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  "RANK": str(rank), "LOCAL_RANK": str(rank),
                                  "WORLD_SIZE": str(int(nproc)), **(env or {})})
        procs.append(subprocess.Popen([sys.executable, "-m", module, *worker_args],
                                      env=rank_env, **popen))
    return procs


def wait_all(procs: list[subprocess.Popen], grace_s: float = 30.0) -> int:
    """Wait for rank 0, then give the other ranks ``grace_s`` seconds to exit (killing
    any that do not); returns rank 0's exit status."""
    code = procs[0].wait()
    deadline = time.monotonic() + grace_s
    for p in procs[1:]:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code


def worker_argv(args) -> list[str]:
    """The worker's command line from parsed ``splitfed launch`` arguments."""
    argv = [args.config] if args.config is not None else []
    argv += list(args.overrides)
    for flag, value in (("--resume", args.resume), ("--run-dir", args.run_dir),
                        ("--timeout", args.timeout), ("--client-timeout", args.client_timeout),
                        ("--real-delays", args.real_delays)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def launch(nproc: int, worker_args: Sequence[str], launcher: str = "torchrun") -> int:
    """Run the ranks on this machine; returns rank 0's (torchrun: the group's) status."""
    if nproc < 2:
        raise ConfigError("--nproc must be at least 2 (rank 0 serves, the others host "
                          "clients)")
    if launcher == "torchrun":
        return subprocess.call(torchrun_command(nproc, worker_args), env=_loopback_env())
    if launcher == "spawn":
        procs = spawn(nproc, worker_args)
        try:
            return wait_all(procs)
        except KeyboardInterrupt:
            for p in procs:
                p.kill()
            raise
    raise ConfigError(f"unknown launcher {launcher!r}; launchers: torchrun, spawn")
