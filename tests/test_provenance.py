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


def test_the_code_version_is_read_when_the_run_starts_not_when_it_ends(tmp_path,
                                                                        monkeypatch):
    """A checkout that changes while a run (or a study's worker) runs does not change the
    code version the run records (its commit, its files' digest): it is read as the run
    starts."""
    import splitfed.provenance as prov

    real = subprocess.run
    head = {"commit": "a" * 40}

    def fake(argv, *args, **kwargs):
        if argv[:1] == ["git"] and "rev-parse" in argv:
            return subprocess.CompletedProcess(argv, 0, head["commit"] + "\n", "")
        if argv[:1] == ["git"] and "status" in argv:
            return subprocess.CompletedProcess(argv, 0, "", "")
        return real(argv, *args, **kwargs)

    class Later:                 # the checkout moves on after the run has started
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            head["commit"] = "b" * 40
            head["files"] = "edited"
            return self.inner(*args, **kwargs)

    head["files"] = "imported"
    monkeypatch.setattr(prov.subprocess, "run", fake)
    monkeypatch.setattr(prov, "tree_digest", lambda root, *a: head["files"])
    prov.git_commit.cache_clear()
    prov.source_digest.cache_clear()
    try:
        import splitfed.experiment as experiment

        monkeypatch.setattr(experiment, "run_rounds", Later(experiment.run_rounds))
        cfg = build_config({"data": {"name": "digits"}, "rounds": 1, "progress": False,
                            "model": {"name": "mlp", "hidden": [8]},
                            "partition": {"num_clients": 2}})
        run_experiment(cfg, run_dir=tmp_path / "run")
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert head["commit"] == "b" * 40                 # it did move on
        assert summary["provenance"]["commit"] == "a" * 40
        assert summary["provenance"]["source"] == "imported"   # the files the run imported
    finally:
        prov.git_commit.cache_clear()
        prov.source_digest.cache_clear()


def test_the_source_digest_is_the_package_files():
    from splitfed.provenance import source_digest, tree_digest

    assert provenance([])["source"] == source_digest()
    assert len(source_digest()) == 64 and int(source_digest(), 16) >= 0
    assert tree_digest(Path(splitfed.__file__).resolve().parent) == source_digest()


def test_the_source_digest_follows_code_not_caches(tmp_path):
    from splitfed.provenance import tree_digest

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "c.yaml").write_text("k: v\n")
    first = tree_digest(pkg)
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (pkg / "notes.txt").write_text("not code")
    assert tree_digest(pkg) == first                       # caches and other files: no
    (pkg / "a.py").write_text("x = 2\n")
    assert tree_digest(pkg) != first                       # a code change: yes
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "c.yaml").rename(pkg / "c.yaml")
    assert tree_digest(pkg) != first                       # a moved file: yes
