"""Fuzzed command lines: whatever the arguments, ``splitfed`` answers with an exit status
(0 done, 2 a user error, 3 a diverged run) and, on an error, one line on stderr; no
exception escapes ``splitfed.cli.main``.

Argument vectors mix meaningful tokens (good and bad configs, run directories, metrics
files, overrides, options, paths that are files where directories are expected) with
arbitrary text. Every path the commands may write to lies in a temporary directory,
which is also the working directory while they run.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitfed.cli import main

TINY = ("name: t\nseed: 0\nrounds: 1\nprogress: false\ncheckpoint_every: 0\n"
        "algorithm: {name: fedavg}\ndata: {name: digits, limit_train: 200, limit_test: 50}\n"
        "partition: {scheme: iid, num_clients: 3}\nmodel: {name: mlp, hidden: [8]}\n"
        "train: {batch_size: 8, local_steps: 1, lr: 0.1}\nparticipation: {mode: full}\n"
        "out_dir: runs\n")
STUDY = ("name: st\nbase: tiny.yaml\nout_dir: studies\nx_axes: [round]\n"
         "grid: {train.lr: [0.1, 0.2]}\n")
BAD_STUDY = "name: bad\nbase: tiny.yaml\ngrid: {model.cut: [1, 9]}\nout_dir: studies\n"

# text a user could type: no control characters (a terminal does not pass them through)
JUNK = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "tiny.yaml").write_text(TINY)
    (d / "study.yaml").write_text(STUDY)
    (d / "bad_study.yaml").write_text(BAD_STUDY)
    (d / "afile").write_text("not yaml: [")
    (d / "adir").mkdir()
    (d / "torn.jsonl").write_text('{"round": 0, "test_acc": 0.1}\n{"round": 1, "te')
    (d / "empty.jsonl").write_text("")
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    cwd = os.getcwd()
    os.chdir(d)
    try:
        assert main(["run", "tiny.yaml", "out_dir=done"]) == 0
    finally:
        os.chdir(cwd)
    (run,) = (d / "done").iterdir()
    shutil.copytree(run, d / "run")
    return d


PATHS = ["tiny.yaml", "afile", "adir", "missing", "binary.yaml", "afile/sub", "/proc/x",
         "quick_digits_nope", ""]


def _argv(command: str, heads: list[str], tails: list[str], first: list[str] = ()):
    """``command``, mostly a good first argument (and one of ``first``), then tokens
    (``"--opt value"`` is one token of two arguments) and some arbitrary text."""
    good = st.sampled_from(heads).map(str.split)
    head = st.one_of(good, good, good,
                     st.lists(st.one_of(st.sampled_from(heads + PATHS), JUNK), max_size=2))
    token = st.sampled_from(tails).map(str.split)
    tail = st.lists(st.one_of(token, token, token, JUNK.map(lambda j: [j])), max_size=4)
    lead = st.sampled_from(list(first)).map(lambda f: [f]) if first else st.just([])
    return st.tuples(head, lead, tail).map(
        lambda t: [command, *t[0], *t[1], *(a for part in t[2] for a in part)])


def _check(world, argv: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(world)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(cwd)
    text = err.getvalue()
    event(f"exit {code}")            # pytest --hypothesis-show-statistics shows the mix
    assert code in (0, 2, 3), (argv, code, text)
    assert "Traceback" not in text, (argv, text)
    if code == 2:
        lines = text.splitlines()
        assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), (argv, text)


OVERRIDES = ["rounds=0", "rounds=2", "rounds=-1", "model.cut=1", "model.cut=9",
             "train.lr=0.5", "train.lr=1.0e+12", "train.lr=abc", "out_dir=afile",
             "out_dir=other", "partition.num_clients=500", "partition.scheme=natural",
             "algorithm.name=sflv1", "algorithm.name=nope", "name=a/b", "seed=7",
             "model.hidden=[]", "participation.mode=uniform", "data.limit_train=2",
             "engine.device=cuda", "data.name=synthetic", "=", "a.b", "train.lr=[1,"]


@SETTINGS
@given(argv=_argv("run", ["tiny.yaml", "--resume run", "--resume"],
                  OVERRIDES + ["--resume run", "--resume adir", "--resume", "--progress"]))
def test_fuzz_run(world, argv):
    _check(world, argv)


@SETTINGS
@given(argv=_argv("partition", ["tiny.yaml"], OVERRIDES))
def test_fuzz_partition(world, argv):
    _check(world, argv)


@settings(SETTINGS, max_examples=20)
@given(argv=_argv("sweep", ["tiny.yaml"],
                  OVERRIDES + ["train.lr=0.1,0.2", "model.cut=1,9", "rounds=1,x", "name=a,b",
                               "--seeds 0,1", "--seeds 1,1", "--seeds x", "--name sw",
                               "--name ..", "--out-dir sweeps", "--out-dir afile",
                               "--group-by train.lr", "--group-by rounds", "--progress"],
                  first=["train.lr=0.1,0.2", "train.batch_size=4,8", "rounds=0,1",
                         "partition.num_clients=2,3,5000", "model.cut=1,fc1"]))
def test_fuzz_sweep(world, argv):
    _check(world, argv)


@SETTINGS
@given(argv=_argv("study", ["study.yaml", "bad_study.yaml"],
                  ["--out-dir studies", "--out-dir afile", "--out-dir adir",
                   "--out-dir /proc/x", "--progress", "--out-dir"]))
def test_fuzz_study(world, argv):
    _check(world, argv)


@SETTINGS
@given(argv=_argv("plot", ["run", "run/metrics.jsonl", "torn.jsonl", "empty.jsonl",
                           "done"],
                  ["run", "-o p.png", "--out p.pdf", "-o p.svg", "-o p.xyz", "-o p",
                   "-o adir", "-o afile/p.png", "-o /proc/p.png", "--force",
                   "--x round,time", "--x bytes", "--x speed", "--label A",
                   "--label $\\frac{$", "--title T", "-o"]))
def test_fuzz_plot(world, argv):
    _check(world, argv)
