"""Running a study's runs side by side: worker processes of this machine, or the workers
of a Dask cluster.

The parent process (:func:`splitfed.study.run_study`) checks and locks the study and
decides what each run needs (:mod:`splitfed.study.reuse`); the runs to do are then
handed out one at a time as :class:`PointTask` and executed by :func:`run_point`, the one
function every mode shares: it imports the config's plugins, sets PyTorch's thread count
and runs (or resumes) the run in its directory. It returns a :class:`PointResult`: the
run's records, or why it failed; a failing run does not stop the others.

- :func:`run_local`: ``jobs`` long-lived worker processes of the ``spawn`` start method
  (``fork`` is unsafe once PyTorch has started threads), each with its own pipe. The
  parent sends one task at a time to an idle worker and waits on the pipes and the
  processes' sentinels (:func:`multiprocessing.connection.wait`). A worker that dies
  loses only the run it was running (reported as failed: its directory is resumed by the
  next invocation) and is replaced. (:class:`concurrent.futures.ProcessPoolExecutor` is
  not used: one dead worker breaks its whole pool, and every run in flight with it.)
- :func:`run_dask`: the tasks go to a Dask ``distributed`` scheduler, an existing one
  (``address``, or ``DASK_SCHEDULER_ADDRESS``) or a :func:`local_cluster` of ``jobs``
  single-threaded worker processes listening on 127.0.0.1 only. Dask reruns a task whose
  worker died (up to its ``distributed.scheduler.allowed-failures``); the rerun resumes
  the run from its directory.

Ctrl-C: the workers of :func:`run_local` get SIGINT too (one process group); the parent
waits for them for a few seconds, terminates those still running and raises
:class:`~splitfed.errors.RunInterrupted`. The run directories stay resumable. On Linux a
worker also ends when the parent dies, however it dies.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import operator
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING

from splitfed.errors import ConfigError, PluginError, RunInterrupted, SplitfedError, one_line
from splitfed.files import is_user_os_error, os_error_message
from splitfed.locking import LOCK_NAME

if TYPE_CHECKING:
    from splitfed.config import RunConfig

#: the executors of ``--executor``
EXECUTORS = ("local", "dask")
#: the largest ``--threads``
MAX_THREADS = 1024
#: seconds the parent waits for its workers to stop after Ctrl-C before terminating them
GRACE_S = 10.0
#: how a missing Dask is answered
INSTALL_DASK = "pip install 'splitfed[cluster]'"
_ADDRESS = re.compile(r"(?:(?:tcp|tls)://)?([^\s/:]+|\[[0-9a-fA-F:.]+\]):([0-9]{1,5})")
#: the largest ``--jobs``
MAX_JOBS = 1024


# --------------------------------------------------------------------- options


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it,
    else the number of CPUs)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_options(jobs: int | None = None, threads: int = 1, executor: str | None = None,
                  address: str | None = None) -> None:
    """Raise :class:`~splitfed.errors.ConfigError`, naming the option and what it takes,
    for a bad ``--jobs``, ``--threads``, ``--executor`` or ``--address``, or for
    ``--executor dask`` without Dask installed; and :class:`~splitfed.errors.SplitfedError`
    when called from the top level of a script that a worker process is importing again
    (:func:`_in_worker_import`). Writes and starts nothing."""
    script = _in_worker_import()
    if script is not None:
        raise SplitfedError(f"a study worker process imported {script} again and it started "
                            "a study or sweep at its top level; put the run_study / "
                            "run_sweep call under `if __name__ == \"__main__\":` (each "
                            "worker process imports the script that started it)")
    if jobs is not None and (not _whole(jobs) or not 1 <= jobs <= MAX_JOBS):
        raise ConfigError(f"--jobs: expected a whole number from 1 to {MAX_JOBS} (runs at "
                          f"the same time; default: the usable cores), got {jobs!r}")
    if not _whole(threads) or not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"--threads: expected a whole number from 1 to {MAX_THREADS} "
                          f"(PyTorch threads per run; default 1), got {threads!r}")
    if executor is not None and executor not in EXECUTORS:
        raise ConfigError(f"--executor: expected one of {', '.join(EXECUTORS)}, got "
                          f"{executor!r}")
    if address is not None:
        if executor != "dask":
            raise ConfigError("--address: a Dask scheduler's address, only with "
                              "--executor dask")
        if not valid_address(address):
            raise ConfigError(f"--address: expected a Dask scheduler address tcp://HOST:PORT "
                              f"or tls://HOST:PORT (port 1 to 65535), e.g. "
                              f"tcp://10.0.0.5:8786, got {address!r}")
    if executor == "dask":
        import_distributed()


def _whole(value) -> bool:
    try:
        return not isinstance(value, bool) and operator.index(value) == value
    except TypeError:
        return False


def valid_address(address) -> bool:
    """Whether ``address`` is ``[tcp://|tls://]HOST:PORT`` with a port from 1 to 65535."""
    m = _ADDRESS.fullmatch(address) if isinstance(address, str) else None
    return m is not None and 1 <= int(m.group(2)) <= 65535


def resolve_jobs(jobs: int | None, left: int) -> int:
    """How many runs go at the same time: ``jobs`` (None: :func:`usable_cores`), at most
    the ``left`` runs to do, at least 1."""
    return max(1, min(usable_cores() if jobs is None else jobs, left))


def import_distributed():
    """The ``distributed`` module, or a :class:`~splitfed.errors.ConfigError` saying how
    to install it."""
    try:
        import distributed
    except ImportError:
        raise ConfigError(f"--executor dask: Dask's distributed scheduler is not "
                          f"installed; install it with {INSTALL_DASK}") from None
    return distributed


# ---------------------------------------------------------------- one point


@dataclass
class PointTask:
    """One run to do, as a worker gets it."""

    index: int            # the run's position in the study's runs
    label: str
    seed: int
    config: RunConfig
    run_dir: Path
    state: str            # new, unfinished or stale (splitfed.study.reuse.run_dir_state)
    threads: int = 1      # PyTorch threads
    progress: bool = False


@dataclass
class PointResult:
    """What :func:`run_point` gave: the run's status, records, measured wall time and
    recorded provenance, or ``error`` (why it failed; the rest is then empty)."""

    index: int
    status: str | None = None
    records: list[dict] = field(default_factory=list)
    wall_time_s: float = 0.0
    provenance: dict | None = None
    error: str | None = None


def run_point(task: PointTask) -> PointResult:
    """Execute one run of a study, in this process: import the config's plugins (and the
    installed entry points), set PyTorch's thread count to ``task.threads``, then run it
    into ``task.run_dir``:

    - a stale run (finished by other code, its ``summary.json`` still there) is replaced;
    - a directory holding a checkpoint is resumed from it (an interrupted run, or one
      whose worker died earlier in this study);
    - anything else left in the directory (a run interrupted before its first checkpoint)
      is cleared and the run starts from round 0; the MLflow run it recorded in a store
      outside the directory is deleted (:func:`splitfed.tracking.discard_recorded_run`).

    The parent has checked that the directory holds nothing but a run of this config.
    Failures are returned, not raised (``error``: the message of a splitfed error or of
    an error of the user's disk or files (a full disk), else ``<type>: <message>`` with
    the traceback printed on stderr; a ``SystemExit`` a
    plugin raises is a failure of its run too, in this process as in a worker); Ctrl-C raises
    :class:`~splitfed.errors.RunInterrupted`."""
    import torch

    from splitfed.checkpoint import CHECKPOINT
    from splitfed.experiment import lock_run_dir
    from splitfed.registry import load_entry_points, load_plugins
    from splitfed.study.reuse import FINISHED, read_json
    from splitfed.tracking import discard_recorded_run

    try:
        load_entry_points()
        load_plugins(task.config.plugins)
        torch.set_num_threads(task.threads)
        run_experiment, resume_experiment = _experiment()
        d = Path(task.run_dir)
        finished = read_json(d / "summary.json").get("status") in FINISHED
        if not (task.state == "stale" and finished) and (d / CHECKPOINT).is_file():
            result = resume_experiment(d)
        else:
            if d.is_dir() and any(p.name != LOCK_NAME for p in d.iterdir()):
                with lock_run_dir(d):                # never clear a run being written
                    if not finished:                 # an interrupted attempt's MLflow
                        discard_recorded_run(d)      # run in a shared store goes too
                    clear_dir(d)
            cfg = dataclasses.replace(task.config, progress=task.progress)
            result = run_experiment(cfg, run_dir=d)
        prov = read_json(d / "summary.json").get("provenance")
        return PointResult(task.index, result.status, result.records, result.wall_time_s,
                           prov if isinstance(prov, dict) else None)
    except RunInterrupted:
        raise
    except SplitfedError as e:
        cause = e.__cause__
        if isinstance(e, PluginError) and isinstance(cause, Exception) and not isinstance(
                cause, SplitfedError):               # a plugin's own exception: where it was
            print(f"splitfed: run {task.label!r} (seed {task.seed}) failed:", file=sys.stderr)
            traceback.print_exception(cause)
            sys.stderr.flush()
        return PointResult(task.index, error=str(e))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - one run's failure (a plugin's
        # sys.exit() too) must not stop the others
        if isinstance(e, OSError) and is_user_os_error(e):     # a full disk: one line,
            return PointResult(task.index, error=os_error_message(e))  # as a run says it
        print(f"splitfed: run {task.label!r} (seed {task.seed}) failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        if isinstance(e, SystemExit):
            code = e.code if isinstance(e.code, int) else repr(e.code)[:80]
            return PointResult(task.index, error=f"the run called exit (SystemExit: {code})")
        return PointResult(task.index, error=f"{type(e).__name__}: {e}")


def clear_dir(d: Path) -> None:
    """Remove everything in ``d`` but its lock file, which the caller holds: deleting
    a held lock file would let another process lock a new one and write ``d`` too."""
    for p in d.iterdir():
        if p.name == LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _experiment():
    """run_experiment and resume_experiment, looked up on :mod:`splitfed.study` when
    called, so that replacing ``splitfed.study.run_experiment`` (as tests do) takes
    effect."""
    import splitfed.study as package

    return package.run_experiment, package.resume_experiment


#: called with a task when it starts (``again``: a rerun after its worker died)
OnStart = Callable[[PointTask, bool], None]
#: called with a task and its result when it ends
OnFinish = Callable[[PointTask, PointResult], None]


# ------------------------------------------------------------- the local pool


def _worker(conn, handle_sigint: bool = True) -> None:
    """A worker process: says it is ready, then runs the tasks it receives one at a time
    and sends each result back, until it receives None or its pipe closes.

    It starts with SIGINT ignored (:class:`_Worker`): a Ctrl-C while it imports does not
    print a traceback (the parent then closes its pipe, which ends it here). From here
    on, Ctrl-C ends it quietly (``handle_sigint``; False when the parent ignores SIGINT,
    e.g. started in the background by a shell without job control)."""
    try:
        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing semaphore, which a worker killed by a
        # signal would leave behind (a "leaked semaphore" warning at exit); the workers
        # show no progress bars
        tqdm.set_lock(threading.RLock())
        _die_with_parent()
        if handle_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        # the parent blocked SIGINT while it started this process (_Worker), and a
        # process inherits its parent's signal mask
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        conn.send("ready")
        while True:
            task = conn.recv()
            if task is None:
                return
            conn.send(run_point(task))
    except (KeyboardInterrupt, RunInterrupted):
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # stopping already
        try:
            conn.send("interrupted")
        except (OSError, ValueError):
            pass
    except (EOFError, OSError):     # the parent has gone
        pass


def _die_with_parent() -> None:
    """On Linux, have the kernel send this process SIGTERM when its parent dies (a parent
    killed by SIGKILL cannot stop its workers), so that no run goes on unwatched; its
    directory stays resumable. Elsewhere, a worker ends when its run ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:   # it died before the prctl
        os._exit(1)


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        interactive = (threading.current_thread() is not threading.main_thread()
                       or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
        self.process = ctx.Process(target=_worker, args=(child, interactive), daemon=True,
                                   name="splitfed-study-worker")
        if threading.current_thread() is not threading.main_thread():
            self.process.start()            # signal handlers belong to the main thread
        else:
            # the new process starts with SIGINT ignored (an ignored signal stays ignored
            # across exec; see _worker); here a Ctrl-C in the meantime is blocked, so it
            # is delivered once the handler is back, not lost
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self.process.start()
            finally:
                signal.signal(signal.SIGINT, handler)
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self.ready = False
        self.task: PointTask | None = None

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def _in_worker_import() -> str | None:
    """The script's path when the caller runs at the top level of the main script that a
    ``spawn`` worker process is importing again (as ``__mp_main__``, to find what the
    parent defined there), else None."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "<module>"
                and frame.f_globals.get("__name__") == "__mp_main__"):
            return str(frame.f_globals.get("__file__", "the main script"))
        frame = frame.f_back
    return None


def _script_hint() -> str:
    """For the error of workers that exit as they start: the guard a script needs."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or Path(path).stem in ("splitfed", "__main__"):
        return ""
    return (f"; a script that starts a study or sweep ({path}) must do it under "
            "`if __name__ == \"__main__\":`, since each worker process imports it again")


def run_local(tasks: list[PointTask], jobs: int, on_start: OnStart,
              on_finish: OnFinish) -> None:
    """Run ``tasks`` on ``jobs`` worker processes of this machine (see the module doc);
    ``on_start`` and ``on_finish`` are called in this process as runs start and end, a
    run whose worker died ending with ``error`` ``worker process died (exit code N);
    run the command again to resume it``. Ctrl-C raises
    :class:`~splitfed.errors.RunInterrupted` once the workers have stopped."""
    ctx = multiprocessing.get_context("spawn")
    pending = deque(tasks)
    workers: list[_Worker] = []
    failed_starts = 0
    try:
        for _ in range(min(jobs, len(pending))):
            workers.append(_Worker(ctx))
        while pending or any(w.task is not None for w in workers):
            for w in workers:
                if w.ready and w.task is None and pending:
                    task = pending.popleft()
                    try:
                        w.conn.send(task)
                    except OSError:             # it has just died: the sentinel says so
                        pending.appendleft(task)
                        continue
                    w.task = task
                    on_start(task, False)
            ready = wait([w.conn for w in workers] + [w.process.sentinel for w in workers])
            for w in list(workers):
                message = None
                if w.conn in ready or w.process.sentinel in ready:
                    message = _receive(w)
                if message == "ready":
                    w.ready, failed_starts = True, 0
                elif message == "interrupted":
                    raise KeyboardInterrupt
                elif isinstance(message, PointResult):
                    task, w.task = w.task, None
                    on_finish(task, message)
                elif message is _DEAD:
                    w.process.join(5)
                    code = w.process.exitcode
                    workers.remove(w)
                    w.close()
                    if w.task is not None:
                        on_finish(w.task, PointResult(w.task.index, error=(
                            f"worker process died (exit code {code}); run the command "
                            "again to resume it")))
                    elif not w.ready:
                        failed_starts += 1
                        if failed_starts > 3:
                            raise SplitfedError(f"study worker processes exit as they "
                                                f"start (exit code {code}); run with "
                                                f"--jobs 1 to see why{_script_hint()}")
                    if pending and len(workers) < jobs:
                        workers.append(_Worker(ctx))
        for w in workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in workers:
            w.process.join(GRACE_S)
            if w.process.is_alive():
                w.process.terminate()
            w.close()
    except KeyboardInterrupt:
        _stop(workers)
        raise RunInterrupted(None) from None
    except BaseException:
        _stop(workers, grace=0.0)
        raise


_DEAD = object()


def _join(workers: list[_Worker], deadline: float) -> None:
    """Wait until every worker has ended, or until ``deadline`` (time.monotonic)."""
    alive = [w.process.sentinel for w in workers if w.process.is_alive()]
    while alive and time.monotonic() < deadline:
        wait(alive, timeout=max(0.0, deadline - time.monotonic()))
        alive = [w.process.sentinel for w in workers if w.process.is_alive()]


def _receive(w: _Worker):
    """The worker's next message if one is waiting, :data:`_DEAD` when it has died (or
    its message cannot be read), else None."""
    try:
        if w.conn.poll():
            return w.conn.recv()
    except (EOFError, OSError):
        return _DEAD
    except Exception:  # noqa: BLE001 - a torn or unreadable message: the worker is lost
        w.process.kill()
        return _DEAD
    return None if w.process.is_alive() else _DEAD


def _stop(workers: list[_Worker], grace: float = GRACE_S) -> None:
    """Close the pipes (idle workers exit), give the workers up to ``grace`` seconds to
    end (those still running after a second are sent SIGINT: the signal may have come to
    this process alone), then terminate (and at last kill) the ones left."""
    for w in workers:
        w.close()
    deadline = time.monotonic() + grace
    if grace > 0:
        _join(workers, min(deadline, time.monotonic() + 1.0))
        for w in workers:
            if w.process.is_alive():
                try:
                    os.kill(w.process.pid, signal.SIGINT)
                except OSError:
                    pass
    _join(workers, deadline)
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(2)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()


# ----------------------------------------------------------------------- Dask


def local_cluster(jobs: int):
    """A Dask ``LocalCluster`` of ``jobs`` worker processes with one thread each, every
    server of it listening on 127.0.0.1 only, no dashboard, no memory limit (the nanny
    would otherwise restart a worker whose run needs more than its share).

    The workers start without the ``MALLOC_TRIM_THRESHOLD_=65536`` that Dask's nanny sets
    by default (``distributed.nanny.pre-spawn-environ``): with it glibc returns freed
    memory to the system after nearly every tensor PyTorch frees, and training runs
    measured 2.4 times slower (LeNet-5, batch 32, one thread). Workers of a cluster
    started elsewhere need the same setting (docs/studies.md)."""
    import dask

    distributed = import_distributed()
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ}):
        return distributed.LocalCluster(n_workers=jobs, threads_per_worker=1,
                                        processes=True, host="127.0.0.1",
                                        dashboard_address=None, memory_limit=0,
                                        silence_logs=logging.ERROR)


def _scheduler_address(address: str | None) -> str | None:
    """``address``, else Dask's ``scheduler-address`` setting (``DASK_SCHEDULER_ADDRESS``),
    else None."""
    import dask

    return address or dask.config.get("scheduler-address", None) or None


def _connect(address: str):
    """A Dask client of the scheduler at ``address``, or a ConfigError saying why not."""
    distributed = import_distributed()
    if not valid_address(address):
        raise ConfigError(f"--executor dask: the scheduler address {address!r} (from "
                          "--address or DASK_SCHEDULER_ADDRESS) is not tcp://HOST:PORT or "
                          "tls://HOST:PORT")
    try:
        return distributed.Client(address)
    except Exception as e:  # noqa: BLE001 - whatever Dask raises, one line names it
        raise ConfigError(f"--executor dask: cannot reach the Dask scheduler at {address} "
                          f"({one_line(e, None) or type(e).__name__})") from None


def check_scheduler(executor: str | None, address: str | None) -> None:
    """With ``executor="dask"`` and a scheduler address (given, or Dask's setting):
    connect once and close, so that an unreachable scheduler is refused before anything
    is written (:class:`~splitfed.errors.ConfigError`)."""
    if executor != "dask":
        return
    import_distributed()
    address = _scheduler_address(address)
    if address:
        _connect(address).close()


def _dask_point(task: PointTask, topic: str) -> PointResult:
    """The Dask task: say that the run starts (an event on ``topic``), then
    :func:`run_point`."""
    from distributed import get_worker

    try:
        get_worker().log_event(topic, {"index": task.index})
    except Exception:  # noqa: BLE001 - the start line is not worth failing the run
        pass
    return run_point(task)


def run_dask(tasks: list[PointTask], jobs: int, address: str | None, on_start: OnStart,
             on_finish: OnFinish) -> None:
    """Run ``tasks`` on a Dask cluster: the scheduler at ``address`` (None: Dask's
    ``scheduler-address`` setting, e.g. the environment variable
    ``DASK_SCHEDULER_ADDRESS``), or when neither is set a :func:`local_cluster` of
    ``jobs`` workers, closed at the end. A task whose worker died is rerun by Dask (it
    resumes the run from its directory); after Dask's ``allowed-failures`` the run fails.
    Ctrl-C cancels the tasks and raises :class:`~splitfed.errors.RunInterrupted`."""
    distributed = import_distributed()
    address = _scheduler_address(address)
    cluster = client = None
    futures: dict = {}
    try:
        if address:
            client = _connect(address)
        else:
            cluster = local_cluster(jobs)
            client = distributed.Client(cluster)
        topic = f"splitfed-start-{uuid.uuid4().hex}"
        events: queue.Queue = queue.Queue()
        client.subscribe_topic(topic, events.put)
        by_index = {t.index: t for t in tasks}
        futures = {client.submit(_dask_point, t, topic, pure=False,
                                 key=f"splitfed-run-{t.index}-{uuid.uuid4().hex}"): t
                   for t in tasks}
        started: set[int] = set()
        pending = set(futures)

        def drain():
            while True:
                try:
                    _, msg = events.get_nowait()
                except queue.Empty:
                    return
                index = msg.get("index") if isinstance(msg, dict) else None
                if index in by_index:
                    on_start(by_index[index], index in started)
                    started.add(index)

        while pending:
            drain()
            done = [f for f in pending if f.done()]
            if not done:
                time.sleep(0.1)
                continue
            drain()
            for f in sorted(done, key=lambda f: futures[f].index):
                pending.discard(f)
                task = futures[f]
                started.add(task.index)
                on_finish(task, _dask_result(f, task))
    except KeyboardInterrupt:
        if client is not None:
            try:
                client.cancel(list(futures))
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        raise RunInterrupted(None) from None
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()


def _dask_result(future, task: PointTask) -> PointResult:
    if future.status == "finished":
        result = future.result()
        if isinstance(result, PointResult):
            return result
        return PointResult(task.index, error=f"the Dask task returned {type(result)}")
    if future.status == "cancelled":
        return PointResult(task.index, error="cancelled by the Dask scheduler; run the "
                                             "command again to resume it")
    e = future.exception()
    if type(e).__name__ == "KilledWorker":
        return PointResult(task.index, error=(
            "its Dask worker died each time it ran (the scheduler's allowed-failures); run "
            "the command again to resume it"))
    return PointResult(task.index, error=f"{type(e).__name__}: {e}")
