"""The communication ledger keeps, per round and transfer, only the clients that sent:
its memory and its saved state grow with the transfers made, never with the number of
clients times the rounds; every query equals the per-client sums of a dense table; a
checkpoint holds the sparse entries, resumes exactly, and a forged entry is refused."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from splitfed import safeio
from splitfed.checkpoint import CHECKPOINT, load_checkpoint
from splitfed.errors import FormatError
from splitfed.experiment import resume_experiment, run_experiment
from splitfed.transport.ledger import Ledger
from tests.helpers import assert_same_run, copy_run, digits_config, interrupt_round

SFL = [("model", "down"), ("activations", "up"), ("labels", "up"),
       ("activation_grads", "down"), ("model", "up")]


def _arrays(obj) -> list[np.ndarray]:
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        return [a for v in obj.values() for a in _arrays(v)]
    if isinstance(obj, (list, tuple)):
        return [a for v in obj for a in _arrays(v)]
    return []


def test_memory_and_saved_state_grow_with_the_clients_that_sent_not_with_all_clients():
    """100,000 clients, 5 of them in each of 60 rounds, 5 kinds of transfer: 1,500
    (client, transfer) entries. A dense vector per round and transfer would be 240 MB."""
    n, rounds, m = 100_000, 60, 5
    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ledger = Ledger(n)
        for t in range(1, rounds + 1):
            ledger.round = t
            ids = rng.choice(n, m, replace=False).astype(np.int64)
            for kind, direction in SFL:
                ledger.record(kind, direction, ids, 1000)
            for c in ids[:2]:                       # one client at a time, as SL does
                ledger.record("activations", "up", np.array([c], dtype=np.int64), 10)
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.reset_peak()
        state = ledger.state()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    entries = rounds * len(SFL) * m
    keys = rounds * len(SFL)
    # 16 bytes of arrays per entry, and a few hundred bytes of Python objects per key
    assert held < 16 * entries + 1500 * keys, held
    assert peak < held + 16 * entries + 1500 * keys, peak
    arrays = _arrays(state["rounds"])
    assert sum(a.nbytes for a in arrays) == 16 * entries
    assert len(safeio.dumps(state)) < 16 * entries + 400 * keys + 4096
    assert ledger.round_totals(7)["bytes_up/activations"] == m * 1000 + 2 * 10
    assert ledger.total() == entries * 1000 + rounds * 2 * 10


def _reference_check(ledger: Ledger, dense: dict, n: int, rounds) -> None:
    keys = {(k, d) for (_, k, d) in dense} | {("scalars", "up")}
    for t in rounds:
        expect = {"bytes_up": 0, "bytes_down": 0}
        for (r, k, d), arr in sorted(dense.items()):
            if r == t:
                expect[f"bytes_{d}/{k}"] = int(arr.sum())
                expect[f"bytes_{d}"] += int(arr.sum())
        assert ledger.round_totals(t) == expect, t
        for k, d in keys:
            got = ledger.per_client(t, k, d)
            want = dense.get((t, k, d), np.zeros(n, dtype=np.int64))
            assert got.dtype == np.int64 and np.array_equal(got, want), (t, k, d)
    for kind in (None, "model", "activations", "labels", "scalars"):
        for direction in (None, "up", "down"):
            want = sum(int(a.sum()) for (_, k, d), a in dense.items()
                       if kind in (None, k) and direction in (None, d))
            assert ledger.total(kind, direction) == want, (kind, direction)


def test_every_query_equals_a_dense_table_of_the_same_records():
    """Random records: the same round and transfer recorded many times (rounds revisited),
    a client repeated within a record, one client as an int64 array or a list, per-client
    byte counts, records of no client and of zero bytes."""
    n = 23
    rng = np.random.default_rng(5)
    ledger, dense = Ledger(n), {}
    kinds = [("model", "up"), ("model", "down"), ("activations", "up"), ("labels", "up")]
    for _ in range(400):
        t = int(rng.integers(0, 6))
        kind, direction = kinds[rng.integers(len(kinds))]
        how = rng.integers(5)
        if how == 0:                                # the one-client path
            ids = np.array([rng.integers(n)], dtype=np.int64)
            nbytes = int(rng.integers(0, 10 ** 12))
        elif how == 1:
            ids = [int(rng.integers(n))]
            nbytes = int(rng.integers(0, 1000))
        elif how == 2:                              # repeated ids, per-client bytes
            ids = rng.integers(0, n, size=int(rng.integers(0, 12)))
            nbytes = rng.integers(0, 1000, size=ids.size)
        elif how == 3:
            ids = rng.permutation(n)[:int(rng.integers(1, n))]
            nbytes = np.int64(rng.integers(0, 5))
        else:
            ids = np.zeros(0, dtype=np.int64)
            nbytes = 7
        ledger.round = t
        ledger.record(kind, direction, ids, nbytes)
        arr = dense.setdefault((t, kind, direction), np.zeros(n, dtype=np.int64))
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        np.add.at(arr, flat, np.broadcast_to(np.asarray(nbytes, dtype=np.int64), flat.shape))
    _reference_check(ledger, dense, n, range(8))
    state = ledger.state()
    for t, table in state["rounds"].items():
        for key, sent in table.items():
            ids, nbytes = sent["ids"], sent["bytes"]
            assert ids.dtype == nbytes.dtype == np.int64 and ids.shape == nbytes.shape
            assert (np.diff(ids) > 0).all(), (t, key)       # each client once, in order
            k, d = key.split("|")
            assert np.array_equal(nbytes, dense[(t, k, d)][ids])
    copy = Ledger(n)
    copy.load_state(safeio.loads(safeio.dumps(state)))
    _reference_check(copy, dense, n, range(8))
    state["rounds"][1][next(iter(state["rounds"][1]))]["bytes"][:] = -1
    _reference_check(ledger, dense, n, range(8))           # the state is a copy
    legacy = {"num_clients": n, "round": 5,                 # as checkpoints held it before
              "rounds": {t: {f"{k}|{d}": a.tolist() for (r, k, d), a in dense.items()
                             if r == t} for t in {r for r, _, _ in dense}}}
    old = Ledger(n)
    old.load_state(legacy)
    _reference_check(old, dense, n, range(8))


@pytest.mark.parametrize("ids", [[23], [-1], [0, 5, 23]])
def test_a_client_outside_the_run_is_refused(ids):
    ledger = Ledger(23)
    one = np.array(ids, dtype=np.int64) if len(ids) == 1 else ids
    with pytest.raises(IndexError, match="out of range for 23 clients"):
        ledger.record("model", "up", one, 4)
    assert ledger.total() == 0


# ------------------------------------------------------------------ checkpoints

SAMPLED = {"partition": {"scheme": "iid", "num_clients": 40},
           "participation": {"mode": "uniform", "clients_per_round": 3},
           "algorithm": {"name": "sflv1"},
           "model": {"name": "mlp", "hidden": [32, 16], "cut": 1}}


def _interrupted(run_dir: Path, monkeypatch) -> Path:
    from splitfed.errors import RunInterrupted

    cfg = digits_config(rounds=6, checkpoint_every=2, **SAMPLED)
    with monkeypatch.context() as m:
        interrupt_round(m, "sflv1", 5)
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, run_dir=run_dir)
    return run_dir


def _ledger_of(run_dir: Path) -> dict:
    return load_checkpoint(run_dir)["ledger"]


def _same_ledger(a: dict, b: dict) -> None:
    assert a["num_clients"] == b["num_clients"] and a["round"] == b["round"]
    assert a["rounds"].keys() == b["rounds"].keys()
    for t, table in a["rounds"].items():
        assert table.keys() == b["rounds"][t].keys(), t
        for key, sent in table.items():
            for part in ("ids", "bytes"):
                assert np.array_equal(sent[part], b["rounds"][t][key][part]), (t, key, part)


def test_a_checkpoint_holds_the_sampled_clients_and_a_resume_is_exact(tmp_path, monkeypatch):
    cfg = digits_config(rounds=6, checkpoint_every=2, **SAMPLED)
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    cut = _interrupted(tmp_path / "cut", monkeypatch)
    saved = _ledger_of(cut)
    assert saved["round"] == 4 and set(saved["rounds"]) == {1, 2, 3, 4}
    for table in saved["rounds"].values():
        assert {"activations|up", "model|down"} <= set(table)
        for sent in table.values():
            assert 1 <= sent["ids"].size <= 3               # the cohort, not 40 clients
    resumed = resume_experiment(cut)
    assert_same_run(full, resumed)
    _same_ledger(_ledger_of(tmp_path / "full"), _ledger_of(cut))


def test_a_checkpoint_with_every_clients_bytes_as_written_before_resumes(tmp_path,
                                                                         monkeypatch):
    cfg = digits_config(rounds=6, checkpoint_every=2, **SAMPLED)
    full = run_experiment(cfg, run_dir=tmp_path / "full")
    cut = _interrupted(tmp_path / "cut", monkeypatch)
    ckpt = load_checkpoint(cut)
    for table in ckpt["ledger"]["rounds"].values():
        for key, sent in table.items():
            every = np.zeros(40, dtype=np.int64)
            every[sent["ids"]] = sent["bytes"]
            table[key] = every.tolist()
    safeio.save(ckpt, cut / CHECKPOINT)
    assert_same_run(full, resume_experiment(cut))
    _same_ledger(_ledger_of(tmp_path / "full"), _ledger_of(cut))


def _entry(c: dict) -> dict:
    table = c["ledger"]["rounds"][2]
    return table["activations|up"]


FORGED = {
    "an id past the clients": (lambda e: e["ids"].__setitem__(-1, 40),
                               "are not distinct clients 0..39 in increasing order"),
    "a negative id": (lambda e: e["ids"].__setitem__(0, -1),
                      "are not distinct clients 0..39 in increasing order"),
    "a repeated id": (lambda e: e["ids"].__setitem__(1, e["ids"][0]),
                      "are not distinct clients 0..39 in increasing order"),
    "ids out of order": (lambda e: e.update(ids=e["ids"][::-1].copy(),
                                            bytes=e["bytes"][::-1].copy()),
                         "are not distinct clients 0..39 in increasing order"),
    "more ids than clients": (lambda e: e.update(ids=np.arange(41, dtype=np.int64),
                                                 bytes=np.ones(41, dtype=np.int64)),
                              "are not distinct clients 0..39 in increasing order"),
    "a negative byte count": (lambda e: e["bytes"].__setitem__(0, -5),
                              "has a negative byte count"),
    "lengths that differ": (lambda e: e.update(bytes=e["bytes"][:-1].copy()),
                            "ids and 2 byte counts"),
    "float bytes": (lambda e: e.update(bytes=e["bytes"].astype(np.float64)),
                    "not vectors of int64"),
    "a matrix of ids": (lambda e: e.update(ids=e["ids"].reshape(1, -1)),
                        "not vectors of int64"),
    "ids as a list": (lambda e: e.update(ids=e["ids"].tolist()), "not vectors of int64"),
    "no bytes": (lambda e: e.pop("bytes"), "does not hold the ids and bytes"),
    "an extra field": (lambda e: e.update(extra=1), "does not hold the ids and bytes"),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    mp = pytest.MonkeyPatch()
    try:
        return _interrupted(tmp_path_factory.mktemp("stopped") / "run", mp)
    finally:
        mp.undo()


@pytest.mark.parametrize("how", [*FORGED, "a transfer of no known kind", "a dense list"])
def test_a_forged_ledger_entry_is_refused_in_one_line(tmp_path, stopped, how):
    run_dir = copy_run(stopped, tmp_path / "run")
    ckpt = load_checkpoint(run_dir)
    assert _entry(ckpt)["ids"].size == 3
    if how == "a transfer of no known kind":
        ckpt["ledger"]["rounds"][2]["weights|up"] = _entry(ckpt)
        what = "has a key 'weights|up' that is not kind|direction"
    elif how == "a dense list":
        ckpt["ledger"]["rounds"][2]["activations|up"] = [1, 2, 3]
        what = "is not 40 byte counts"
    else:
        change, what = FORGED[how]
        change(_entry(ckpt))
    safeio.save(ckpt, run_dir / CHECKPOINT)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    with pytest.raises(FormatError) as info:
        resume_experiment(run_dir)
    lines = str(info.value).strip().splitlines()
    assert len(lines) == 1, lines
    assert str(run_dir / CHECKPOINT) in lines[0] and what in lines[0], lines[0]
    assert "not a valid splitfed checkpoint" in lines[0]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_chunks_of_a_cohort_add_up_as_one_record_of_them_all():
    # chunks in increasing order (appended), then the same chunks again and a chunk of
    # known clients out of order (added at their positions), then new clients in the
    # middle and a client twice (merged): every total is the per-client sum
    ledger = Ledger(num_clients=12)
    expected = np.zeros(12, dtype=np.int64)
    records = [([0, 1, 2], 5), ([3, 4], [1, 2]), ([7, 9], 3), ([0, 1, 2], 5),
               ([9, 3], [4, 6]), ([1, 7], 2), ([5, 6], 8), ([11, 11, 2], [1, 1, 1])]
    for ids, nbytes in records:
        ledger.record("activations", "up", np.asarray(ids, dtype=np.int64), nbytes)
        np.add.at(expected, ids, np.broadcast_to(np.asarray(nbytes), (len(ids),)))
    assert ledger.per_client(0, "activations", "up").tolist() == expected.tolist()
    state = ledger.state()["rounds"][0]["activations|up"]
    assert state["ids"].tolist() == np.flatnonzero(expected).tolist()


def test_a_chunk_starting_with_the_last_client_recorded_adds_to_it():
    """A sorted with_replacement cohort cut into chunks can put one client at the end of a
    chunk and the start of the next: its bytes add up, and the ledger keeps each client
    once (ids distinct and increasing, the module doc)."""
    ledger = Ledger(num_clients=5)
    ledger.record("activations", "up", np.array([0, 1, 2], dtype=np.int64), [10, 20, 30])
    ledger.record("activations", "up", np.array([2, 3], dtype=np.int64), [5, 7])
    ledger.record("activations", "up", np.array([2], dtype=np.int64), 1)    # one-client path
    assert ledger.per_client(0, "activations", "up").tolist() == [10, 20, 36, 7, 0]
    sent = ledger.state()["rounds"][0]["activations|up"]
    assert sent["ids"].tolist() == [0, 1, 2, 3] and sent["bytes"].tolist() == [10, 20, 36, 7]
    assert ledger.total("activations", "up") == 73


def test_one_client_after_a_merge_is_added_to_that_client():
    """The one-client fast path remembers where its client sits; a merge that inserts
    another client before it (a record naming a client twice) moves it, and the next
    record of that client still adds to it, not to whatever now sits at the old place."""
    ledger = Ledger(num_clients=5)
    one = np.array([3], dtype=np.int64)
    ledger.record("model", "up", one, 1)
    ledger.record("model", "up", np.array([1, 1], dtype=np.int64), [2, 2])     # merged
    ledger.record("model", "up", one, 4)
    assert ledger.per_client(0, "model", "up").tolist() == [0, 4, 0, 5, 0]
