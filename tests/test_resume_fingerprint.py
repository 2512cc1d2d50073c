"""A resume continues the same run: every checkpoint records the run's config, and a
resume under an edited ``config.yaml`` (any key but ``rounds`` and those that do not
change the numbers) or with a checkpoint of another run is refused with one line naming
the first key that differs and both values, before anything changes; through
``splitfed run --resume``, ``splitfed launch --resume`` (the launcher and rank 0) and the
auto-resume of sweeps. Raising ``rounds`` alone still resumes bit-identically."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import splitfed
from splitfed import safeio
from splitfed.checkpoint import CHECKPOINT, DATA_KEY, FREE_KEYS, data_digest, load_checkpoint
from splitfed.cli import main
from splitfed.config import load_config
from splitfed.configtools import dump_yaml
from splitfed.errors import FormatError, RunInterrupted, SplitfedError
from splitfed.experiment import build_environment, resume_experiment, run_experiment
from splitfed.sweep import run_sweep
from tests.helpers import digits_config, interrupt_round
from tests.test_checkpoint import records, same
from tests.test_checkpoint_safety import copy_run, one_line, snapshot

QUICK = ["rounds=2", "checkpoint_every=1", "progress=false"]


def quick(tmp_path: Path, *over: str):
    return load_config("quick_digits", [*QUICK, f"out_dir={tmp_path / 'runs'}", *over])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished quick_digits run of 2 rounds, checkpointed every round, to copy."""
    root = tmp_path_factory.mktemp("finished")
    run_experiment(quick(root), run_dir=root / "run")
    return root / "run"


def edit(run_dir: Path, change) -> None:
    path = run_dir / "config.yaml"
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def refused(run_dir: Path) -> str:
    """The one-line error of resuming ``run_dir``; nothing in it changed."""
    before = snapshot(run_dir)
    with pytest.raises(FormatError) as info:
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before
    msg = one_line(str(info.value))
    assert msg.startswith(f"{run_dir / CHECKPOINT}: "), msg
    assert "a resume continues the same run (only rounds may change)" in msg, msg
    return msg


def test_the_checkpoint_records_the_config(finished):
    ckpt = load_checkpoint(finished)
    record = json.loads(ckpt["config"])
    assert record["train"]["lr"] == 0.1 and record["algorithm"]["name"] == "fedavg"
    assert not {k for k in FREE_KEYS if "." not in k} & set(record)
    assert "eval_batch_size" not in record["engine"] and "batch_size" in record["train"]
    assert len(ckpt["config_sha256"]) == 64


def test_an_edited_lr_is_refused_naming_it(tmp_path, finished):
    run_dir = copy_run(finished, tmp_path / "run")

    def change(c):
        c["rounds"] = 3
        c["train"]["lr"] = 0.5

    edit(run_dir, change)
    msg = refused(run_dir)
    assert "it was written with train.lr=0.1 but config.yaml says 0.5" in msg, msg


@pytest.mark.parametrize("change, says", [
    (lambda c: c["algorithm"].update(name="fedprox"),
     "algorithm.name=fedavg but config.yaml says fedprox"),
    (lambda c: c["partition"]["options"].update(alpha=0.3),
     "partition.options.alpha=1.0 but config.yaml says 0.3"),
    (lambda c: c["train"].update(local_steps=5), "train.local_steps=10 but config.yaml "
                                                 "says 5"),
    # the config is compared before the state: the key is named, not a state's shape
    (lambda c: c["algorithm"].update(name="scaffold"),
     "algorithm.name=fedavg but config.yaml says scaffold"),
    (lambda c: c["model"]["options"].update(hidden=[32]),
     "model.options.hidden=[64] but config.yaml says [32]"),
    (lambda c: c["clock"].update(profile="exponential"),
     "clock.profile=fixed but config.yaml says exponential"),
    (lambda c: c["partition"]["options"].pop("min_partition_size"),
     "partition.options.min_partition_size=5 but config.yaml has no "
     "partition.options.min_partition_size"),
])
def test_other_edits_are_refused_naming_the_key(tmp_path, finished, change, says):
    run_dir = copy_run(finished, tmp_path / "run")
    edit(run_dir, lambda c: (c.update(rounds=3), change(c)))
    msg = refused(run_dir)
    assert f"it was written with {says}" in msg, msg


def test_a_long_value_is_shortened(tmp_path, finished):
    run_dir = copy_run(finished, tmp_path / "run")
    edit(run_dir, lambda c: c["data"].update(data_dir="d" * 100_000))   # digits: unread
    msg = refused(run_dir)
    assert f"config.yaml says {'d' * 60}... (100000 characters)" in msg, msg
    assert len(msg) < 500, len(msg)


