"""Start a distributed run on this machine: ``splitfed launch CONFIG --nproc N``.

What listens where (docs/distributed.md, "Security"):

- the run's key-value store (:class:`splitfed.runtime.secure.StoreServer`), a thread of
  this process, bound to ``--listen`` (default ``127.0.0.1``). Every connection must
  prove the run's secret (HMAC-SHA256 challenge-response): a random secret per launch
  unless ``SPLITFED_SECRET`` or ``--secret-file`` gives one; an address that is not
  loopback is refused without one. The ranks join the process group through it
  (``init_process_group(store=...)``), not through torch's TCPStore;
- gloo's connections between the ranks, bound to the interface of ``--listen``
  (``GLOO_SOCKET_IFNAME``); they are not authenticated (the control messages they carry
  are: HMAC, and never pickled);
- torchrun's agent (``--launcher torchrun``) meets its workers through a FileStore in a
  private temporary directory (``--rdzv-backend c10d``, ``store_type=file``) and, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, hosts no TCP store.

Two launchers:

- ``torchrun`` (default): torchrun's agent stops every rank when one exits with an
  error: a client process that dies ends the run (one line names the rank, exit status
  1; resume it with ``--resume``). Once rank 0 has reported its status, the other ranks
  have :data:`GRACE_S` seconds to exit before the launcher stops them (a hung client
  rank that rank 0 dropped does not hold the launcher).
- ``spawn``: starts the N processes itself: a client process that dies or hangs is
  dropped by rank 0 and the run goes on. Once every client rank has ended, one at
  least with an error (they give up on a rank 0 that hangs after ``--client-timeout``),
  a rank 0 that logs no round for ``--client-timeout`` seconds (at least
  :data:`GRACE_S`) is stopped, and the launcher prints one line naming the first
  failed rank (exit status 1; resume the run).

The ranks die with the launcher (``PR_SET_PDEATHSIG`` and a watchdog on the launcher's
pid), run in their own session (Ctrl-C reaches the launcher only: it stops every rank,
prints one line and exits 130), and report their status to the launcher through a file
(so that torchrun does not wrap a ``splitfed: error:`` line in its own report).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from splitfed.errors import ConfigError, SplitfedError, Terminated, sigterm_interrupts
from splitfed.files import escape_controls, read_regular
from splitfed.runtime import secure
from splitfed.runtime.status import STATUS_ENV, run_dir_error, write_status

WORKER = "splitfed.runtime.worker"
#: most processes ``splitfed launch`` starts
MAX_NPROC = 256
LAUNCHER_ENV = "SPLITFED_LAUNCHER_PID"
#: the launcher's command line (a JSON list), which rank 0 records as the run's command
COMMAND_ENV = "SPLITFED_LAUNCH_COMMAND"
#: seconds the other ranks have to exit once rank 0 has ended (a rank that rank 0 dropped
#: may hang: it is stopped then)
GRACE_S = 30.0
#: the exit status of ``splitfed launch`` when a rank died before rank 0 reported the
#: run's status (the run can be resumed)
RANK_DIED = 1
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (no-op
    elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------- options


#: the longest wait an option may ask for: 30 days, in seconds (the process group's and
#: the sockets' timeouts overflow their C types far above it)
MAX_WAIT_S = 30 * 24 * 3600.0


def _positive(name: str, value, *, zero_ok: bool = False, most: float = MAX_WAIT_S) -> None:
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0) and value <= most
    if not ok:
        raise ConfigError(f"{name}: expected a number {'>= 0' if zero_ok else '> 0'} and "
                          f"<= {most:g}, got {value:g}")


def check_run_options(args) -> None:
    """The options every rank shares (``--timeout``, ``--client-timeout``,
    ``--real-delays``); raises :class:`ConfigError`."""
    _positive("--timeout", args.timeout)
    _positive("--client-timeout", args.client_timeout)
    _positive("--real-delays", args.real_delays, zero_ok=True)


def check_options(args) -> tuple[str, str | None]:
    """Every option of ``splitfed launch``, before anything starts; returns the listen
    address and the user's secret (None: a random one per launch)."""
    if not 2 <= args.nproc <= MAX_NPROC:
        raise ConfigError(f"--nproc: expected 2 to {MAX_NPROC} processes (rank 0 serves, "
                          f"the others host clients), got {args.nproc}")
    check_run_options(args)
    if args.launcher not in ("torchrun", "spawn"):
        raise ConfigError(f"--launcher: unknown launcher {args.launcher!r}; launchers: "
                          "torchrun, spawn")
    listen = secure.parse_address(args.listen or "127.0.0.1")
    secret = secure.read_secret(args.secret_file)
    secure.require_secret(listen, secret)
    return listen, secret


