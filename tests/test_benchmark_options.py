"""The throughput benchmark's options: a bad value is a one-line usage error naming the
option and what it takes, given before anything is built or timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench import interleaved, parse_args

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, said", [
    (["-C", "0"], "argument --clients/-C: expected a whole number >= 1, got '0'"),
    (["-K", "0"], "argument --local-steps/-K: expected a whole number >= 1, got '0'"),
    (["--batch", "0"], "argument --batch: expected a whole number >= 1, got '0'"),
    (["--repeats", "0"], "argument --repeats/-R: expected a whole number >= 1, got '0'"),
    (["--threads", "0"], "argument --threads: expected a whole number >= 1, got '0'"),
    (["--threads", "-1"], "argument --threads: expected a whole number >= 1, got '-1'"),
    (["--seed", "-1"], "argument --seed: expected a whole number >= 0, got '-1'"),
    (["--lr", "-1"], "argument --lr: expected a number > 0, got '-1'"),
    (["--eval-batch-size", "0"],
     "argument --eval-batch-size: expected a whole number >= 1, got '0'"),
    (["--flower-cpus", "0"], "argument --flower-cpus: expected a number > 0, got '0'"),
    (["--paper-run", "1"],
     "argument --paper-run: expected 0 (none) or a whole number of rounds >= 2, got '1'"),
    (["--scaling", "--scaling-clients", "0,10"],
     "argument --scaling-clients: expected comma-separated whole numbers >= 1, got '0,10'"),
    (["--scaling", "--scaling-clients", "2,4", "--scaling-samples", "100"],
     "--scaling-samples 100 is not a multiple of C * batch = 64 (C=2)"),
    (["--scaling", "-P", "8", "--scaling-clients", "2,10"],
     "--population 8 is below the largest of --scaling-clients, 10"),
    (["-P", "8", "-C", "10"], "--population 8 is below --clients 10"),
    (["-C", "100", "-K", "20", "--real"],
     "--real: P * K * batch = 64000 samples exceed Fashion-MNIST's 60,000 training images"),
    (["--model", "resnet18", "--real"],
     "--real: Fashion-MNIST's samples are 1x28x28; --model resnet18 takes 3x32x32"),
    (["--model", "lenet5", "--width", "2"],
     "--width 2: model: unknown option(s) ['width'] for model lenet5; allowed: none"),
    (["--variants", ","], "--variants: none given; one or more of central_b32, "),
])
def test_a_bad_option_is_a_usage_error_naming_it(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {said}" in last


def test_scaling_takes_a_population_of_its_largest_cohort_or_more(tmp_path):
    """--scaling ignores --clients: -P is checked against --scaling-clients only."""
    assert parse_args(["--scaling", "-P", "8", "--scaling-clients", "2,4"]).population == 8
    out = tmp_path / "scaling.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--scaling", "-P", "8",
         "--scaling-clients", "2,4", "--scaling-samples", "32", "--batch", "8",
         "--repeats", "1", "--threads", "1", "--variants", "central_b32", "--no-eval",
         "--no-peak", "--no-memory", "--quiet", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    blocks = json.loads(out.read_text())["scaling"]
    assert [(b["workload"]["clients"], b["workload"]["local_steps"],
             b["workload"]["population"]) for b in blocks] == [(2, 2, 8), (4, 1, 8)]


def test_nothing_to_interleave_times_nothing():
    """Only Flower or pfl, without the evaluation rows: no in-process row to time."""
    assert interleaved({}, 3) == {}
