"""Studies and sweeps with runs side by side (``--jobs``, ``--executor dask``): the same
records as one after the other, a failing run or a dead worker process does not stop the
others and is resumed by the next invocation, bad options are refused before anything is
written, and every run records the ``--threads`` it ran with."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

import splitfed.study.parallel as parallel
from splitfed.cli import main
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError, SplitfedError
from splitfed.locking import LOCK_NAME
from splitfed.sweep import run_sweep
from tests.helpers import digits_config

AXES = ["train.lr=0.05,0.1", "train.batch_size=8,4"]
#: the fields of a metrics record measured on the wall clock
WALL_FIELDS = ("round_time_s",)


def _config(folder: Path, algorithm: dict | None = None) -> str:
    """A 3-round digits config with a checkpoint every round; ``algorithm``: its section
    (a plugin's algorithm, unknown to this process)."""
    path = folder / "small.yaml"
    dump_yaml(digits_config(rounds=3, checkpoint_every=1), path)
    if algorithm is not None:
        raw = yaml.safe_load(path.read_text())
        raw["algorithm"] = algorithm
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def _records(sweep_dir: Path) -> dict[str, list[dict]]:
    """Each run's metrics.jsonl records without the wall-clock fields, by run directory."""
    out = {}
    for run in sorted((sweep_dir / "runs").iterdir()):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        out[run.name] = [{k: v for k, v in json.loads(x).items() if k not in WALL_FIELDS}
                         for x in lines]
    return out


def _without_wall_time(table: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    wall = rows[0].index("wall time (s)")
    return [r[:wall] + r[wall + 1:] for r in rows]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """A 2x2 sweep on digits run one point after the other in this process."""
    root = tmp_path_factory.mktemp("sequential")
    threads = torch.get_num_threads()
    result = run_sweep(_config(root), AXES, out_dir=root / "out", quiet=True, jobs=1)
    assert torch.get_num_threads() == threads          # restored after the runs
    return result, root / "out" / "small-sweep"


def _assert_same(result, sweep_dir, sequential):
    reference, reference_dir = sequential
    assert _records(sweep_dir) == _records(reference_dir)
    assert len(_records(sweep_dir)) == 4 and all(len(r) == 4 for r in
                                                 _records(sweep_dir).values())
    assert result.table == reference.table                       # sweep.md: no wall time
    assert _without_wall_time(result.study.table) == _without_wall_time(reference.study.table)
    assert [o.label for o in result.study.outcomes] == [o.label for o in
                                                        reference.study.outcomes]
    for run in (sweep_dir / "runs").iterdir():
        summary = json.loads((run / "summary.json").read_text())
        assert summary["threads"] == summary["provenance"]["threads"] == 1


def test_runs_in_worker_processes_give_the_sequential_records(sequential, tmp_path, capsys):
    cfg = _config(tmp_path)
    result = run_sweep(cfg, AXES, out_dir=tmp_path / "out", jobs=2)
    sweep_dir = tmp_path / "out" / "small-sweep"
    _assert_same(result, sweep_dir, sequential)
    out = capsys.readouterr().out
    assert out.count(" ... started (elapsed ") == 4
    finished = [line for line in out.splitlines() if line.startswith("[")
                and "started" not in line]
    assert sorted(line.split("]")[0] for line in finished) == ["[1/4", "[2/4", "[3/4",
                                                                "[4/4"]
    assert all(" in " in line and line.endswith(" s)") and "(elapsed " in line
               for line in finished), finished
    command = json.loads((sweep_dir / "sweep.json").read_text())["command"]
    assert command.endswith(" --jobs 2")
    # the same command again: every point is skipped, nothing runs
    again = run_sweep(cfg, AXES, out_dir=tmp_path / "out", jobs=2)
    assert all(o.skipped for o in again.study.outcomes)
    assert "started" not in capsys.readouterr().out


def test_a_local_dask_cluster_gives_the_sequential_records(sequential, tmp_path,
                                                          monkeypatch):
    distributed = pytest.importorskip("distributed")
    made = []

    def spy(jobs):
        """The cluster the runner makes, and every address it listens on."""
        cluster = real(jobs)
        http = cluster.scheduler.http_server._sockets.values()
        hosts = [cluster.scheduler_address, *(f"http://{s.getsockname()[0]}:"
                                              f"{s.getsockname()[1]}" for s in http)]
        for nanny in cluster.workers.values():
            hosts += [nanny.address, nanny.worker_address]
        with distributed.Client(cluster) as client:
            for sockets in client.run(lambda dask_worker: [
                    s.getsockname() for s in dask_worker.http_server._sockets.values()]
                    ).values():
                hosts += [f"http://{host}:{port}" for host, port in sockets]
        web = hosts[1]
        with pytest.raises(urllib.error.HTTPError, match="404"):   # no dashboard
            urllib.request.urlopen(web + "/status", timeout=10)
        made.append((jobs, len(cluster.workers), hosts))
        return cluster

    real = parallel.local_cluster
    monkeypatch.setattr(parallel, "local_cluster", spy)
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    result = run_sweep(_config(tmp_path), AXES, out_dir=tmp_path / "out", quiet=True,
                       executor="dask", jobs=2)
    _assert_same(result, tmp_path / "out" / "small-sweep", sequential)
    ((jobs, workers, hosts),) = made
    assert jobs == 2 and workers == 2 and len(hosts) == 1 + 1 + 2 * 2 + 2
    for address in hosts:                                   # loopback only
        assert address.split("://")[1].startswith("127.0.0.1:"), address


def test_threads_are_set_for_every_run_and_recorded(tmp_path):
    cfg = _config(tmp_path)
    threads = torch.get_num_threads()
    for jobs in (1, 2):
        result = run_sweep(cfg, ["train.lr=0.05,0.1"], out_dir=tmp_path / f"j{jobs}",
                           quiet=True, jobs=jobs, threads=3)
        assert torch.get_num_threads() == threads       # this process: restored
        for o in result.study.outcomes:
            summary = json.loads((o.run_dir / "summary.json").read_text())
            assert summary["threads"] == summary["provenance"]["threads"] == 3
        command = json.loads((result.study.dir / "sweep.json").read_text())["command"]
        assert command.endswith(f" --jobs {jobs} --threads 3")


# -------------------------------------------------------------- bad options


@pytest.mark.parametrize("option, message", [
    (["--jobs", "0"], "argument --jobs: expected a whole number >= 1, got '0'"),
    (["--jobs", "two"], "argument --jobs: expected a whole number >= 1, got 'two'"),
    (["--threads", "0"], "argument --threads: expected a whole number >= 1, got '0'"),
    (["--threads", "5000"], "--threads: expected a whole number from 1 to 1024"),
    (["--executor", "ray"], "argument --executor: invalid choice: 'ray' (choose from "),
    (["--address", "tcp://127.0.0.1:8786"], "--address: a Dask scheduler's address, only "
                                            "with --executor dask"),
    (["--jobs", "1_0"], "argument --jobs: expected a whole number >= 1, got '1_0'"),
    (["--jobs", "5000"], "--jobs: expected a whole number from 1 to 1024"),
    (["--executor", "dask", "--address", "not an address"],
     "--address: expected a Dask scheduler address tcp://HOST:PORT or tls://HOST:PORT"),
    (["--executor", "dask", "--address", "ucx://127.0.0.1:8786"],
     "--address: expected a Dask scheduler address tcp://HOST:PORT or tls://HOST:PORT"),
    (["--executor", "dask", "--address", "tcp://127.0.0.1:99999"],
     "(port 1 to 65535)"),
])
@pytest.mark.parametrize("command", ["sweep", "study"])
def test_bad_parallel_options_are_refused_in_one_line_before_anything_is_written(
        tmp_path, capsys, monkeypatch, option, message, command):
    if "dask" in option:
        pytest.importorskip("distributed")
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path)
    (tmp_path / "s.yaml").write_text(f"name: s\nbase: {cfg}\ngrid: {{train.lr: [0.1, 0.2]}}\n")
    head = ["sweep", cfg, *AXES] if command == "sweep" else ["study", "s.yaml"]
    code = main([*head, "--out-dir", "out", *option])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert err.startswith("splitfed: error: ")
    if "ray" in option:
        assert "local" in err and "dask" in err
    assert not (tmp_path / "out").exists()


def test_the_api_checks_the_options_too(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    for kwargs, message in (({"jobs": 0}, "--jobs: expected a whole number from 1 to"),
                            ({"jobs": True}, "--jobs: expected a whole number from 1 to"),
                            ({"threads": 1.5}, "--threads: expected a whole number"),
                            ({"executor": "ray"}, "--executor: expected one of local, dask")):
        with pytest.raises(ConfigError, match=message):
            run_sweep(cfg, AXES, out_dir=tmp_path / "out", quiet=True, **kwargs)
    monkeypatch.setitem(sys.modules, "distributed", None)        # not installed
    with pytest.raises(ConfigError, match=r"^--executor dask: .* not installed; install it "
                                          r"with pip install 'splitfed\[cluster\]'$"):
        run_sweep(cfg, AXES, out_dir=tmp_path / "out", quiet=True, executor="dask")
    assert not (tmp_path / "out").exists()


def test_a_script_reimported_by_a_worker_does_not_start_a_study_again(tmp_path, monkeypatch):
    """A spawned worker imports the parent's main script again as ``__mp_main__``: a
    study or sweep started at that script's top level (directly or through a function it
    calls there) is refused there, naming the guard; the same lines run as ``__main__``
    (the parent) pass the check."""
    script = str(tmp_path / "my_study.py")
    line = "from splitfed.study.parallel import check_options\ncheck_options(jobs=2)\n"
    code = compile(line, script, "exec")
    with pytest.raises(SplitfedError, match=(
            rf"^a study worker process imported {re.escape(script)} again and it started a "
            r"study or sweep at its top level; put the run_study / run_sweep call under "
            r"`if __name__ == \"__main__\":`")):
        exec(code, {"__name__": "__mp_main__", "__file__": script})
    exec(code, {"__name__": "__main__", "__file__": script})
    inside = compile("def go():\n    " + line.replace("\n", "\n    ") + "\ngo()\n", script,
                     "exec")
    with pytest.raises(SplitfedError):                # called from the top level, via go()
        exec(inside, {"__name__": "__mp_main__", "__file__": script})
    # the parent's message when its workers die as they start names the guard for scripts
    monkeypatch.setattr(sys.modules["__main__"], "__file__", script, raising=False)
    assert parallel._script_hint() == (
        f"; a script that starts a study or sweep ({script}) must do it under "
        "`if __name__ == \"__main__\":`, since each worker process imports it again")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "/venv/bin/splitfed")
    assert parallel._script_hint() == ""


@pytest.mark.parametrize("how", ["--address", "DASK_SCHEDULER_ADDRESS"])
def test_an_unreachable_scheduler_is_refused_before_anything_is_written(tmp_path, how):
    pytest.importorskip("distributed")
    import socket

    import dask

    with socket.socket() as s:                           # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    settings = {"distributed.comm.timeouts.connect": "2s"}
    if how != "--address":
        settings["scheduler-address"] = address         # what the variable sets
    with dask.config.set(settings), pytest.raises(
            ConfigError, match=f"^--executor dask: cannot reach the Dask scheduler at "
                               f"{address} "):
        run_sweep(_config(tmp_path), AXES, out_dir=tmp_path / "out", quiet=True,
                  executor="dask", address=address if how == "--address" else None)
    assert not (tmp_path / "out").exists()


def test_the_cli_offers_the_executors_the_runner_knows():
    from splitfed.cli import build_parser

    sweep = build_parser()._subparsers._group_actions[0].choices["sweep"]
    (action,) = [a for a in sweep._actions if a.dest == "executor"]
    assert tuple(action.choices) == parallel.EXECUTORS


# ------------------------------------------- failing runs, dead workers (processes)

PLUGIN = '''"""Algorithms for the tests of parallel studies: FedAvg that fails in a given round
(when PARALLEL_TEST_FAIL=1), and FedAvg that stops in round 2 to have its process killed
(once: the marker file says it happened)."""

import os
import time
from dataclasses import dataclass, field

from splitfed import register_algorithm
from splitfed.algorithms.fedavg import FedAvg


@dataclass
class FailingOptions:
    global_lr: float = 1.0
    fail_round: int = field(default=0, metadata={"ge": 0})


@register_algorithm("test_failing")
class Failing(FedAvg):
    name = "test_failing"
    Options = FailingOptions

    def round(self, env, state, t, cohort):
        if t == self.options.fail_round and os.environ.get("PARALLEL_TEST_FAIL") == "1":
            raise RuntimeError(f"failing on purpose in round {t}")
        if t == self.options.fail_round and os.environ.get("PARALLEL_TEST_EXIT") == "1":
            raise SystemExit(5)
        return super().round(env, state, t, cohort)


@dataclass
class StallingOptions:
    global_lr: float = 1.0
    marker: str = ""


@register_algorithm("test_stalling")
class Stalling(FedAvg):
    name = "test_stalling"
    Options = StallingOptions

    def round(self, env, state, t, cohort):
        if t == 2:
            try:
                fd = os.open(self.options.marker + ".claim", os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                fd = None
            if fd is not None:                      # the first run in round 2 stops here
                os.close(fd)
                with open(self.options.marker + ".tmp", "w") as fh:
                    fh.write(str(os.getpid()))
                os.replace(self.options.marker + ".tmp", self.options.marker)
                time.sleep(300)
        return super().round(env, state, t, cohort)
'''


#: the line of the plugin's raise, which a failure names
PLUGIN_LINE = str(next(i for i, line in enumerate(PLUGIN.splitlines(), 1)
                       if "raise RuntimeError" in line))


@pytest.fixture
def lab(tmp_path):
    """A working directory with the plugin on PYTHONPATH (the worker processes inherit
    it)."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "parallel_test_plugin.py").write_text(PLUGIN)
    return tmp_path


def _splitfed(argv, cwd, **env):
    environ = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg",
                   PYTHONPATH=str(Path(cwd) / "plugins"), **env)
    environ.pop("PARALLEL_TEST_FAIL", None)
    environ.pop("PARALLEL_TEST_EXIT", None)
    environ.update(env)
    return subprocess.Popen([sys.executable, "-m", "splitfed", *argv], cwd=cwd, env=environ,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _run(argv, cwd, **env):
    proc = _splitfed(argv, cwd, **env)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_a_failing_run_does_not_stop_the_others_and_is_rerun_next_time(lab):
    _config(lab, algorithm={"name": "test_failing"})
    argv = ["sweep", "small.yaml", "algorithm.fail_round=0,2,4", "--plugin",
            "parallel_test_plugin", "--out-dir", "out", "--jobs", "2"]   # 4: never (3 rounds)
    code, out, err = _run(argv, lab, PARALLEL_TEST_FAIL="1")
    sweep = lab / "out" / "small-sweep"
    assert code == 2, err
    assert err.splitlines()[-2:] == [
        "splitfed: error: 1 of 3 runs failed; the others are kept and the results are "
        "written once every run has finished: run the same command again (after fixing "
        "the cause) to run the failed ones",
        "  run 'algorithm.fail_round=2' (seed 3): algorithm.name: algorithm 'test_failing' "
        "(plugin parallel_test_plugin) failed in round 2: RuntimeError: failing on purpose in "
        "round 2 (at " + str(lab / "plugins" / "parallel_test_plugin.py") + ":" + PLUGIN_LINE
        + ")"]
    assert err.count("Traceback") == 1                       # printed by its worker
    assert out.count("failed in round 2: RuntimeError: failing on purpose in round 2") == 1
    for point in (0, 4):
        done = sweep / "runs" / f"algorithm.fail_round-{point}-s3"
        assert json.loads((done / "summary.json").read_text())["status"] == "completed"
    failed = sweep / "runs" / "algorithm.fail_round-2-s3"
    assert not (failed / "summary.json").exists()
    assert not any((sweep / name).exists() for name in ("results.md", "sweep.md"))
    assert not (sweep / LOCK_NAME).exists()

    code, out, err = _run(argv, lab)                         # the cause fixed
    assert code == 0, err
    assert out.count("(done earlier, skipped)") == 2
    summary = json.loads((failed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == [1]
    assert (sweep / "results.md").is_file() and (sweep / "sweep.md").is_file()


@pytest.mark.parametrize("jobs", ["1"])      # in this process (a worker reports the same)
def test_a_plugin_that_exits_fails_its_run_only(lab, jobs):
    _config(lab, algorithm={"name": "test_failing"})
    argv = ["sweep", "small.yaml", "algorithm.fail_round=2,4", "--plugin",
            "parallel_test_plugin", "--out-dir", "out", "--jobs", jobs]  # 4: never (3 rounds)
    code, out, err = _run(argv, lab, PARALLEL_TEST_EXIT="1")
    sweep = lab / "out" / "small-sweep"
    assert code == 2, err
    assert err.splitlines()[-1] == ("  run 'algorithm.fail_round=2' (seed 3): the run called "
                                    "exit (SystemExit: 5)"), err
    done = sweep / "runs" / "algorithm.fail_round-4-s3"
    assert json.loads((done / "summary.json").read_text())["status"] == "completed"
    assert not (sweep / "runs" / "algorithm.fail_round-2-s3" / "summary.json").exists()
    assert not (sweep / LOCK_NAME).exists()


def test_a_killed_worker_loses_only_its_run_which_the_next_invocation_finishes(lab):
    marker = lab / "stalled.pid"
    _config(lab, algorithm={"name": "test_stalling", "marker": str(marker)})
    argv = ["sweep", "small.yaml", "train.lr=0.05,0.1,0.2", "--plugin",
            "parallel_test_plugin", "--out-dir", "out", "--jobs", "2"]
    proc = _splitfed(argv, lab)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(marker.read_text())
    assert pid != proc.pid
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    runs = lab / "out" / "small-sweep" / "runs"
    finished = sorted(p.name for p in runs.iterdir() if (p / "summary.json").exists())
    (lost,) = [p.name for p in runs.iterdir() if not (p / "summary.json").exists()]
    assert len(finished) == 2
    lr = lost.removeprefix("train.lr-").removesuffix("-s3")
    assert err.splitlines()[-1] == (f"  run 'train.lr={lr}' (seed 3): worker process died "
                                    "(exit code -9); run the command again to resume it")
    assert err.splitlines()[-2].startswith("splitfed: error: 1 of 3 runs failed")

    code, out, err = _run(argv, lab)                # one run left: in that process
    assert code == 0, err
    assert out.count("(done earlier, skipped)") == 2 and "started" not in out
    summary = json.loads((runs / lost / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == [1]
    rounds = [json.loads(x)["round"] for x in (runs / lost / "metrics.jsonl").read_text()
              .splitlines()]
    assert rounds == [0, 1, 2, 3]


def _running_in_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not ended (zombies excluded)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


SLOW = ("name: s\nseed: 0\nrounds: 20\nprogress: false\ncheckpoint_every: 5\n"
        "eval_every: 1000\ndata: {name: synthetic}\nmodel: {name: mlp}\n"
        "partition: {scheme: natural, num_clients: 30}\n"
        "participation: {mode: uniform, clients_per_round: 3}\n"
        "train: {batch_size: 8, local_steps: 1, lr: 0.05}\n")


def test_ctrl_c_stops_the_workers_and_the_same_command_finishes_the_sweep(lab):
    # 200 rounds: the workers go on for seconds after the first checkpoint (round 5), so
    # that Ctrl-C sent when it appears reaches running workers on a loaded machine too
    (lab / "slow.yaml").write_text(SLOW.replace("rounds: 20", "rounds: 200"))
    argv = ["sweep", "slow.yaml", "train.lr=0.05,0.1", "--out-dir", "out", "--jobs", "2"]
    runs = lab / "out" / "slow-sweep" / "runs"
    proc = _splitfed(argv, lab)
    deadline = time.monotonic() + 120
    while not any(runs.glob("*/checkpoint.pt")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)                # Ctrl-C: the whole process group
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # every worker stops on its own, none waits to be terminated after the grace period
    assert time.monotonic() - t0 < parallel.GRACE_S, err
    assert err.splitlines()[-1] == (
        "splitfed: interrupted; finished runs are kept, continue the sweep by running the "
        "same command again: splitfed sweep slow.yaml train.lr=0.05,0.1 --out-dir out "
        "--jobs 2")
    assert "Traceback" not in err
    deadline = time.monotonic() + 30                  # no worker left behind
    while _running_in_group(proc.pid):
        assert time.monotonic() < deadline, _running_in_group(proc.pid)
        time.sleep(0.1)
    code, out, err = _run(argv, lab)
    assert code == 0, err
    data = json.loads((lab / "out" / "slow-sweep" / "sweep.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["completed"] * 2


def test_the_runs_at_the_same_time_are_at_most_the_runs_left(monkeypatch):
    """``--jobs`` (default: the usable cores) is capped at the runs left to do, and is at
    least one: a study with one run left runs it in this process."""
    monkeypatch.setattr(parallel, "usable_cores", lambda: 8)
    assert [parallel.resolve_jobs(None, left) for left in (0, 1, 3, 8, 20)] == [
        1, 1, 3, 8, 8]
    assert [parallel.resolve_jobs(4, left) for left in (0, 1, 3, 8)] == [1, 1, 3, 4]