def check_config(args):
    """Check the run here as ``splitfed run --dry-run`` does (:func:`splitfed.plan.
    build_plan`: the config, the algorithm, the environment, the algorithm's check, where
    the run would write) and what only the runtime refuses (:func:`~splitfed.runtime.
    session.check_supported`), and open the MLflow store it names
    (:func:`splitfed.tracking.preflight`): a bad config is reported before any rank
    starts or anything is written. Returns the result of the run ``--resume`` names when
    it ended without keeping a checkpoint (nothing to run:
    :func:`splitfed.experiment.ended_without_checkpoint`), else None."""
    import dataclasses

    from splitfed.config import build_config, load_config
    from splitfed.configtools import load_yaml
    from splitfed.experiment import check_empty
    from splitfed.plan import build_plan
    from splitfed.runtime.session import check_supported
    from splitfed.tracking import preflight, remote_store

    if args.resume is not None:
        if args.config is not None or args.overrides:
            raise ConfigError("--resume RUN_DIR continues with RUN_DIR's own config.yaml; "
                              "give no CONFIG or key=value with it")
        saved = Path(args.resume) / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {args.resume}: no config.yaml there")
        cfg = build_config(load_yaml(saved))
        done = _check_resume(Path(args.resume), cfg)
        if done is not None:
            return done
    elif args.config is None:
        raise ConfigError("give a CONFIG (YAML file or shipped config name), or --resume "
                          "RUN_DIR")
    else:
        cfg = load_config(args.config, args.overrides,
                          plugins=getattr(args, "plugin", None))
    check_supported(cfg)
    where = args.resume if args.resume is not None else args.run_dir
    if where is not None:       # the run's own directory: it must be creatable beside it
        if args.run_dir is not None:
            try:
                check_empty(Path(args.run_dir))
            except OSError as e:
                raise run_dir_error(args.run_dir, e) from None
        build_plan(dataclasses.replace(cfg, out_dir=str(Path(where).parent)))
    else:
        build_plan(cfg, args.overrides)
    if not remote_store(cfg):               # build_plan opened a server's store
        preflight(cfg)
    if args.run_dir is not None:
        check_run_dir_creatable(Path(args.run_dir))


def check_run_dir_creatable(run_dir: Path) -> None:
    """Create ``run_dir`` (and its missing parents) and remove them again: a directory
    that cannot be created (a read-only or full file system, ``/proc``, a name too long)
    is refused here, with one line naming ``--run-dir``, before any rank starts. Rank 0
    creates it again when the run starts."""
    made: list[Path] = []
    try:
        missing = []
        path = run_dir
        while not path.exists() and not path.is_symlink():
            missing.append(path)
            if path.parent == path:
                break
            path = path.parent
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:         # "d/..", or made meanwhile by another
                if not path.is_dir():
                    raise
                continue
            made.append(path)
    except OSError as e:
        raise run_dir_error(run_dir, e) from None
    finally:
        for path in reversed(made):
            try:
                path.rmdir()
            except OSError:
                pass


