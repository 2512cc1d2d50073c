"""Studies: validation before any run, outputs, resuming, and the numbers in the table."""

import errno
import json
import math
import shutil

import pytest
import yaml

import splitfed.study as study_mod
from splitfed.cli import main
from splitfed.config import build_config
from splitfed.errors import ConfigError
from splitfed.study import runner
from splitfed.experiment import run_experiment
from splitfed.study import (
    config_hash,
    curve,
    load_study,
    rounds_to_target,
    run_numbers,
    RunsFailed,
    run_study,
    slugify,
    study_from_mapping,
    summarize,
    time_to_target,
)

BASE = {"name": "tiny", "seed": 0, "rounds": 2,
        "data": {"name": "digits"},
        "partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 1.0,
                      "min_partition_size": 5},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"batch_size": 16, "local_steps": 2, "lr": 0.1},
        "participation": {"mode": "full"}}

STUDY = {"name": "tiny_study", "base": "base.yaml", "overrides": ["rounds=2"],
         "runs": [{"label": "FL", "set": ["algorithm.name=fedavg"]},
                  {"label": "central", "set": ["algorithm.name=centralized"]}],
         "grid": {"partition.alpha": [0.5, "inf"]},
         "group_by": "partition.alpha", "x_axes": ["round", "bytes"],
         "target_accuracy": 0.2}


def _write_study(folder, study=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.yaml").write_text(yaml.safe_dump(BASE))
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study or STUDY, sort_keys=False))
    return path


