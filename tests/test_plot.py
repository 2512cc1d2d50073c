"""``splitfed plot``: accuracy of runs against rounds and simulated time."""

from __future__ import annotations

import json
import math
import sys

import pytest
from helpers import digits_config

from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.experiment import run_experiment
from splitfed.plot import load_curves, plot_runs

matplotlib = pytest.importorskip("matplotlib")


def time_rel(rounds: int) -> float:
    """The relative deviation of a curve's time from the float64 sum of ``rounds`` round
    times: the curve keeps 12 significant digits (half a unit of the 12th: 5e-12), and a
    sum of ``rounds`` terms (or a telescoping one of differences of the clock's end
    times) rounds each term and each partial sum by at most eps64 / 2 of the total."""
    return 5e-12 + 2 * rounds * sys.float_info.epsilon


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
            assert t == pytest.approx(total, rel=time_rel(len(records)), abs=0)


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


def test_an_existing_output_is_kept_unless_forced(runs, tmp_path, capsys):
    out = tmp_path / "acc.png"
    out.write_bytes(b"keep me")
    assert main(["plot", str(runs[0]), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"splitfed: error: --out {out}: the file exists; pass --force to "
                   "overwrite it, or choose another --out\n")
    assert out.read_bytes() == b"keep me"
    assert main(["plot", str(runs[0]), "-o", str(out), "--force"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)      # not left private
    assert [p.name for p in tmp_path.iterdir()] == ["acc.png"]   # no temporary file left


def test_a_dangling_link_as_output_is_named_and_replaced_only_if_forced(runs, tmp_path,
                                                                        capsys):
    out = tmp_path / "acc.png"
    out.symlink_to(tmp_path / "gone" / "x.png")
    assert main(["plot", str(runs[0]), "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"splitfed: error: --out {out}: is a link to a file that does not exist; pass "
        "--force to replace the link, or choose another --out\n")
    assert out.is_symlink() and not (tmp_path / "gone").exists()
    assert main(["plot", str(runs[0]), "-o", str(out), "--force"]) == 0
    assert not out.is_symlink() and out.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["acc.png"]


@pytest.fixture
def bad_inputs(tmp_path):
    files = {"empty.jsonl": "", "torn.jsonl": '{"round": 0, "test_acc": 0.1}\n{"round": 1, "te',
             "list.jsonl": "[1, 2]\n", "noround.jsonl": '{"test_acc": 0.5}\n',
             "strround.jsonl": '{"round": "a", "test_acc": 0.5}\n',
             "inf.jsonl": '{"round": 1e400, "test_acc": 0.5}\n',
             "config.yaml": "algorithm: {name: fedavg}\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "dir_metrics" / "metrics.jsonl").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("arg, match", [
    ("missing", "no such metrics file"),
    ("dir_metrics", "metrics.jsonl: not a regular file"),
    ("config.yaml", "line 1 is not a JSON record"),
    ("empty.jsonl", "no evaluated round"),
    ("torn.jsonl", "line 2 is not a JSON record"),
    ("list.jsonl", "line 1 is not a JSON object"),
    ("noround.jsonl", "line 1 has no round number"),
    ("strround.jsonl", "line 1 has no round number"),
    ("inf.jsonl", "line 1 has no round number"),
    ("binary.jsonl", "not UTF-8"),
])
def test_bad_metrics_files_are_one_line_errors(bad_inputs, capsys, arg, match):
    code = main(["plot", str(bad_inputs / arg), "-o", str(bad_inputs / "out.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("splitfed: error: "), err
    assert match in err and str(bad_inputs / arg) in err
    assert not (bad_inputs / "out.png").exists()


@pytest.mark.parametrize("out, match", [
    ("acc.unknownext", "unknown image format '.unknownext'; end the name with .png, .pdf "
                       "or .svg"),
    ("acc", "unknown image format '(no suffix)'"),
    ("", "give an image file name"),
    ("missing/acc.png", "missing does not exist; create it first"),
    ("afile/acc.png", "afile is a file, not a directory"),
    ("adir.png", "is a directory"),
    ("/proc/acc.png", "cannot write it"),
])
def test_bad_outputs_are_one_line_errors(runs, tmp_path, monkeypatch, capsys, out, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir.png").mkdir()
    assert main(["plot", str(runs[0]), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("splitfed: error: ") and match in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir.png", "afile"]


def test_broken_math_in_a_label_is_a_one_line_error(runs, tmp_path, capsys):
    assert main(["plot", str(runs[0]), "--title", r"$\frac{$", "-o",
                 str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "check the $...$ math in --label and --title" in err
    assert main(["plot", str(runs[0]), "--label", r"$\alpha$", "-o",
                 str(tmp_path / "a.png")]) == 0                     # math is drawn
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


@pytest.mark.parametrize("label", ["", "  ", "_hidden"])
def test_a_label_the_legend_would_hide_is_refused(runs, tmp_path, capsys, label):
    assert main(["plot", str(runs[0]), "--label", label, "-o",
                 str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"splitfed: error: --label: {label!r}")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------- diverged runs


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    cfg = digits_config(rounds=6, out_dir=str(tmp_path_factory.mktemp("div")), name="big",
                        train={"batch_size": 8, "local_steps": 5, "local_epochs": None,
                               "lr": 1e10},
                        clock={"profile": "exponential", "mean": 1.0})
    result = run_experiment(cfg)
    assert result.status == "diverged"
    return result


def test_a_diverged_run_is_drawn_to_its_divergence_and_marked(runs, diverged, tmp_path,
                                                               monkeypatch):
    import splitfed.plot as plot

    n = diverged.diverged_round
    curves = load_curves([runs[1], diverged.run_dir])
    c = curves[1]
    assert curves[0]["diverged_round"] is None and curves[0]["diverged_at"] is None
    assert c["diverged_round"] == n and c["label"] == f"fedavg (diverged at round {n})"
    assert c["round"] == [r["round"] for r in diverged.records if "test_acc" in r]
    assert all(r < n for r in c["round"])
    at = c["diverged_at"]
    assert at["round"] == n and at["test_acc"] == c["test_acc"][-1]
    assert at["time_s"] == pytest.approx(diverged.records[-1]["sim_time_s"],
                                         rel=time_rel(len(diverged.records)), abs=0)
    assert at["bytes"] == sum(r.get("bytes_up", 0) + r.get("bytes_down", 0)
                              for r in diverged.records)
    figures = []
    monkeypatch.setattr(plot, "_save", lambda fig, out, force=False: figures.append(fig))
    plot_runs([runs[1], diverged.run_dir], tmp_path / "a.png", axes=["round", "time", "bytes"])
    (fig,) = figures
    for ax, x in zip(fig.axes, (at["round"], at["time_s"], at["bytes"] / 1e6)):
        marks = [line for line in ax.get_lines() if line.get_marker() == "x"]
        assert len(marks) == 1
        assert list(marks[0].get_xdata()) == [pytest.approx(x)]
        assert list(marks[0].get_ydata()) == [at["test_acc"]]
        line = next(li for li in ax.get_lines() if li.get_label() == c["label"])
        assert marks[0].get_color() == line.get_color()
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert c["label"] in legend
    monkeypatch.undo()
    out = plot_runs([diverged.run_dir], tmp_path / "d.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_curve_stops_at_the_first_divergence(tmp_path):
    """plot module doc: a diverged run is drawn up to its last evaluation before it
    diverged, the marker at the first non-finite round, even if records follow it."""
    run = tmp_path / "r"
    run.mkdir()
    records = [{"round": 0, "test_acc": 0.1},
               {"round": 1, "test_acc": 0.4, "train_loss": 1.0},
               {"round": 2, "test_acc": 0.1, "train_loss": math.nan},
               {"round": 3, "test_acc": 0.6, "train_loss": 1.0},
               {"round": 4, "test_acc": 0.1, "train_loss": math.inf}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (c,) = load_curves([run])
    assert c["round"] == [0, 1] and c["test_acc"] == [0.1, 0.4]
    assert c["diverged_round"] == 2 and c["diverged_at"]["round"] == 2


def test_a_run_with_only_its_initial_evaluation_has_a_wall_time_axis(tmp_path):
    """load_curves draws study.curve's points: time is simulated only when every round
    after round 0 records sim_round_s, and a run with no such round has none."""
    from splitfed.study import curve

    run = tmp_path / "r"
    run.mkdir()
    records = [{"round": 0, "test_acc": 0.1}]
    (run / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    (c,) = load_curves([run])
    assert c["time_kind"] == curve(records)["time_kind"] == "wall"
    assert c["time_s"] == [0.0]
