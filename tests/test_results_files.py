"""What ``splitfed results`` and ``splitfed plot`` make of run directories that were
copied between systems, planted in a shared directory or named oddly: every file they
read is a bounded regular file, text that is not UTF-8 or holds control characters is
printed escaped on one line, each run is listed once however it is named, a CSV cell is
never a spreadsheet formula, and ``plot`` never replaces a file without ``--force``."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from splitfed import plot
from splitfed.cli import main
from splitfed.errors import FormatError
from splitfed.experiment import run_experiment
from splitfed.metrics import read_records
from splitfed.results import run_dirs
from tests.helpers import digits_config
from tests.test_results_more import _refused as _one_error

BIN = os.path.join(os.path.dirname(sys.executable), "splitfed")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("results_files")
    return run_experiment(digits_config(), run_dir=root / "good").run_dir


def _copy(good, where):
    shutil.copytree(good, where)
    return where


@pytest.mark.parametrize("kind", ["fifo", "dev zero", "not utf-8", "too large"])
def test_a_config_yaml_that_is_not_a_bounded_text_file_is_one_line(good, tmp_path, capsys,
                                                                   kind):
    run = _copy(good, tmp_path / "run")
    config = run / "config.yaml"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)                       # no writer: reading would block for ever
        what = "not a regular file"
    elif kind == "dev zero":
        config.symlink_to("/dev/zero")          # endless: reading would exhaust memory
        what = "not a regular file"
    elif kind == "not utf-8":
        config.write_bytes(b"name: \xff\xfe\n")
        what = "not UTF-8 text (byte 6"
    else:
        config.write_bytes(b"#" * (2 << 20))
        what = "bytes, more than the 1048576 allowed"
    t0 = time.monotonic()
    _one_error(capsys, ["results", str(run), "--last"], f"{config}: ", what)
    assert time.monotonic() - t0 < 30


def test_text_that_is_not_utf8_or_holds_controls_is_printed_escaped(good, tmp_path):
    root = tmp_path / "runs"
    latin = _copy(good, root / "caf\udce9")     # a name with the byte 0xe9 (Latin-1)
    (latin / "summary.json").write_text(json.dumps({"status": "\ud800"}))
    forged = _copy(good, root / "forged")
    (forged / "summary.json").write_text(json.dumps({"status": "done\nFAKE ROW\x1b[2J"}))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    for fmt in ("table", "csv"):
        proc = subprocess.run([BIN, "results", str(root), "--last", "--format", fmt],
                              capture_output=True, env=env, timeout=120)
        out = proc.stdout.decode("utf-8")
        assert proc.returncode == 0, proc.stderr
        assert "caf\\udce9" in out and "\\ud800" in out
        if fmt == "table":                     # one line a run, no escape sequence
            assert len(out.splitlines()) == 4 and "done\\nFAKE ROW\\x1b[2J" in out
            assert "\x1b" not in out
        else:                                  # data: the text as it is, quoted
            rows = list(csv.DictReader(io.StringIO(out)))
            assert {r["status"] for r in rows} == {"\\ud800", "done\nFAKE ROW\x1b[2J"}
    assert main(["plot", str(latin), "-o", str(tmp_path / "a.png")]) == 0
    assert main(["plot", str(forged), "-o", str(tmp_path / "b.png"), "--label",
                 "caf\udce9", "--title", "t\udce9"]) == 0


def test_an_error_about_a_path_stays_one_line(capsys, tmp_path):
    _one_error(capsys, ["results", str(tmp_path / "a\rb\x1bc")], "a\\rb\\x1bc")
    _one_error(capsys, ["results", ""], "an empty path")


def test_a_path_that_exists_is_taken_as_it_is_even_with_glob_characters(good, tmp_path):
    run = _copy(good, tmp_path / "exp[1]-x")
    assert run_dirs([str(run)]) == [run]
    assert run_dirs([str(tmp_path / "exp?1?-x")]) == [run]    # a pattern still globs


def test_each_run_is_listed_once_however_it_is_named(good, tmp_path, monkeypatch):
    root = tmp_path / "runs"
    run = _copy(good, root / "r1")
    (root / "latest").symlink_to("r1")
    (root / "self").symlink_to(".")             # a loop
    (root / "again").symlink_to(".")            # a second loop: a walk of 2^n paths
    monkeypatch.chdir(tmp_path)
    spellings = [str(run), "./runs/../runs/r1", "runs/latest", str(root / "**")]
    t0 = time.monotonic()
    assert run_dirs(spellings) == [run]
    assert run_dirs([str(root / "**")]) == [root / "r1"]
    assert run_dirs([str(root / "*")]) == [root / "r1"]
    assert time.monotonic() - t0 < 30


def test_csv_cells_are_never_spreadsheet_formulas(good, tmp_path, capsys):
    run = _copy(good, tmp_path / "=HYPERLINK(x)")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    last.update({"note": "@SUM(A1)", "nested": {"a": [1, 2]}, "run": "OTHER",
                 "status": "forged", "neg": -1.5, "=HYPERLINK(y)": 2})
    (run / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    (run / "summary.json").write_text(json.dumps({"status": "+1"}))
    assert main(["results", str(run), "--format", "csv", "--last"]) == 0
    (row,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert row["run"] == "'=HYPERLINK(x)" and row["run_dir"] == str(run)
    assert row["note"] == "'@SUM(A1)" and row["status"] == "'+1"
    assert row["nested"] == '{"a": [1, 2]}' and row["neg"] == "-1.5"
    assert row["'=HYPERLINK(y)"] == "2" and "=HYPERLINK(y)" not in row   # a column name


def test_a_run_with_no_record_yet_has_a_csv_row_as_it_has_a_table_row(good, tmp_path,
                                                                       capsys):
    run = _copy(good, tmp_path / "empty")
    (run / "metrics.jsonl").write_text("")
    (run / "summary.json").unlink()
    assert main(["results", str(run), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["run"], r["status"]) for r in rows] == [("empty", "unfinished")]


def test_records_are_lines_separated_by_newlines_only(good, tmp_path):
    run = _copy(good, tmp_path / "ff")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(lines[0] + "\x0c" + "\n".join(lines[1:]) + "\n")
    with pytest.raises(FormatError, match="line 1 is not a JSON record"):
        read_records(run / "metrics.jsonl")


def test_default_labels_are_drawn_as_plain_text(good, tmp_path, monkeypatch):
    labels = []
    monkeypatch.setattr(plot, "_save", lambda fig, out, force=False: labels.extend(
        t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()))
    runs = []
    for name in ("_hidden", "$\\bar$"):
        run = _copy(good, tmp_path / name)
        (run / "config.yaml").unlink()          # labelled by the directory's name
        runs.append(str(run))
    plot.plot_runs(runs, tmp_path / "x.png", axes=["round"])
    assert labels == [" _hidden", "\\$\\bar\\$"]


def test_plot_never_replaces_a_file_without_force(good, tmp_path, monkeypatch):
    out = tmp_path / "race.png"
    real = plot._save

    def meanwhile(fig, target, force=False):   # another process writes it while we draw
        target.write_bytes(b"theirs")
        return real(fig, target, force)

    monkeypatch.setattr(plot, "_save", meanwhile)
    with pytest.raises(Exception, match="written by another process while this plot was "
                                        "drawn; pass --force"):
        plot.plot_runs([good], out)
    assert out.read_bytes() == b"theirs"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".race")]
    plot.plot_runs([good], out, force=True)
    assert out.read_bytes() != b"theirs"


@pytest.mark.skipif(shutil.which("xelatex") is not None, reason="xelatex is installed")
def test_a_format_whose_tool_is_missing_is_one_line(good, tmp_path, capsys):
    _one_error(capsys, ["plot", str(good), "-o", str(tmp_path / "x.pgf")],
               "cannot write this format", "xelatex")
    assert list(tmp_path.iterdir()) == []


def test_results_and_plot_import_no_installed_plugin(good, tmp_path, monkeypatch, capsys):
    """They read run directories only: a broken installed plugin does not stop them."""
    from splitfed import registry
    from splitfed.errors import PluginError

    def broken():
        raise PluginError("plugin (entry point 'broken' of group splitfed.plugins) "
                          "'missing' cannot be imported")

    monkeypatch.setattr(registry, "load_entry_points", broken)
    assert main(["results", str(good), "--last"]) == 0
    assert main(["plot", str(good), "-o", str(tmp_path / "a.png")]) == 0
    capsys.readouterr()
    _one_error(capsys, ["list"], "entry point 'broken'")


def test_a_summary_records_its_plugins_digests_as_text(good, tmp_path, capsys):
    summary = json.loads((good / "summary.json").read_text())
    plugins = summary["provenance"]["plugins"]          # those this process imported
    assert isinstance(plugins, dict) and all(isinstance(v, str) for v in plugins.values())
    run = _copy(good, tmp_path / "run")
    summary["provenance"]["plugins"] = {"my_lab": "ab12"}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["results", str(run), "--last"]) == 0
    summary["provenance"]["plugins"] = {"my_lab": 3}
    (run / "summary.json").write_text(json.dumps(summary))
    capsys.readouterr()
    _one_error(capsys, ["results", str(run), "--last"], "provenance.plugins.my_lab is 3")


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_metrics_file_that_is_no_regular_file_is_named_as_such(tmp_path, capsys, kind):
    from splitfed.cli import main

    run = tmp_path / "r"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    if kind == "fifo":
        os.mkfifo(metrics)
    elif kind == "device":
        metrics.symlink_to("/dev/zero")
    else:
        metrics.mkdir()
    odd = "not a regular file (a directory, a pipe, a socket or a device)"
    for args, path in ((["results", str(run)], metrics), (["results", str(tmp_path)], metrics),
                       (["results", str(metrics)], metrics),
                       (["plot", str(run), "-o", str(tmp_path / "a.png")], metrics)):
        if kind == "directory" and args[1] == str(metrics):
            continue                        # a directory: searched for runs, holds none
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"splitfed: error: {path}: {odd}; "), err
        assert err.count("\n") == 1
    assert not (tmp_path / "a.png").exists()
