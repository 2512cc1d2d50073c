"""Run directories read back by ``splitfed results`` and ``splitfed plot``: a
``metrics.jsonl`` or ``summary.json`` that a run could not have written (a number beyond
the range of a float, a key twice, a round repeated, a summary of the wrong shape or
types) is one line naming the file (and line), before any table or figure is made."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from splitfed.cli import main
from splitfed.errors import FormatError
from splitfed.experiment import run_experiment
from splitfed.metrics import is_finite_number, loads_strict, read_records
from splitfed.results import load_rows, summary_rows
from tests.helpers import digits_config


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A real digits run of 2 rounds: records of rounds 0, 1, 2."""
    root = tmp_path_factory.mktemp("results_more")
    result = run_experiment(digits_config(), run_dir=root / "good")
    assert result.status == "completed"
    return result.run_dir


def _copy(good, tmp_path, name="run"):
    run = tmp_path / name
    shutil.copytree(good, run)
    return run


def _edit_line(run, n, edit):
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[n - 1] = edit(lines[n - 1])
    path.write_text("\n".join(lines) + "\n")


def _refused(capsys, args, *parts):
    """``splitfed ARGS`` exits 2 with one line holding every one of ``parts``."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("splitfed: error: "), err
    for part in parts:
        assert part in err, err
    return err


def _both_refuse(capsys, run, tmp_path, *parts):
    _refused(capsys, ["results", str(run), "--last"], *parts)
    _refused(capsys, ["results", str(run), "--format", "csv"], *parts)
    out = tmp_path / "acc.png"
    _refused(capsys, ["plot", str(run), "-o", str(out), "--x", "round,time,bytes"], *parts)
    assert not out.exists()


BAD_LINES = [
    # (line, edit, what the error says)
    (3, lambda s: s.replace('"bytes_up": ', '"bytes_up": 1e400, "x": ', 1),
     "line 3: the number 1e400 is beyond the range of a float"),
    (2, lambda s: s.replace('"sim_round_s": ', '"sim_round_s": -1e999, "x": ', 1),
     "line 2: the number -1e999 is beyond the range of a float"),
    (3, lambda s: s.replace('"bytes_up": ', f'"bytes_up": {10**400}, "x": ', 1),
     "line 3: the number 100000000000000000000000... is beyond the range of a float"),
    (3, lambda s: s.replace('"bytes_up": ', f'"bytes_up": {10**40}, "x": ', 1),
     "line 3 has bytes_up = 1000000000000000000000000000000000000...; a byte count is "
     "an integer 0..9223372036854775807"),
    (2, lambda s: s.replace('"bytes_down": ', '"bytes_down": -5, "x": ', 1),
     "line 2 has bytes_down = -5"),
    (2, lambda s: s.replace('"bytes_down": ', '"bytes_down": 1.5, "x": ', 1),
     "line 2 has bytes_down = 1.5"),
    (2, lambda s: s.replace('"bytes_up": ', '"bytes_up": Infinity, "x": ', 1),
     "line 2 has bytes_up = inf"),
    (2, lambda s: s.replace('"bytes_up/model": ', '"bytes_up/model": "many", "x": ', 1),
     "line 2 has bytes_up/model = many"),
    (1, lambda s: s.replace('"test_acc": ', '"test_acc": "0.5", "x": ', 1),
     "line 1 has test_acc = '0.5', not a number"),
    (1, lambda s: s.replace('"test_acc": ', '"test_acc": true, "x": ', 1),
     "line 1 has test_acc = 'True', not a number"),
    (2, lambda s: s.replace('"sim_time_s": ', '"sim_time_s": "abc", "x": ', 1),
     "line 2 has sim_time_s = 'abc', not a number"),
    (2, lambda s: s.replace('"train_loss": ', '"train_loss": [1], "x": ', 1),
     "line 2 has train_loss = '[1]', not a number"),
    (1, lambda s: s.replace('{"round": 0', '{"round": 0, "round": 1', 1),
     "line 1: the key 'round' appears twice in one object"),
    (2, lambda s: s.replace('"train_loss": ', '"test_acc": 0.5, "test_acc": ', 1),
     "line 2: the key 'test_acc' appears twice"),
    (3, lambda s: s.replace('"round": 2', '"round": 1', 1),
     "line 3 is of round 1, after round 1; rounds must increase"),
    (3, lambda s: s.replace('"round": 2', '"round": 0', 1),
     "line 3 is of round 0, after round 1"),
    (2, lambda s: s.replace('"round": 1', f'"round": {2**63}', 1),
     "line 2 has no round number (an integer 0..9223372036854775807)"),
]


@pytest.mark.parametrize("n, edit, says", BAD_LINES)
def test_a_metrics_line_a_run_cannot_write_is_refused(good, tmp_path, capsys, n, edit, says):
    run = _copy(good, tmp_path)
    _edit_line(run, n, edit)
    path = run / "metrics.jsonl"
    with pytest.raises(FormatError) as info:
        read_records(path)
    assert str(info.value).startswith(f"{path}: {says}"), str(info.value)
    _both_refuse(capsys, run, tmp_path, str(path), says)


def test_a_record_repeated_at_the_end_is_refused(good, tmp_path, capsys):
    run = _copy(good, tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[1]]) + "\n")    # round 1 again
    _both_refuse(capsys, run, tmp_path, f"{path}: line 4 is of round 1, after round 2")


def test_a_good_run_reads_as_before(good, tmp_path, capsys):
    """Rounds 0, 1, 2 with integer byte counts; the NaN and Infinity tokens of a
    diverged record (and in an algorithm's own fields) read back as floats."""
    records = read_records(good / "metrics.jsonl")
    assert [r["round"] for r in records] == [0, 1, 2]
    assert sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in records) == \
        summary_rows(good)[0]["bytes"]
    run = _copy(good, tmp_path)
    _edit_line(run, 3, lambda s: s.replace('"train_loss": ', '"train_loss": NaN, '
                                           '"extra": -Infinity, "x": ', 1))
    records = read_records(run / "metrics.jsonl")
    assert math.isnan(records[2]["train_loss"]) and records[2]["extra"] == -math.inf
    assert summary_rows(run)[0]["diverged_round"] == 2
    assert main(["results", str(run), "--last"]) == 0
    assert "completed (round 2)" in capsys.readouterr().out
    assert [r["round"] for r in load_rows(run)] == [0, 1, 2]


