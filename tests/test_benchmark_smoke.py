"""The throughput benchmark runs end to end at a tiny size (no timing assertions)."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.bench import EVAL_LABELS, FLOWER, LIMITS, flops_per_sample
from benchmarks.workload import Workload
from benchmarks.variants import VARIANTS

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_benchmark_tiny_run_reports_every_variant(tmp_path):
    out = tmp_path / "bench.json"
    # one thread: on a busy 2-core CI machine two threads per process can stall badly
    proc = _bench("--clients", "4", "--local-steps", "1", "--repeats", "1", "--threads", "1",
                  "--no-flower", "--no-pfl", "--no-memory", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == set(VARIANTS) | set(EVAL_LABELS) and FLOWER not in results
    assert report["peak_gflops"] > 0
    for name, r in results.items():
        assert r["samples_per_s"] > 0, name
        assert len(r["round_s"]) == 1
        assert r["gflops"] > 0 and 0 < r["x_peak"] == round(r["gflops"] / report["peak_gflops"], 3)
        if name in EVAL_LABELS:
            assert r["x_train"] > 0 and r["train_reference"] in VARIANTS
            # timed in the training rows' round robin: paired with its reference
            ref = results[r["train_reference"]]
            want = round(r["samples"] / r["round_s"][0]
                         / (ref["samples"] / ref["round_s"][0]), 3)
            assert r["x_train_paired"] == {"median": want, "min": want, "max": want}
        else:
            assert r["x_peer"] > 0 and r["x_b32"] > 0 and r["x_limit"] > 0
            for key, ref in (("x_b32_paired", "central_b32"), ("x_peer_paired", "peer_loop")):
                if name != ref:     # one repeat: the paired ratio is that repeat's
                    want = round(results[ref]["round_s"][0] / r["round_s"][0], 3)
                    assert r[key] == {"median": want, "min": want, "max": want}, name
    assert report["limit_variant"] in LIMITS
    assert report["workload"]["samples_per_round"] == 4 * 1 * 32
    for key in ("torch", "threads", "cpu_model"):
        assert key in report["machine"]
    assert len(report["load_start"]) == 3 and len(report["load_end"]) == 3
    assert "splitfed_fedavg" in proc.stdout and "samples/s" in proc.stdout


def test_paired_ratios_by_hand_and_shown_from_a_saved_report(tmp_path):
    """Repeat r's ratio is the reference's round time over the row's in that repeat;
    rows timed elsewhere (evaluation, external peers) or with fewer repeats are not
    paired, nor is a reference with itself."""
    from benchmarks.bench import paired_ratios

    results = {"central_b32": {"round_s": [2.0, 4.0, 3.0]},
               "peer_loop": {"round_s": [3.0, 6.0, 6.0]},
               "splitfed_fedavg": {"round_s": [1.0, 2.0, 3.0]},
               "splitfed_sl": {"round_s": [1.0, 2.0]},
               "eval_splitfed": {"round_s": [1.0, 1.0, 1.0]},
               FLOWER: {"round_s": [1.0, 1.0, 1.0]}}
    paired_ratios(results)
    assert "x_train_paired" not in results["eval_splitfed"]   # timed apart (older runs)
    for name, r in results.items():     # 32 training samples a round, 64 evaluated
        r["samples"] = 64 if name == "eval_splitfed" else 32
    results["eval_splitfed"].update(paired_with_training=True,
                                    train_reference="splitfed_fedavg",
                                    round_s=[0.5, 0.5, 2.0])
    paired_ratios(results)
    # (64 / 0.5) / (32 / 1), (64 / 0.5) / (32 / 2), (64 / 2) / (32 / 3)
    assert results["eval_splitfed"]["x_train_paired"] == {"median": 4.0, "min": 3.0,
                                                          "max": 8.0}
    assert results["splitfed_fedavg"]["x_peer_paired"] == {"median": 3.0, "min": 2.0,
                                                           "max": 3.0}
    assert results["splitfed_fedavg"]["x_b32_paired"] == {"median": 2.0, "min": 1.0,
                                                          "max": 2.0}
    assert results["peer_loop"]["x_b32_paired"] == {"median": 0.667, "min": 0.5,
                                                    "max": 0.667}
    assert "x_peer_paired" not in results["peer_loop"]
    for name in ("splitfed_sl", "eval_splitfed", FLOWER):
        assert not {"x_b32_paired", "x_peer_paired"} & set(results[name]), name

    # --show prints a saved report's tables, pairing a report that predates the pairs
    out = tmp_path / "bench.json"
    workload = {"clients": 2, "local_steps": 1, "batch": 32, "samples_per_round": 64}
    rows = {name: {"round_s": r["round_s"], "samples_per_s": 64 / r["round_s"][0]}
            for name, r in results.items() if name in ("peer_loop", "splitfed_fedavg")}
    out.write_text(json.dumps({"command": "python -m benchmarks.bench -C 2",
                               "machine": {"threads": 1}, "workload": workload,
                               "results": rows, "peak_gflops": 100.0}))
    proc = _bench("--show", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "python -m benchmarks.bench -C 2" in proc.stdout and "1 threads" in proc.stdout
    assert "splitfed_fedavg       x peer 3.00 [2.00-3.00]" in proc.stdout
    (tmp_path / "list.json").write_text("[1, 2]")
    for name in ("missing.json", "list.json"):
        bad = _bench("--show", str(tmp_path / name))
        assert bad.returncode != 0 and "not a report written by --out" in bad.stderr, name
        assert "Traceback" not in bad.stderr


def test_x_train_is_referenced_to_a_row_of_the_same_round_robin():
    """Flower and pfl run afterwards in their own processes (Flower on every core): the
    evaluation rows' x train is never referenced to, nor paired with, them."""
    from benchmarks.bench import PFL, add_ratios, paired_ratios

    results = {"splitfed_fedavg": {"round_s": [1.0, 2.0, 3.0], "samples": 32,
                                   "samples_per_s": 16.0},
               FLOWER: {"round_s": [0.5, 0.5, 0.5], "samples": 32, "samples_per_s": 64.0},
               PFL: {"samples_per_s": 128.0},
               "eval_splitfed": {"round_s": [0.5, 0.5, 2.0], "samples": 64,
                                 "samples_per_s": 128.0, "paired_with_training": True}}
    add_ratios(results)
    ev = results["eval_splitfed"]
    assert ev["train_reference"] == "splitfed_fedavg" and ev["x_train"] == 8.0
    assert ev["x_train_paired"] == {"median": 4.0, "min": 3.0, "max": 8.0}
    # a report saved with Flower as the reference (--show): not paired with it
    del ev["x_train_paired"]
    ev["train_reference"] = FLOWER
    paired_ratios(results)
    assert "x_train_paired" not in ev


