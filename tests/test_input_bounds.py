"""Bad input is refused at once, and every accepted config runs to the end.

Numbers beyond what the data and the machine allow, partitions that leave a client
without samples, participation and clock traces that no client can ever meet: each is
refused through ``splitfed run`` with exit status 2 and one ``splitfed: error:`` line
naming the key and what is allowed, within a second and before a run directory exists.
A run that ends without any client having trained reports ``no_client_trained``.
"""

from __future__ import annotations

import json
import time

import pytest

from splitfed.cli import main
from splitfed.config import (
    MAX_BATCH_SIZE,
    MAX_CLIENTS,
    MAX_LOCAL_STEPS,
    MAX_ROUND_SAMPLES,
    MAX_ROUNDS,
    build_config,
)
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment

QUICK = ["progress=false"]
BASE_YAML = """name: bounds
rounds: 2
data: {name: digits}
partition: {scheme: iid, num_clients: 8}
model: {name: mlp, hidden: [16]}
train: {batch_size: 16, local_steps: 2, lr: 0.1}
participation: {mode: uniform, clients_per_round: 4}
"""


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    """Load digits once (scikit-learn's import), so that timings measure the checks."""
    from splitfed.data import load_dataset
    load_dataset("digits")


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(BASE_YAML)
    return str(path)


def refused(tmp_path, capsys, overrides, config="quick_digits"):
    """Run ``splitfed run config overrides``; assert exit 2, one line, nothing written,
    an answer within a second of this process's CPU time (other work on a shared
    machine does not count); return the line."""
    out = tmp_path / "runs"
    t0 = time.process_time()
    code = main(["run", config, *QUICK, f"out_dir={out}", *overrides])
    elapsed = time.process_time() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), err
    assert "Traceback" not in err
    assert not out.exists(), list(out.iterdir())
    assert elapsed < 1.0, f"{overrides}: answered after {elapsed:.2f} s"
    return lines[0]


# ------------------------------------------------------------------ static bounds

STATIC = [
    (["train.batch_size=1000000000000000000"], "train.batch_size", f"<= {MAX_BATCH_SIZE}"),
    (["train.batch_size=1e18"], "train.batch_size", f"<= {MAX_BATCH_SIZE}"),
    (["train.batch_size=1.0e+18"], "train.batch_size", f"<= {MAX_BATCH_SIZE}"),
    (["train.local_steps=1000000000000"], "train.local_steps", f"<= {MAX_LOCAL_STEPS}"),
    (["train.local_steps=1e12"], "train.local_steps", f"<= {MAX_LOCAL_STEPS}"),
    (["train.local_steps=null", "train.local_epochs=1e300"], "train.local_epochs", "<="),
    (["train.local_steps=null", "train.local_epochs=inf"], "train.local_epochs", "<="),
    ([f"rounds={10**30}"], "rounds", f"<= {MAX_ROUNDS}"),
    (["rounds=1e30"], "rounds", f"<= {MAX_ROUNDS}"),
    (["rounds=1.0e+30"], "rounds", f"<= {MAX_ROUNDS}"),
    ([f"eval_every={10**20}"], "eval_every", "<="),
    ([f"checkpoint_every={10**20}"], "checkpoint_every", "<="),
    ([f"seed={10**30}"], "seed", "<="),
    ([f"partition.num_clients={10**12}"], "partition.num_clients", f"<= {MAX_CLIENTS}"),
    ([f"participation.clients_per_round={10**12}"], "participation.clients_per_round",
     "<="),
    ([f"engine.eval_batch_size={10**12}"], "engine.eval_batch_size", "<="),
    ([f"engine.chunk_size={10**12}"], "engine.chunk_size", "<="),
    ([f"data.limit_train={10**15}"], "data.limit_train", "<="),
    ([f"data.limit_test={10**15}"], "data.limit_test", "<="),
    ([f"server_data.samples_per_round={10**15}"], "server_data.samples_per_round", "<="),
    ([f"server_data.min_per_class={10**15}"], "server_data.min_per_class", "<="),
    (["clock.over_select=inf", "participation.clients_per_round=2"], "clock.over_select",
     "<="),
    (["clock.over_select=1e300", "participation.clients_per_round=2"],
     "clock.over_select", "<="),
    (["algorithm.name=musplitfed", f"algorithm.tau={10**12}"], "algorithm.tau", "<="),
    (["algorithm.name=musplitfed", f"algorithm.directions={10**9}"],
     "algorithm.directions", "<="),
    (["algorithm.name=musplitfed", f"algorithm.max_tau={10**9}"], "algorithm.max_tau",
     "<="),
    (["algorithm.name=gas", f"algorithm.directions={10**9}"], "algorithm.directions", "<="),
    (["algorithm.name=gas", f"algorithm.buffer_size={10**12}"], "algorithm.buffer_size",
     "<="),
    (["algorithm.name=csefsl", f"algorithm.aux_hidden={10**12}"], "algorithm.aux_hidden",
     "<="),
    (["algorithm.name=csefsl", f"algorithm.period={10**12}"], "algorithm.period", "<="),
    (["algorithm.name=sflv1", f"algorithm.server_period={10**12}"],
     "algorithm.server_period", "<="),
    (["algorithm.name=server_only", f"algorithm.server_steps={10**12}"],
     "algorithm.server_steps", "<="),
    (["algorithm.name=server_only", f"algorithm.server_batch_size={10**12}"],
     "algorithm.server_batch_size", "<="),
    (["algorithm.name=server_only", "algorithm.server_epochs=1e300"],
     "algorithm.server_epochs", "<="),
    (["algorithm.name=fedlora", f"algorithm.rank={10**12}"], "algorithm.rank", "<="),
]