def _check_resume(run_dir: Path, cfg):
    """The checkpoint of the run to resume, if any, is whole and was written under its
    ``config.yaml`` (:func:`splitfed.experiment.check_resume_config`), before any rank
    starts; rank 0 checks it again, with the rest, when it resumes. Without one: the
    run's result when it ended (:func:`splitfed.experiment.ended_without_checkpoint`),
    else None (rank 0 starts it again from round 0 in its directory)."""
    from splitfed.checkpoint import checkpoint_records, load_checkpoint
    from splitfed.experiment import check_resume_config, ended_without_checkpoint

    ckpt = load_checkpoint(run_dir, rounds=cfg.rounds)
    if ckpt is None:
        return ended_without_checkpoint(run_dir, cfg)
    check_resume_config(run_dir, ckpt, cfg, warn=False)
    checkpoint_records(run_dir, ckpt, rounds=cfg.rounds)
    return None


def worker_argv(args) -> list[str]:
    """The worker's command line from parsed ``splitfed launch`` arguments."""
    argv = [args.config] if args.config is not None else []
    argv += list(args.overrides)
    for flag, value in (("--resume", args.resume), ("--run-dir", args.run_dir),
                        ("--timeout", args.timeout), ("--client-timeout", args.client_timeout),
                        ("--real-delays", args.real_delays)):
        if value is not None:
            argv += [flag, str(value)]
    for plugin in getattr(args, "plugin", None) or ():
        argv += ["--plugin", plugin]
    return argv


# --------------------------------------------------------------------- processes


