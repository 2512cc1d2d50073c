"""What a study reuses from a run directory (:mod:`splitfed.study.reuse`): only a run of
the identical config, compared on every key that changes a run's numbers."""

from __future__ import annotations

import json

import pytest

from splitfed.config import build_config
from splitfed.configtools import to_dict
from splitfed.errors import ConfigError
from splitfed.experiment import write_config
from splitfed.study.reuse import config_identity, run_dir_state
from splitfed.study.spec import StudyRun
from tests.study.test_study import BASE

#: the keys a run's numbers do not depend on (its files' place, its progress bar, how
#: often it checkpoints, where it reports)
NOT_COMPARED = {"out_dir", "progress", "checkpoint_every", "tracking"}


def test_the_identity_holds_every_key_but_those_that_change_no_number():
    cfg = build_config(BASE)
    assert set(config_identity(cfg)) == set(to_dict(cfg)) - NOT_COMPARED


@pytest.mark.parametrize("over", [{"seed": 1}, {"rounds": 3}, {"train": {"lr": 0.2}},
                                  {"train": {"batch_size": 8}},
                                  {"partition": {"num_clients": 5}},
                                  {"model": {"hidden": [8]}},
                                  {"algorithm": {"name": "fedprox"}}])
def test_a_change_that_changes_the_numbers_changes_the_identity(over):
    base = build_config(BASE)
    changed = build_config({**BASE, **{k: {**BASE.get(k, {}), **v} if isinstance(v, dict)
                                       else v for k, v in over.items()}})
    assert config_identity(changed) != config_identity(base)


def _saved(tmp_path, saved: dict, current: dict, summary: dict | None = None,
           metrics: bool = False):
    d = tmp_path / "run"
    d.mkdir(parents=True)
    write_config(build_config(saved), d / "config.yaml")
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    if metrics:
        (d / "metrics.jsonl").write_text(json.dumps({"round": 0, "test_acc": 0.1}) + "\n")
    return StudyRun("r", 0, build_config(current), d)


def test_a_run_dir_of_a_config_with_an_option_more_or_less_is_refused(tmp_path):
    """An option given now that the recorded run did not give (or the other way round)
    is a different config, found whichever side holds the key."""
    without = {**BASE, "model": {"name": "mlp"}}
    with pytest.raises(ConfigError, match=r"different config \(differs at model\.options"):
        run_dir_state(_saved(tmp_path / "a", without, BASE))
    with pytest.raises(ConfigError, match=r"different config \(differs at model\.options"):
        run_dir_state(_saved(tmp_path / "b", BASE, without))


def test_a_run_dir_of_another_train_section_is_refused(tmp_path):
    other = {**BASE, "train": {**BASE["train"], "lr": 0.05}}
    with pytest.raises(ConfigError, match=r"different config \(differs at train\.lr\)"):
        run_dir_state(_saved(tmp_path, other, BASE))


def test_records_without_a_finished_summary_are_an_unfinished_run(tmp_path):
    """A run stopped before it wrote its summary (or stopped with ``interrupted``) is
    unfinished, whatever records it left: resumed, never taken as done."""
    assert run_dir_state(_saved(tmp_path / "a", BASE, BASE, metrics=True)).state == \
        "unfinished"
    stopped = _saved(tmp_path / "b", BASE, BASE, {"status": "interrupted"}, metrics=True)
    assert run_dir_state(stopped).state == "unfinished"
    no_records = _saved(tmp_path / "c", BASE, BASE, {"status": "completed"})
    assert run_dir_state(no_records).state == "unfinished"


def test_a_plugin_whose_files_could_not_be_read_is_never_the_same_code():
    """A plugin digest ``unknown`` (its files could not be read) proves nothing: the run
    is made by other code even when it recorded ``unknown`` too; a plugin only one side
    imported is not compared."""
    from splitfed.study.reuse import compare_code

    now = {"splitfed": "1.2.0", "commit": "a" * 40, "source": "c" * 64,
           "plugins": {"p": "unknown", "q": "e" * 64}}
    same, note = compare_code(dict(now), now)
    assert not same and note == "the code of plugin p changed since the run was recorded"
    known = dict(now, plugins={"p": "f" * 64, "q": "e" * 64})
    assert compare_code(dict(known), known) == (True, None)
    assert not compare_code(dict(known, plugins={"p": "0" * 64}), known)[0]
    assert compare_code(dict(known, plugins={}), known) == (True, None)


def _records(rounds: int, clients=1, acc=0.5):
    return [{"round": 0, "test_acc": 0.1}] + [
        {"round": t, "test_acc": acc, "train_loss": 1.0, "clients_used": clients}
        for t in range(1, rounds + 1)]


def test_records_give_a_finished_status_only_when_they_end_at_the_last_round():
    """The statuses a finished run's records allow (what a study checks a reused run's
    summary.json against): records that stop before the last round, or go on past it,
    belong to no finished run of this config."""
    from splitfed.experiment import record_statuses

    cfg = build_config(dict(BASE, rounds=3))
    assert record_statuses(_records(3), cfg)[0] == ("completed",)
    assert record_statuses(_records(2), cfg)[0] == ()
    assert record_statuses(_records(4), cfg)[0] == ()
    diverged = _records(2) + [{"round": 3, "train_loss": float("nan"), "clients_used": 1}]
    assert record_statuses(diverged, cfg)[0] == ("diverged",)
    assert record_statuses(diverged[:-1] + [dict(diverged[-1], round=2)]
                           + [{"round": 3, "train_loss": 1.0}], cfg)[0] == ()


def test_no_client_trained_only_when_no_round_used_a_client():
    from splitfed.experiment import record_statuses

    cfg = build_config(dict(BASE, rounds=3))
    assert record_statuses(_records(3, clients=0), cfg)[0] == ("no_client_trained",)
    some = _records(3, clients=0)
    some[2]["clients_used"] = 2
    assert record_statuses(some, cfg)[0] == ("completed",)
    unknown = _records(3, clients=0)
    del unknown[3]["clients_used"]
    assert record_statuses(unknown, cfg)[0] == ("completed", "no_client_trained")