@pytest.mark.parametrize("overrides,key,bound", STATIC, ids=[" ".join(o) for o, _, _ in STATIC])
def test_absurd_numbers_are_refused_at_once(tmp_path, capsys, overrides, key, bound):
    line = refused(tmp_path, capsys, overrides)
    assert key in line and bound in line, line


# ------------------------------------------------------------ bounds from the data

DATA = [
    (["train.batch_size=5000"], "train.batch_size", "1..1438"),
    (["partition.num_clients=2000"], "partition.num_clients", "1..1438"),
    (["partition.num_clients=100000"], "partition.num_clients", "1..1438"),
    (["train.local_steps=1000000", "train.batch_size=1000"], "train.local_steps",
     str(MAX_ROUND_SAMPLES)),
    (["data.name=synthetic", "train.local_steps=null", "train.local_epochs=10000",
      "participation.mode=full", "participation.clients_per_round=null"],
     "train.local_epochs", str(MAX_ROUND_SAMPLES)),
    (["participation.mode=with_replacement", "participation.clients_per_round=1000000",
      "train.local_steps=1000"], "train.local_steps", str(MAX_ROUND_SAMPLES)),
    (["algorithm.name=server_only", "algorithm.server_steps=1000000",
      "algorithm.server_batch_size=1000"], "algorithm.server_steps", str(MAX_ROUND_SAMPLES)),
    (["model.hidden=[1000000000]"], "model.options", "parameters"),
    (["model.hidden=[100000, 100000, 100000, 100000, 100000, 100000]"], "model.options",
     "parameters"),
    (["data.name=synthetic", "data.num_devices=100000000", "partition.scheme=iid"],
     "num_devices", "100000"),
    (["data.name=synthetic", "data.dim=1000000000", "partition.scheme=iid"], "dim",
     "100000"),
    (["data.name=synthetic", "data.num_devices=100000", "data.dim=100000",
      "partition.scheme=iid"], "num_devices", "values"),
    (["data.name=synthetic_text", "data.num_train=1000000000000", "partition.scheme=iid",
      "model.hidden=[4]"], "num_train", "1000000"),
    (["data.name=synthetic_text", "data.seq_len=100000000", "partition.scheme=iid",
      "model.hidden=[4]"], "seq_len", "16384"),
]


@pytest.mark.parametrize("overrides,key,bound", DATA, ids=[" ".join(o) for o, _, _ in DATA])
def test_numbers_beyond_the_data_are_refused(tmp_path, capsys, overrides, key, bound):
    line = refused(tmp_path, capsys, overrides)
    assert key in line and bound in line, line


def test_batch_larger_than_a_client_repeats_samples(tmp_path):
    """B above a client's samples but within the training set is accepted (a client
    with fewer samples than B repeats samples within a batch; splitfed.engine.batches)."""
    cfg = build_config({"name": "b", "rounds": 1, "progress": False,
                        "data": {"name": "digits", "limit_train": 200, "limit_test": 20},
                        "partition": {"scheme": "iid", "num_clients": 10},
                        "model": {"name": "mlp", "hidden": [4]},
                        "train": {"batch_size": 200, "local_steps": 1},
                        "out_dir": str(tmp_path)})
    assert run_experiment(cfg, write=False).status == "completed"


# ------------------------------------------------------ partitions with empty clients

EMPTY = [
    (["partition.scheme=dirichlet", "partition.alpha=0.01", "partition.min_partition_size=0",
      "partition.num_clients=1000"], "dirichlet"),
    (["partition.scheme=pathological", "partition.num_classes_per_partition=1",
      "partition.num_clients=1438"], "pathological"),
    (["partition.scheme=pathological", "partition.num_classes_per_partition=1",
      "partition.class_assignment_mode=random", "partition.num_clients=1400"],
     "pathological"),
]


