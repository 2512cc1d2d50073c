"""The command line: run writes a complete run directory; list and partition print."""

import json

from splitfed.cli import main


def test_run_quick_digits_writes_run_dir(tmp_path, capsys):
    code = main(["run", "quick_digits", f"out_dir={tmp_path}", "progress=false", "rounds=2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "test accuracy" in out and "wall time" in out
    (run_dir,) = list(tmp_path.iterdir())
    for f in ("config.yaml", "partition.txt", "metrics.jsonl", "summary.json"):
        assert (run_dir / f).exists(), f
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 2]


def test_bad_config_writes_nothing(tmp_path, capsys):
    code = main(["run", "quick_digits", f"out_dir={tmp_path}", "model.cut=99"])
    err = capsys.readouterr().err
    assert code == 2 and "valid cuts" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_list_and_partition(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in ("fedavg", "centralized", "fashion_mnist", "lenet5", "dirichlet", "bernoulli"):
        assert word in out
    assert main(["partition", "quick_digits"]) == 0
    assert "client" in capsys.readouterr().out.lower()


# ------------------------------------------------------- errors: one line, no traceback

import errno  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import splitfed.cli as cli  # noqa: E402
from splitfed.errors import RunInterrupted  # noqa: E402

TINY = ("name: t\nseed: 0\nrounds: 1\nprogress: false\nalgorithm: {name: fedavg}\n"
        "data: {name: digits}\npartition: {scheme: iid, num_clients: 3}\n"
        "model: {name: mlp, hidden: [8]}\n"
        "train: {batch_size: 8, local_steps: 1, lr: 0.1}\nparticipation: {mode: full}\n")


def one_line_error(capsys, code):
    """The command failed with exit 2 and one ``splitfed: error:`` line on stderr."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), err
    return lines[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    (tmp_path / "afile").write_text("hello")
    (tmp_path / "adir").mkdir()
    return tmp_path


@pytest.mark.parametrize("argv, match", [
    (["run", "{d}/tiny.yaml", "out_dir={d}/afile"], "cannot create the run directory"),
    (["run", "{d}/tiny.yaml", "name=" + "x" * 300], "longer than the 255 bytes allowed"),
    (["run", "{d}/adir"], "adir: not a regular file"),
    (["run", "{d}/missing.yaml"], "neither a file nor a shipped config"),
    (["run", "--resume", "{d}/afile"], "no config.yaml there"),
    (["run", "{d}/tiny.yaml", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "--resume"], "expected one argument"),
    (["sweep", "{d}/tiny.yaml", "train.lr=0.1,0.2", "--out-dir", "{d}/afile"],
     "cannot create the sweep directory .*afile/tiny-sweep .*Not a directory"),
    (["sweep", "{d}/tiny.yaml", "train.lr=0.1,0.2", "--out-dir", "{d}/afile/sub"],
     "Not a directory"),
    (["study", "{d}/adir"], "adir: not a regular file"),
    (["study", "{d}/afile"], "top level must be a mapping"),
    (["plot", "{d}/adir"], "no such metrics file"),
    (["partition", "{d}/afile"], "top level must be a mapping"),
    (["list", "extra"], "unrecognized arguments: extra"),
    ([], "the following arguments are required"),
])
def test_user_errors_are_one_line(files, capsys, argv, match):
    line = one_line_error(capsys, main([a.format(d=files) for a in argv]))
    assert re.search(match, line), line
    assert not (files / "afile").is_dir()


def test_os_errors_on_user_paths_are_one_line_and_bugs_keep_their_traceback(
        monkeypatch, capsys):
    def raising(exc):
        def command(args):
            raise exc
        return command

    monkeypatch.setattr(cli, "_cmd_list", raising(
        PermissionError(errno.EACCES, "Permission denied", "/some/results.json")))
    line = one_line_error(capsys, main(["list"]))
    assert line == ("splitfed: error: /some/results.json: Permission denied; "
                    "check the path")
    monkeypatch.setattr(cli, "_cmd_list", raising(OSError(errno.ENOSPC, "No space left")))
    assert "No space left" in one_line_error(capsys, main(["list"]))
    for bug in (ConnectionResetError(errno.ECONNRESET, "reset"), KeyError("x"),
                TypeError("bug")):
        monkeypatch.setattr(cli, "_cmd_list", raising(bug))
        with pytest.raises(type(bug)):
            main(["list"])


def test_keyboard_interrupt_exits_130_with_how_to_continue(files, monkeypatch, capsys):
    import splitfed.experiment as experiment
    import splitfed.study as study

    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "run_experiment", interrupted)
    assert main(["run", str(files / "tiny.yaml"), f"out_dir={files}/runs"]) == 130
    assert capsys.readouterr().err == "splitfed: interrupted\n"

    def run_interrupted(cfg, **kwargs):
        raise RunInterrupted(files / "runs" / "t-1")

    monkeypatch.setattr(experiment, "run_experiment", run_interrupted)
    assert main(["run", str(files / "tiny.yaml"), f"out_dir={files}/runs"]) == 130
    assert capsys.readouterr().err == (
        f"splitfed: interrupted; continue it with: splitfed run --resume {files}/runs/t-1\n")

    monkeypatch.setattr(study, "run_experiment", run_interrupted)
    argv = ["sweep", str(files / "tiny.yaml"), "train.lr=0.1,0.2", "--out-dir",
            str(files / "sw"), "--jobs", "1"]               # in this process
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("splitfed: interrupted; finished runs are kept, continue the sweep "
                          "by running the same command again: splitfed sweep ")
    assert err.strip().endswith(f"--out-dir {files}/sw --jobs 1")
    assert not (files / "sw" / "tiny-sweep" / ".splitfed.lock").exists()   # released


# ------------------------------------------------------------ Ctrl-C on a real process

# a run that goes on for a few seconds after its first checkpoint (at round 10), so that
# a signal sent when that checkpoint appears reaches it while it runs, on a loaded
# machine too (with 30 rounds the last 20 took 0.2 s, and the signal sometimes came late)
SLOW = ("name: s\nseed: 0\nrounds: 300\nprogress: false\ncheckpoint_every: 10\n"
        "eval_every: 1000\ndata: {name: synthetic}\nmodel: {name: mlp}\n"
        "partition: {scheme: natural, num_clients: 30}\n"
        "participation: {mode: uniform, clients_per_round: 3}\n"
        "train: {batch_size: 8, local_steps: 1, lr: 0.05}\n")


def splitfed_command() -> list[str]:
    binary = Path(sys.executable).with_name("splitfed")
    return [str(binary)] if binary.is_file() else [sys.executable, "-m", "splitfed"]


def start(argv, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.Popen(splitfed_command() + argv, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def interrupt_when(proc, ready, timeout=60.0):
    """SIGINT ``proc`` as soon as ``ready()``; returns (exit status, stdout, stderr)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the command did not start writing"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_ctrl_c_during_a_run_then_resume(tmp_path):
    (tmp_path / "slow.yaml").write_text(SLOW)
    runs = tmp_path / "runs"
    proc = start(["run", "slow.yaml", "out_dir=runs"], tmp_path)
    code, out, err = interrupt_when(proc, lambda: any(runs.glob("*/checkpoint.pt")))
    assert code == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    (run_dir,) = runs.iterdir()
    assert err == ("splitfed: interrupted; continue it with: splitfed run --resume "
                   f"{Path('runs') / run_dir.name}\n")
    assert not (run_dir / "summary.json").exists()
    assert main(["run", "--resume", str(run_dir)]) == 0           # the line's command
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"]
    rounds = [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(301))


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """``kill`` (or a batch system's stop) during a run: the last checkpoint stays, one
    line says how to continue, exit status 143 (128 + SIGTERM)."""
    (tmp_path / "slow.yaml").write_text(SLOW)
    runs = tmp_path / "runs"
    proc = start(["run", "slow.yaml", "out_dir=runs"], tmp_path)
    deadline = time.monotonic() + 60
    while not any(runs.glob("*/checkpoint.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    (run_dir,) = runs.iterdir()
    assert proc.returncode == 143, err
    assert err == ("splitfed: terminated; continue it with: splitfed run --resume "
                   f"{Path('runs') / run_dir.name}\n")
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    proc = subprocess.Popen(splitfed_command() + ["list"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                   # the reader is gone before anything is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == ""


@pytest.mark.parametrize("command", [["list"], ["config", "show", "quick_digits"],
                                     ["config", "explain", "fedavg"]])
def test_a_command_started_without_stdout_writes_nothing_and_succeeds(tmp_path, command):
    """fd 1 closed (``splitfed list >&-``, a cron job): Python has no sys.stdout; the
    output is discarded as print discards it, not a traceback."""
    proc = subprocess.run(splitfed_command() + command, cwd=tmp_path, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          pass_fds=(), preexec_fn=lambda: os.close(1), timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("override, says", [
    ("algorithm.name=nope", "algorithm.name: unknown algorithm 'nope'"),
    ("algorithm.bogus=1", "unknown key 'algorithm.bogus'"),
    ("algorithm.global_lr=-1", "algorithm.global_lr: must be > 0"),
])
def test_config_show_refuses_an_algorithm_a_run_would_refuse(capsys, override, says):
    """What config show prints is what a run would use: not an algorithm (or options of
    it) that the run then refuses."""
    assert main(["config", "show", "quick_digits", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err


def test_version_and_config_show(capsys, tmp_path):
    import yaml

    import splitfed
    from splitfed.cli import main
    from splitfed.config import build_config, load_config
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"splitfed {splitfed.__version__}"
    args = ["quick_digits", "train.lr=0.3", "~partition.alpha",
            "~partition.min_partition_size", "partition.scheme=iid"]
    assert main(["config", "show", *args]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert build_config(shown) == load_config(args[0], args[1:])  # what a run would use
    assert shown["train"]["lr"] == 0.3 and shown["partition"]["options"] == {}
    assert main(["config", "show", "quick_digits", "train.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitfed: error: train.lr") and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [
    ["run", "{bomb}"], ["partition", "{bomb}"], ["study", "{bomb}"],
    ["launch", "{bomb}", "--nproc", "2"], ["config", "show", "{bomb}"],
    ["sweep", "quick_digits", "train.lr=[&a [1,1,1]],[*a]"],
])
def test_a_yaml_alias_is_answered_before_torch_loads(tmp_path, argv):
    """Every command refuses an alias (a billion-laughs file) at once: one line, exit 2,
    in a process that never imports torch."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text('a: &a ["lol","lol","lol"]\nb: &b [*a,*a,*a]\nc: [*b,*b,*b]\n')
    code = ("import sys\nfrom splitfed.cli import main\nrc = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)\n")
    args = [a.format(bomb=bomb) for a in argv]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("splitfed: error: ") and "aliases" in line


# ----------------------------------------------------------- list, results, config explain


def test_list_does_not_fail_on_a_model_it_cannot_build(monkeypatch, capsys):
    """``splitfed list`` on an install without an optional package (transformers): opt's
    cuts are not built (``config explain opt`` builds it), and a model that cannot be built
    says why instead of failing the command."""
    from splitfed.errors import ConfigError
    from splitfed.models import MODELS

    def broken(input_shape, num_classes):
        raise ConfigError("needs the package 'nothing'")

    monkeypatch.setitem(sys.modules, "transformers", None)     # not installed
    monkeypatch.setitem(MODELS, "lenet5", broken)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "  opt            cuts: " in out and "(splitfed config explain opt)" in out
    assert "  lenet5         cannot be built here: needs the package 'nothing'" in out
    assert main(["config", "explain", "opt"]) == 0
    assert "cuts: cannot be built here: transformer models need the 'transformers' package" \
        in capsys.readouterr().out


def test_results_prints_the_runs_table(tmp_path, capsys):
    assert main(["run", "quick_digits", f"out_dir={tmp_path}", "progress=false",
                 "rounds=1", "checkpoint_every=0"]) == 0
    capsys.readouterr()
    assert main(["results", str(tmp_path), "--last"]) == 0
    out = capsys.readouterr().out
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name in out and "fedavg" in out and "completed" in out
    assert main(["results", f"{tmp_path}/*", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("run,") and len(lines) == 3      # rounds 0 and 1
    line = one_line_error(capsys, main(["results", str(tmp_path / "none")]))
    assert "none" in line
    line = one_line_error(capsys, main(["results", str(tmp_path), "--format", "xml"]))
    assert "invalid choice: 'xml'" in line


def test_results_without_the_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "splitfed.results", None)
    line = one_line_error(capsys, main(["results", "runs"]))
    assert "no splitfed.results module" in line


@pytest.mark.parametrize("argv, match", [
    (["config"], "the following arguments are required"),
    (["config", "explain", "a", "b"], "unrecognized arguments: b"),
    (["config", "show"], "config show: the following arguments are required: config"),
    (["config", "frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_config_usage_errors_are_one_line(capsys, argv, match):
    line = one_line_error(capsys, main(argv))
    assert re.search(match, line), line


def test_partition_shows_the_runs_partition_after_the_servers_pool(tmp_path, capsys):
    # a hybrid algorithm's clients share what the server's pool leaves (disjoint)
    over = ["algorithm.name=fedclg_s", "server_data.fraction=0.5",
            "server_data.min_per_class=0", "rounds=1", "progress=false",
            f"out_dir={tmp_path}"]
    assert main(["partition", "quick_digits", *over]) == 0
    shown = capsys.readouterr().out.strip()
    assert main(["run", "quick_digits", *over]) == 0
    (written,) = tmp_path.glob("*/partition.txt")
    assert written.read_text().strip() == shown
    capsys.readouterr()
    assert main(["partition", "quick_digits", *over, "server_data.fraction=0.999"]) == 2
    err = capsys.readouterr().err
    assert "partition.num_clients" in err and "left after the server's pool" in err


@pytest.mark.parametrize("option", ["partition.alpha=1", "partition.foo=1",
                                    "partition.natural=[[0]]"])
def test_the_natural_scheme_takes_no_options(tmp_path, capsys, option):
    argv = ["run", "quick_digits", "data.name=synthetic", "partition.scheme=natural",
            "~partition.alpha", "~partition.min_partition_size", "partition.num_clients=30",
            f"out_dir={tmp_path}", option]
    assert main(argv) == 2
    err = capsys.readouterr().err
    key = option.split("=")[0]
    assert f"{key}: not an option of scheme 'natural'" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_synthetic_test_fraction_that_leaves_no_test_samples_is_refused(tmp_path, capsys):
    argv = ["run", "quick_digits", "data.name=synthetic", "partition.scheme=natural",
            "~partition.alpha", "~partition.min_partition_size", "partition.num_clients=30",
            "data.test_fraction=1e-17", f"out_dir={tmp_path}"]
    assert main(argv) == 2
    assert "data.test_fraction: 1e-17 leaves no test samples" in capsys.readouterr().err


def test_ctrl_c_after_a_run_has_ended_keeps_its_status(tmp_path):
    """A run that has printed its result is done: Ctrl-C then (here again every 0.2 s
    until the process ends, which takes a while as the interpreter shuts down) neither
    says "interrupted" nor changes the exit status, and the process is not killed by
    the signal."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "splitfed", "run", "quick_digits", "rounds=1",
         "progress=false", f"out_dir={tmp_path / 'runs'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        for line in proc.stdout:
            if line.startswith("run directory:"):
                break
        while proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert "interrupted" not in err and "Traceback" not in err, err


def test_config_show_refuses_a_partition_option_its_scheme_does_not_take(capsys):
    """`config show` prints only a config a run would take: a scheme switched without
    removing the old scheme's options is refused in the run's line, exit 2."""
    argv = ["quick_digits", "partition.scheme=pathological", "~partition.alpha",
            "partition.num_classes_per_partition=2"]
    assert main(["config", "show", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("splitfed: error: partition.min_partition_size: not an option of scheme "
                   "'pathological'; options: num_classes_per_partition, "
                   "class_assignment_mode"), err
    assert main(["config", "show", *argv, "~partition.min_partition_size"]) == 0
