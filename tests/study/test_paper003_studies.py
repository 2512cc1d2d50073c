"""The paper 003 Table 8 studies (studies/paper003/table8_e1*.yaml) define the paper's
setup (Sec. 5.3, Appendix E): checked on the validated configs, nothing is run."""

from pathlib import Path

from splitfed.study import load_study

STUDIES = Path(__file__).resolve().parents[2] / "studies" / "paper003"
LRS = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1]
PARTITIONS = {
    "iid": ("iid", {}),
    "dir0.5": ("dirichlet", {"alpha": 0.5, "self_balancing": True,
                             "min_partition_size": 10, "max_tries": 100}),
    "dir0.2": ("dirichlet", {"alpha": 0.2, "self_balancing": True,
                             "min_partition_size": 1, "max_tries": 100}),
    "C5": ("shard", {"num_shards_per_partition": 5}),
    "C2": ("shard", {"num_shards_per_partition": 2}),
}


def check_setup(cfg):
    assert (cfg.rounds, cfg.eval_every, cfg.eval_last) == (1000, 50, 100)
    assert cfg.data.name == "fashion_mnist" and cfg.partition.num_clients == 1000
    assert (cfg.participation.mode, cfg.participation.clients_per_round) == ("uniform", 10)
    tr = cfg.train
    assert (tr.batch_size, tr.local_epochs, tr.local_steps) == (10, 1.0, None)
    assert (tr.momentum, tr.weight_decay) == (0.9, 1e-4)
    assert cfg.model.name == "lenet5" and cfg.model.cut == 2
    if cfg.algorithm.name == "sl":
        assert cfg.algorithm.options == {"server_optimizer": "per_client"}
    else:
        assert cfg.algorithm.name == "fedavg" and cfg.algorithm.options == {}


def partition_of(label):
    return label.split()[1]


def test_table8_e1_is_five_partitions_by_six_rates_by_two_methods():
    study = load_study(STUDIES / "table8_e1.yaml")
    assert study.spec.average_last == 100
    cells = set()
    for run in study.runs:
        cfg = run.config
        check_setup(cfg)
        scheme, options = PARTITIONS[partition_of(run.label)]
        assert (cfg.partition.scheme, cfg.partition.options) == (scheme, options)
        assert run.label.startswith({"fedavg": "FL ", "sl": "SL "}[cfg.algorithm.name])
        cells.add((cfg.algorithm.name, partition_of(run.label), cfg.train.lr, run.seed))
    assert len(study.runs) == len(cells) == 60
    assert {c[2] for c in cells} == set(LRS) and {c[3] for c in cells} == {1234}


def test_threshold_cells_run_three_seeds():
    study = load_study(STUDIES / "table8_e1_threshold.yaml")
    assert study.spec.seeds == [0, 1, 2] and study.spec.average_last == 100
    cells = {}
    for run in study.runs:
        check_setup(run.config)
        scheme, options = PARTITIONS[partition_of(run.label)]
        assert (run.config.partition.scheme, run.config.partition.options) == (scheme,
                                                                               options)
        key = (run.config.algorithm.name, partition_of(run.label))
        cells.setdefault(key, set()).add(run.config.train.lr)
    assert len(study.runs) == 36
    assert cells == {("sl", "iid"): {0.05, 0.1}, ("sl", "dir0.5"): {0.05, 0.1},
                     ("sl", "dir0.2"): {0.01, 0.05}, ("sl", "C5"): {0.01, 0.05},
                     ("sl", "C2"): {0.01, 0.05}, ("fedavg", "dir0.2"): {0.05, 0.1}}


def report():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "table8_report", Path(__file__).resolve().parents[2] / "studies" / "paper003"
        / "table8_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_reads_both_studies_run_names():
    name = report()._NAME
    assert name.fullmatch("sl-iid-train.lr-0.05-s1234").groups() == ("sl", "iid", "0.05", "1234")
    assert name.fullmatch("fl-dir0.2-lr-0.1-s2").groups() == ("fl", "dir0.2", "0.1", "2")


def test_seed_table_by_hand():
    # two seeds alive at 80% and 84%, one diverged: it reads 10.0, as the paper's dead cells
    r = report()
    seeds = {0: {"acc": 0.80, "diverged": None}, 1: {"acc": 0.84, "diverged": None},
             2: {"acc": None, "diverged": 312}}
    cells = {("sl", "iid", 0.05): {"acc": 0.82, "diverged": None, "seeds": 3,
                                   "per_seed": seeds},
             ("sl", "iid", 0.1): {"acc": 0.1, "diverged": None, "seeds": 1,
                                  "per_seed": {0: {"acc": 0.1, "diverged": None}}}}
    lines = r.seed_table(cells).splitlines()
    # mean (80 + 84 + 10) / 3 = 58.0; sample std of (80, 84, 10) = 41.6
    assert lines[2:] == ["| SL | IID | 0.05 | 82.4 | 58.0 ± 41.6 | "
                         "80.0 (s0), 84.0 (s1), 10.0 (s2) | 1/3 |"]
    assert r.seed_table({}) == ""
