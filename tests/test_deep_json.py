"""JSON nested beyond ``MAX_JSON_DEPTH`` in a run directory's files (a ``metrics.jsonl``
line, ``summary.json``) is a damaged file: ``splitfed results``, ``splitfed plot`` and
``splitfed run --resume`` answer with one ``splitfed: error:`` line naming the file, as
for a torn line, and change nothing; the parser's stack is never exhausted."""

from __future__ import annotations

import shutil

import pytest

from splitfed.cli import main
from splitfed.metrics import read_records
from splitfed.safeio import MAX_JSON_DEPTH, loads_json

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-round digits run with a checkpoint."""
    out = tmp_path_factory.mktemp("deep") / "runs"
    assert main(["run", "quick_digits", "rounds=2", "checkpoint_every=1", "progress=false",
                 f"out_dir={out}"]) == 0
    (run_dir,) = out.iterdir()
    return run_dir


@pytest.fixture
def run_dir(finished, tmp_path):
    return shutil.copytree(finished, tmp_path / "run")


def snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def nested(depth: int) -> str:
    return "[" * (depth - 1) + "{}" + "]" * (depth - 1)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), err[-2000:]
    assert "Traceback" not in err and "RecursionError" not in err
    return lines[0]


def test_loads_json_bounds_the_depth():
    assert loads_json(nested(MAX_JSON_DEPTH)) is not None
    assert loads_json('{"round": 1, "x": [[1, 2], {"a": null}]}')["x"][1] == {"a": None}
    assert loads_json("3") == 3
    for text in (nested(MAX_JSON_DEPTH + 1), '{"a": ' + nested(MAX_JSON_DEPTH) + "}", DEEP,
                 '{"a": ' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
            loads_json(text)


@pytest.mark.parametrize("line", [DEEP, '{"round": 2, "x": ' + nested(MAX_JSON_DEPTH) + "}"])
def test_a_deep_metrics_line_is_a_damaged_file(run_dir, capsys, line):
    metrics = run_dir / "metrics.jsonl"
    kept = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*kept[:-1], line]) + "\n")
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=f"{metrics}: line {len(kept)} .*nested deeper"):
        read_records(metrics)
    for argv in (["results", str(run_dir)], ["plot", str(run_dir), "-o",
                                              str(run_dir.parent / "a.png")]):
        assert main(argv) == 2
        line_out = one_error_line(capsys)
        assert str(metrics) in line_out and "nested deeper" in line_out, line_out
    assert main(["run", "--resume", str(run_dir)]) == 2
    line_out = one_error_line(capsys)
    assert str(metrics) in line_out and "damaged" in line_out, line_out
    assert snapshot(run_dir) == before
    assert not (run_dir.parent / "a.png").exists()


def test_a_deep_summary_is_a_damaged_file(run_dir, capsys):
    summary = run_dir / "summary.json"
    summary.write_text('{"status": ' + DEEP + "}")
    assert main(["results", str(run_dir)]) == 2
    line = one_error_line(capsys)
    assert str(summary) in line and "nested deeper" in line, line
