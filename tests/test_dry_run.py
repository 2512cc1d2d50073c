"""``splitfed run CONFIG --dry-run``: every check a run makes, the plan printed, nothing
trained and nothing written."""

import re

import numpy as np
import pytest

from splitfed.algorithms.fedavg import FedAvg
from splitfed.cli import main
from splitfed.config import build_config
from splitfed.experiment import run_experiment
from splitfed.plan import build_plan, format_plan

TINY = ("name: t\nseed: 0\nrounds: 3\nprogress: false\nalgorithm: {name: fedavg}\n"
        "data: {name: digits}\npartition: {scheme: iid, num_clients: 4}\n"
        "model: {name: mlp, hidden: [8]}\n"
        "train: {batch_size: 8, local_steps: 2, local_epochs: null, lr: 0.1}\n"
        "participation: {mode: uniform, clients_per_round: 2}\nout_dir: runs\n")


@pytest.fixture
def here(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def written(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_dry_run_prints_the_plan_and_writes_nothing(here, capsys):
    assert main(["run", "tiny.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run of tiny.yaml: ")
    labels = [line.split()[0] for line in out.splitlines()[1:]]
    assert labels == ["algorithm", "transforms", "data", "clients", "participation", "local",
                      "samples/round", "model", "compute", "communication", "rounds",
                      "clock", "device", "would"]
    assert "clients        4, iid: samples min 359, median 359.5, max 360 (total 1438)" in out
    assert "participation  uniform: 2 clients a round" in out
    assert "samples/round  32 (" in out                        # 2 clients x 2 steps x 8
    assert "model          mlp: " in out
    assert re.search(r"would write +runs/t-fedavg-YYYYmmdd-HHMMSS/ \(out_dir would be "
                     r"created\): config\.yaml, ", out)
    assert written(here) == ["tiny.yaml"]                    # no runs/, no file


def test_split_plan_counts_each_side_and_the_activations(here, capsys):
    argv = ["run", "tiny.yaml", "--dry-run", "algorithm.name=sflv2", "model.hidden=[8,8]"]
    assert main(argv) == 0                                   # overrides after the flag
    out = capsys.readouterr().out
    assert "algorithm      sflv2 (split)" in out
    assert "at the cut, all clients of a round: " in out
    cfg = build_config({"name": "t", "algorithm": {"name": "sflv2"},
                        "data": {"name": "digits"}, "model": {"name": "mlp",
                                                              "hidden": [8, 8]},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None},
                        "out_dir": str(here / "runs")})
    plan = build_plan(cfg)
    m = plan["model"]
    assert m["client_parameters"] + m["server_parameters"] == m["parameters"]
    assert m["client_parameters"] == 64 * 8 + 8                # fc1: 8x8 pixels -> 8
    # a round of 4 clients x 2 steps x 8 samples: 8 float32 and an int64 label up, the
    # activations' gradient down per sample
    assert m["bytes"]["cut_up"] == 4 * 2 * 8 * (8 * 4 + 8)
    assert m["bytes"]["cut_down"] == 4 * 2 * 8 * 8 * 4
    assert plan["clients"]["samples_per_round"]["mean"] == 4 * 2 * 8   # full participation
    assert written(here) == ["tiny.yaml"]


def test_an_algorithm_that_fixes_its_local_steps_plans_with_them(here, capsys):
    """MU-SplitFed takes one client step a round whatever train.local_steps says: the
    plan counts that, and over-selection predicts each client's work from it."""
    argv = ["run", "tiny.yaml", "--dry-run", "algorithm.name=musplitfed", "model.cut=1",
            "model.hidden=[8,8]", "train.local_steps=5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("local steps    K per client min 1, median 1, max 1 (musplitfed takes 1 a round; "
            "train.local_steps and local_epochs do not apply, batch_size 8)") in out
    assert "samples/round  16 (" in out                        # 2 clients x 1 step x 8
    from splitfed.algorithms.musplitfed import MUSplitFed
    from splitfed.engine.loop import local_steps_of
    from splitfed.experiment import build_environment

    cfg = build_config({"name": "t", "data": {"name": "digits"},
                        "model": {"name": "mlp", "hidden": [8]},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "train": {"batch_size": 8, "local_epochs": 2}})
    env = build_environment(cfg)
    ids = np.arange(4)
    assert local_steps_of(MUSplitFed(), env, ids).tolist() == [1, 1, 1, 1]
    assert local_steps_of(FedAvg(), env, ids).tolist() == env.local_steps(ids).tolist() \
        == [90, 90, 90, 90]                         # ceil(359 or 360 / 8) = 45, 2 epochs


def test_the_plan_counts_what_the_clients_of_a_round_compute(here, capsys):
    """The compute of a round's clients is the algorithm's client_macs: K B forward and
    backward passes of FedAvg's model (64 x 8 + 8 x 10 MACs forward per sample), 2 q + 1
    forward passes per sample of a MU-SplitFed client's part (64 x 8) with q = 2."""
    assert main(["run", "tiny.yaml", "--dry-run"]) == 0
    assert "all clients of a round: 56,832 (what fedavg's clients compute)" in \
        capsys.readouterr().out                                 # 2 x 2 x 8 x 3 x 592
    cfg = build_config({"name": "t", "algorithm": {"name": "musplitfed", "directions": 2},
                        "data": {"name": "digits"},
                        "model": {"name": "mlp", "hidden": [8, 8], "cut": 1},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "participation": {"mode": "uniform", "clients_per_round": 2},
                        "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None},
                        "out_dir": str(here / "runs")})
    assert build_plan(cfg)["model"]["client_macs_per_round"] == 2 * 1 * 8 * 5 * 64 * 8


@pytest.mark.parametrize("override, match", [
    ("model.cut=99", "model.cut=99 is not valid for mlp"),
    ("train.batch_size=5000", "train.batch_size: 5000 exceeds the 1438 training samples"),
    ("participation.clients_per_round=9", "clients_per_round"),
    ("out_dir=afile/sub", "out_dir: cannot create the run directory afile/sub/t-fedavg-"
                          "YYYYmmdd-HHMMSS .*afile is not a directory"),
    ("name=" + "x" * 300, "name: cannot create the run directory .* choose a shorter name"),
    ("train.lr=-1", "train.lr: must be > 0"),
])
def test_a_bad_config_fails_as_the_run_would(here, capsys, override, match):
    (here / "afile").write_text("a file")
    assert main(["run", "tiny.yaml", override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("splitfed: error: ") and re.search(match, line), line
    assert written(here) == ["afile", "tiny.yaml"]


def test_dry_run_takes_no_resume(here, capsys):
    assert main(["run", "--resume", "runs/x", "--dry-run"]) == 2
    assert "does not take --resume" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "scaffold_plus", "fedclg_c",
                                       "fedclg_s", "clgsgd"])
def test_the_planned_bytes_of_a_round_are_what_the_run_sends(here, algorithm):
    """Full participation: the plan's bytes per client (the model each way, and the
    gradient transforms' messages: SCAFFOLD's control variates both ways, FedCLG-C's
    server gradient down, FedCLG-S's client gradients up) times the clients are the
    bytes the run's ledger records in its first round."""
    cfg = build_config({"name": "t", "rounds": 1, "progress": False,
                        "algorithm": {"name": algorithm}, "data": {"name": "digits"},
                        "model": {"name": "mlp", "hidden": [8]},
                        "partition": {"scheme": "iid", "num_clients": 4},
                        "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None},
                        "checkpoint_every": 0, "out_dir": str(here / "runs")})
    b = build_plan(cfg)["model"]["bytes"]
    records = run_experiment(cfg, write=False).records
    first = next(r for r in records if r["round"] == 1)
    assert first["bytes_down"] == 4 * (b["model"] + b["messages_down"])
    assert first["bytes_up"] == 4 * (b["model"] + b["messages_up"])
    assert b["cut_up"] == b["cut_down"] == 0
    sent = {"scaffold": (1, 1), "scaffold_plus": (1, 1), "fedclg_c": (1, 0),
            "fedclg_s": (0, 1)}.get(algorithm, (0, 0))
    assert (b["messages_down"], b["messages_up"]) == tuple(n * b["model"] for n in sent)


@pytest.mark.parametrize("returned", [(1.5, 0), (-1, 0), 7, (True, 0), (1, 2, 3)])
def test_a_transform_whose_message_bytes_are_not_two_counts_is_named(returned):
    from types import SimpleNamespace

    from splitfed.engine.loop import message_bytes
    from splitfed.errors import PluginError

    step = SimpleNamespace(name="mine", message_bytes=lambda env, part: returned)
    with pytest.raises(PluginError, match=r"algorithm.client_transforms: transform .mine.: "
                                          r"message_bytes must return"):
        message_bytes(SimpleNamespace(gradient_transforms=[step]), None, 10)


@pytest.mark.parametrize("client_gradient, batch", [
    ("first_batch", 8), ("fresh_batch", 8), ("full", 8),
    ("fresh_batch", 256)])                    # more than client 2's 186 samples
@pytest.mark.parametrize("algorithm", ["fedclg_c", "fedclg_s"])
def test_the_planned_client_macs_of_a_round_are_what_the_run_charges(
        here, monkeypatch, algorithm, client_gradient, batch):
    """Full participation: the plan's compute of a round's clients (K B forward and
    backward passes each, and FedCLG's pass for g^i_t: B samples with ``fresh_batch``,
    also for a client with fewer, whose batch repeats samples, all D_i with ``full``,
    none with ``first_batch``) is what the run charged the clients on the clock in its
    first round, client by client as over-selection predicts it, and what its record
    counts."""
    from splitfed.engine.clock import CLIENT, VirtualClock
    from splitfed.engine.loop import client_work, local_steps_of
    from splitfed.experiment import build_algorithm, build_environment

    cfg = build_config({"name": "t", "rounds": 1, "progress": False,
                        "algorithm": {"name": algorithm, "client_gradient": client_gradient},
                        "data": {"name": "digits"}, "model": {"name": "mlp", "hidden": [8]},
                        "partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5},
                        "train": {"batch_size": batch, "local_steps": 2,
                                  "local_epochs": None},
                        "checkpoint_every": 0, "out_dir": str(here / "runs")})
    plan = build_plan(cfg)
    charged = np.zeros(4, dtype=np.int64)
    compute = VirtualClock.compute

    def tally(self, role, ids, macs):
        if role == CLIENT:
            ids = np.atleast_1d(np.asarray(ids))
            np.add.at(charged, ids, np.broadcast_to(np.asarray(macs), ids.shape))
        return compute(self, role, ids, macs)
    monkeypatch.setattr(VirtualClock, "compute", tally)
    records = run_experiment(cfg, write=False).records
    first = next(r for r in records if r["round"] == 1)
    assert plan["model"]["client_macs_per_round"] == charged.sum() == first["client_macs"]
    env, algo = build_environment(cfg), build_algorithm(cfg)
    ids = np.arange(4)
    predicted = client_work(algo, env, local_steps_of(algo, env, ids), ids=ids)[0]
    np.testing.assert_array_equal(predicted, charged)
    assert env.data_sizes.tolist() == [362, 413, 186, 377]    # the server took its pool
    extra = {"first_batch": 0, "fresh_batch": batch, "full": env.data_sizes}[client_gradient]
    whole = 3 * (64 * 8 + 8 * 10)              # a forward and a backward pass, mlp [8]
    np.testing.assert_array_equal(charged, (2 * batch + extra) * whole)
    assert plan["model"]["client_samples_of"] == (
        [] if client_gradient == "first_batch" else [algorithm])
    assert (f"clients compute, with their own passes for {algorithm})" in format_plan(plan)) \
        is (client_gradient != "first_batch")


@pytest.mark.parametrize("returned", [1.5, -1, True, (1, 2), np.array([1, 2]),
                                      np.array([1.0, 2.0, 3.0]), np.array([1, -2, 3])])
def test_a_transform_whose_client_samples_are_not_counts_is_named(returned):
    from types import SimpleNamespace

    from splitfed.engine.loop import transform_samples
    from splitfed.errors import PluginError

    step = SimpleNamespace(name="mine", client_samples=lambda env, ids: returned)
    with pytest.raises(PluginError, match=r"algorithm.client_transforms: transform .mine.: "
                                          r"client_samples must return"):
        transform_samples(SimpleNamespace(gradient_transforms=[step]), None, np.arange(3))


def test_the_samples_of_several_gradient_transforms_add_up():
    """Each gradient transform's ``client_samples`` is its own extra pass: the round's
    extra samples per client are their sum, client by client."""
    from types import SimpleNamespace

    from splitfed.engine.loop import transform_samples

    steps = [SimpleNamespace(name="a", client_samples=lambda env, ids: 2),
             SimpleNamespace(name="b", client_samples=lambda env, ids: np.arange(len(ids))),
             SimpleNamespace(name="c", client_samples=lambda env, ids: 0)]
    got = transform_samples(SimpleNamespace(gradient_transforms=steps), None, np.arange(3))
    assert got.dtype == np.int64 and got.tolist() == [2, 3, 4]