@pytest.mark.parametrize("overrides,scheme", EMPTY, ids=[s for _, s in EMPTY])
def test_partitions_leaving_clients_empty_are_refused(tmp_path, capsys, base, overrides,
                                                      scheme):
    line = refused(tmp_path, capsys, overrides, config=base)
    assert "partition.scheme" in line and scheme in line, line
    assert "no samples" in line and "num_clients" in line, line


def test_natural_partition_emptied_by_limit_is_refused(tmp_path, capsys, base):
    line = refused(tmp_path, capsys, [
        "data.name=synthetic", "data.num_devices=30", "data.limit_train=3",
        "partition.scheme=natural", "partition.num_clients=30"], config=base)
    assert "partition.scheme" in line and "no samples" in line, line


# ------------------------------------------------- participation and clock traces

PARTICIPATION = [
    (["participation.clients_per_round=9"], "participation.clients_per_round"),
    (["participation.mode=bernoulli", "participation.clients_per_round=null",
      "participation.q=0"], "participation.q"),
    (["participation.mode=bernoulli", "participation.clients_per_round=null",
      "participation.q=[0, 0, 0, 0, 0, 0, 0, 0]"], "participation.q"),
    (["participation.mode=with_replacement", "participation.clients_per_round=0"],
     "participation.clients_per_round"),
    (["participation.mode=with_replacement", "participation.clients_per_round=null"],
     "participation.clients_per_round"),
    (["participation.mode=full", "clock.over_select=1"], "clock.over_select"),
    (["participation.mode=with_replacement", "clock.over_select=1"], "clock.over_select"),
    (["participation.clients_per_round=null", "clock.over_select=1"],
     "participation.clients_per_round"),
]


@pytest.mark.parametrize("overrides,key", PARTICIPATION,
                         ids=[" ".join(o) for o, _ in PARTICIPATION])
def test_participation_that_cannot_be_met_is_refused(tmp_path, capsys, overrides, key):
    line = refused(tmp_path, capsys, overrides)
    assert key in line, line


