"""The paper 004 Table I analogue (studies/paper004/table1*.yaml): the validated configs
define the intended setup (nothing is trained), every client holds exactly 150 samples,
and studies/paper004/tables.py computes speed-ups and chooses rates as specified, on
hand-made results."""

import importlib.util
import json
from pathlib import Path

import pytest

from splitfed.experiment import build_environment
from splitfed.study import load_study

STUDIES = Path(__file__).resolve().parents[2] / "studies" / "paper004"
GRID = {0.01, 0.05, 0.25}                       # paper 004 Sec. VI-A1, MNIST
METHODS = {"CLG-SGD": "clgsgd", "FedCLG-S": "fedclg_s", "FedCLG-C": "fedclg_c"}
requires_fmnist = pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(),
                                     reason="Fashion-MNIST is not installed")


def check_setup(cfg, label):
    assert cfg.algorithm.name == METHODS[label.split(" (")[0]]
    options = dict(cfg.algorithm.options)
    assert options.pop("server_steps") == 1 and options.get("server_epochs") is None
    assert options.pop("server_gradient", None) == (
        "full" if cfg.algorithm.name.startswith("fedclg") else None)
    assert (cfg.rounds, cfg.data.name) == (400, "fashion_mnist")
    assert (cfg.partition.scheme, cfg.partition.num_clients, cfg.partition.options) == (
        "shard", 200, {"num_shards_per_partition": 3})
    tr = cfg.train
    assert (tr.batch_size, tr.local_steps, tr.lr_decay, tr.lr_min) == (64, 3, 0.99, 0.001)
    assert (cfg.participation.mode, cfg.participation.weighting) == ("uniform", "uniform")
    assert (cfg.server_data.fraction, cfg.server_data.samples_per_round) == (0.5, 600)
    assert not cfg.server_data.full_batch        # the server steps keep batches of 64
    return cfg.train.lr, options.get("server_lr")


def test_tuning_is_three_methods_by_the_rate_grid_on_two_seeds():
    study = load_study(STUDIES / "table1_tuning.yaml")
    cells = set()
    for run in study.runs:
        eta, gamma = check_setup(run.config, run.label)
        assert run.config.participation.clients_per_round == 4
        cells.add((run.config.algorithm.name, eta, gamma, run.seed))
    assert len(study.runs) == len(cells) == 3 * 9 * 2
    assert {c[1] for c in cells} == {c[2] for c in cells} == GRID
    assert {c[3] for c in cells} == {100, 101}
    assert study.spec.target_accuracy == 0.8


def test_table1_is_three_methods_by_three_m_on_five_other_seeds():
    study = load_study(STUDIES / "table1.yaml")
    cells = set()
    for run in study.runs:
        eta, gamma = check_setup(run.config, run.label)
        assert eta in GRID and gamma in GRID
        cells.add((run.config.algorithm.name, run.config.participation.clients_per_round,
                   run.seed))
    assert len(study.runs) == len(cells) == 3 * 3 * 5
    assert {c[1] for c in cells} == {4, 6, 24} and {c[2] for c in cells} == set(range(5))
    tuning = load_study(STUDIES / "table1_tuning.yaml")
    assert not {r.seed for r in tuning.runs} & {r.seed for r in study.runs}
    assert study.spec.target_accuracy == tuning.spec.target_accuracy


@pytest.mark.parametrize("name, m", [("table1_fine_m.yaml", 6), ("table1_fine_m24.yaml", 24)])
def test_the_finer_rates_at_another_m_are_table1_fine_at_that_m(name, m):
    """Table I's other columns at the rates chosen at M = 4 (table1_fine.yaml): the same
    methods, rates, seeds and setup, only M differs."""
    def cells(study_name, want_m):
        out = set()
        for run in load_study(STUDIES / study_name).runs:
            eta, gamma = check_setup(run.config, run.label)
            assert run.config.participation.clients_per_round == want_m
            out.add((run.config.algorithm.name, eta, gamma, run.seed))
        return out

    fine = cells("table1_fine.yaml", 4)
    assert cells(name, m) == fine and len(fine) == 3 * 5
    assert load_study(STUDIES / name).spec.target_accuracy == 0.8


