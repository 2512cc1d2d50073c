"""Every summary.json says what made it: code version and commit, libraries, threads,
CPU kernels and the command."""

import json
import subprocess
from pathlib import Path

import torch

import splitfed
from splitfed.config import build_config
from splitfed.experiment import run_experiment
from splitfed.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent


def test_provenance_of_a_run(tmp_path):
    cfg = build_config({"data": {"name": "synthetic"}, "model": {"name": "mlp"},
                        "partition": {"scheme": "natural", "num_clients": 30}, "rounds": 1,
                        "progress": False, "out_dir": str(tmp_path)})
    result = run_experiment(cfg)
    prov = json.loads((result.run_dir / "summary.json").read_text())["provenance"]
    assert prov["splitfed"] == splitfed.__version__
    assert prov["torch"] == torch.__version__
    assert prov["threads"] == torch.get_num_threads()
    assert prov["cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())
    assert prov["command"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if (ROOT / ".git").exists() and head.returncode == 0:
        assert prov["commit"] == head.stdout.strip() and isinstance(prov["dirty"], bool)
    else:
        assert prov["commit"] is None


def test_provenance_names_the_command():
    assert provenance(["/usr/bin/splitfed", "run", "x.yaml", "rounds=2"])["command"] == \
        "splitfed run x.yaml rounds=2"