def _summary(run, edit):
    path = run / "summary.json"
    data = json.loads(path.read_text())
    path.write_text(edit(data) if callable(edit) else edit)
    return path


BAD_SUMMARIES = [
    ("[]", "not a summary file (a JSON array, not an object)"),
    ('"done"', "not a summary file (a JSON string, not an object)"),
    (lambda d: json.dumps({**d, "wall_time_s": "slow"}),
     'not a summary file (wall_time_s is "slow"; allowed: a finite number >= 0)'),
    (lambda d: json.dumps({**d, "wall_time_s": -1}),
     "wall_time_s is -1; allowed: a finite number >= 0"),
    (lambda d: json.dumps({**d, "wall_time_s": math.inf}),
     "wall_time_s is Infinity; allowed: a finite number >= 0"),
    (lambda d: json.dumps({**d, "status": 3}), "status is 3; allowed: text"),
    (lambda d: json.dumps({**d, "rounds": 2.5}),
     "rounds is 2.5; allowed: an integer >= 0 or null"),
    (lambda d: json.dumps({**d, "diverged_round": True}),
     "diverged_round is true; allowed: an integer >= 0 or null"),
    (lambda d: json.dumps({**d, "final_test_acc": "0.9"}),
     'final_test_acc is "0.9"; allowed: a number or null'),
    (lambda d: json.dumps({**d, "provenance": ["x"]}),
     'provenance is ["x"]; allowed: an object or null'),
    (lambda d: json.dumps({**d, "provenance": {**d["provenance"], "dirty": "no"}}),
     'provenance.dirty is "no"; allowed: true or false or null'),
    (lambda d: json.dumps({**d, "provenance": {**d["provenance"], "commit": 5}}),
     "provenance.commit is 5; allowed: text or null"),
    (lambda d: json.dumps(d)[:-1] + ', "status": "failed"}',
     "the key 'status' appears twice in one object"),
    (lambda d: json.dumps(d)[:-1] + ', "x": 1e400}',
     "the number 1e400 is beyond the range of a float"),
]