class Ranks(list):
    """The started processes (a list of :class:`subprocess.Popen`, rank order for
    ``spawn``) with the run's store server, secret and status directory."""

    server: secure.StoreServer
    secret: str
    status_dir: Path
    #: ``(rank, exit code)`` of the client ranks that failed before :func:`wait_all`
    #: stopped a rank 0 that did not end (empty otherwise)
    failed: list[tuple[int, int]]

    def status(self, default: int) -> int:
        """Rank 0's exit status as it reported it (``default`` if it did not)."""
        reported = self.reported()
        return default if reported is None else reported

    def _read(self, name: str) -> str | None:
        """The status file ``name`` as text: a regular file of at most
        :data:`MAX_STATUS_BYTES` (a pipe there cannot block the launcher); None when it
        is not there yet or is not such a file."""
        try:
            return read_regular(self.status_dir / name, name, MAX_STATUS_BYTES).decode(
                "utf-8")
        except (OSError, SplitfedError, UnicodeDecodeError):
            return None

    def reported(self) -> int | None:
        """Rank 0's exit status, once it has reported it (None before)."""
        text = (self._read("rank0") or "").strip()
        return int(text) if text.isascii() and text.isdigit() and len(text) < 4 else None

    def run_dir(self) -> str:
        """The run directory rank 0 writes, once it has made it (``RUN_DIR`` before)."""
        text = self._read("run_dir")
        return escape_controls(text) if text else "RUN_DIR"

    def failures(self) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of the workers whose failure ended torchrun's agent, the
        first first (a negative code: killed by that signal); empty when none."""
        text = self._read(FAILURES)
        try:
            data = json.loads(text) if text else []
        except (ValueError, RecursionError):
            return []
        if not isinstance(data, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(map(_small_int, p)) for p in data):
            return []
        return [(rank, code) for rank, code in data]

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.status_dir, ignore_errors=True)


def _small_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 31


#: a launcher's status directory: ``<tmp>/splitfed-launch-<launcher pid>-<random>``
STATUS_PREFIX = "splitfed-launch-"
#: the file in the status directory where torchrun's agent lists the failed workers
FAILURES = "failures.json"
#: the largest status file read back (an exit status, a path, a short list)
MAX_STATUS_BYTES = 1 << 16


def _remove_stale_status_dirs() -> None:
    """Remove this user's status directories whose launcher is gone: a launcher killed
    with SIGKILL cannot remove its own (its ranks die with it). A directory whose pid is
    alive (or whose name has no pid) stays."""
    uid = os.getuid()
    for path in Path(tempfile.gettempdir()).glob(f"{STATUS_PREFIX}*-*"):
        pid = path.name[len(STATUS_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.is_symlink() or path.lstat().st_uid != uid:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError, OverflowError):
            continue


def _setup(listen: str = "127.0.0.1", secret: str | None = None,
           env: dict | None = None) -> tuple[Ranks, dict]:
    secure.require_secret(listen, secret)
    iface = secure.interface_of(listen)
    secret = secret or secure.new_secret()
    ranks = Ranks()
    ranks.secret = secret
    ranks.failed = []
    ranks.server = secure.StoreServer(secret, listen, 0)
    _remove_stale_status_dirs()
    ranks.status_dir = Path(tempfile.mkdtemp(prefix=f"{STATUS_PREFIX}{os.getpid()}-"))
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", secure.SECRET_ENV)}
    base.update({"GLOO_SOCKET_IFNAME": iface, secure.STORE_ENV: ranks.server.endpoint,
                 secure.SECRET_ENV: secret, secure.LISTEN_ENV: listen,
                 LAUNCHER_ENV: str(os.getpid()), STATUS_ENV: str(ranks.status_dir),
                 **(env or {})})
    return ranks, base


def spawn(nproc: int, worker_args: Sequence[str], *, module: str = WORKER,
          env: dict | None = None, listen: str = "127.0.0.1", secret: str | None = None,
          **popen) -> Ranks:
    """Start ranks 0..nproc-1 of ``python -m module worker_args``, with this process
    hosting the run's store (on ``listen``) and the ranks in their own session, dying
    with this process."""
    ranks, base = _setup(listen, secret, env)
    for rank in range(int(nproc)):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(int(nproc))}
        ranks.append(subprocess.Popen([sys.executable, "-m", module, *worker_args],
                                      env=rank_env, start_new_session=True, **popen))
    return ranks


def torchrun_command(nproc: int, worker_args: Sequence[str], rdzv_dir: Path) -> list[str]:
    """torchrun's agent, started through this module's ``__main__`` (it dies with the
    launcher); its rendezvous file and its log directory are in ``rdzv_dir`` (the
    launcher's status directory, removed when the launcher ends)."""
    return [sys.executable, "-m", __name__, "--nnodes=1",
            f"--nproc-per-node={int(nproc)}", "--max-restarts=0",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_dir / 'rendezvous'}",
            "--rdzv-conf=store_type=file", f"--rdzv-id=splitfed-{os.getpid()}",
            f"--log-dir={rdzv_dir / 'torchelastic'}",
            "-m", WORKER, *worker_args]


def torchrun(nproc: int, worker_args: Sequence[str], *, listen: str = "127.0.0.1",
             secret: str | None = None, env: dict | None = None, **popen) -> Ranks:
    """Start torchrun's agent (one process, listed alone) with ``nproc`` workers."""
    ranks, base = _setup(listen, secret, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                          **(env or {})})
    base.setdefault("OMP_NUM_THREADS", "1")
    ranks.append(subprocess.Popen(torchrun_command(nproc, worker_args, ranks.status_dir),
                                  env=base, start_new_session=True, **popen))
    return ranks


