"""``splitfed results`` and ``splitfed plot`` read ``metrics.jsonl`` as a stream: the
memory they take is bounded by what they output, not by a dict per record (about 40
times the file's size), and a line longer than a record can be is one error."""

from __future__ import annotations

import gc
import io
import json
import tracemalloc

import pytest

import splitfed.metrics as metrics_mod
from splitfed.errors import FormatError
from splitfed.experiment import run_experiment
from splitfed.metrics import read_records
from splitfed.plot import load_curves
from splitfed.results import load_rows, print_table, summary_rows
from tests.helpers import copy_run, digits_config

#: records of a long run, shorter than the ones a real run writes (about 400 bytes): the
#: shorter the records, the larger a dict per record is against the file (here ~100 bytes
#: a line, 1.2 MB in all: tracemalloc makes reading slow, and the bounds below hold for
#: any length, the streamed ones better the longer the file)
ROUNDS = 12_000


def _record(i: int) -> dict:
    return {"round": i, "train_loss": round(1 / (i + 1), 6), "test_acc": round(i / ROUNDS, 6),
            "bytes_up": 1000 + i, "sim_round_s": 0.25}


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A real run directory (config.yaml, summary.json) whose metrics.jsonl holds
    ROUNDS short records, and its size; the functions measured have been run once on
    the real one, so that no first import counts."""
    root = tmp_path_factory.mktemp("memory")
    real = run_experiment(digits_config(rounds=1), run_dir=root / "real").run_dir
    run = copy_run(real, root / "long")
    with open(run / "metrics.jsonl", "w") as fh:
        fh.write("".join(json.dumps(_record(i)) + "\n" for i in range(ROUNDS)))
    summary_rows(real, last=True), summary_rows(real, last=False), load_curves([real])
    list(load_rows(real))
    return run, (run / "metrics.jsonl").stat().st_size


def _peak(f):
    """What ``f()`` returns and the most memory Python allocated while it ran (bytes)."""
    gc.collect()
    tracemalloc.start()
    try:
        out = f()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_last_round_of_each_run_takes_memory_independent_of_the_file(long_run):
    run, size = long_run
    assert size > 1 << 20
    (row,), peak = _peak(lambda: summary_rows(run, last=True))
    # a stream holds one 64 KiB piece of the file, one line and a few numbers per run
    # (about 160 KB in all, whatever the file's length): under a quarter of this file.
    # A dict per record took 8 to 9 times the file here (40 times for shorter records)
    assert peak < size / 4, (peak, size)
    assert row["round"] == ROUNDS - 1 and row["status"] == "completed"
    assert row["final_test_acc"] == _record(ROUNDS - 1)["test_acc"]
    assert row["best_test_acc"] == _record(ROUNDS - 1)["test_acc"]
    assert row["bytes"] == sum(1000 + i for i in range(ROUNDS))
    out = io.StringIO()
    print_table(run, "table", last=True, file=out)
    assert out.getvalue().splitlines()[2].split()[3] == str(ROUNDS - 1)


def test_every_round_takes_less_memory_than_the_file(long_run):
    run, size = long_run
    rows, peak = _peak(lambda: summary_rows(run, last=False))
    # five numbers a round packed in 9 bytes each (45 bytes, 50 with the arrays' spare
    # room; a line here is ~100 bytes), the dicts built when asked for: below the file
    assert peak < size, (peak, size)
    assert len(rows) == ROUNDS and rows[-1]["round"] == ROUNDS - 1
    assert rows[10]["bytes"] == sum(1000 + i for i in range(11))
    rows, peak = _peak(lambda: load_rows(run))
    # every field packed in 9 bytes and 12 more a record: a field takes at least 9 bytes
    # of the file here ("k": v, ), so the rows take less than the file (a dict per row
    # with the run's 40-odd columns took 22 times the file)
    assert peak < size, (peak, size)
    assert len(rows) == ROUNDS and rows[-1]["round"] == ROUNDS - 1
    record = {k: v for k, v in rows[123].items() if k in _record(123)}
    assert record == _record(123) and rows[123]["status"] == "completed"


def test_the_plot_keeps_only_the_points_it_draws(long_run):
    run, size = long_run
    (curve,), peak = _peak(lambda: load_curves([run]))
    # the points drawn, one per evaluated round: round, accuracy, bytes and time as
    # Python lists (about 150 bytes) and the simulated and measured times as arrays until
    # the last record says which is drawn (16): ~1.7 times a 100-byte line, under 3
    assert peak < 3 * size, (peak, size)
    assert len(curve["round"]) == ROUNDS and curve["time_kind"] == "simulated"
    assert curve["time_s"][-1] == pytest.approx(0.25 * ROUNDS)


def test_a_line_longer_than_a_record_can_be_is_one_error(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 0}\n{"round": 1, "x": "' + "a" * 200 + '"}\n{"round": 2}\n')
    monkeypatch.setattr(metrics_mod, "MAX_RECORD_BYTES", 100)
    with pytest.raises(FormatError) as info:
        read_records(path)
    assert str(info.value) == (f"{path}: line 2 is longer than the 100 bytes a record may "
                               "have; not a metrics file as splitfed writes it")
    # bytes that are not UTF-8, later in the file, are named first, as before
    path.write_bytes(path.read_bytes() + b'{"round": 3, "x": "\xff"}\n')
    with pytest.raises(FormatError, match=r"not UTF-8 text at byte 267\)$"):
        read_records(path)


def test_a_stream_names_the_same_fault_as_a_whole_read(tmp_path):
    from splitfed.metrics import iter_records

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"round": 0}\n{"round": 0}\n{"round": 1, "x": "\xe2\x82"}\n')
    for read in (read_records, lambda p: list(iter_records(p))):
        with pytest.raises(FormatError, match=r"not UTF-8 text at byte 45\)$"):
            read(path)
    path.write_bytes(b'{"round": 0}\n{"round": 0}\n')
    with pytest.raises(FormatError, match="line 2 is of round 0, after round 0"):
        read_records(path)
