"""The multi-process runtime (torch.distributed, gloo on loopback) against the simulator.

Real processes: rank 0 serves, ranks 1.. host the clients. Each test bounds its
processes with a timeout, so a hung rendezvous fails instead of hanging.
"""

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_float_close, digits_config
from splitfed.configtools import dump_yaml
from splitfed.engine.stacked import StackedModel
from splitfed.experiment import build_environment, run_experiment
from splitfed.models import build_model
from splitfed.runtime.launch import spawn
from splitfed.runtime.placement import host_ranks

HERE = Path(__file__).parent
ENV = {"OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
LIMIT_S = 240
ALGORITHMS = ("fedavg", "sl", "sflv1", "sflv2", "musplitfed", "csefsl", "fedprox", "fedopt",
              "scaffold", "scaffold_plus", "clgsgd", "server_only", "gas")


class _Hosts:
    """A placement for in-process checks: this process hosts the clients in ``mine``."""

    def __init__(self, mine):
        self.mine = set(mine)

    def local_slots(self, role, ids):
        return np.array([i for i, c in enumerate(np.atleast_1d(ids)) if c in self.mine],
                        dtype=np.int64)

    def stacked(self, module, start, n, *, role, ids, **kw):
        from splitfed.runtime.placement import PartialStackedModel
        if len(self.local_slots(role, ids)) == len(np.atleast_1d(ids)):
            return StackedModel(module, start, n, role=role, ids=ids, **kw)
        return PartialStackedModel(self, module, start, n, role=role, ids=ids, **kw)


def test_partial_stacked_model_trains_exactly_the_hosted_copies():
    """Hosting clients 1 and 3 of [0, 1, 2, 3]: their copies train as in the full
    stacked model, the other rows are zeros and nothing is computed for them."""
    model = build_model("mlp", (1, 8, 8), 10, hidden=[16])
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = np.arange(4)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, 1, 8, 8, generator=g), torch.randint(0, 10, (4, 5), generator=g)
    env = build_environment(digits_config(partition__num_clients=4))
    full = env.stacked(model, start, 4, ids=ids)          # no placement: all copies here
    assert type(full) is StackedModel and full.n == 4
    # the full stacked model in float64 too, from the same float32 values (the bound)
    full64 = env.stacked(copy.deepcopy(model).double(),
                         {k: v.double() for k, v in start.items()}, 4, ids=ids)
    env.placement = _Hosts([1, 3])
    part = env.stacked(model, start, 4, ids=ids)
    assert type(part).__name__ == "PartialStackedModel" and part.n == 2
    for a in (4, 3, 2):            # copies still working are a prefix, as in the executor
        for m, xs in ((full, x), (part, x), (full64, x.double())):
            out = m.forward(xs[:a], a)
            loss = F.cross_entropy(out.flatten(0, 1), y[:a].flatten(), reduction="none")
            m.step(loss.sum(), lr=0.1)
    want, want64, got = full.final(), full64.final(), part.final()
    for k in want:
        # weight gradients sum over the 5 samples and the 64 inputs
        assert_float_close(got[k][[1, 3]], want[k][[1, 3]], want64[k][[1, 3]], terms=5 * 64,
                           what=k)
        assert not got[k][[0, 2]].any()


def test_clients_are_hosted_in_contiguous_blocks():
    assert host_ranks(6, 3).tolist() == [1, 1, 1, 2, 2, 2]
    assert host_ranks(5, 4).tolist() == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="at least 2 processes"):
        host_ranks(4, 1)


def _config(name, algorithm, tmp_path, **over):
    """``algorithm``: a name, or the whole algorithm section."""
    if isinstance(algorithm, str):
        algorithm = {"name": algorithm}
    raw = {"name": name, "algorithm": algorithm,
           "partition": {"scheme": "iid", "num_clients": 6},
           "participation": {"mode": "uniform", "clients_per_round": 4},
           "out_dir": str(tmp_path / "runs")}
    if algorithm["name"] == "musplitfed":
        raw["train"] = {"batch_size": 8, "local_steps": 1, "local_epochs": None, "lr": 0.05}
    raw.update(over)
    return digits_config(**raw)