def _forbid_runs(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a run was started")
    monkeypatch.setattr(study_mod, "run_experiment", fail)


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A tiny study (2 grid values x 2 runs, 2 rounds on digits), run once."""
    root = tmp_path_factory.mktemp("study")
    path = _write_study(root / "spec")
    result = run_study(path, out_dir=root / "out", quiet=True)
    return path, root / "out", result


def _copy(done, tmp_path):
    path, out, _ = done
    shutil.copytree(out, tmp_path / "out")
    return path, tmp_path / "out"


# ------------------------------------------------------------------- helpers


def test_rounds_to_target_on_synthetic_records():
    records = [{"round": 0, "test_acc": 0.1},
               {"round": 1, "train_loss": 2.0},            # not evaluated
               {"round": 2, "test_acc": 0.79},
               {"round": 3, "test_loss": 1.0},
               {"round": 4, "test_acc": 0.8},
               {"round": 5, "test_acc": 0.9}]
    assert rounds_to_target(records, 0.8) == 4
    assert rounds_to_target(records, 0.05) == 0
    assert rounds_to_target(records, 0.95) is None
    assert rounds_to_target([], 0.5) is None


@pytest.mark.parametrize("last", [{"train_loss": float("nan"), "test_acc": 0.3},
                                  {"test_loss": "inf", "test_acc": 0.3},
                                  {"test_acc": "nan"}])          # logged as text
def test_the_round_a_run_diverged_at_reaches_no_target(last):
    """Its accuracy is not the model's (best_test_acc leaves it out too)."""
    from splitfed.study.analysis import time_to_target

    records = [{"round": 0, "test_acc": 0.1, "sim_time_s": 0.0},
               {"round": 1, "test_acc": 0.2, "sim_time_s": 1.0},
               {"round": 2, "sim_time_s": 2.0, **last}]
    assert rounds_to_target(records, 0.15) == 1 and time_to_target(records, 0.15) == 1.0
    assert rounds_to_target(records, 0.25) is None and time_to_target(records, 0.25) is None


def test_curve_and_totals_are_cumulative():
    records = [{"round": 0, "test_acc": 0.1},
               {"round": 1, "bytes_up": 10, "bytes_down": 5, "bytes_up/weights": 10,
                "bytes_down/weights": 5, "round_time_s": 1.0},
               {"round": 2, "bytes_up": 20, "bytes_down": 5, "bytes_up/weights": 12,
                "bytes_up/labels": 8, "bytes_down/weights": 5, "round_time_s": 2.0,
                "test_acc": 0.5}]
    c = curve(records)
    assert c["round"] == [0, 2] and c["test_acc"] == [0.1, 0.5]
    assert c["bytes"] == [0, 40] and c["time_s"] == [0.0, 3.0] and c["time_kind"] == "wall"
    n = run_numbers(records, 0.4)
    assert (n["bytes_up"], n["bytes_down"], n["rounds_to_target"]) == (30, 10, 2)
    assert n["bytes_by_kind"] == {"bytes_down/weights": 10, "bytes_up/labels": 8,
                                  "bytes_up/weights": 22}
    assert n["final_test_acc"] == 0.5 and n["best_test_acc"] == 0.5
    sim = [dict(r, sim_round_s=0.5) if r["round"] else r for r in records]
    assert curve(sim)["time_s"] == [0.0, 1.0] and curve(sim)["time_kind"] == "simulated"
    fast = [dict(r, sim_round_s=1.9088e-9) if r["round"] else r for r in records]
    assert curve(fast)["time_s"] == [0.0, 3.8176e-9]          # not rounded to 0
    slow = [dict(r, sim_round_s=123456.7890123456) if r["round"] else r for r in records]
    assert curve(slow)["time_s"] == [0.0, 246913.578025]


def test_a_diverged_runs_curve_ends_before_its_divergence():
    """As splitfed plot draws it and the best accuracy counts it: the diverged round's
    evaluation (a finite accuracy of a model with NaN loss) is not on the curve."""
    records = [{"round": 0, "test_acc": 0.1, "test_loss": 2.3},
               {"round": 1, "train_loss": 2.0, "test_acc": 0.4, "test_loss": 1.9},
               {"round": 2, "train_loss": float("nan"), "test_acc": 0.1003,
                "test_loss": float("nan")}]
    assert curve(records, "diverged")["round"] == [0, 1]
    assert curve(records[:2], "diverged")["round"] == [0]       # status alone: last round
    assert curve(records[:2], "completed")["round"] == [0, 1]
    assert curve(records)["round"] == [0, 1, 2]          # no status: every evaluation


def test_the_mean_curve_goes_on_with_the_seeds_that_did_not_diverge():
    from splitfed.study.plots import _mean_curve

    def seed(rounds, accs):
        return {"curve": {"round": rounds, "test_acc": accs, "bytes": [0] * len(rounds),
                          "time_s": [0.0] * len(rounds)}}

    x, y, std = _mean_curve([seed([0, 1, 2], [0.1, 0.5, 0.7]),
                             seed([0, 1, 2], [0.1, 0.3, 0.5]),
                             seed([0, 1], [0.1, 0.2])], "round")        # diverged at 2
    assert list(x) == [0, 1, 2]
    assert list(y) == pytest.approx([0.1, (0.5 + 0.3 + 0.2) / 3, 0.6])
    # float64 sample std of 0.7 and 0.5, sqrt(0.02): the differences 0.1 from the mean
    # 0.6 carry the eps64 rounding of 0.7 (7 times their own), ~1e-15; 1e-12 is far above
    assert std[2] == pytest.approx(math.sqrt(0.02), rel=1e-12) and std[0] == pytest.approx(0)


def test_seed_summaries_are_the_mean_and_the_sample_standard_deviation():
    """study/analysis.py and the study report's note: mean +- *sample* standard deviation
    over seeds (divisor n - 1), over the seeds that have a value."""
    s = summarize([0.5, None, 0.7, 0.9])
    assert s["n"] == 3 and s["values"] == [0.5, None, 0.7, 0.9]
    # float64 mean and std of three values: a few eps64 (2.2e-16) apart
    assert s["mean"] == pytest.approx(0.7, rel=1e-15)
    assert s["std"] == pytest.approx(0.2, rel=1e-15)        # population std: 0.1633
    assert summarize([0.4]) == {"mean": 0.4, "std": 0.0, "n": 1, "values": [0.4]}
    assert summarize([None, None])["mean"] is None and summarize([None])["std"] is None


def test_a_target_reached_by_the_initial_model_takes_no_simulated_time():
    """time_to_target: the seconds at the first evaluation reaching the target; round 0
    (the initial model, whose record carries no sim_time_s) is at time 0."""
    records = [{"round": 0, "test_acc": 0.5},
               {"round": 1, "test_acc": 0.7, "sim_round_s": 2.0, "sim_time_s": 2.0}]
    assert time_to_target(records, 0.4) == 0.0
    assert time_to_target(records, 0.6) == 2.0


def test_the_curve_takes_simulated_time_only_when_every_round_records_it():
    """curve(): time sums sim_round_s when *every* training round records it, else the
    measured round_time_s."""
    records = [{"round": 0, "test_acc": 0.1},
               {"round": 1, "round_time_s": 1.0, "sim_round_s": 0.25, "test_acc": 0.2},
               {"round": 2, "round_time_s": 2.0, "test_acc": 0.3}]
    c = curve(records)
    assert c["time_kind"] == "wall" and c["time_s"] == [0.0, 1.0, 3.0]


def test_the_time_axis_says_which_time_the_curves_hold():
    from splitfed.study.plots import axis_label
    sim, wall = {"time_kind": "simulated"}, {"time_kind": "wall"}
    assert axis_label("time", [sim, sim]) == "cumulative simulated time (s)"
    assert axis_label("time", [wall]) == "cumulative wall time (s)"
    assert axis_label("time", [sim, wall]).startswith("cumulative time (s; simulated")
    assert axis_label("round", [sim]) == "round"


def test_the_results_table_prints_short_simulated_times_readably():
    from splitfed.results import _seconds
    assert [_seconds(v) for v in (0.0, 3.8176e-09, 0.004, 0.01, 12.345, 2e12)] == [
        "0.00", "3.818e-09", "0.004", "0.01", "12.35", "2e+12"]


def test_labels_and_run_dirs_follow_the_grid(tmp_path):
    study = study_from_mapping(dict(STUDY, seeds=[0, 3]), out_dir=tmp_path,
                               base_dir=_write_study(tmp_path / "spec").parent)
    labels = [v.label for v in study.variants]
    assert labels == ["FL (partition.alpha=0.5)", "central (partition.alpha=0.5)",
                      "FL (partition.alpha=inf)", "central (partition.alpha=inf)"]
    assert [v.line_label for v in study.variants] == ["FL", "central"] * 2
    assert [v.group for v in study.variants] == ["0.5", "0.5", "inf", "inf"]
    run = study.variants[0].runs[1]
    assert run.seed == 3 and run.config.seed == 3 and run.config.rounds == 2
    assert run.config.partition.options["alpha"] == 0.5
    assert run.run_dir == tmp_path / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s3"
    assert slugify("SFL-V2 cut 1") == "sfl-v2-cut-1"
    assert not tmp_path.joinpath("tiny_study").exists()  # loading writes nothing


# ---------------------------------------------------------------- validation


def test_typo_in_one_run_fails_before_any_run_dir(tmp_path, monkeypatch):
    _forbid_runs(monkeypatch)
    for typo, word in (("train.lrr=0.1", "lrr"), ("model.hiden=[8]", "hiden"),
                       ("algorithm.name=nosuchalgo", "nosuchalgo")):
        runs = STUDY["runs"] + [{"label": "bad", "set": [typo]}]
        path = _write_study(tmp_path / "spec", dict(STUDY, runs=runs))
        with pytest.raises(ConfigError, match=word) as err:
            run_study(path, out_dir=tmp_path / "out", quiet=True)
        assert "'bad" in str(err.value)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    ({"seed": [1]}, "unknown key 'study.seed'.*did you mean 'seeds'"),
    ({"runs": [{"lable": "x", "set": []}]}, "study.runs\\[0\\].lable"),
    ({"x_axes": ["rounds"]}, "study.x_axes"),
    ({"runs": [{"label": "a"}, {"label": "a"}], "grid": {}}, "used twice"),
    ({"runs": [{"label": "a b"}, {"label": "a-b"}], "grid": {}}, "same run directory"),
    ({"runs": [{"label": "a", "set": ["partition.alpha=1"]}]}, "set both"),
    ({"overrides": ["out_dir=elsewhere"]}, "set by the study"),
    ({"runs": [], "grid": {}}, "no run is defined"),
    ({"runs": [{"label": " "}]}, "non-empty label"),
    ({"runs": [{"label": "a\nb"}]}, r"label 'a\\nb' has a control character"),
    ({"runs": [{"label": "a\u2028b"}]}, r"label 'a\\u2028b' has a control character"),
    ({"runs": [{"label": "c\x85d"}]}, r"label 'c\\x85d' has a control character"),
    ({"name": "x" * 256}, "study.name: 256 characters, more than the 255"),
    ({"grid": {f"x{i}.y": [1] for i in range(65)}},
     "study.grid: 65 keys, more than the 64 a grid may have"),
    ({"group_by": "partition.nosuch"}, "group_by"),
    ({"base": "no_such_config"}, "study.base"),
])
def test_bad_study_files_are_refused(tmp_path, change, message):
    path = _write_study(tmp_path, dict(STUDY, **change))
    with pytest.raises(ConfigError, match=message):
        load_study(path)