def test_machine_info_records_which_cpu_kernels_run(monkeypatch):
    import torch

    from benchmarks.bench import machine_info

    caps = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    for key, value in caps.items():
        monkeypatch.setenv(key, value)
    info = machine_info()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {k: info["env"].get(k) for k in caps} == caps


def test_flower_row_is_no_fraction_of_a_peak_measured_at_other_threads(monkeypatch):
    """Flower trains on Ray actors in parallel, the peak is measured at --threads."""
    import os

    from benchmarks import bench

    w = Workload(clients=2, local_steps=1)
    res = {"flwr": "1.0", "num_cpus_per_client": 1.0, "round_s": {"1": 9.0, "2": 0.5}}
    monkeypatch.setattr(bench, "run_script", lambda *a, **k: {
        "result": res, "wall_s": 9.5, "peak_mb": 2000.0})
    results = {"central_b32": bench.summarize(w, [1.0], "b32"),
               FLOWER: bench.run_flower(w, "python", 1, 1.0, lambda msg: None)}
    assert results[FLOWER]["cpus"] == min(os.cpu_count(), 2)
    bench.add_ratios(results, w, peak=100.0)
    assert results[FLOWER]["gflops"] > 0 and "x_peak" not in results[FLOWER]
    assert results["central_b32"]["x_peak"] > 0
    assert (f"{FLOWER} trained on {min(os.cpu_count(), 2)} CPUs (Ray actors in parallel), "
            "the other rows on 1 threads: no x peak"
            in bench.table(w.describe(), results, 100.0, threads=1))