def _finish(procs, limit_s=LIMIT_S):
    """Wait for every rank (rank 0 first); kill them all past ``limit_s``."""
    deadline = time.monotonic() + limit_s
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not finish within {limit_s} s")
    finally:
        if hasattr(procs, "close"):
            procs.close()               # the run's store and status directory
    return [p.returncode for p in procs]


def _params_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].double(), b[k].double(), rtol=1e-5, atol=1e-6), k


def test_algorithms_equal_the_simulator_parameters_and_bytes(tmp_path):
    """3 processes (2 client ranks, 6 clients, 4 sampled per round, cohorts spanning
    ranks): the same final parameters as the in-process run, and the payload bytes that
    crossed the wire equal the simulator's ledger, round by round and kind by kind."""
    # CSE-FSL: round 2 has the server pass (uploads when t > 1), round 3 too; SCAFFOLD:
    # round 3 uses client controls updated in round 2 from the model received then
    three = ("csefsl", "scaffold", "scaffold_plus")
    cfgs = [_config(a, a, tmp_path, rounds=3 if a in three else 2) for a in ALGORITHMS]
    cfgs += [   # options and participation modes that change who computes what, when
        _config("sflv2_per_client", {"name": "sflv2", "order": "per_client"}, tmp_path,
                rounds=2),
        _config("sflv1_period", {"name": "sflv1", "server_period": 1}, tmp_path, rounds=2,
                engine={"chunk_size": 2}, participation={"mode": "bernoulli", "q": 0.7}),
        _config("sl_momentum", "sl", tmp_path, rounds=2,
                participation={"mode": "with_replacement", "clients_per_round": 4},
                train={"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.1,
                       "momentum": 0.9})]
    cfgs += [   # transforms on split algorithms (docs/transforms.md): configs, not code
        _config("sflv2_prox_scaffold", {"name": "sflv2", "client_transforms": [
            {"name": "prox", "mu": 0.1}, {"name": "scaffold"}]}, tmp_path, rounds=3),
        _config("sflv1_fedopt", {"name": "sflv1", "server_transforms": [
            {"name": "fedopt", "server_lr": 0.05}]}, tmp_path, rounds=2),
        _config("sl_server_momentum", {"name": "sl", "server_transforms": [
            {"name": "momentum", "beta": 0.9}]}, tmp_path, rounds=3),
        _config("csefsl_scaffold", {"name": "csefsl", "client_transforms": [
            {"name": "scaffold"}]}, tmp_path, rounds=3)]
    runtime_equals_simulator(cfgs, tmp_path)


def test_a_transformer_on_token_ids_equals_the_simulator(tmp_path):
    """OPT takes integer token ids and gives float activations: the stand-ins for the
    outputs of clients on other ranks take the model's dtype, not the input's."""
    pytest.importorskip("transformers")
    text = {"data": {"name": "synthetic_text", "num_train": 64, "num_test": 32},
            "model": {"name": "opt", "vocab_size": 64, "cut": 2}}
    cfgs = [_config(f"opt_{a}", a, tmp_path, rounds=2, **text)
            for a in ("fedavg", "sflv1", "musplitfed")]
    runtime_equals_simulator(cfgs, tmp_path)


def runtime_equals_simulator(cfgs, tmp_path):
    """Run ``cfgs`` on 3 processes of the runtime and check each against the simulator:
    parameters, bytes on the wire equal to the ledger's, training losses."""
    torch.save(cfgs, tmp_path / "configs.pt")
    procs = spawn(3, [str(tmp_path), str(tmp_path / "configs.pt")],
                  module="distributed_worker", env=ENV)
    assert _finish(procs) == [0, 0, 0]
    for cfg in cfgs:
        ref = run_experiment(cfg, write=False)
        got = torch.load(tmp_path / f"{cfg.name}.pt", weights_only=False)
        _params_close(ref.state["model"], got["state"]["model"])
        for r_ref, r_got in zip(ref.records[1:], got["records"][1:], strict=True):
            wire = {k.replace("wire_", "bytes_"): v for k, v in r_got.items()
                    if k.startswith("wire_")}
            ledger = {k: v for k, v in r_ref.items() if k.startswith("bytes_")}
            assert wire == ledger, cfg.name
            assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], rel=1e-5)
            assert r_got["sim_round_s"] == pytest.approx(r_ref["sim_round_s"])
            # the work counted: rank 0 charges the copies hosted elsewhere as the
            # simulator charges them
            for key in ("client_macs", "server_macs"):
                assert r_got.get(key) == r_ref.get(key), (cfg.name, key)
        assert got["records"][-1]["test_acc"] == ref.records[-1]["test_acc"]


