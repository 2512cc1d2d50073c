"""How ``splitfed launch`` ends when a rank does not: a client rank that hangs after rank
0 has ended the run, a client rank killed under torchrun; and what a launch leaves in
the temporary directory.

Real launches are bounded by timeouts, and every process a test starts is killed at its
end (the ranks are found by the launcher's pid in their environment).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from splitfed.runtime import launch, secure

HERE = Path(__file__).parent
LIMIT_S = 120
#: ``splitfed launch`` with the launcher's grace period set by the first argument
LAUNCHER = ("import sys; from splitfed.runtime import launch; "
            "launch.GRACE_S = float(sys.argv[1]); from splitfed.cli import main; "
            "sys.exit(main(sys.argv[2:]))")
#: a run whose rounds take about a second (real delays), so that a rank can be stopped
#: in the middle
RUN = ["quick_digits", "algorithm.name=sflv2", "progress=false", "--real-delays", "1",
       "--timeout", "3"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != secure.SECRET_ENV}
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def _start(run_dir, *extra, grace_s=30.0, rounds=6, nproc=3, launcher="torchrun", env=None):
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(grace_s), "launch", *RUN,
                             f"rounds={rounds}", "--nproc", str(nproc), "--launcher",
                             launcher, "--run-dir", str(run_dir), *extra],
                            env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _launched_by(pid: int) -> dict[int, int]:
    """``{pid: RANK}`` of the live processes that name ``pid`` as their launcher (the
    ranks, and torchrun's agent as rank -1)."""
    out = {}
    needle = f"{launch.LAUNCHER_ENV}={pid}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in env and state not in ("Z", "X"):
            rank = next((v[5:] for v in env if v.startswith(b"RANK=")), b"-1")
            out[int(entry.name)] = int(rank)
    return out


def _kill_all(proc) -> None:
    for pid in _launched_by(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.kill()
    proc.communicate()


def _wait_for(cond, proc, what, limit_s=LIMIT_S):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited ({proc.returncode}) before {what}: "
                        f"{proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    pytest.fail(f"{what} did not happen within {limit_s} s")


def _rounds_done(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return -1
    rounds = [json.loads(x)["round"] for x in lines if x.strip().endswith("}")]
    return rounds[-1] if rounds else -1


def _signal_rank(proc, rank: int, sig) -> None:
    pids = [pid for pid, r in _launched_by(proc.pid).items() if r == rank]
    assert len(pids) == 1, _launched_by(proc.pid)
    os.kill(pids[0], sig)


def _signal_after_round_1(run_dir: Path, sig, **start):
    """A launch into ``run_dir`` (:func:`_start` with ``start``) whose rank 2 gets ``sig``
    once round 1 is recorded; returns the launcher's process."""
    proc = _start(run_dir, **start)
    try:
        _wait_for(lambda: _rounds_done(run_dir) >= 1, proc, "round 1")
        _signal_rank(proc, 2, sig)
    except BaseException:
        _kill_all(proc)
        raise
    return proc


def _lines(err: str) -> list[str]:
    """The launcher's stderr lines: besides rank 0's line on the rank it lost (which it
    may print before it ends), one line, and no report of torchrun's."""
    lines = [x for x in err.strip().splitlines()
             if not (x.startswith("splitfed: rank ") and " lost (" in x)]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines


def _status_file(launcher_pid: int) -> Path | None:
    for d in Path(tempfile.gettempdir()).glob(f"{launch.STATUS_PREFIX}{launcher_pid}-*"):
        if (d / "rank0").is_file():
            return d / "rank0"
    return None


def test_a_hung_client_rank_does_not_hold_the_torchrun_launcher(tmp_path):
    """Rank 0 drops the stopped rank after --timeout and ends the run; the launcher then
    gives the other ranks its grace period, stops the agent and its workers, and exits
    with the run's status."""
    run_dir = tmp_path / "run"
    proc = _signal_after_round_1(run_dir, signal.SIGSTOP, grace_s=2.0)
    try:
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the launcher did not exit after the run had ended")
        assert proc.returncode == 0, err[-2000:]
        assert "status completed" in out
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and "2" in summary["lost_ranks"]
        deadline = time.monotonic() + 10
        while _launched_by(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _launched_by(proc.pid)            # the stopped rank too
    finally:
        _kill_all(proc)


def test_sigterm_after_the_run_ended_does_not_ask_to_resume_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _signal_after_round_1(run_dir, signal.SIGSTOP, grace_s=600.0)
    try:
        _wait_for(lambda: _status_file(proc.pid) is not None, proc, "rank 0's status")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 143
        lines = _lines(err)
        assert lines[-1] == ("splitfed: terminated: the run had already ended (exit status "
                             "0); the remaining ranks stopped"), err[-2000:]
        assert "--resume" not in err
    finally:
        _kill_all(proc)


def test_a_killed_client_rank_under_torchrun_is_one_line_and_status_1(tmp_path):
    run_dir = tmp_path / "run"
    proc = _signal_after_round_1(run_dir, signal.SIGKILL, rounds=40)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        _kill_all(proc)
    assert proc.returncode == 1
    lines = _lines(err)
    assert lines[-1] == ("splitfed: error: rank 2 died (signal SIGKILL); torchrun stopped "
                        f"the other ranks; continue the run with splitfed launch --resume "
                        f"{run_dir} --nproc 3")
    assert (run_dir / "checkpoint.pt").is_file()


def test_a_torchrun_launch_leaves_nothing_in_the_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "splitfed", "launch", "quick_digits",
                           "--nproc", "2", "rounds=1", "progress=false",
                           "--run-dir", str(tmp_path / "run")],
                          env=_env(TMPDIR=str(tmp)), capture_output=True, text=True,
                          timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp.iterdir()) == []


RANK0_FAILS = '''"""Rank 0 fails as its first transfer in direction $FAIL_DIRECTION starts."""
import os
from splitfed.errors import SplitfedError
from splitfed.transport import distributed as D

if os.environ.get("RANK") == "0":
    deliver = D.DistributedTransport._deliver

    def failing(self, kind, direction, ids, payload):
        if direction == os.environ["FAIL_DIRECTION"]:
            raise SplitfedError(f"rank 0 failed as a transfer {direction} started")
        return deliver(self, kind, direction, ids, payload)

    D.DistributedTransport._deliver = failing
'''


@pytest.mark.parametrize("direction", ["up", "down"])
def test_rank_0_failing_mid_round_stops_the_client_ranks_at_once(tmp_path, direction):
    """Rank 0 fails while every client rank waits in a transfer: uploading (a send rank
    0 never takes) or downloading (a receive it never fills). Its stop still reaches
    each client rank at once, which ends the run as at a stop between rounds: rank 0
    does not wait --timeout per client rank, reports no healthy rank as lost, and no
    client rank takes the stop for tensor data (a short message, or one longer than
    its buffer: gloo aborts it). The launch prints rank 0's error alone."""
    (tmp_path / "rank0_fails.py").write_text(RANK0_FAILS)
    env = _env(FAIL_DIRECTION=direction)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run(
        [sys.executable, "-m", "splitfed", "launch", "quick_digits", "rounds=2",
         "participation.mode=full", "participation.clients_per_round=null",
         "progress=false", "--nproc", "3", "--launcher", "spawn", "--plugin",
         "rank0_fails", "--timeout", "20", "--client-timeout", "60", "--run-dir",
         str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=LIMIT_S)
    lines = [x for x in proc.stderr.splitlines()
             if x.strip() and not x.startswith("splitfed: warning: plugin rank0_fails ")]
    assert lines == [f"splitfed: error: rank 0 failed as a transfer {direction} "
                     "started"], proc.stderr[-3000:]
    assert proc.returncode == 2