# ------------------------------------------------------------------- running


def test_study_writes_table_json_and_plots(done):
    path, out, result = done
    d = out / "tiny_study"
    assert result.dir == d and result.completed
    for name in ("results.md", "results.json", "accuracy_vs_round.png",
                 "accuracy_vs_bytes.png"):
        assert (d / name).stat().st_size > 0, name
    assert sorted(p.name for p in (d / "runs").iterdir()) == [
        "central-partition.alpha-0.5-s0", "central-partition.alpha-inf-s0",
        "fl-partition.alpha-0.5-s0", "fl-partition.alpha-inf-s0"]
    md = (d / "results.md").read_text()
    assert "| run | final acc | best acc | rounds to 0.2 | MB up | MB down |" in md
    assert "| FL (partition.alpha=0.5) | 0." in md
    assert f"splitfed study {path} --out-dir {out}" in md
    assert "```yaml\nname: tiny_study\n" in md
    summary = json.loads((d / "results.json").read_text())
    assert [r["label"] for r in summary["runs"]] == [v.label for v in result.study.variants]
    fl = summary["runs"][0]["per_seed"][0]
    records = [json.loads(x) for x in (d / fl["run_dir"] / "metrics.jsonl")
               .read_text().splitlines()]
    assert fl["bytes_up"] == sum(r.get("bytes_up", 0) for r in records) > 0
    assert fl["curve"]["round"] == [0, 1, 2] and fl["curve"]["bytes"][-1] == (
        fl["bytes_up"] + fl["bytes_down"])
    assert fl["final_test_acc"] == records[-1]["test_acc"]
    assert fl["rounds_to_target"] == rounds_to_target(records, 0.2)
    assert fl["config_hash"] == config_hash(result.study.runs[0].config)
    assert result.table in md


def test_rerun_skips_completed_runs(done, tmp_path, monkeypatch, capsys):
    path, out = _copy(done, tmp_path)  # config identity ignores out_dir: copies resume
    _forbid_runs(monkeypatch)
    again = run_study(path, out_dir=out)
    printed = capsys.readouterr().out
    assert printed.count("(done earlier, skipped)") == 4 and "[4/4]" in printed
    assert "| central (partition.alpha=inf) |" in printed
    first = [r["final_test_acc"] for r in done[2].summary["runs"]]
    assert [r["final_test_acc"] for r in again.summary["runs"]] == first
    assert main(["study", str(path), "--out-dir", str(out)]) == 0


def test_incomplete_run_is_rerun_and_foreign_run_refused(done, tmp_path, monkeypatch):
    path, out = _copy(done, tmp_path)
    runs = out / "tiny_study" / "runs"
    (runs / "fl-partition.alpha-inf-s0" / "summary.json").unlink()
    (runs / "fl-partition.alpha-inf-s0" / "checkpoint.pt").unlink()  # else it is resumed
    calls = []

    def counting(cfg, **kwargs):
        calls.append(kwargs["run_dir"])
        return run_experiment(cfg, **kwargs)

    monkeypatch.setattr(study_mod, "run_experiment", counting)
    result = run_study(path, out_dir=out, quiet=True)
    assert calls == [runs / "fl-partition.alpha-inf-s0"] and result.completed
    assert [o.skipped for o in result.outcomes] == [True, True, False, True]

    _forbid_runs(monkeypatch)
    changed = _write_study(tmp_path / "spec2", dict(STUDY, overrides=["rounds=3"]))
    with pytest.raises(ConfigError, match="different config.*rounds"):
        run_study(changed, out_dir=out, quiet=True)