@requires_fmnist
def test_every_client_holds_150_samples():
    """Sec. VI-A2: 200 clients with 150 samples each, besides the server's pool."""
    run = load_study(STUDIES / "table1.yaml").runs[0]
    env = build_environment(run.config)
    assert list(env.data_sizes) == [150] * 200
    assert len(env.server_data.pool) == 30000


# ----------------------------------------------------------------------------- tables.py


def tables():
    spec = importlib.util.spec_from_file_location("paper004_tables", STUDIES / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seed_run(seed, reached_at, best=0.9):
    """A seed whose test accuracy is 0.5 until ``reached_at`` (None: never), then 0.85."""
    rounds = list(range(0, 201, 10))
    acc = [0.85 if reached_at is not None and r >= reached_at else 0.5 for r in rounds]
    return {"seed": seed, "final_test_acc": acc[-1], "best_test_acc": best,
            "curve": {"round": rounds, "test_acc": acc}}


def run_of(label, group, reached, best=0.9):
    return {"label": label, "line_label": label, "group": group,
            "per_seed": [seed_run(s, r, best) for s, r in enumerate(reached)]}


def test_speed_up_spread_over_seeds_by_hand():
    t = tables()
    ref, own = {0: 60, 1: 80, 2: None}, {0: 30, 1: 50, 2: 40}
    # the paper's ratio of mean rounds: 70 / 40; per seed 60 / 30 and 80 / 50
    of_means, per_seed = t.speedup(ref, own)
    assert of_means == "1.75x"
    assert per_seed == "1.80x ± 0.28 [1.60, 2.00] (2/3 seeds)"
    assert t.rounds_cell(own) == "40.0 ± 10.0" and t.rounds_cell(ref) == (
        "70.0 ± 14.1 (2/3 seeds)")
    assert t.speedup({0: None}, {0: 30}) == ("-", "-")


def test_table1_rows_pair_the_seeds_of_each_m():
    t = tables()
    summary = {"group_by": "participation.clients_per_round", "target_accuracy": 0.8,
               "runs": [run_of("CLG-SGD", "4", [60, 80]), run_of("FedCLG-C", "4", [30, 40]),
                        run_of("CLG-SGD", "24", [40, 40]), run_of("FedCLG-C", "24", [40, 20])]}
    lines = t.table1(summary, targets=(0.8,)).splitlines()[2:]
    assert lines == [
        "| 4 | 0.8 | CLG-SGD | 2 | 70.0 ± 14.1 | 1.00x | 1.00x ± 0.00 [1.00, 1.00] |",
        "| 4 | 0.8 | FedCLG-C | 2 | 35.0 ± 7.1 | 2.00x | 2.00x ± 0.00 [2.00, 2.00] |",
        "| 24 | 0.8 | CLG-SGD | 2 | 40.0 ± 0.0 | 1.00x | 1.00x ± 0.00 [1.00, 1.00] |",
        "| 24 | 0.8 | FedCLG-C | 2 | 30.0 ± 14.1 | 1.33x | 1.50x ± 0.71 [1.00, 2.00] |"]


def test_tuning_chooses_per_method_the_fastest_rates_every_seed_reached():
    t = tables()
    summary = {"target_accuracy": 0.8, "runs": [
        run_of("CLG-SGD (train.lr=0.05, algorithm.server_lr=0.25)", "clgsgd", [50, 70]),
        run_of("CLG-SGD (train.lr=0.25, algorithm.server_lr=0.25)", "clgsgd", [20, None]),
        run_of("CLG-SGD (train.lr=0.01, algorithm.server_lr=0.05)", "clgsgd", [60, 60]),
        run_of("FedCLG-C (train.lr=0.05, algorithm.server_lr=0.01)", "fedclg_c", [40, 40],
               best=0.86),
        run_of("FedCLG-C (train.lr=0.01, algorithm.server_lr=0.05)", "fedclg_c", [30, 50],
               best=0.88),                      # the same mean rounds, a higher best
        run_of("FedCLG-S (train.lr=0.25, algorithm.server_lr=0.25)", "fedclg_s",
               [None, None])]}
    text, chosen = t.tuning(summary)
    assert chosen == {"CLG-SGD": ("0.05", "0.25"), "FedCLG-C": ("0.01", "0.05")}
    assert "| CLG-SGD | 0.25 | 0.25 | 20 (1/2 seeds) |" in text
    assert t.chosen_runs(chosen).splitlines() == [
        "runs:",
        "  - {label: CLG-SGD, set: [algorithm.name=clgsgd, train.lr=0.05, "
        "algorithm.server_lr=0.25]}",
        "  - {label: FedCLG-C, set: [algorithm.name=fedclg_c, train.lr=0.01, "
        "algorithm.server_lr=0.05, algorithm.server_gradient=full]}"]


def test_tuning_row_says_how_many_seeds_diverged():
    t = tables()
    run = run_of("FedCLG-S (train.lr=0.25, algorithm.server_lr=0.25)", "fedclg_s", [None, 40])
    run["per_seed"][0].update(status="diverged", final_test_acc=None, best_test_acc=0.1)
    run["per_seed"][1].update(status="completed")
    text, chosen = t.tuning({"target_accuracy": 0.8, "runs": [run]})
    assert chosen == {}
    assert ("| FedCLG-S | 0.25 | 0.25 | 40 (1/2 seeds) | 0.8500 (1/2 seeds; 1 diverged) "
            "| 0.5000 |") in text


def test_first_round_is_the_first_evaluation_at_or_above_the_target():
    t = tables()
    curve = {"round": [0, 2, 4, 6], "test_acc": [0.1, 0.79, 0.8, 0.7]}
    assert t.first_round(curve, 0.8) == 4
    assert t.first_round(curve, 0.81) is None


def test_rates_are_chosen_over_both_tuning_grids(tmp_path, capsys):
    # the fine grid's FedCLG-C point is faster than the coarse grid's: the choice over
    # both is the fine one, while each study's own choice is printed too
    t = tables()
    coarse = {"target_accuracy": 0.8, "runs": [
        run_of("CLG-SGD (train.lr=0.25, algorithm.server_lr=0.25)", "clgsgd", [50, 70]),
        run_of("FedCLG-C (train.lr=0.25, algorithm.server_lr=0.05)", "fedclg_c", [60, 80])]}
    fine = {"target_accuracy": 0.8, "runs": [
        run_of("FedCLG-C (train.lr=0.15, algorithm.server_lr=0.1)", "fedclg_c", [40, 50]),
        run_of("FedCLG-C (train.lr=0.25, algorithm.server_lr=0.25)", "fedclg_c",
               [20, None])]}
    for name, summary in (("table1_tuning", coarse), ("table1_fine_tuning", fine)):
        (tmp_path / f"paper004_{name}").mkdir()
        (tmp_path / f"paper004_{name}" / "results.json").write_text(json.dumps(summary))
    t.main(["tables.py", str(tmp_path)])
    out = capsys.readouterr().out
    both = out.split("Chosen rates over both tuning grids")[1]
    assert ("{label: FedCLG-C, set: [algorithm.name=fedclg_c, train.lr=0.15, "
            "algorithm.server_lr=0.1, algorithm.server_gradient=full]}") in both
    assert "train.lr=0.25, algorithm.server_lr=0.25]}" in both          # CLG-SGD's
    assert "## table1_fine: no results yet" in out