def test_show_prints_a_scaling_reports_cost_per_sample_and_its_paper_run(tmp_path, capsys):
    from benchmarks.bench import show

    def block(clients, fedavg_s):
        workload = {"clients": clients, "local_steps": 64 // (clients * 8), "batch": 8,
                    "samples_per_round": 64}
        return {"workload": workload, "results": {
            "splitfed_fedavg": {"round_s": [fedavg_s], "samples_per_s": 64 / fedavg_s}}}

    paper = {"rounds": 2, "median_wall_s": {"eval_every_round": 3.0, "eval_last_only": 2.5},
             "ratio": 1.2, "test_samples": 10000, "eval_s_per_round": 0.5,
             "eval_forward_gflop": 8.33}
    out = tmp_path / "scaling.json"
    out.write_text(json.dumps({"command": "python -m benchmarks.bench --scaling",
                               "machine": {"threads": 1}, "paper_run": paper,
                               "scaling": [block(2, 0.064), block(4, 0.128)]}))
    show([str(out)])
    shown = capsys.readouterr().out
    assert "cost per sample (microseconds) at 64 samples per round" in shown
    # 1e6 / (64 / 0.064) = 1000 us at C=2, 2000 at C=4: 2.00x
    assert "splitfed_fedavg  1000.0  2000.0       2.00" in shown
    assert ("paper-scale run (FedAvg, 2 rounds, 10 of 1000 clients, batch 10): evaluating "
            "every round 3.0 s, only after the last 2.5 s: x1.20; one evaluation of 10,000 "
            "samples 500 ms (8.33 GFLOP)") in shown