def _slow_config(tmp_path, algorithm, rounds, clients=4):
    """Full participation; about 0.3 s of real client compute delay per round
    (``--real-delays 1`` with a slow fixed profile)."""
    cfg = digits_config(name=algorithm, algorithm={"name": algorithm}, rounds=rounds,
                        partition={"scheme": "iid", "num_clients": clients},
                        clock={"profile": "fixed", "client_compute": 2e5},
                        out_dir=str(tmp_path / "runs"))
    path = tmp_path / f"{algorithm}.yaml"
    dump_yaml(cfg, path)
    return path


def _wait_for_round(run_dir: Path, t: int, procs, limit_s=LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.is_file():
            rounds = [json.loads(x)["round"] for x in metrics.read_text().splitlines() if x]
            if rounds and rounds[-1] >= t:
                return
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a rank exited before round {t}: {[p.poll() for p in procs]}")
        time.sleep(0.05)
    for p in procs:
        p.kill()
    pytest.fail(f"round {t} was not reached within {limit_s} s")


def test_killed_and_hung_client_processes_are_dropped_and_the_run_completes(tmp_path):
    """Rank 2 is killed (its connection closes), rank 3 stopped (it never answers: rank
    0's timeout); their clients are dropped and the run completes with rank 1's."""
    run_dir = tmp_path / "run"
    path = _slow_config(tmp_path, "sflv2", rounds=6, clients=6)
    procs = spawn(4, [str(path), "--run-dir", str(run_dir), "--real-delays", "1",
                      "--timeout", "10"], env=ENV)
    _wait_for_round(run_dir, 2, procs)
    procs[2].send_signal(signal.SIGKILL)            # hosts clients 2 and 3
    procs[3].send_signal(signal.SIGSTOP)            # hosts clients 4 and 5
    try:
        procs[0].wait(LIMIT_S)
    finally:
        procs[3].kill()
    codes = _finish(procs)
    assert codes[0] == 0 and codes[2] == -signal.SIGKILL
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 6
    assert sorted(summary["lost_ranks"]) == ["2", "3"]
    assert "no answer within 10 s" in summary["lost_ranks"]["3"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["participants"] == 6 and records[1]["dropped"] == 0
    assert records[-1]["participants"] == 2 and records[-1]["dropped"] == 4
    assert records[-1]["lost_ranks"] == [2, 3]


def test_a_killed_server_resumes_to_the_uninterrupted_parameters(tmp_path):
    run_dir = tmp_path / "run"
    path = _slow_config(tmp_path, "fedavg", rounds=5)
    procs = spawn(3, [str(path), "--run-dir", str(run_dir), "--real-delays", "1"], env=ENV)
    _wait_for_round(run_dir, 2, procs)
    procs[0].send_signal(signal.SIGKILL)
    codes = _finish(procs)
    assert codes[0] == -signal.SIGKILL and codes[1:] == [1, 1]   # clients saw it go
    done = [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text()
            .splitlines()]
    assert done[-1] < 5
    procs = spawn(3, ["--resume", str(run_dir)], env=ENV)
    assert _finish(procs) == [0, 0, 0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"]
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    from splitfed.config import load_config
    ref = run_experiment(load_config(str(path)), write=False)
    _params_close(ref.state["model"], ckpt["state"]["model"])
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(6))
    # the summary's wire totals cover the rounds before the resume too, and the control
    # overhead is a running total over the whole run
    for key in ("wire_up", "wire_down", "wire_up/model", "wire_down/model"):
        assert summary[key] == sum(r[key] for r in records[1:]) > 0, key
    assert summary["wire_up"] == sum(r["bytes_up"] for r in records[1:])
    overhead = [r["overhead_bytes"] for r in records[1:]]
    assert overhead == sorted(overhead)
    # resuming the finished run again changes nothing, and writes a deleted
    # partition.txt again
    before = (run_dir / "summary.json").read_bytes()
    partition = (run_dir / "partition.txt").read_text()
    (run_dir / "partition.txt").unlink()
    procs = spawn(3, ["--resume", str(run_dir)], env=ENV)
    assert _finish(procs) == [0, 0, 0]
    assert (run_dir / "summary.json").read_bytes() == before
    assert (run_dir / "partition.txt").read_text() == partition


@pytest.mark.parametrize("name,over", [
    # dropout draws from torch's default generator, on every rank for its own clients:
    # each rank seeds it every round from the seed and the round
    ("fedavg", {"model": {"name": "alexnet", "dropout": 0.5, "width": 0.125}}),
    # SCAFFOLD's client controls c_i are applied on the client ranks: a resumed run
    # gives them the checkpoint's, not round 0's zeros
    ("scaffold", {}),
    ("scaffold_plus", {}),
])
def test_a_resumed_launch_ends_with_the_uninterrupted_state(tmp_path, name, over):
    """A run stopped after round 2 and resumed to round 4 ends where the run of 4 rounds
    does: the same model and algorithm state (SCAFFOLD's c and every c_i)."""
    path = tmp_path / "c.yaml"
    dump_yaml(_config("c", name, tmp_path, rounds=4, **over), path)
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _finish(spawn(3, [str(path), "--run-dir", str(whole)], env=ENV)) == [0, 0, 0]
    assert _finish(spawn(3, [str(path), "rounds=2", "--run-dir", str(part)],
                         env=ENV)) == [0, 0, 0]
    text, n = re.subn(r"^rounds: 2$", "rounds: 4", (part / "config.yaml").read_text(),
                      flags=re.MULTILINE)
    assert n == 1
    (part / "config.yaml").write_text(text)
    assert _finish(spawn(3, ["--resume", str(part)], env=ENV)) == [0, 0, 0]
    got, ref = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (part, whole))
    assert got["round"] == ref["round"] == 4
    _params_close(_tensors(ref["state"]), _tensors(got["state"]))


def test_a_launch_resume_of_a_run_without_a_checkpoint(tmp_path, capsys, no_ranks):
    """A run that kept no checkpoint (``checkpoint_every: 0``): ``launch --resume``
    prints the result of one that ended, as ``run --resume`` does, without starting a
    rank or changing a file; one that did not end (no summary) starts again from round 0
    in its directory and ends as the run did."""
    from splitfed.cli import main

    d = tmp_path / "d"
    first = run_experiment(_config("c", "fedavg", tmp_path, rounds=2, checkpoint_every=0),
                           run_dir=d)
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    assert "checkpoint.pt" not in files
    assert main(["launch", "--resume", str(d), "--nproc", "3"]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"run directory: {d}\n") and "status completed" in out
    assert {p.name: p.read_bytes() for p in d.iterdir()} == files
    (d / "summary.json").unlink()
    procs = spawn(2, ["--resume", str(d)], env=ENV)     # 2 processes: bit for bit
    assert _finish(procs) == [0, 0]
    again = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in again] == [0, 1, 2]
    assert [r.get("train_loss") for r in again] == [r.get("train_loss") for r in first.records]
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"


def _tensors(tree, at="") -> dict:
    if isinstance(tree, torch.Tensor):
        return {at: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{at}/{key}")
                .items()}
    return {}


def test_launch_through_torchrun_refuses_an_unsupported_algorithm(tmp_path):
    path = tmp_path / "c.yaml"
    dump_yaml(digits_config(algorithm={"name": "fedclg_c"}), path)
    proc = subprocess.run([sys.executable, "-m", "splitfed", "launch", str(path),
                           "--nproc", "2"], env={**os.environ, **ENV}, capture_output=True,
                          text=True, timeout=LIMIT_S)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), proc.stderr
    assert "does not run on the multi-process runtime" in proc.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
