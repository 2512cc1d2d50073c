"""A study's tables take each run's numbers from that run: with several seeds of one
label, each row and each per-seed entry is the outcome of its own seed."""

from __future__ import annotations

from pathlib import Path

import yaml

from splitfed.study import study_from_mapping
from splitfed.study.outcome import RunOutcome, StudyResult
from splitfed.study.report import results_summary
from splitfed.study.reuse import config_hash
from splitfed.sweep import sweep_rows, sweep_study
from tests.study.test_study import BASE


def _outcomes(study) -> list[RunOutcome]:
    """A made-up outcome per run whose accuracy and bytes tell the runs apart."""
    out = []
    for i, run in enumerate(study.runs):
        acc = (i + 1) / 10
        records = [{"round": 0, "test_acc": 0.0},
                   {"round": 1, "test_acc": acc, "bytes_up": 100 * (i + 1),
                    "bytes_down": 10 * (i + 1)}]
        out.append(RunOutcome(run.label, run.seed, run.run_dir, "completed", records,
                              1.0, skipped=False))
    return out


def test_sweep_rows_take_the_numbers_of_their_own_seed(tmp_path):
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(dict(BASE, rounds=1)))
    mapping = sweep_study(str(config), ["train.lr=0.1,0.2"], seeds=[4, 9],
                          out_dir=tmp_path / "out")
    study = study_from_mapping(mapping)
    outcomes = _outcomes(study)
    result = StudyResult(study, study.dir, outcomes, "", {})
    rows = sweep_rows(result, mapping["grid"])
    assert [(r["train.lr"], r["seed"]) for r in rows] == [(0.1, 4), (0.1, 9), (0.2, 4),
                                                           (0.2, 9)]
    assert [r["final_test_acc"] for r in rows] == [0.1, 0.2, 0.3, 0.4]
    assert [r["bytes_up"] for r in rows] == [100, 200, 300, 400]
    assert [Path(r["run_dir"]).name for r in rows] == [
        "train.lr-0.1-s4", "train.lr-0.1-s9", "train.lr-0.2-s4", "train.lr-0.2-s9"]


def test_results_per_seed_entries_describe_their_own_seeds_run(tmp_path):
    study = study_from_mapping({"name": "s", "base_config": dict(BASE, rounds=1),
                                "grid": {"train.lr": [0.1, 0.2]}, "seeds": [4, 9]},
                               out_dir=tmp_path / "out")
    summary = results_summary(study, _outcomes(study), "cmd")
    for variant, entry in zip(study.variants, summary["runs"]):
        assert entry["seeds"] == [4, 9]
        per_seed = entry["per_seed"]
        assert [s["config_hash"] for s in per_seed] == [
            config_hash(r.config) for r in variant.runs]
        assert per_seed[0]["config_hash"] != per_seed[1]["config_hash"]
        assert [s["run_dir"] for s in per_seed] == [
            str(r.run_dir.relative_to(study.dir)) for r in variant.runs]
    assert [s["final_test_acc"] for e in summary["runs"] for s in e["per_seed"]] == [
        0.1, 0.2, 0.3, 0.4]