def test_memory_probe_reports_peak_rss():
    proc = _bench("--memory-probe", "splitfed_sflv2", "--clients", "2", "--local-steps", "1",
                  "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["peak_mb"] > 0 and probe["delta_mb"] >= 0


def test_flops_per_sample_of_lenet5_by_hand():
    """LeNet-5 on 1x28x28: conv1 28*28*6*25 + conv2 10*10*16*150 + 400*120 + 120*84 + 84*10
    = 416,520 multiply-accumulates forward; training is the forward pass, the weights'
    gradients (as many) and the inputs' gradients of every layer but conv1 (whose input is
    the data), 2 FLOP each."""
    w = Workload(clients=2, local_steps=1)
    forward = 28 * 28 * 6 * 25 + 10 * 10 * 16 * 150 + 400 * 120 + 120 * 84 + 84 * 10
    assert flops_per_sample(w, "eval_splitfed") == 2 * forward
    for name in ("central_b32", "peer_loop", "splitfed_fedavg", "splitfed_sl"):
        assert flops_per_sample(w, name) == 2 * (3 * forward - 28 * 28 * 6 * 25) == 2263920
    # MU-SplitFed at the default cut 2 (after the second pool, 16x5x5) and tau = 2
    client = 28 * 28 * 6 * 25 + 10 * 10 * 16 * 150
    assert flops_per_sample(w, "splitfed_musplitfed") == 2 * (3 * client + 6 * (forward - client))


def test_paper_run_times_both_runs_and_counts_evaluations():
    from benchmarks.paper_run import paper_run

    res = paper_run(rounds=2, log=lambda *a: None)
    assert res["runs"]["eval_every_round"]["evaluations"] == 3      # rounds 0, 1, 2
    assert res["runs"]["eval_last_only"]["evaluations"] == 2        # rounds 0 and 2
    assert res["ratio"] == round(res["median_wall_s"]["eval_every_round"]
                                 / res["median_wall_s"]["eval_last_only"], 3)
    # the runs differ by one evaluation (round 1): its time is the whole difference
    assert res["extra_evaluations"] == 1
    assert res["eval_s_per_round"] == round(res["median_wall_s"]["eval_every_round"]
                                            - res["median_wall_s"]["eval_last_only"], 4)


def test_a_peer_interpreter_that_cannot_run_is_a_reason_not_a_traceback(tmp_path):
    from benchmarks.peers import probe

    missing = tmp_path / "no-venv" / "bin" / "python"
    python, why = probe(str(missing), "print(1)", "make the environment first")
    assert python is None and why.startswith(f"cannot run {missing} (No such file")
    assert why.endswith("; make the environment first")
    here = tmp_path / "not-executable"
    here.write_text("")
    assert probe(str(here), "print(1)", "advice")[1].startswith(
        f"cannot run {here} (Permission denied)")


def test_deeper_models_run_at_a_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench("--clients", "2", "--local-steps", "1", "--batch", "4", "--repeats", "1",
                  "--threads", "1", "--model", "resnet18", "--width", "4", "--no-memory",
                  "--no-eval", "--no-peak", "--variants", "peer_loop,splitfed_fedavg,pfl_fedavg",
                  "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["workload"]["model"] == "resnet18" and report["workload"]["width"] == 4
    assert report["workload"]["input_shape"] == [3, 32, 32]
    assert report["results"]["splitfed_fedavg"]["x_peer"] > 0
    assert "skipped" in report["results"]["pfl_fedavg"]


def test_peer_scripts_run_in_their_own_interpreter(tmp_path, monkeypatch):
    # a stand-in for a peer simulator's script: reads the saved workload, writes its JSON
    from benchmarks.peers import probe, run_script

    (tmp_path / "fake_peer.py").write_text(
        "import argparse, json, torch\n"
        "ap = argparse.ArgumentParser()\n"
        "ap.add_argument('--data'); ap.add_argument('--out'); ap.add_argument('--fail')\n"
        "a = ap.parse_args()\n"
        "if a.fail: raise SystemExit('told to fail')\n"
        "w = torch.load(a.data)\n"
        "json.dump({'samples': len(w['y']), 'clients': w['clients']}, open(a.out, 'w'))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    w = Workload(clients=3, local_steps=2, batch=4)
    done = run_script(w, sys.executable, "fake_peer", [], tree_memory=True)
    assert done["result"] == {"samples": 24, "clients": 3}
    assert done["wall_s"] > 0 and done["peak_mb"] >= 0
    failed = run_script(w, sys.executable, "fake_peer", ["--fail", "1"])
    assert failed["error"].startswith("exit 1:") and "told to fail" in failed["error"]
    assert probe(sys.executable, "print(6 * 7)", "advice") == (sys.executable, "42")
    python, why = probe(sys.executable, "import no_such_module", "install it")
    assert python is None and "No module named 'no_such_module'" in why
    assert why.endswith("; install it")


def test_cohort_forward_warms_both_up_and_rotates_the_first(monkeypatch):
    """The cohort path's one-time plan is built outside the timings, and neither
    variant always runs first."""
    import torch.nn.functional as F

    from benchmarks import cohort_forward

    clients, batch, calls = 2, 3, []
    real = F.cross_entropy

    def spy(logits, target, *a, **k):     # a cohort step's loss has clients * batch rows
        calls.append("cohort" if len(logits) == clients * batch else "loop")
        return real(logits, target, *a, **k)

    monkeypatch.setattr(F, "cross_entropy", spy)
    rates = cohort_forward.run(clients=clients, batch=batch, steps=1, repeats=2)
    assert set(rates) == {"cohort", "loop"} and all(r > 0 for r in rates.values())
    loop = ["loop"] * clients                 # a loss per client, one step each
    #                 warm-up                  repeat 1                 repeat 2
    assert calls == ["cohort", *loop] + ["cohort", *loop] + [*loop, "cohort"]


def test_bit_identity_compare_with_an_unusable_file_is_a_usage_error(tmp_path):
    (tmp_path / "cases.json").write_text('{"fedavg": [1]}')     # a case that is a list
    for name, said in (("missing.json", "cannot read it ("),
                       ("cases.json", "not a file written by --save")):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.bit_identity", "--compare",
                               str(tmp_path / name)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and f"error: --compare {tmp_path / name}: {said}" in last
        assert "Traceback" not in proc.stderr and "cases" not in proc.stdout, name


def test_sl_overhead_probe_runs_and_restores_the_bookkeeping():
    from benchmarks import sl_overhead
    from splitfed.engine import split
    from splitfed.engine.clock import VirtualClock
    from splitfed.transport.ledger import Ledger

    real = (Ledger.record, VirtualClock.transfer, VirtualClock.charge, VirtualClock.replay_one)
    one_pass = split._joint_update
    res = sl_overhead.run(clients=2, local_steps=1, batch=8, repeats=1)
    assert set(res) == {"central", "split_loop", "splitfed_sl", "sl_no_accounting",
                        "sl_step_by_step", "sl_two_passes"}
    assert split._joint_update is one_pass
    assert all(v > 0 for v in res.values())
    assert (Ledger.record, VirtualClock.transfer, VirtualClock.charge,
            VirtualClock.replay_one) == real
    assert split.SETTLE_TURNS is True


def test_zo_chunks_probe_runs_and_restores_the_default_calls():
    from benchmarks import zo_chunks
    from splitfed.engine.stacked import ForwardCopies

    real = ForwardCopies._chunk
    times = zo_chunks.forward("lenet5", clients=16, batch=2, chunks=(0, 8), repeats=1)
    assert set(times) == {0, 8} and all(v > 0 for v in times.values())
    # 16 clients of 48 samples: two calls of 8 by default (about 512 samples per call)
    times, same = zo_chunks.musplitfed(clients=16, local_steps=1, batch=48, repeats=1)
    assert same and set(times) == {"default calls", "one call"}
    assert ForwardCopies._chunk is real