def wait_all(procs: list[subprocess.Popen], grace_s: float | None = None,
             poll_s: float = 0.2, patience_s: float | None = None) -> int:
    """Wait for the ranks that :func:`spawn` started (rank 0 first); returns rank 0's
    exit status.

    Once rank 0 has ended, the other ranks have ``grace_s`` seconds (:data:`GRACE_S`)
    to exit; any that does not is killed. A client rank that ends before rank 0 is
    dropped by rank 0 and the run goes on (alone, rank 0 finishes the remaining rounds
    without clients); but once every client rank has ended, at least one with a failure
    (they give up on a rank 0 that does not answer within ``--client-timeout``), rank 0
    is stopped when it makes no progress (no record added to the run's
    ``metrics.jsonl``) for ``patience_s`` seconds (at least ``grace_s``; the client
    ranks' ``--client-timeout`` in ``splitfed launch``): a hung rank 0 does not hold the
    launcher, one that still runs its rounds is left to finish them. The client ranks
    that failed, in the order they ended, are then in ``procs.failed`` (a
    :class:`Ranks`)."""
    grace = GRACE_S if grace_s is None else grace_s
    patience = grace if patience_s is None else max(grace, patience_s)
    failed: list[tuple[int, int]] = []
    deadline, seen = None, None         # for rank 0, once no client rank is left
    while (code := procs[0].poll()) is None:
        for rank, p in enumerate(procs[1:], 1):
            status = p.poll()
            if status and all(rank != r for r, _ in failed):
                failed.append((rank, status))
        if failed and all(p.poll() is not None for p in procs[1:]):
            mark = _progress(procs)
            if deadline is None or mark != seen:
                deadline, seen = time.monotonic() + patience, mark
        if deadline is not None and time.monotonic() >= deadline:
            stop(procs)
            if isinstance(procs, Ranks):
                procs.failed = failed
            return procs[0].returncode
        time.sleep(poll_s)
    deadline = time.monotonic() + grace
    for p in procs[1:]:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code


def wait_agent(ranks: Ranks, grace_s: float | None = None, poll_s: float = 0.2) -> int:
    """Wait for torchrun's agent (``ranks[0]``); once rank 0 has reported its status,
    give the agent and its other workers ``grace_s`` seconds (:data:`GRACE_S`) to exit,
    then stop them (a client rank that hangs keeps torchrun's agent waiting for ever).
    Returns the agent's exit status, or rank 0's when the agent was stopped."""
    agent = ranks[0]
    deadline = None
    while True:
        code = agent.poll()
        if code is not None:
            return code
        if deadline is None and ranks.reported() is not None:
            deadline = time.monotonic() + (GRACE_S if grace_s is None else grace_s)
        if deadline is not None and time.monotonic() >= deadline:
            stop(ranks)
            return ranks.status(1)
        time.sleep(poll_s)


