"""A study's worker holds a run directory's lock while it clears a run interrupted before
its first checkpoint and while it reruns it: another process (``splitfed run --resume``
of that directory) is refused meanwhile, and cannot have its lock file deleted under it."""

from __future__ import annotations

import splitfed.tracking
from splitfed.config import load_config
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError
from splitfed.experiment import lock_run_dir
from splitfed.locking import LOCK_NAME
from splitfed.study.parallel import PointTask, clear_dir, run_point


def interrupted_run(tmp_path):
    """The config of a one-round run and its directory as a run killed before its first
    checkpoint left it: config.yaml and a metrics file, no checkpoint."""
    cfg = load_config("quick_digits", ["rounds=1", "progress=false",
                                       f"out_dir={tmp_path / 'runs'}"])
    d = tmp_path / "run"
    d.mkdir()
    dump_yaml(cfg, d / "config.yaml")
    (d / "metrics.jsonl").write_text('{"round": 0}\n')
    (d / "stray").mkdir()
    return cfg, d


def test_the_worker_holds_the_lock_while_it_clears_the_run(tmp_path, monkeypatch):
    cfg, d = interrupted_run(tmp_path)
    seen = []

    def discard(run_dir):                 # the MLflow clean-up, seconds on a real store
        try:
            with lock_run_dir(run_dir):
                seen.append("free")
        except ConfigError:
            seen.append("held")
    monkeypatch.setattr(splitfed.tracking, "discard_recorded_run", discard)
    result = run_point(PointTask(0, "a", 0, cfg, d, "unfinished"))
    assert result.error is None and result.status == "completed", result.error
    assert seen == ["held"]
    assert not (d / "stray").exists() and (d / "summary.json").is_file()


def test_a_run_another_process_holds_is_not_cleared(tmp_path):
    cfg, d = interrupted_run(tmp_path)
    with lock_run_dir(d):
        result = run_point(PointTask(0, "a", 0, cfg, d, "unfinished"))
        assert (d / LOCK_NAME).is_file()
    assert result.status is None and "in use" in result.error, result.error
    assert (d / "stray").is_dir() and (d / "metrics.jsonl").is_file()


def test_clear_dir_keeps_only_the_lock_file(tmp_path):
    _, d = interrupted_run(tmp_path)
    with lock_run_dir(d):
        clear_dir(d)
        assert [p.name for p in d.iterdir()] == [LOCK_NAME]
