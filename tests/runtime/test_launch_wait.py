"""How the ``spawn`` launcher waits for its ranks (:func:`splitfed.runtime.launch.
wait_all`): a client rank that ends before rank 0 is dropped and rank 0 goes on; once
every client rank has ended, one at least with an error, a rank 0 that logs no round
for the patience period is stopped (also when it is stopped with SIGSTOP), one that
still logs rounds finishes, and the launcher says so in one line. The ranks here are
tiny processes that sleep or exit at once."""

import argparse
import signal
import subprocess
import sys
import time

import pytest

from splitfed.runtime import launch

LIMIT_S = 20


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _ranks(*codes: str) -> launch.Ranks:
    ranks = launch.Ranks(_proc(c) for c in codes)
    ranks.failed = []
    return ranks


def _cleanup(ranks):
    for p in ranks:
        if p.poll() is None:
            p.kill()
            p.wait()


SLEEP = "import time; time.sleep(60)"


@pytest.mark.parametrize("sigstop", [False, True])
def test_a_rank_0_that_outlives_every_failed_client_rank_is_stopped(sigstop):
    ranks = _ranks(SLEEP, "raise SystemExit(1)", "import time; time.sleep(0.5); "
                   "raise SystemExit(1)")
    try:
        if sigstop:                         # a hung rank 0: only SIGKILL ends it
            ranks[0].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        code = launch.wait_all(ranks, grace_s=1.0, poll_s=0.05)
        took = time.monotonic() - start
        assert took < LIMIT_S / 2, took
        assert took >= 1.0                  # rank 0 had its grace period
        assert code == -signal.SIGKILL and ranks[0].returncode == -signal.SIGKILL
        assert ranks.failed == [(1, 1), (2, 1)]
    finally:
        _cleanup(ranks)


def test_rank_0_has_the_longer_of_the_patience_and_the_grace_period():
    """``patience_s`` (the client ranks' --client-timeout) longer than the grace period:
    a rank 0 that logs nothing once every client rank has failed is stopped after the
    patience, not after the shorter grace period."""
    ranks = _ranks(SLEEP, "raise SystemExit(1)")
    try:
        start = time.monotonic()
        code = launch.wait_all(ranks, grace_s=0.2, poll_s=0.05, patience_s=1.5)
        took = time.monotonic() - start
        assert 1.5 <= took < LIMIT_S / 2, took
        assert code == -signal.SIGKILL and ranks.failed == [(1, 1)]
    finally:
        _cleanup(ranks)


def test_a_failed_client_rank_is_dropped_while_another_client_rank_runs():
    # the spawn launcher's promise: a client process that dies is dropped by rank 0
    ranks = _ranks("import time; time.sleep(2)", "import os, signal; "
                   "os.kill(os.getpid(), signal.SIGKILL)", SLEEP)
    try:
        code = launch.wait_all(ranks, grace_s=0.5, poll_s=0.05)
        assert code == 0 and ranks.failed == []
        assert ranks[1].returncode == -signal.SIGKILL
        assert ranks[2].returncode == -signal.SIGKILL       # killed after the grace
    finally:
        _cleanup(ranks)


def test_rank_0_that_ends_within_the_grace_period_keeps_its_status():
    # every client rank lost, rank 0 ends the run on its own (clients_lost: status 3)
    ranks = _ranks("import time; time.sleep(1.5); raise SystemExit(3)",
                   "raise SystemExit(1)", "raise SystemExit(1)")
    try:
        assert launch.wait_all(ranks, grace_s=10.0, poll_s=0.05) == 3
        assert ranks.failed == []
    finally:
        _cleanup(ranks)


def test_a_rank_0_that_still_logs_rounds_is_left_to_finish(tmp_path):
    """Alone, rank 0 runs the remaining rounds without clients: a record every 0.3 s
    for 3 s outlives a patience of 1 s without being stopped."""
    run_dir, status = tmp_path / "run", tmp_path / "status"
    run_dir.mkdir()
    status.mkdir()
    (status / "run_dir").write_text(str(run_dir))
    rounds = (f"import time\nfor t in range(10):\n    time.sleep(0.3)\n"
              f"    open({str(run_dir / 'metrics.jsonl')!r}, 'a').write('{{}}\\n')\n"
              "raise SystemExit(3)")
    ranks = _ranks(rounds, "raise SystemExit(1)", "raise SystemExit(1)")
    ranks.status_dir = status
    try:
        assert launch.wait_all(ranks, grace_s=0.5, poll_s=0.05, patience_s=1.0) == 3
        assert ranks.failed == []
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 10
    finally:
        _cleanup(ranks)


def test_clients_that_end_well_do_not_stop_rank_0():
    ranks = _ranks("import time; time.sleep(1.5)", "pass", "pass")
    try:
        assert launch.wait_all(ranks, grace_s=0.2, poll_s=0.05) == 0
    finally:
        _cleanup(ranks)


def test_the_launcher_reports_a_stopped_rank_0_in_one_line(capsys):
    ranks = launch.Ranks()
    ranks.failed = [(2, 1), (1, 1)]
    ranks.status_dir = launch.Path("/nonexistent-status-dir")
    args = argparse.Namespace(launcher="spawn", resume="runs/x", nproc=3,
                              client_timeout=45.0)
    assert launch._died(ranks, args, -signal.SIGKILL) == launch.RANK_DIED
    err = capsys.readouterr().err.splitlines()
    assert err == ["splitfed: error: rank 2 failed (exit status 1); no client rank was "
                   "left and rank 0 logged no round for 45 s: the launcher stopped it; "
                   "continue the run with splitfed launch --resume runs/x --nproc 3"]
    ranks.failed = []                       # rank 0 itself died: as before
    launch._died(ranks, args, -signal.SIGKILL)
    assert capsys.readouterr().err.startswith("splitfed: error: rank 0 died (signal "
                                              "SIGKILL); continue the run with")
    args.resume = None                      # before rank 0 made the run directory
    launch._died(ranks, args, -signal.SIGKILL)
    assert capsys.readouterr().err == ("splitfed: error: rank 0 died (signal SIGKILL); no "
                                       "run directory was made yet: run the same command "
                                       "again\n")


@pytest.mark.parametrize("name, content, method, expected", [
    ("failures.json", "[[1, Infinity]]", "failures", []),
    ("failures.json", "[[1e400, 1]]", "failures", []),
    ("failures.json", "[" * 100_000 + "]" * 100_000, "failures", []),
    ("failures.json", '{"a": 1}', "failures", []),
    ("failures.json", "[[2, -9], [1, 1]]", "failures", [(2, -9), (1, 1)]),
    ("rank0", "1_0", "reported", None),
    ("rank0", "\u0663", "reported", None),
    ("rank0", "3\n", "reported", 3),
    ("rank0", "7" * 100_000, "reported", None),
    ("run_dir", "runs/x\n\x1b[2J", "run_dir", "runs/x\\n\\x1b[2J"),
])
def test_the_launchers_status_files_are_read_with_care(tmp_path, name, content, method,
                                                       expected):
    ranks = launch.Ranks()
    ranks.status_dir = tmp_path
    (tmp_path / name).write_text(content)
    assert getattr(ranks, method)() == expected


def test_a_pipe_in_place_of_a_status_file_does_not_block_the_launcher(tmp_path):
    import os

    ranks = launch.Ranks()
    ranks.status_dir = tmp_path
    for name in ("rank0", "run_dir", "failures.json"):
        os.mkfifo(tmp_path / name)
    assert (ranks.reported(), ranks.run_dir(), ranks.failures()) == (None, "RUN_DIR", [])
