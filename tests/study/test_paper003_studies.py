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
