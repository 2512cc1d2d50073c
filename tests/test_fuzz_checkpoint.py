"""Fuzzing the checkpoint loader: random bytes, truncations and bit flips of a real
checkpoint, and well-formed files (written with ``splitfed.safeio``) of a wrong
structure. Each is refused with a one-line :class:`~splitfed.errors.SplitfedError` by
``load_checkpoint`` and ``resume_experiment``, and the run directory is left as it was;
a bit flip that changes nothing the loader reads (zip padding) loads the original."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitfed import safeio
from splitfed.algorithms import get_algorithm
from splitfed.checkpoint import CHECKPOINT, load_checkpoint
from splitfed.errors import RunInterrupted, SplitfedError
from splitfed.experiment import resume_experiment, run_experiment
from tests.helpers import digits_config

FAST = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, bytes, dict[str, bytes], dict]:
    """A run interrupted in round 3 (checkpoint at round 2): its directory, checkpoint
    bytes, the bytes of its other files, and the loaded checkpoint."""
    run_dir = tmp_path_factory.mktemp("fuzz") / "run"
    cfg = digits_config(algorithm={"name": "scaffold"}, rounds=4, checkpoint_every=2,
                        participation={"mode": "uniform", "clients_per_round": 2},
                        clock={"profile": "exponential", "mean": 1.0})
    cls = get_algorithm("scaffold")
    original = cls.round
    mp = pytest.MonkeyPatch()

    def round_(self, env, state, t, cohort):
        if t == 3:
            raise KeyboardInterrupt
        return original(self, env, state, t, cohort)

    mp.setattr(cls, "round", round_)
    try:
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, run_dir=run_dir)
    finally:
        mp.undo()
    data = (run_dir / CHECKPOINT).read_bytes()
    others = files(run_dir)
    return run_dir, data, others, load_checkpoint(run_dir)


def files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())
            if p.is_file() and p.name != CHECKPOINT}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def refused(run_dir: Path, others: dict[str, bytes], *, by_loader: bool = True) -> str:
    """``resume_experiment`` (and ``load_checkpoint`` when ``by_loader``: the parts of a
    checkpoint that fit the run are checked on resume) refuse the checkpoint in
    ``run_dir`` with one line naming it, and nothing else in the directory changes."""
    path = str(run_dir / CHECKPOINT)
    msgs = []
    try:
        load_checkpoint(run_dir, rounds=4)
    except SplitfedError as e:
        msgs.append(str(e))
    else:
        assert not by_loader, "load_checkpoint accepted it"
    with pytest.raises(SplitfedError) as info:
        resume_experiment(run_dir)
    msgs.append(str(info.value))
    for msg in msgs:
        assert "\n" not in msg and path in msg and len(msg) < 1000, msg
    assert files(run_dir) == others
    return msgs[-1]


def write(run_dir: Path, data: bytes) -> None:
    (run_dir / CHECKPOINT).write_bytes(data)


@FAST
@given(data=st.binary(max_size=2048), zip_magic=st.booleans())
def test_random_bytes_are_refused(run, data, zip_magic):
    run_dir, _, others, _ = run
    write(run_dir, (b"PK\x03\x04" if zip_magic else b"") + data)
    refused(run_dir, others)


@FAST
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_checkpoints_are_refused(run, cut):
    run_dir, data, others, _ = run
    write(run_dir, data[:int(cut * len(data))])
    refused(run_dir, others)


@FAST
@given(flips=st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True),
                                st.integers(0, 7)), min_size=1, max_size=3))
def test_bit_flips_are_refused_or_change_nothing(run, flips):
    run_dir, data, others, original = run
    flipped = bytearray(data)
    for where, bit in flips:
        flipped[int(where * len(data))] ^= 1 << bit
    write(run_dir, bytes(flipped))
    try:
        loaded = load_checkpoint(run_dir, rounds=4)
    except SplitfedError as e:
        assert "\n" not in str(e) and str(run_dir / CHECKPOINT) in str(e)
        assert files(run_dir) == others
        return
    assert same(loaded, original), f"a flip at {flips} changed the checkpoint unnoticed"


# ------------------------------------------------------------------ wrong structures

PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.just(10**400) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8)
    | st.builds(lambda n, k: torch.zeros(n, dtype=[torch.float32, torch.int64,
                                                  torch.uint8][k]),
                st.integers(0, 5), st.integers(0, 2))
    | st.builds(lambda n: np.arange(n, dtype=np.float64), st.integers(0, 5)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=6) | st.integers(-3, 3), inner, max_size=3),
    max_leaves=8)


def _paths(obj, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, (list, tuple)) and len(obj) <= 8:
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _kind(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape))
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape)
    if isinstance(v, dict):
        return ("dict", frozenset(map(repr, v)))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, len(v))
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


#: collections whose entries vary from run to run (random streams created as a run
#: goes, the ledger's rounds and kinds of transfer): one entry fewer, or a well-formed
#: entry more, or an empty collection, is a valid checkpoint of another state, which
#: the loader cannot tell from this run's; such edits are not drawn
DYNAMIC = {("streams", "numpy"), ("streams", "torch"), ("ledger", "rounds")}


def _dynamic(path: tuple) -> bool:
    return path[:2] in DYNAMIC and len(path) <= 4


@st.composite
def mutations(draw, ckpt: dict):
    """A copy of ``ckpt`` with one part replaced by a value of another kind, removed,
    or with a key added."""
    paths = [p for p in _paths(ckpt) if p]
    path = draw(st.sampled_from(paths))
    mutated = copy.deepcopy(ckpt)
    parent = mutated
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    if isinstance(parent, tuple):
        return None
    actions = ["replace"]
    if isinstance(parent, dict) and not _dynamic(path[:-1]):
        actions += ["remove", "add"]
    action = draw(st.sampled_from(actions))
    if action == "remove":
        del parent[key]
    elif action == "add":
        new_key = draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in parent))
        parent[new_key] = draw(PLAIN)
    else:
        new = draw(PLAIN.filter(lambda v: _kind(v) != _kind(old)))
        if _dynamic(path) and isinstance(new, dict) and not new:
            return None
        parent[key] = new
    return mutated, (action, path)


@SLOW
@given(st.data())
def test_well_formed_but_wrong_checkpoints_are_refused(run, data):
    run_dir, _, others, original = run
    drawn = data.draw(mutations(original))
    if drawn is None:
        return
    mutated, how = drawn
    try:
        safeio.save(mutated, run_dir / CHECKPOINT)
    except TypeError:
        return                              # not writable as plain data: nothing to load
    assert refused(run_dir, others, by_loader=False), how


def test_the_original_checkpoint_is_accepted(run):
    """The fixture's checkpoint (what every case above starts from) does load."""
    run_dir, data, others, original = run
    write(run_dir, data)
    assert same(load_checkpoint(run_dir, rounds=4), original)
    buf = io.BytesIO()
    safeio.save(original, buf)
    write(run_dir, buf.getvalue())
    assert same(load_checkpoint(run_dir, rounds=4), original)