@pytest.mark.parametrize("edit, says", BAD_SUMMARIES)
def test_a_summary_a_run_cannot_write_is_refused(good, tmp_path, capsys, edit, says):
    run = _copy(good, tmp_path)
    path = _summary(run, edit)
    for args in (["results", str(run)], ["results", str(run), "--format", "csv"]):
        err = _refused(capsys, args, f"{path}: ", says, "the run directory is damaged")
        assert "slow" not in capsys.readouterr().out
    assert err


def test_a_summary_that_is_not_a_regular_file_is_refused(good, tmp_path, capsys):
    run = _copy(good, tmp_path)
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()
    _refused(capsys, ["results", str(run)], f"{run / 'summary.json'}: not a regular file")


def test_a_good_summary_with_nan_and_extra_keys_reads_as_written(good, tmp_path):
    run = _copy(good, tmp_path)
    _summary(run, lambda d: json.dumps({**d, "final_test_acc": math.nan, "custom": [1]}))
    row = load_rows(run, last=True)[0]
    assert row["status"] == "completed" and row["wall_time_s"] >= 0
    missing = _copy(good, tmp_path, "missing")
    (missing / "summary.json").unlink()
    assert load_rows(missing, last=True)[0]["status"] == "unfinished"


def test_loads_strict_and_is_finite_number():
    assert loads_strict('{"a": NaN, "b": [1, 2.5], "c": {"d": -Infinity}}')["b"] == [1, 2.5]
    for text, says in [('{"a": 1, "a": 1}', "appears twice"), ("[1e400]", "1e400"),
                       (str(10**309), "beyond the range"), ('{"a": {"b": 1, "b": 2}}',
                                                            "'b' appears twice")]:
        with pytest.raises(ValueError, match=says):
            loads_strict(text)
    assert is_finite_number(10**300) and not is_finite_number(10**400)
    assert not is_finite_number(math.inf) and not is_finite_number(True)


def test_times_adding_up_beyond_a_float_name_the_file_not_the_labels(good, tmp_path,
                                                                      capsys):
    run = _copy(good, tmp_path)
    for n in (2, 3):
        _edit_line(run, n, lambda s: s.replace('"sim_round_s": ',
                                               '"sim_round_s": 1.5e308, "x": ', 1))
    out = tmp_path / "acc.png"
    err = _refused(capsys, ["plot", str(run), "-o", str(out), "--x", "round,time"],
                   f"{run / 'metrics.jsonl'}: its cumulative times",
                   "cannot be drawn against time; draw against round, bytes (--x)")
    assert "$" not in err and not out.exists()
    assert main(["plot", str(run), "-o", str(out), "--x", "round,bytes"]) == 0


def test_a_drawing_error_points_at_the_math_only_when_there_is_math(good, tmp_path, capsys,
                                                                   monkeypatch):
    from matplotlib.figure import Figure

    def fail(self, *args, **kwargs):
        raise ValueError("boom")
    monkeypatch.setattr(Figure, "savefig", fail)
    out = tmp_path / "acc.png"
    err = _refused(capsys, ["plot", str(good), "-o", str(out)], "cannot draw the figure "
                   "(boom)")
    assert "$" not in err
    _refused(capsys, ["plot", str(good), "-o", str(out), "--label", "$x$"],
             "cannot draw the figure (boom); check the $...$ math in --label and --title")
    assert not out.exists()