def test_run_experiment_refuses_a_non_empty_run_dir(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    cfg = build_config(dict(BASE, progress=False, rounds=0))
    with pytest.raises(ConfigError, match="not empty"):
        run_experiment(cfg, run_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]


def test_saved_config_missing_newer_fields_still_matches():
    from splitfed.config import build_config
    from splitfed.configtools import to_dict
    from splitfed.study import config_identity
    cfg = build_config({"data": {"name": "digits"}})
    saved = to_dict(cfg)
    del saved["server_data"]                     # a run written before the field existed
    del saved["train"]["lr_decay"]
    assert config_identity(saved) == config_identity(cfg)


# ------------------------------------------------ validated end to end, one writer

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from splitfed.errors import FormatError  # noqa: E402
from splitfed.locking import LOCK_NAME, DirLock, check_free, holder  # noqa: E402
from splitfed.metrics import read_records  # noqa: E402


def test_a_run_that_fails_only_when_built_is_refused_before_anything_is_written(
        tmp_path, monkeypatch):
    _forbid_runs(monkeypatch)
    runs = STUDY["runs"] + [{"label": "cut", "set": ["algorithm.name=sflv2",
                                                     "model.cut=7"]}]
    path = _write_study(tmp_path / "spec", dict(STUDY, runs=runs))
    study = load_study(path, out_dir=tmp_path / "out")   # the schema alone accepts it
    with pytest.raises(ConfigError, match=r"^run 'cut \(partition.alpha=0.5\)': "
                                          r"model.cut=7 is not valid for mlp"):
        run_study(study, quiet=True)
    assert not (tmp_path / "out").exists()


def test_each_distinct_config_is_built_once(tmp_path, monkeypatch):
    import splitfed.experiment as experiment
    built = []
    real = experiment.build_environment

    def counting(cfg, **kwargs):
        built.append(cfg.seed)
        return real(cfg, **kwargs)

    loaded = []
    real_load = experiment.load_dataset

    def counting_load(*args, **kwargs):
        loaded.append(1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(experiment, "build_environment", counting)
    monkeypatch.setattr(experiment, "load_dataset", counting_load)
    study = study_from_mapping(dict(STUDY, seeds=[0, 1]), out_dir=tmp_path,
                               base_dir=_write_study(tmp_path / "spec").parent)
    study_mod.check_runs(study.runs + study.runs)
    assert sorted(built) == [0] * 4 + [1] * 4
    assert len(loaded) == 2                 # one data set a seed, shared by its 4 configs


def test_checking_many_runs_says_how_far_it_is(tmp_path, monkeypatch, capsys):
    import splitfed.study.runner as runner
    monkeypatch.setattr(runner, "CHECK_PROGRESS_S", 0.0)
    study = study_from_mapping(dict(STUDY, seeds=[0, 1]), out_dir=tmp_path,
                               base_dir=_write_study(tmp_path / "spec").parent)
    study_mod.check_runs(study.runs)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (elapsed")[0] for line in lines] == [
        f"splitfed: checking the runs before any starts: {i} of 8" for i in range(8)]


def test_a_finished_run_whose_records_were_cut_short_is_refused_before_any_run(
        done, tmp_path, monkeypatch):
    """metrics.jsonl cut after a whole line still reads as valid records; summary.json
    says how many rounds the run had, and reuse checks it. A run with no record at all
    is damaged too."""
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s0"
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert len(lines) > 1
    _forbid_runs(monkeypatch)
    metrics.write_text("".join(lines[:-1]))
    with pytest.raises(FormatError, match="metrics.jsonl ends at round .* but summary.json "
                                          "says the run ended at round 2; .*fl-partition"
                                          ".alpha-0.5-s0 is damaged: delete that directory"):
        run_study(path, out_dir=out, quiet=True)
    metrics.write_text("")
    with pytest.raises(FormatError, match="holds no record; the finished run"):
        run_study(path, out_dir=out, quiet=True)


def _edit_summary(run, **changes):
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, **changes}, indent=2))


@pytest.mark.parametrize("run_name, status, why", [
    ("fl-partition.alpha-0.5-s0", "diverged", "no non-finite loss or accuracy in any round"),
    ("fl-partition.alpha-0.5-s0", "no_client_trained",
     "no divergence and clients trained in round 1"),
    ("central-partition.alpha-inf-s0", "no_client_trained", "no divergence")])
def test_a_finished_run_whose_status_its_records_contradict_is_refused(
        done, tmp_path, monkeypatch, run_name, status, why):
    """The table and the exit status take a reused run's status from summary.json: it
    must be the one its metrics.jsonl gives, not one written by hand."""
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / run_name
    _edit_summary(run, status=status)
    _forbid_runs(monkeypatch)
    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(FormatError) as caught:
        run_study(path, out_dir=out, quiet=True)
    assert str(caught.value) == (
        f"{run / 'summary.json'} says the run ended {status!r} but metrics.jsonl records "
        f"{why}; the finished run in {run} is damaged: delete that directory to run it "
        "again")


