"""``splitfed plot``: accuracy of runs against rounds and simulated time."""

from __future__ import annotations

import json

import pytest
from helpers import digits_config

from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.experiment import run_experiment
from splitfed.plot import load_curves, plot_runs

matplotlib = pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    dirs = []
    for name in ("fedavg", "sflv1"):
        cfg = digits_config(algorithm={"name": name}, rounds=3, out_dir=str(out),
                            name=name, model={"name": "mlp", "hidden": [32], "cut": 1},
                            clock={"profile": "exponential", "mean": 1.0})
        dirs.append(run_experiment(cfg).run_dir)
    return dirs


def test_curves_follow_the_metrics(runs):
    curves = load_curves(runs)
    assert [c["label"] for c in curves] == ["fedavg", "sflv1"]
    for c, d in zip(curves, runs):
        records = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert c["round"] == [0, 1, 2, 3]
        assert c["test_acc"] == [r["test_acc"] for r in records]
        assert c["time_kind"] == "simulated"
        total = 0.0
        for r, t in zip(records[1:], c["time_s"][1:]):
            total += r["sim_round_s"]
            assert t == pytest.approx(total, abs=1e-6)


def test_plot_writes_a_figure(runs, tmp_path):
    out = plot_runs(runs, tmp_path / "acc.png", axes=["round", "time", "bytes"],
                    labels=["A", "B"], title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(runs[0]), str(runs[1] / "metrics.jsonl"),
                 "-o", str(tmp_path / "cli.svg")]) == 0
    assert (tmp_path / "cli.svg").read_text().lstrip().startswith("<?xml")


def test_clear_errors(runs, tmp_path, capsys):
    with pytest.raises(ConfigError, match="no such metrics file"):
        plot_runs([tmp_path / "nope"], tmp_path / "a.png")
    with pytest.raises(ConfigError, match="--x: unknown axis speed; allowed: round, time"):
        plot_runs(runs, tmp_path / "a.png", axes=["speed"])
    with pytest.raises(ConfigError, match="2 runs"):
        plot_runs(runs, tmp_path / "a.png", labels=["only one"])
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "no such metrics file" in capsys.readouterr().err