def describe_exit(code: int) -> str:
    """A process's exit code in words: ``signal SIGKILL`` or ``exit status 1``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the processes and everything they started (torchrun's workers). All are
    stopped (SIGSTOP) before any is killed: a rank killed first would reset its links,
    and a rank still running could print that as its own failure."""
    alive = [p.pid for p in procs if p.poll() is None]
    below = [d for pid in alive for d in descendants(pid)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in [*alive, *below]:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    for p in procs:
        p.wait()


def _progress(procs) -> tuple | None:
    """What changes when rank 0 logs a round: the size and time of its run's
    ``metrics.jsonl`` (None before rank 0 has told the launcher its run directory)."""
    if getattr(procs, "status_dir", None) is None or procs.run_dir() == "RUN_DIR":
        return None
    try:
        st = (Path(procs.run_dir()) / "metrics.jsonl").stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def launch(args) -> int:
    """``splitfed launch``: check the options and the config, start the ranks, wait;
    returns rank 0's status (0 completed, 2 error, 3 another end of the run), 130 after
    Ctrl-C, 143 after SIGTERM (:func:`splitfed.errors.sigterm_interrupts`)."""
    with sigterm_interrupts():
        return _launch(args)


def _launch(args) -> int:
    ranks = None
    try:
        listen, secret = check_options(args)
        done = check_config(args)
        if done is not None:                # it ended and kept no checkpoint: its result
            from splitfed.config import load_config
            from splitfed.experiment import summary_line

            print(summary_line(load_config(done.run_dir / "config.yaml"), done))
            print(f"run directory: {done.run_dir}")
            return 0 if done.status == "completed" else 3
        start = spawn if args.launcher == "spawn" else torchrun
        ranks = start(args.nproc, worker_argv(args), listen=listen, secret=secret,
                      env={COMMAND_ENV: json.dumps(list(sys.argv))})
        code = (wait_all(ranks, patience_s=args.client_timeout) if args.launcher == "spawn"
                else wait_agent(ranks))
        if ranks.reported() is None:
            return _died(ranks, args, code)
        return ranks.status(code)
    except KeyboardInterrupt as e:
        interrupted = not isinstance(e, Terminated)
        what = "interrupted" if interrupted else "terminated"
        if ranks is not None:
            stop(ranks)
        reported = None if ranks is None else ranks.reported()
        if reported is None:
            print(f"splitfed: {what}: all ranks stopped ({_next_step(ranks, args)})",
                  file=sys.stderr, flush=True)
        else:
            print(f"splitfed: {what}: the run had already ended (exit status {reported}); "
                  "the remaining ranks stopped", file=sys.stderr, flush=True)
        return 130 if interrupted else 143
    finally:
        if ranks is not None:
            ranks.close()


def _next_step(ranks: Ranks | None, args) -> str:
    """What continues the run, whole, to be copied (as ``splitfed run``'s own hint): the
    resume command of its directory, or, when rank 0 had not made one yet, the same
    command again (nothing was written)."""
    made = ranks.run_dir() if ranks is not None else "RUN_DIR"
    run_dir = args.resume or (None if made == "RUN_DIR" else made)
    if run_dir is None:
        return "no run directory was made yet: run the same command again"
    return f"continue the run with splitfed launch --resume {run_dir} --nproc {args.nproc}"


def _died(ranks: Ranks, args, code: int) -> int:
    """Rank 0 did not report the run's status: a rank died (under torchrun: a worker
    failed and the agent stopped the others; under spawn: rank 0, or every client rank
    and then the launcher stopped a rank 0 that did not end). One line says which rank
    and how to continue; returns :data:`RANK_DIED`."""
    if args.launcher == "torchrun":
        failures = ranks.failures()
        stopped = "; torchrun stopped the other ranks"
    elif ranks.failed:
        failures = ranks.failed
        patience = max(GRACE_S, args.client_timeout)
        stopped = (f"; no client rank was left and rank 0 logged no round for "
                   f"{patience:g} s: the launcher stopped it")
    else:
        failures, stopped = [(0, code)], ""
    if failures:
        rank, why = failures[0]
        what = f"rank {rank} {'died' if why < 0 else 'failed'} ({describe_exit(why)})"
    else:
        what = f"the ranks ended without rank 0's status ({describe_exit(code)})"
    print(f"splitfed: error: {what}{stopped}; {_next_step(ranks, args)}", file=sys.stderr,
          flush=True)
    return RANK_DIED


def _agent_main() -> None:
    """``python -m splitfed.runtime.launch TORCHRUN_ARGS``: torchrun's agent that dies
    with the launcher that started it (``PR_SET_PDEATHSIG``)."""
    die_with_parent(signal.SIGKILL)
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and os.getppid() != int(launcher):
        os._exit(137)                   # the launcher was gone before the line above
    sys.argv = ["torchrun", *sys.argv[1:]]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "LOGLEVEL" not in os.environ:    # torchrun's own level setting, else quiet
        _quiet_agent()
    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError as e:       # the launcher prints one line, not this report
        _record_failures(e)
        sys.exit(RANK_DIED)


def _quiet_agent() -> None:
    """Keep torchrun's agent from logging its warnings and its report on a failed worker
    (it stops the other ranks with SIGTERM, logs it, ...): the launcher prints one line."""
    import logging

    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def _record_failures(e) -> None:
    """Write the failed workers of torchrun's ``ChildFailedError`` (rank, exit code; the
    first failure first) into the launcher's status directory."""
    first = e.get_first_failure()[0]
    failures = sorted(e.failures.items(), key=lambda kv: (kv[0] != first, kv[1].timestamp))
    write_status(FAILURES, json.dumps([[int(rank), int(f.exitcode)] for rank, f in failures]))


if __name__ == "__main__":
    _agent_main()