def test_raising_rounds_alone_resumes_bit_identically(tmp_path, finished):
    full = run_experiment(quick(tmp_path, "rounds=3"), run_dir=tmp_path / "full")
    run_dir = copy_run(finished, tmp_path / "run")
    edit(run_dir, lambda c: c.update(rounds=3))
    resumed = resume_experiment(run_dir)
    assert resumed.status == "completed"
    same(full.state, resumed.state)
    assert records(run_dir) == records(tmp_path / "full")
    same(load_checkpoint(tmp_path / "full")["state"], load_checkpoint(run_dir)["state"])
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == [2]


def test_the_keys_that_do_not_change_the_numbers_may_change(tmp_path, finished):
    run_dir = copy_run(finished, tmp_path / "run")

    def change(c):
        c.update(rounds=3, name="renamed", out_dir=str(tmp_path / "elsewhere"),
                 progress=False, checkpoint_every=5)
        c["engine"]["eval_batch_size"] = 7
        c["tracking"]["tensorboard"] = False

    edit(run_dir, change)
    assert resume_experiment(run_dir).status == "completed"
    assert load_checkpoint(run_dir)["round"] == 3


def test_a_checkpoint_of_another_run_is_refused(tmp_path, finished):
    other = tmp_path / "other"
    run_experiment(quick(tmp_path, "train.lr=0.5"), run_dir=other)
    run_dir = copy_run(finished, tmp_path / "run")
    (run_dir / CHECKPOINT).write_bytes((other / CHECKPOINT).read_bytes())
    msg = refused(run_dir)
    assert "it was written with train.lr=0.5 but config.yaml says 0.1" in msg, msg


def test_an_altered_config_record_is_refused(tmp_path, finished):
    run_dir = copy_run(finished, tmp_path / "run")
    ckpt = load_checkpoint(run_dir)
    ckpt["config"] = ckpt["config"].replace('"lr":0.1', '"lr":0.5')
    safeio.save(ckpt, run_dir / CHECKPOINT)
    before = snapshot(run_dir)
    with pytest.raises(FormatError, match="does not match its config_sha256: the file was "
                                          "altered"):
        resume_experiment(run_dir)
    assert snapshot(run_dir) == before
    ckpt.pop("config_sha256")
    safeio.save(ckpt, run_dir / CHECKPOINT)
    with pytest.raises(FormatError, match="it has config but no config_sha256"):
        resume_experiment(run_dir)


def test_a_checkpoint_without_a_config_is_resumed_with_a_warning(tmp_path, finished,
                                                                  capsys):
    """Checkpoints written before they recorded the config are taken unchecked; the
    resumed run's checkpoints record it."""
    run_dir = copy_run(finished, tmp_path / "run")
    ckpt = load_checkpoint(run_dir)
    del ckpt["config"], ckpt["config_sha256"]
    safeio.save(ckpt, run_dir / CHECKPOINT)
    edit(run_dir, lambda c: c.update(rounds=3))
    capsys.readouterr()
    assert resume_experiment(run_dir).status == "completed"
    err = capsys.readouterr().err
    assert "records no config" in err and str(run_dir / CHECKPOINT) in err, err
    assert json.loads(load_checkpoint(run_dir)["config"])["train"]["lr"] == 0.1