def test_a_finished_run_whose_records_contradict_its_status_is_refused(done, tmp_path,
                                                                        monkeypatch):
    """Records of a federated run in which no client trained are those of a
    ``no_client_trained`` run, not a ``completed`` one; records that stop before the
    last round without diverging are those of no finished run."""
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s0"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    _forbid_runs(monkeypatch)
    idle = [{**r, "clients_used": 0} if r["round"] > 0 else r for r in records]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in idle))
    with pytest.raises(FormatError, match="fl-partition.alpha-0.5-s0/summary.json says "
                                          "the run ended 'completed' but metrics.jsonl "
                                          "records no divergence and no client trained "
                                          "in any round; .* is damaged"):
        run_study(path, out_dir=out, quiet=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    _edit_summary(run, rounds=records[-2]["round"])
    with pytest.raises(FormatError, match="records no divergence and its last round is 1, "
                                          "not the run's last round 2; .* is damaged"):
        run_study(path, out_dir=out, quiet=True)


def test_a_diverged_run_whose_records_go_on_after_the_divergence_is_refused(
        done, tmp_path, monkeypatch):
    """A run stops at the round it diverges at: records with a non-finite loss and
    rounds after it are no finished run's, whatever its summary says."""
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s0"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    broken = [{**r, "train_loss": float("nan")} if r["round"] == 1 else r for r in records]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in broken))
    _edit_summary(run, status="diverged")
    _forbid_runs(monkeypatch)
    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(FormatError, match=r"says the run ended 'diverged' but metrics\.jsonl "
                                          "records a non-finite loss or accuracy at round "
                                          r"1 and records after it, to round 2; .* is "
                                          "damaged"):
        run_study(path, out_dir=out, quiet=True)


@pytest.mark.parametrize("text, why", [
    ('{"name": "tiny", "status": "compl', "not JSON"),        # torn
    ("", "not JSON"),                                           # empty
    ("[1, 2]", "not a JSON object"),
    ('{"name": "tiny"}', "no status"),
    ('{"name": "tiny", "status": "running"}', "status 'running' is none a run writes"),
    ('{"name": "tiny", "status": 1}', "status '1' is none a run writes")])
def test_a_finished_run_whose_summary_is_damaged_is_refused_before_any_run(
        done, tmp_path, monkeypatch, text, why):
    """A run writes summary.json once, whole, when it ends: one that is there but is not
    a JSON object is damaged, not a sign of an unfinished run to resume (which would
    rewrite it without provenance, and the next study would rerun it as stale)."""
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s0"
    (run / "summary.json").write_text(text)
    before = {p: p.read_bytes() for p in run.iterdir()}
    _forbid_runs(monkeypatch)
    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(FormatError) as caught:
        run_study(path, out_dir=out, quiet=True)
    message = str(caught.value)
    assert message.startswith(f"{run / 'summary.json'}: {why}")
    assert message.endswith(f"the finished run in {run} is damaged: delete that directory "
                            "to run it again")
    assert "\n" not in message
    assert {p: p.read_bytes() for p in run.iterdir()} == before


def test_damaged_study_directories_are_refused_before_any_run(done, tmp_path, monkeypatch):
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s0"
    _forbid_runs(monkeypatch)
    (run / "config.yaml").write_text("rounds: [")
    with pytest.raises(ConfigError, match="fl-partition.alpha-0.5-s0 is damaged: cannot "
                                          "parse .*delete the directory"):
        run_study(path, out_dir=out, quiet=True)
    shutil.rmtree(run)
    run.write_text("a file")
    with pytest.raises(ConfigError, match="is a file, not a run directory"):
        run_study(path, out_dir=out, quiet=True)
    run.unlink()
    (out / "tiny_study" / "accuracy_vs_bytes.png").unlink()
    (out / "tiny_study" / "accuracy_vs_bytes.png").mkdir()
    with pytest.raises(ConfigError, match="accuracy_vs_bytes.png exists and is not a file"):
        run_study(path, out_dir=out, quiet=True)


def test_read_records_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for text, match in [('{"round": 0}\n{"round": 1, "te', "line 2 is not a JSON record"),
                        ('[1, 2]\n', "line 1 is not a JSON object"),
                        ('{"test_acc": 0.5}\n', "line 1 has no round number"),
                        ('{"round": -1}\n', "line 1 has no round number"),
                        ('{"round": true}\n', "line 1 has no round number"),
                        ('{"round": 1e400}\n', "line 1 has no round number")]:
        path.write_text(text)
        with pytest.raises(FormatError, match=f"{path}: {match}"):
            read_records(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(FormatError, match="not UTF-8"):
        read_records(path)
    path.write_text('{"round": 0, "test_acc": 0.1}\n\n{"round": 1, "test_acc": "nan"}\n')
    assert read_records(path) == [{"round": 0, "test_acc": 0.1},     # earlier versions'
                                  {"round": 1, "test_acc": math.nan}]  # "nan": a float


# -------------------------------------------------------------------- DirLock


def test_dir_lock_is_exclusive_named_and_released(tmp_path):
    d = tmp_path / "new" / "dir"
    with DirLock.acquire(d, "study directory") as lock:
        assert lock.held and (d / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        assert holder(d) == os.getpid()
        message = (f"study directory {d} is in use by another splitfed process "
                   f"(pid {os.getpid()}); wait for it or choose another --name/--out-dir")
        with pytest.raises(ConfigError) as err:
            DirLock.acquire(d, "study directory")
        assert str(err.value) == message
        with pytest.raises(ConfigError, match="in use"):
            check_free(d, "study directory")
        with pytest.raises(ConfigError, match=r"run directory .* \(pid \d+\); resume later"):
            DirLock.acquire(d, "run directory", hint="resume later")
    assert not lock.held and not (d / LOCK_NAME).exists() and holder(d) is None
    check_free(d)
    (d / LOCK_NAME).write_text("12345\n")            # left by a killed process: not held
    assert holder(d) is None
    DirLock.acquire(d).release()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="cannot create the study directory"):
        DirLock.acquire(tmp_path / "afile" / "sub", "study directory")


def test_dir_lock_dies_with_its_process(tmp_path):
    code = ("import sys, time; from splitfed.locking import DirLock; "
            "lock = DirLock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=f"pid {proc.pid}"):
            DirLock.acquire(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (tmp_path / LOCK_NAME).exists()           # stale file, but no lock
    with DirLock.acquire(tmp_path):
        pass


def test_the_study_lock_is_held_while_runs_run_and_released_after_a_failure(
        tmp_path, monkeypatch):
    path = _write_study(tmp_path / "spec")
    seen = []

    def failing(cfg, **kwargs):
        seen.append(holder(tmp_path / "out" / "tiny_study"))
        raise ConfigError("boom")

    monkeypatch.setattr(study_mod, "run_experiment", failing)
    with pytest.raises(RunsFailed, match=r"^4 of 4 runs failed; .*\n  run 'FL "
                                         r"\(partition.alpha=0.5\)' \(seed 0\): boom\n"):
        run_study(path, out_dir=tmp_path / "out", quiet=True, jobs=1)
    assert seen == [os.getpid()] * 4            # a failing run does not stop the others
    assert holder(tmp_path / "out" / "tiny_study") is None
    assert not (tmp_path / "out" / "tiny_study" / LOCK_NAME).exists()


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "checkpoint.pt"])
def test_a_run_file_that_is_a_directory_is_refused_before_any_run(done, tmp_path,
                                                                   monkeypatch, name):
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "central-partition.alpha-inf-s0"
    (run / name).unlink(missing_ok=True)
    (run / name).mkdir()
    _forbid_runs(monkeypatch)
    with pytest.raises(ConfigError, match=f"central-partition.alpha-inf-s0 is damaged: "
                                          f"{name} is not a file; delete the directory"):
        run_study(path, out_dir=out, quiet=True)


# ------------------------------------------------- code versions, provenance, publish

from pathlib import Path  # noqa: E402

import splitfed  # noqa: E402
from splitfed.study import compare_code, publish  # noqa: E402
from splitfed.study.__main__ import main as study_main  # noqa: E402


def _set_provenance(run_dir, **changes):
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    if changes.pop("drop", False):
        del summary["provenance"]
    else:
        summary["provenance"].update(changes)
    path.write_text(json.dumps(summary))


def _counting(monkeypatch):
    calls = []

    def counting(cfg, **kwargs):
        calls.append(kwargs["run_dir"].name)
        return run_experiment(cfg, **kwargs)

    monkeypatch.setattr(study_mod, "run_experiment", counting)
    return calls


def test_compare_code_needs_the_version_and_the_commit_when_both_are_known():
    now = {"splitfed": "1.2.0", "commit": "a" * 40, "dirty": False}
    assert compare_code(dict(now), now) == (True, None)
    assert compare_code(dict(now, dirty=True), now) == (True, None)   # not compared
    same, note = compare_code(dict(now, splitfed="1.1.0"), now)
    assert not same and note == (f"recorded with splitfed 1.1.0 (commit {'a' * 10}), "
                                 f"now splitfed 1.2.0 (commit {'a' * 10})")
    same, note = compare_code(dict(now, commit="b" * 40, dirty=True), now)
    assert not same and note.startswith(f"recorded with splitfed 1.2.0 (commit {'b' * 10}, "
                                        "uncommitted changes), now")
    same, note = compare_code(dict(now, commit=None), now)           # e.g. a wheel
    assert same and note == ("compared the splitfed version only: the git commit is "
                             "unknown where the run was recorded")
    assert compare_code(dict(now), dict(now, commit=None)) == (
        True, "compared the splitfed version only: the git commit is unknown here")
    assert not compare_code(dict(now, commit=None, splitfed="1.1.0"), now)[0]
    same, note = compare_code(None, now)
    assert not same and note.startswith("recorded with an unknown code version")


def test_compare_code_goes_by_the_source_digest_when_both_have_one():
    now = {"splitfed": "1.2.0", "commit": "a" * 40, "dirty": False, "source": "c" * 64}
    # another commit, the same package files (a change to docs only): the same code
    assert compare_code(dict(now, commit="b" * 40), now) == (True, None)
    assert compare_code(dict(now, commit=None), now) == (True, None)
    # the same commit, other files (uncommitted changes to the code): other code
    same, note = compare_code(dict(now, dirty=True, source="d" * 64), now)
    assert not same and note == (f"recorded with splitfed 1.2.0 (commit {'a' * 10}, "
                                 f"uncommitted changes, source {'d' * 10}), now splitfed "
                                 f"1.2.0 (commit {'a' * 10}, source {'c' * 10})")
    # a record without a digest: the commits decide, as before
    old = {k: v for k, v in now.items() if k != "source"}
    assert compare_code(old, now) == (True, None)
    assert not compare_code(dict(old, commit="b" * 40), now)[0]


def test_a_run_recorded_by_another_version_is_rerun_not_reused(done, tmp_path, monkeypatch,
                                                                 capsys):
    path, out = _copy(done, tmp_path)
    runs = out / "tiny_study" / "runs"
    _set_provenance(runs / "fl-partition.alpha-inf-s0", splitfed="0.0.1")
    # other package files (the digest decides, whatever git knows)
    _set_provenance(runs / "central-partition.alpha-0.5-s0", commit="0" * 40,
                    source="0" * 64)
    _set_provenance(runs / "central-partition.alpha-inf-s0", drop=True)
    calls = _counting(monkeypatch)
    result = run_study(path, out_dir=out, jobs=1)
    printed = capsys.readouterr().out
    assert calls == ["central-partition.alpha-0.5-s0", "fl-partition.alpha-inf-s0",
                     "central-partition.alpha-inf-s0"]
    assert [o.skipped for o in result.outcomes] == [True, False, False, False]
    assert ("[3/4] FL (partition.alpha=inf) (seed 0): stale: recorded with splitfed 0.0.1 "
            "(commit ") in printed and f"now splitfed {splitfed.__version__}" in printed
    assert printed.count("; rerunning") == 3
    assert f"source {'0' * 10}), now splitfed" in printed
    assert "recorded with an unknown code version" in printed
    assert "stale" not in (out / "tiny_study" / "results.md").read_text().split("```")[0]
    prov = json.loads((runs / "fl-partition.alpha-inf-s0" / "summary.json").read_text())
    assert prov["provenance"]["splitfed"] == splitfed.__version__     # made again, now
    assert result.summary["provenance"]["runs"]["splitfed"] == [splitfed.__version__]


def test_keep_stale_keeps_and_marks_the_run_and_publishing_refuses_it(done, tmp_path,
                                                                       monkeypatch, capsys):
    path, out = _copy(done, tmp_path)
    runs = out / "tiny_study" / "runs"
    _set_provenance(runs / "fl-partition.alpha-0.5-s0", splitfed="0.0.1")
    _forbid_runs(monkeypatch)
    result = run_study(path, out_dir=out, keep_stale=True)
    printed = capsys.readouterr().out
    assert "[1/4] FL (partition.alpha=0.5) (seed 0) ... 0." in printed
    assert "(done earlier, skipped) [stale: recorded with splitfed 0.0.1" in printed
    assert "; kept]" in printed and "rerunning" not in printed
    assert result.outcomes[0].stale.startswith("recorded with splitfed 0.0.1")
    md = (out / "tiny_study" / "results.md").read_text()
    assert "| status |" in md and "| completed (stale) |" in md
    assert "- FL (partition.alpha=0.5) (seed 0): stale, recorded with splitfed 0.0.1" in md
    assert f"Provenance: splitfed 0.0.1 / {splitfed.__version__}, commit " in md
    assert "splitfed study" in md and "--keep-stale" in md
    seed = result.summary["runs"][0]["per_seed"][0]
    assert seed["stale"].startswith("recorded with") and seed["skipped"]
    assert result.summary["provenance"]["runs"]["splitfed"] == ["0.0.1", splitfed.__version__]
    with pytest.raises(ConfigError, match="1 run.* are stale"):
        publish(out / "tiny_study", tmp_path / "pub")
    with pytest.raises(ConfigError, match="not with keep_stale"):
        run_study(path, out_dir=out, keep_stale=True, publish_to=tmp_path / "pub")
    assert not (tmp_path / "pub").exists()


def test_a_recorded_run_without_commit_is_reused_by_version_and_says_so(done, tmp_path,
                                                                         monkeypatch, capsys):
    path, out = _copy(done, tmp_path)
    # recorded without a commit and without the digest of the package files
    _set_provenance(out / "tiny_study" / "runs" / "fl-partition.alpha-0.5-s0", commit=None,
                    source=None)
    _forbid_runs(monkeypatch)
    result = run_study(path, out_dir=out)
    assert result.outcomes[0].note == ("compared the splitfed version only: the git commit "
                                       "is unknown where the run was recorded")
    assert result.outcomes[0].stale is None
    assert "[compared the splitfed version only" in capsys.readouterr().out


def test_results_record_provenance(done):
    _, out, result = done
    prov = result.summary["provenance"]
    for key in ("splitfed", "commit", "dirty", "torch", "threads", "cpu_capability",
                "command"):
        assert key in prov, key
    assert prov["splitfed"] == splitfed.__version__ and prov["command"].startswith(
        "splitfed study ")
    assert prov["runs"]["threads"] and prov["unrecorded"] == 0
    for run in result.summary["runs"]:
        for seed in run["per_seed"]:
            assert seed["provenance"]["splitfed"] == splitfed.__version__
    md = (out / "tiny_study" / "results.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("Provenance: "))
    assert f"splitfed {splitfed.__version__}, commit " in line and " threads, CPU " in line


def test_studies_write_under_runs_by_default_never_into_docs(tmp_path):
    study = load_study(_write_study(tmp_path / "spec"))
    assert study.dir == Path("runs/studies/tiny_study")
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "studies").glob("*/*.yaml"))
    studies = [f for f in files if {"runs", "grid"} & set(yaml.safe_load(f.read_text()))]
    assert len(studies) >= 10
    for f in studies:
        spec = yaml.safe_load(f.read_text())
        assert "out_dir" not in spec, f          # a clone's run never rewrites docs/results


def test_publish_copies_results_and_plots_not_runs(done, tmp_path, capsys):
    _, out, _ = done
    target = publish(out / "tiny_study", tmp_path / "docs" / "results")
    assert target == tmp_path / "docs" / "results" / "tiny_study"
    assert sorted(p.name for p in target.iterdir()) == [
        "accuracy_vs_bytes.png", "accuracy_vs_round.png", "base.yaml", "results.json",
        "results.md", "study.yaml"]
    assert (target / "results.md").read_bytes() == (out / "tiny_study" / "results.md"
                                                    ).read_bytes()
    assert study_main(["publish", str(out / "tiny_study"), str(tmp_path / "again")]) == 0
    assert capsys.readouterr().out == f"published: {tmp_path / 'again' / 'tiny_study'}\n"
    assert study_main(["publish", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "holds no results.json" in capsys.readouterr().err


def test_publish_refuses_what_it_could_not_write_in_one_line(done, tmp_path, capsys):
    _, out, _ = done
    study = out / "tiny_study"
    long_dest = str(tmp_path / ("x" * 300))
    assert study_main(["publish", str(study), long_dest]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitfed: error: publish: ") and err.count("\n") == 1, err
    assert "longer than the 255 bytes" in err
    (tmp_path / "p" / "tiny_study" / "accuracy_vs_round.png").mkdir(parents=True)
    assert study_main(["publish", str(study), str(tmp_path / "p")]) == 2
    assert "accuracy_vs_round.png exists and is not a file" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "p" / "tiny_study").iterdir()) == [
        "accuracy_vs_round.png"]                            # nothing published


def test_publish_copies_only_the_plots_of_known_axes(done, tmp_path):
    _, out, _ = done
    copy = tmp_path / "a" / "tiny_study"
    shutil.copytree(out / "tiny_study", copy, ignore=shutil.ignore_patterns("runs"))
    summary = json.loads((copy / "results.json").read_text())
    summary["x_axes"] = ["round", "/../../../pwned"]
    (copy / "results.json").write_text(json.dumps(summary))
    (tmp_path / "a" / "pwned.png").write_text("x")
    target = publish(copy, tmp_path / "dest")
    assert "accuracy_vs_round.png" in {p.name for p in target.iterdir()}
    assert not (tmp_path / "pwned.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "dest"]


def test_publish_after_a_study(tmp_path, monkeypatch):
    study = dict(STUDY, runs=STUDY["runs"][:1], grid={"partition.alpha": [0.5]},
                 group_by=None)
    path = _write_study(tmp_path / "spec", study)
    monkeypatch.chdir(tmp_path)
    result = run_study(path, quiet=True, publish_to="docs/results")
    assert result.dir == Path("runs/studies/tiny_study")
    published = tmp_path / "docs" / "results" / "tiny_study"
    assert (published / "results.json").is_file() and not (published / "runs").exists()
    assert "--publish docs/results" in (published / "results.md").read_text()


def test_a_diverged_run_reads_diverged_at_round_n(tmp_path):
    study = {"name": "div", "base": "base.yaml", "seeds": [0, 1],
             "runs": [{"label": "ok", "set": []},
                      {"label": "boom", "set": ["train.lr=1.0e+10"]}]}
    path = _write_study(tmp_path / "spec", study)
    result = run_study(path, out_dir=tmp_path / "out", quiet=True)
    boom = result.summary["runs"][1]
    assert boom["status"] == ["diverged", "diverged"]
    rounds = boom["diverged_round"]
    assert all(isinstance(r, int) and r >= 0 for r in rounds)
    assert boom["final_test_acc"]["values"] == [None, None]      # no final accuracy
    assert all(s["final_test_acc"] is None and s["diverged_round"] is not None
               for s in boom["per_seed"])
    row = next(x for x in result.table.splitlines() if x.startswith("| boom |"))
    cell = row.split(" | ")[1]
    assert cell.startswith("diverged at round ") and "n/a" not in row and "nan" not in row
    assert result.summary["runs"][0]["diverged_round"] == [None, None]
    text = (tmp_path / "out" / "div" / "results.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_study_and_sweep_never_read_metrics_csv():
    import inspect

    import splitfed.study.analysis
    import splitfed.study.reuse
    import splitfed.study.runner
    import splitfed.sweep
    for module in (splitfed.study.analysis, splitfed.study.reuse, splitfed.study.runner,
                   splitfed.sweep):
        assert "metrics.csv" not in inspect.getsource(module), module.__name__


def test_eval_batch_size_does_not_change_the_identity_other_engine_keys_do():
    from splitfed.config import build_config
    from splitfed.study import config_identity
    base = build_config({"data": {"name": "digits"}})
    other_eval = build_config({"data": {"name": "digits"}, "engine": {"eval_batch_size": 1000}})
    other_chunk = build_config({"data": {"name": "digits"}, "engine": {"chunk_size": 3}})
    assert config_identity(other_eval) == config_identity(base)
    assert config_identity(other_chunk) != config_identity(base)


# ------------------------------------------------------------------- --set


def test_set_overrides_every_run_and_is_recorded(tmp_path):
    path = _write_study(tmp_path / "spec", dict(STUDY, runs=STUDY["runs"][:1],
                                                grid={"partition.alpha": [0.5]}))
    result = run_study(path, out_dir=tmp_path / "out", quiet=True,
                       overrides=["rounds=1", "train.batch_size=8"])
    run_dir = tmp_path / "out" / "tiny_study" / "runs"
    configs = [yaml.safe_load(p.read_text()) for p in run_dir.glob("*/config.yaml")]
    assert len(configs) == 1 and configs[0]["rounds"] == 1
    assert configs[0]["train"]["batch_size"] == 8
    kept = (result.dir / "study.yaml").read_text()
    assert kept.startswith("# study.yaml with --set rounds=1 train.batch_size=8")
    # the kept file reruns as it ran: the file's overrides, then the command line's
    assert yaml.safe_load(kept)["overrides"] == ["rounds=2", "rounds=1", "train.batch_size=8"]
    record = json.loads((result.dir / "results.json").read_text())
    assert "--set rounds=1 --set train.batch_size=8" in json.dumps(record)


def test_set_is_checked_before_anything_runs(tmp_path, monkeypatch, capsys):
    _forbid_runs(monkeypatch)
    path = _write_study(tmp_path / "spec")
    out = tmp_path / "out"
    assert main(["study", str(path), "--out-dir", str(out), "--set", "rounds"]) == 2
    assert "override 'rounds' must look like key.sub=value" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown key 'train.nosuch'"):
        run_study(path, out_dir=out, quiet=True, overrides=["train.nosuch=1"])
    with pytest.raises(ConfigError, match="only with a study file"):
        run_study(dict(STUDY), out_dir=out, quiet=True, overrides=["rounds=1"])
    assert not out.exists()


def _hybrid_study(baseline_set, out="runs/studies"):
    base = {**BASE, "model": {"name": "mlp", "hidden": [16], "cut": 1}}
    return study_from_mapping({
        "name": "hybrid", "base_config": base, "seeds": [0, 1], "out_dir": str(out),
        "runs": [{"label": "CLG-SGD", "set": ["algorithm.name=clgsgd"]},
                 {"label": "FedAvg", "set": ["algorithm.name=fedavg", *baseline_set]},
                 {"label": "SL", "set": ["algorithm.name=sl", *baseline_set]}]})


def test_a_baseline_without_the_hybrid_runs_pool_is_named_before_anything_runs(
        tmp_path, monkeypatch, capsys):
    study = _hybrid_study([], tmp_path)
    note = runner.server_pool_mismatch(study.runs)
    assert note == ("runs CLG-SGD remove the server's pool from the training set before "
                    "partitioning it and runs FedAvg, SL do not, so their clients hold "
                    "different data; set server_data.always: true on the latter to compare "
                    "them on the same client data")
    # the runs' clients really hold different data
    from splitfed.experiment import build_environment
    sizes = {r.label: int(build_environment(r.config).data_sizes.sum())
             for r in study.runs if r.seed == 0}
    assert sizes["FedAvg"] == sizes["SL"] > sizes["CLG-SGD"]
    _forbid_runs(monkeypatch)
    monkeypatch.setattr(runner, "check_runs", _fail_check)
    with pytest.raises(_Stop):
        study_mod.open_study(study)
    assert capsys.readouterr().err == f"splitfed: warning: {note}\n"


class _Stop(Exception):
    pass


def _fail_check(runs):
    raise _Stop


@pytest.mark.parametrize("baseline_set", [
    ["server_data.always=true"],                            # the same pool, unused
])
def test_baselines_with_the_same_client_data_get_no_warning(baseline_set):
    assert runner.server_pool_mismatch(_hybrid_study(baseline_set).runs) is None


def test_runs_of_other_data_or_seeds_are_not_compared():
    study = _hybrid_study([])
    by_label = {r.label: r for r in study.runs if r.seed == 0}
    other = [by_label["CLG-SGD"], *(r for r in study.runs if r.seed == 1 and
                                    r.label != "CLG-SGD")]
    assert runner.server_pool_mismatch(other) is None
    kept = build_config({**BASE, "algorithm": {"name": "clgsgd"},
                         "model": {"name": "mlp", "hidden": [16], "cut": 1},
                         "server_data": {"disjoint": False}})
    shared = [study_mod.StudyRun("kept", 0, kept, by_label["FedAvg"].run_dir),
              by_label["FedAvg"]]
    assert runner.server_pool_mismatch(shared) is None


def test_a_run_killed_as_it_wrote_its_config_is_run_again(done, tmp_path):
    """A run directory that holds only the lock and a temp file of an atomic write (the
    study was killed between creating config.yaml's temp file and renaming it) is a
    run that has not started: the study runs it, instead of refusing the directory as
    "not a run of this study" on every later attempt."""
    path, out = _copy(done, tmp_path)
    run = out / "tiny_study" / "runs" / "central-partition.alpha-inf-s0"
    shutil.rmtree(run)
    run.mkdir()
    (run / ".config.yaml.k2x9q1.tmp").write_text("name: half-writ")
    (run / LOCK_NAME).write_text("")
    result = run_study(path, out_dir=out, quiet=True)
    ran = [o for o in result.outcomes if not o.skipped]
    assert [o.run_dir.name for o in ran] == [run.name]
    assert (run / "config.yaml").is_file() and not list(run.glob(".*.tmp"))
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   OSError(errno.EFBIG, "File too large")])
def test_a_full_disk_fails_its_runs_in_one_line_each(tmp_path, monkeypatch, capsys, error):
    path = _write_study(tmp_path / "spec")

    def full(cfg, **kwargs):
        raise error

    monkeypatch.setattr(study_mod, "run_experiment", full)
    with pytest.raises(RunsFailed) as failed:
        run_study(path, out_dir=tmp_path / "out", quiet=True, jobs=1)
    assert f"(seed 0): {error.strerror}; check the output directory and the free " \
           "space" in str(failed.value)
    assert "Traceback" not in capsys.readouterr().err


def test_a_study_being_written_is_not_published(done, tmp_path):
    """While a study or sweep process holds the directory's lock (it is rewriting its
    results), publish refuses in one line, and publishes once the lock is free."""
    _, out = _copy(done, tmp_path)
    study_dir = out / "tiny_study"
    with DirLock.acquire(study_dir, "study directory"):
        with pytest.raises(ConfigError, match=r"^study directory .*tiny_study is in use by "
                                              r"another splitfed process \(pid \d+\); publish "
                                              r"it when that study has finished$"):
            publish(study_dir, tmp_path / "pub")
    assert not (tmp_path / "pub").exists()
    assert (publish(study_dir, tmp_path / "pub") / "results.json").is_file()