def write_trace(path, rows):
    lines = ["client_id,compute_macs_per_s,uplink_bytes_per_s,downlink_bytes_per_s,"
             "available_from,available_until"]
    lines += [f"{i},1e9,1e6,1e6,{lo},{hi}" for i, (lo, hi) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("window", [("", 0), (0, 0), (5, 5), ("", -1)])
def test_trace_with_every_client_unavailable_forever_is_refused(tmp_path, capsys, window):
    trace = write_trace(tmp_path / "trace.csv", [window] * 8)
    line = refused(tmp_path, capsys, ["clock.profile=trace", f"clock.path={trace}"])
    if window == ("", 0):      # a window ending where the first round starts
        assert "clock.path" in line and "unavailable" in line, line
    else:                      # an empty or negative window: the trace itself is refused
        assert str(trace) in line and "available_until" in line, line


def test_trace_with_no_client_at_time_zero_starts_when_the_first_comes_online(tmp_path,
                                                                             capsys):
    trace = write_trace(tmp_path / "trace.csv", [(10, "")] * 8)
    code = main(["run", "quick_digits", *QUICK, f"out_dir={tmp_path / 'runs'}", "rounds=2",
                 "clock.profile=trace", f"clock.path={trace}"])
    assert code == 0, capsys.readouterr().err
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["clients_used"] > 0 and records[1]["dropped"] == 0
    assert records[1]["sim_time_s"] > 10.0
    assert records[1]["sim_round_s"] == records[1]["sim_time_s"]


def test_trace_with_some_clients_late_runs(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.csv", [("", "")] * 4 + [(1e9, "")] * 4)
    code = main(["run", "quick_digits", *QUICK, f"out_dir={tmp_path / 'runs'}", "rounds=2",
                 "clock.profile=trace", f"clock.path={trace}"])
    assert code == 0, capsys.readouterr().err


# ------------------------------------------------------- runs where no client trained


def summary_of(out_dir):
    (run_dir,) = list(out_dir.iterdir())
    return json.loads((run_dir / "summary.json").read_text()), run_dir


def test_deadline_no_client_meets_reports_no_client_trained(tmp_path, capsys):
    out = tmp_path / "runs"
    code = main(["run", "quick_digits", *QUICK, f"out_dir={out}", "rounds=2",
                 "clock.deadline=1e-9"])
    printed = capsys.readouterr().out
    assert code == 3
    assert "status no_client_trained" in printed, printed
    summary, run_dir = summary_of(out)
    assert summary["status"] == "no_client_trained" and summary["rounds"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients_used"] for r in records[1:]] == [0, 0]


@pytest.mark.parametrize("deadline, code", [("1e-9", 3), ("null", 0)])
def test_a_study_with_a_run_where_no_client_trained_exits_3(tmp_path, capsys, deadline,
                                                             code):
    """The command line's status says whether every run of a study completed: 3 when
    one ended no_client_trained (no client met the deadline), 0 otherwise."""
    study = tmp_path / "study.yaml"
    study.write_text("name: late\nbase: quick_digits\n"
                     f"overrides: [rounds=1, clock.deadline={deadline}]\n"
                     "grid: {train.lr: [0.1]}\n")
    assert main(["study", str(study), "--out-dir", str(tmp_path / "out"),
                 "--jobs", "1"]) == code
    capsys.readouterr()


@pytest.mark.parametrize("algorithm", ["sflv2", "sl", "fedprox"])
def test_no_client_trained_for_split_and_sequential_algorithms(tmp_path, algorithm):
    cfg = build_config({"name": "d", "rounds": 2, "progress": False,
                        "algorithm": {"name": algorithm},
                        "data": {"name": "digits", "limit_train": 200, "limit_test": 20},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "model": {"name": "mlp", "hidden": [8]},
                        "train": {"batch_size": 8, "local_steps": 2},
                        "clock": {"deadline": 1e-9}})
    assert run_experiment(cfg, write=False).status == "no_client_trained"


def test_a_round_with_one_client_on_time_completes(tmp_path):
    """A trace where half the clients are there: the run trained, it completes."""
    trace = write_trace(tmp_path / "trace.csv", [("", "")] * 2 + [(1e9, "")] * 2)
    cfg = build_config({"name": "d", "rounds": 2, "progress": False,
                        "data": {"name": "digits", "limit_train": 200, "limit_test": 20},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "model": {"name": "mlp", "hidden": [8]},
                        "train": {"batch_size": 8, "local_steps": 1},
                        "clock": {"profile": "trace", "path": str(trace)}})
    result = run_experiment(cfg, write=False)
    assert result.status == "completed"
    assert [r["clients_used"] for r in result.records[1:]] == [2, 2]


@pytest.mark.parametrize("algorithm", ["centralized", "server_only"])
def test_server_alone_training_still_completes(tmp_path, algorithm):
    cfg = build_config({"name": "s", "rounds": 2, "progress": False,
                        "algorithm": {"name": algorithm},
                        "data": {"name": "digits", "limit_train": 300, "limit_test": 20},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "model": {"name": "mlp", "hidden": [8]},
                        "train": {"batch_size": 8, "local_steps": 1},
                        "clock": {"deadline": 1e-9}})
    assert run_experiment(cfg, write=False).status == "completed"


def test_zero_rounds_still_complete():
    cfg = build_config({"name": "z", "rounds": 0, "progress": False,
                        "data": {"name": "digits", "limit_train": 100, "limit_test": 20},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "model": {"name": "mlp", "hidden": [8]},
                        "train": {"batch_size": 8, "local_steps": 1},
                        "clock": {"deadline": 1e-9}})
    assert run_experiment(cfg, write=False).status == "completed"


def test_build_checks_run_before_the_model_is_allocated():
    """A model too large for any machine is refused from its meta-device probe."""
    cfg = build_config({"data": {"name": "digits"}, "model": {"name": "mlp",
                        "hidden": [10**9, 10**9]}, "partition": {"num_clients": 4}})
    t0 = time.process_time()
    with pytest.raises(ConfigError, match="model.options.*parameters"):
        build_algorithm(cfg)
        build_environment(cfg)
    assert time.process_time() - t0 < 1.0


def test_profiles_never_available_and_clock_used():
    import numpy as np

    from splitfed.engine.clock import VirtualClock
    from splitfed.engine.participation import Cohort
    from splitfed.engine.profiles import fixed

    rng = np.random.default_rng(0)
    p = fixed(4, rng)
    assert not p.never_available().any()
    p.available_from = np.array([-np.inf, 0.0, 5.0, -np.inf])
    p.available_until = np.array([0.0, 1.0, 5.0, np.inf])
    assert p.never_available().tolist() == [True, False, True, False]
    clock = VirtualClock(p, rng, deadline=1.0)
    cohort = clock.begin_round(Cohort(np.array([1, 3, 3]), np.full(3, 1 / 3)))
    assert cohort.ids.tolist() == [1, 3, 3]
    clock.transfer("model", "up", np.array([1]), 10**9)       # 1000 s at 1e6 B/s: late
    clock.on_time(np.array([1, 3]))
    assert clock.used(cohort.ids) == 1                           # client 3, once