def test_the_cli_refuses_in_one_line(tmp_path, finished, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    edit(run_dir, lambda c: c["train"].update(lr=0.5))
    before = snapshot(run_dir)
    capsys.readouterr()
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("splitfed: error: ") and "train.lr=0.1" in err, err
    assert snapshot(run_dir) == before


def test_launch_resume_is_refused_by_the_launcher_and_by_rank_0(tmp_path, finished,
                                                                 monkeypatch, capsys):
    from splitfed.runtime import launch
    from splitfed.runtime.session import RuntimeOptions, serve

    def start(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "spawn", start)
    monkeypatch.setattr(launch, "torchrun", start)
    run_dir = copy_run(finished, tmp_path / "run")
    edit(run_dir, lambda c: (c.update(rounds=3), c["train"].update(lr=0.5)))
    before = snapshot(run_dir)
    capsys.readouterr()
    assert main(["launch", "--resume", str(run_dir), "--nproc", "2"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "it was written with train.lr=0.1 but config.yaml says 0.5" in err, err

    class NoLinks:                    # rank 0 refuses before it talks to any rank
        def __getattr__(self, name):
            raise AssertionError(f"links.{name} used")

    with pytest.raises(FormatError, match="train.lr=0.1 but config.yaml says 0.5"):
        serve(NoLinks(), options=RuntimeOptions(), resume=run_dir)
    assert snapshot(run_dir) == before
    launch.check_config(argparse.Namespace(
        resume=str(copy_run(finished, tmp_path / "ok")), config=None, overrides=[],
        run_dir=None, plugin=None))


def test_the_sweep_auto_resume_refuses_a_checkpoint_of_another_run(tmp_path, monkeypatch):
    cfg = tmp_path / "small.yaml"
    dump_yaml(digits_config(rounds=4, checkpoint_every=2), cfg)
    axes = ["train.lr=0.05,0.1"]
    with monkeypatch.context() as m:
        interrupt_round(m, "fedavg", 3)
        with pytest.raises(RunInterrupted):            # Ctrl-C in the first run
            run_sweep(str(cfg), axes, out_dir=tmp_path, quiet=True, jobs=1)
    run_dir = tmp_path / "small-sweep" / "runs" / "train.lr-0.05-s3"
    assert load_checkpoint(run_dir)["round"] == 2
    other = tmp_path / "other"                         # the same point but lr 0.1
    with monkeypatch.context() as m:
        interrupt_round(m, "fedavg", 3)
        with pytest.raises(RunInterrupted):
            run_experiment(digits_config(rounds=4, checkpoint_every=2,
                                         train={"batch_size": 8, "local_steps": 2,
                                                "local_epochs": None, "lr": 0.1}),
                           run_dir=other)
    (run_dir / CHECKPOINT).write_bytes((other / CHECKPOINT).read_bytes())
    before = snapshot(run_dir)
    with pytest.raises(SplitfedError, match=r"checkpoint.pt: it was written with "
                                            r"train.lr=0.1 but config.yaml says 0.05"):
        run_sweep(str(cfg), axes, out_dir=tmp_path, quiet=True, jobs=1)
    assert snapshot(run_dir) == before


def test_data_built_otherwise_on_resume_are_refused(tmp_path, scratch):
    """A partitioner that draws from numpy's global generator instead of its ``rng``
    builds another partition on each build: the resume refuses it (``data_sha256``)
    before any file changes, instead of training the rounds after it on other clients'
    data. The same partitioner drawing from ``rng`` resumes."""
    @splitfed.register_partitioner("zz_global")
    def part(labels, num_clients, rng, own: bool = False):
        order = rng.permutation(len(labels)) if own else np.random.permutation(len(labels))
        return np.array_split(order, num_clients)

    for own in (False, True):
        run_dir = tmp_path / f"own_{own}"
        cfg = quick(tmp_path, "partition.scheme=zz_global", "~partition.alpha",
                    "~partition.min_partition_size", f"partition.options.own={own}")
        run_experiment(cfg, run_dir=run_dir)
        edit(run_dir, lambda c: c.update(rounds=3))
        if own:
            assert resume_experiment(run_dir).status == "completed"
            continue
        before = snapshot(run_dir)
        with pytest.raises(FormatError) as info:
            resume_experiment(run_dir)
        assert snapshot(run_dir) == before
        assert one_line(str(info.value)) == (
            f"{run_dir / CHECKPOINT}: the data or partition built now are not the run's "
            "(data_sha256 differs): the data files changed, or a data set or partitioner "
            "draws from a global random generator instead of the rng it is given "
            "(docs/extending.md); delete it to rerun the run from the start, or delete "
            "the run directory")


def test_a_checkpoint_without_a_data_digest_is_resumed_and_a_bad_one_refused(tmp_path,
                                                                             finished):
    """Checkpoints written before they recorded ``data_sha256`` resume without the check
    (the resumed run's checkpoints record it); a digest that is not one is a damaged
    file."""
    run_dir = copy_run(finished, tmp_path / "run")
    ckpt = load_checkpoint(run_dir)
    assert ckpt[DATA_KEY] == data_digest(build_environment(quick(tmp_path)))
    for bad in ("x" * 64, "ab", 7):
        safeio.save({**ckpt, DATA_KEY: bad}, run_dir / CHECKPOINT)
        with pytest.raises(FormatError, match=f"{DATA_KEY} is not a SHA-256 digest"):
            resume_experiment(run_dir)
    del ckpt[DATA_KEY]
    safeio.save(ckpt, run_dir / CHECKPOINT)
    edit(run_dir, lambda c: c.update(rounds=3))
    assert resume_experiment(run_dir).status == "completed"
    assert len(load_checkpoint(run_dir)[DATA_KEY]) == 64
