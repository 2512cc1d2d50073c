"""The command line: run writes a complete run directory; list and partition print."""

import json

from splitfed.cli import main


def test_run_quick_digits_writes_run_dir(tmp_path, capsys):
    code = main(["run", "quick_digits", f"out_dir={tmp_path}", "progress=false", "rounds=2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "test accuracy" in out and "wall time" in out
    (run_dir,) = list(tmp_path.iterdir())
    for f in ("config.yaml", "partition.txt", "metrics.jsonl", "metrics.csv", "summary.json"):
        assert (run_dir / f).exists(), f
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 2]


def test_bad_config_writes_nothing(tmp_path, capsys):
    code = main(["run", "quick_digits", f"out_dir={tmp_path}", "model.cut=99"])
    err = capsys.readouterr().err
    assert code == 2 and "valid cuts" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_list_and_partition(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in ("fedavg", "centralized", "fashion_mnist", "lenet5", "dirichlet", "bernoulli"):
        assert word in out
    assert main(["partition", "quick_digits"]) == 0
    assert "client" in capsys.readouterr().out.lower()
