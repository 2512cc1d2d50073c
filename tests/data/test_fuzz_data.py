"""Damaged data files: every loader answers with a DataError naming the file and the cause,
never with a numpy, pickle, gzip or torch exception. Byte streams are fuzzed (random
truncation points, random byte flips in IDX headers and gzip streams, random pickles)."""

from __future__ import annotations

import _codecs
import builtins
import codecs
import functools
import gzip
import os
import pathlib
import pickle
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tests.data.test_data_loaders import IDX_NAMES, dump, fake_cifar10, fake_idx, idx_bytes, write

import splitfed
from splitfed.cli import main
from splitfed.data import load_dataset, read_idx
from splitfed.data.cifar import read_pickle
from splitfed.data.datasets import labels_tensor
from splitfed.errors import DataError

FUZZ = settings(max_examples=int(os.environ.get("SPLITFED_FUZZ_EXAMPLES", "60")),
                deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SMALL = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
GOOD = idx_bytes(SMALL)  # 4 + 12 header bytes, 24 data bytes


def read_or_error(path):
    """read_idx's answer: an array, or a DataError that names the file."""
    try:
        return read_idx(path)
    except DataError as err:
        assert str(path) in str(err), str(err)
        return None


# ------------------------------------------------------------------------ IDX bytes


@FUZZ
@given(cut=st.integers(0, len(GOOD) - 1), gz=st.booleans())
def test_idx_truncated_anywhere(tmp_path, cut, gz):
    path = write(tmp_path / f"t{cut}", GOOD[:cut], gz)
    with pytest.raises(DataError) as err:
        read_idx(path)
    assert str(path) in str(err.value)
    assert any(w in str(err.value) for w in ("truncated", "need", "magic", "dims"))


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 255)), min_size=1,
                      max_size=3))
def test_idx_header_byte_flips(tmp_path, flips):
    data = bytearray(GOOD)
    for pos, mask in flips:
        data[pos] ^= mask
    assume(bytes(data) != GOOD)
    out = read_or_error(write(tmp_path / "flipped", bytes(data)))
    if out is not None:  # the flips left a consistent header: the payload is intact
        assert out.size == 24 and out.tobytes() == SMALL.tobytes()


@FUZZ
@given(data=st.binary(max_size=64))
def test_idx_random_bytes(tmp_path, data):
    out = read_or_error(write(tmp_path / "random", data))
    if out is not None:
        assert out.dtype == np.uint8 and data[:3] == b"\x00\x00\x08"


@FUZZ
@given(pos=st.integers(0, 200), mask=st.integers(1, 255))
def test_gzip_stream_byte_flips(tmp_path, pos, mask):
    packed = bytearray(gzip.compress(GOOD, mtime=0))
    pos %= len(packed)
    packed[pos] ^= mask
    path = tmp_path / "flipped.gz"
    path.write_bytes(bytes(packed))
    out = read_or_error(path)
    if out is not None:  # a flip in a field gzip ignores (flags, mtime, OS byte)
        assert out.tobytes() == SMALL.tobytes()


@pytest.mark.parametrize("packed,why", [
    (b"", "truncated IDX file"), (b"\x1f\x8b", "cannot read"), (b"plain text", "cannot read"),
    (gzip.compress(GOOD)[:-6], "cannot read"),  # truncated stream: no CRC/size trailer
])
def test_corrupt_gzip_names_the_file(tmp_path, packed, why):
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(packed)
    with pytest.raises(DataError, match=why) as err:
        read_idx(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("data,why", [
    (b"\x00\x00\x08\x00" + b"\x07", None),                            # 0-d: a scalar
    (b"\x00\x00\x0b\x01" + struct.pack(">I", 2) + b"\x00\x01\x00\x02", "dtype code 0x0b"),
    (b"\x00\x00\x08\x02" + struct.pack(">II", 2**32 - 1, 2**32 - 1) + b"ab", "need"),
    (b"\x00\x00\x08\x10" + b"\x00" * 8, "truncated IDX header"),
    (b"\x00\x00\x08\xff" + b"\x00" * 8, "declares 255 dims"),
    (b"\x08\x03\x00\x00", "magic"),
])
def test_idx_header_cases(tmp_path, data, why):
    path = write(tmp_path / "case", data)
    if why is None:
        assert read_idx(path).shape == ()
        return
    with pytest.raises(DataError, match=why):
        read_idx(path)


# ------------------------------------------------------------------- IDX loaders


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("missing", [name for pair in IDX_NAMES.values() for name in pair])
def test_missing_idx_file_is_named(tmp_path, gz, missing):
    fake_idx(tmp_path, gz)
    (tmp_path / (missing + (".gz" if gz else ""))).unlink()
    with pytest.raises(DataError) as err:
        load_dataset("mnist", str(tmp_path))
    msg = str(err.value)
    assert f"{missing!r} not found" in msg and str(tmp_path / missing) in msg


@FUZZ
@given(which=st.sampled_from([n for pair in IDX_NAMES.values() for n in pair]),
       frac=st.floats(0, 0.999), gz=st.booleans())
def test_loader_names_the_truncated_file(tmp_path_factory, which, frac, gz):
    folder = tmp_path_factory.mktemp("idx")
    fake_idx(folder, gz, n_train=20, n_test=10)
    path = folder / (which + (".gz" if gz else ""))
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    write(folder / which, raw[:int(frac * len(raw))], gz)
    with pytest.raises(DataError) as err:
        load_dataset("mnist", str(folder))
    assert str(path) in str(err.value)


@pytest.mark.parametrize("images,labels,why", [
    (np.zeros((5, 28), np.uint8), np.zeros(5), "3 IDX dims"),
    (np.zeros((5, 28, 28, 1), np.uint8), np.zeros(5), "3 IDX dims"),
    (np.zeros((5, 28, 28), np.uint8), np.zeros((5, 1)), "1 IDX dim"),
    (np.zeros((5, 28, 28), np.uint8), np.zeros(4), "5 images.*has 4"),
    (np.zeros((0, 28, 28), np.uint8), np.zeros(0), "no image data"),
    (np.zeros((5, 28, 28), np.uint8), np.array([0, 1, 2, 3, 10]), "out of range"),
    (np.zeros((5, 28, 28), np.uint8), np.array([0, 1, 2, 3, 255]), "out of range"),
])
def test_idx_loader_shape_and_label_checks(tmp_path, images, labels, why):
    fake_idx(tmp_path, gz=False, n_train=20, n_test=5)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(images))
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(labels))
    with pytest.raises(DataError, match=why) as err:
        load_dataset("mnist", str(tmp_path))
    assert "t10k-" in str(err.value)


def test_idx_train_and_test_image_sizes_must_agree(tmp_path):
    fake_idx(tmp_path, gz=False, n_train=20, n_test=5)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(np.zeros((5, 14, 14))))
    with pytest.raises(DataError, match="train images"):
        load_dataset("mnist", str(tmp_path))


# ----------------------------------------------------------------- CIFAR pickles


@pytest.fixture
def cifar_dir(tmp_path):
    fake_cifar10(tmp_path, n=3)
    return tmp_path


def bad_batch(cifar_dir):
    return cifar_dir / "cifar-10-batches-py" / "test_batch"


def load_cifar_error(cifar_dir, bad):
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", str(cifar_dir))
    assert str(bad) in str(err.value), str(err.value)
    return str(err.value)


VALID_TEST = pickle.dumps({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1, 2]},
                          protocol=3)


@FUZZ
@given(cut=st.integers(0, len(VALID_TEST) - 1))
def test_cifar_truncated_anywhere(tmp_path, cut):
    path = tmp_path / "batch"
    path.write_bytes(VALID_TEST[:cut])
    with pytest.raises(DataError, match="corrupt pickle|expected a pickled dict") as err:
        read_pickle(path)
    assert str(path) in str(err.value)


@FUZZ
@given(data=st.one_of(st.binary(max_size=80),
                      st.builds(lambda p, m, v: _flip(VALID_TEST, p, m),
                                st.integers(0, len(VALID_TEST) - 1), st.integers(1, 255),
                                st.none())))
def test_cifar_random_and_flipped_pickles(tmp_path, data):
    path = tmp_path / "batch"
    path.write_bytes(data)
    try:
        read_pickle(path)
    except DataError as err:
        assert str(path) in str(err)


def _flip(data: bytes, pos: int, mask: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


class _Evil:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("obj", [
    _Evil(os.system, "true"), _Evil(builtins.eval, "1+1"), _Evil(subprocess.call, ["true"]),
    _Evil(builtins.__import__, "os"), {b"data": _Evil(os.getcwd)},
])
def test_cifar_disallowed_globals_are_refused(tmp_path, obj):
    path = tmp_path / "evil"
    path.write_bytes(pickle.dumps(obj, protocol=2))
    with pytest.raises(DataError, match="refusing to load") as err:
        read_pickle(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("batch,why", [
    ("not a dict", "pickled dict"),
    ([1, 2, 3], "pickled dict"),
    ({"data": np.zeros((3, 3072), np.uint8), "labels": [0, 1, 2]}, "missing keys"),
    ({b"data": np.zeros((3, 3072), np.uint8), "labels": [0, 1, 2], 7: 1}, "missing keys"),
    ({b"data": np.zeros((3, 3072), np.uint8)}, r"missing keys \[b'labels'\]"),
    ({b"data": np.zeros((3, 3000), np.uint8), b"labels": [0, 1, 2]}, r"uint8 \[n, 3072\]"),
    ({b"data": np.zeros((3, 3, 1024), np.uint8), b"labels": [0, 1, 2]}, r"\[n, 3072\]"),
    ({b"data": np.zeros((3, 3072), np.float32), b"labels": [0, 1, 2]}, "uint8"),
    ({b"data": [[1, 2], [3]], b"labels": [0, 1]}, "b'data'"),
    ({b"data": None, b"labels": []}, "b'data'"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1]}, r"shape \(2,\)"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [[0], [1], [2]]},
     "a list of integers, one per image"),
    # a list of references to one row: a few bytes a row in the file, 24 kB each once
    # converted; refused before any conversion (the real files hold an array)
    ({b"data": [[7] * 3072] * 3, b"labels": [0, 1, 2]}, "b'data' must be a numpy array"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [[0] * 3072] * 3},
     "a list of integers"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, True, 2]}, "a list of integers"),
    ({b"data": np.zeros((3, 3072), np.uint8), (((b"k",),),): 1},
     "refusing a dict key of type tuple"),
    ({b"data": np.zeros((3, 3072), np.uint8), 10**30: 1}, "refusing an integer of 13 bytes"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1, 10]}, "out of range"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, -1, 2]}, "out of range"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1.5, 2]}, "integers"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": ["a", "b", "c"]}, "integers"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, [1, 2], 3]}, "labels"),
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": None}, "labels"),
    ({b"data": np.zeros((0, 3072), np.uint8), b"labels": []}, "no images"),
])
def test_cifar_malformed_batches(cifar_dir, batch, why):
    bad = bad_batch(cifar_dir)
    dump(bad, batch)
    msg = load_cifar_error(cifar_dir, bad)
    assert re.search(why, msg), msg


class _Dtype:
    """A pickle that builds numpy.dtype('u1') and then sets its state (pickle's BUILD:
    ``dtype.__setstate__``) to ``state``."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return np.dtype, ("u1", False, True), self.state


class _Array:
    """A pickle of an array as numpy writes it, with the dtype ``dt``."""

    def __init__(self, shape, dt, raw):
        self.args = shape, dt, raw

    def __reduce__(self):
        from numpy._core.multiarray import _reconstruct

        shape, dt, raw = self.args
        return _reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dt, False, raw)


@pytest.mark.parametrize("state, itemsize", [
    ((3, "|", None, ("a",), {"a": (np.dtype("u1"), 10**12)}, 1, 1, 0), 1),  # a far field
    ((3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 1), 8),      # an object field
])
def test_cifar_data_of_a_doctored_dtype_is_refused_in_one_line(cifar_dir, capfd, state,
                                                               itemsize):
    # a uint8 dtype with fields compares equal to uint8; numpy reports the object field
    # while it frees the array: both are refused, and nothing is printed
    bad = bad_batch(cifar_dir)
    raw = b"\x41" * (3 * 3072 * itemsize)
    dump(bad, {b"data": _Array((3, 3072), _Dtype(state), raw), b"labels": [0, 1, 2]})
    capfd.readouterr()
    msg = load_cifar_error(cifar_dir, bad)
    assert re.search("uint8 \\[n, 3072\\]|corrupt pickle", msg), msg
    assert capfd.readouterr().err == ""


class _DtypeWithState:
    """A pickle that builds numpy.dtype(``spec``) and then sets ``state`` on it."""

    def __init__(self, spec, state):
        self.spec, self.state = spec, state

    def __reduce__(self):
        return np.dtype, (self.spec, False, True), self.state


@pytest.mark.parametrize("dt", [
    # a 2-byte dtype whose field lies 1 GB past its items: reading one label would read
    # memory far outside the array
    _DtypeWithState("V2", (3, "|", None, ("a",), {"a": (np.dtype("i8"), 10**9)}, 2, 1, 16)),
    _DtypeWithState("V2", (3, "|", (np.dtype("u1"), (2,)), None, None, 2, 1, 0)),  # subarray
    _DtypeWithState("V2", (3, "|", None, None, None, 2, 1, 1)),    # flagged as holding objects
    _DtypeWithState("u1", (3, "|", None, None, None, 1 << 30, 1, 0)),   # another item size
    _DtypeWithState("i8,i8", None),                      # fields from a type string
    _DtypeWithState("(2,)u1", None),                     # a subarray from a type string
])
def test_cifar_labels_of_a_dtype_with_fields_are_refused_unread(tmp_path, dt):
    path = tmp_path / "batch"
    dump(path, {b"data": np.zeros((3, 3072), np.uint8),
                b"labels": _Array((5,), dt, b"\0" * 80)})
    with pytest.raises(DataError, match="corrupt pickle.*refusing numpy dtype") as err:
        read_pickle(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("order", ["<", ">", b"<", b">"])
def test_cifar_dtype_states_numpy_writes_are_read(tmp_path, order):
    """The state a plain dtype's pickle sets, as numpy writes it (text) and as Python 2
    pickles are read (bytes), in either byte order."""
    state = (3, order, None, None, None, -1, -1, 0)
    raw = np.arange(2, dtype=f"{order if isinstance(order, str) else order.decode()}i8")
    path = tmp_path / "batch"
    dump(path, {b"labels": _Array((2,), _DtypeWithState("i8", state), raw.tobytes())})
    assert read_pickle(path)[b"labels"].tolist() == [0, 1]


class _Strided:
    """numpy.ndarray called by the pickle itself: ``shape`` over a one-byte buffer with
    zero strides (a few hundred bytes of file for any number of images)."""

    def __init__(self, shape):
        self.shape = shape

    def __reduce__(self):
        return np.ndarray, (self.shape, np.dtype("u1"), b"\x00", 0, (0,) * len(self.shape))


@pytest.mark.parametrize("batch", [
    {b"data": _Strided((100_000, 3072)), b"labels": _Strided((100_000,))},
    {b"data": np.zeros((3, 3072), np.uint8), b"labels": _Strided((3,))},
    {b"data": _Strided((10**9, 3072)), b"labels": [0]},
])
def test_cifar_arrays_the_file_does_not_store_are_refused(cifar_dir, batch):
    """Only numpy's _reconstruct of an empty array (which the data then fills) is read;
    calling numpy.ndarray from the pickle is refused before anything is allocated."""
    bad = bad_batch(cifar_dir)
    dump(bad, batch)
    assert bad.stat().st_size < 10_000          # a few hundred bytes, or one real array
    msg = load_cifar_error(cifar_dir, bad)
    assert "refusing to call numpy.ndarray" in msg, msg


def test_an_array_larger_than_its_file_is_refused(tmp_path):
    """The loader's second guard: an array read from a pickle is no larger than the file
    and contiguous (a view repeating bytes is not data the file stores)."""
    from splitfed.data.cifar import _check_stored

    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    _check_stored(path, b"data", np.zeros((2, 50), np.uint8))
    with pytest.raises(DataError, match="declares 101 bytes of array in a file of 100 bytes"):
        _check_stored(path, b"data", np.zeros(101, np.uint8))
    view = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (4, 5), (0, 0))
    with pytest.raises(DataError, match="not an array the file stores"):
        _check_stored(path, b"labels", view)


@pytest.mark.parametrize("names", [[b"a"] * 3, 7, {b"x": 1}])
def test_cifar_meta_with_wrong_class_names(cifar_dir, names):
    meta = cifar_dir / "cifar-10-batches-py" / "batches.meta"
    dump(meta, {b"label_names": names})
    msg = load_cifar_error(cifar_dir, meta)
    assert "10 class names" in msg and "optional" in msg


def test_cifar_meta_names_that_are_not_text_are_refused(cifar_dir):
    meta = cifar_dir / "cifar-10-batches-py" / "batches.meta"
    dump(meta, {b"label_names": [b"a"] * 9 + [7]})
    msg = load_cifar_error(cifar_dir, meta)
    assert "class names as text" in msg and "optional" in msg
    # a list nested 10^5 deep (too deep for repr), written opcode by opcode: shown three
    # levels deep
    n = 100_000
    meta.write_bytes(b"\x80\x02}C\x0blabel_names" + b"]" * n + b"a" * (n - 1) + b"s.")
    msg = load_cifar_error(cifar_dir, meta)
    assert "got list [[[[...]]]];" in msg and "optional" in msg


def test_cifar_corrupt_meta_names_the_file(cifar_dir):
    meta = cifar_dir / "cifar-10-batches-py" / "batches.meta"
    meta.write_bytes(b"\x80\x03garbage")
    load_cifar_error(cifar_dir, meta)


def test_cifar100_coarse_labels_range(tmp_path):
    folder = tmp_path / "cifar-100-python"
    for split in ("train", "test"):
        dump(folder / split, {b"data": np.zeros((2, 3072), np.uint8),
                              b"fine_labels": [99, 0], b"coarse_labels": [20, 0]})
    assert load_dataset("cifar100", str(tmp_path)).num_classes == 100
    with pytest.raises(DataError, match="coarse_labels.*out of range") as err:
        load_dataset("cifar100", str(tmp_path), label_mode="coarse")
    assert str(folder / "train") in str(err.value)


def test_cifar_missing_batch_is_named(cifar_dir):
    (cifar_dir / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match="'data_batch_3' not found"):
        load_dataset("cifar10", str(cifar_dir))


def test_unreadable_path_is_a_data_error(tmp_path):
    (tmp_path / "cifar-10-batches-py" / "test_batch").mkdir(parents=True)
    with pytest.raises(DataError, match="test_batch"):
        read_pickle(tmp_path / "cifar-10-batches-py" / "test_batch")


# A hostile batch, opcode by opcode: the dict {key: 1}, the key pushed by ``key_ops``
def dict_with_key(key_ops: bytes) -> bytes:
    return b"\x80\x02}" + key_ops + b"K\x01s."


def dag_tuple(depth: int) -> bytes:
    """t = (t', t') ``depth`` times over, t' taken from the memo: 8 bytes a level, and
    2**depth tuples to visit to hash or print it."""
    return b")q\x00" + b"0h\x00h\x00\x86q\x00" * depth


_LOAD = """
import resource, sys, time
from splitfed.data import load_dataset
from splitfed.errors import DataError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    load_dataset("cifar10", sys.argv[1])
except DataError as e:
    print(e)
print(time.perf_counter() - start)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def load_cifar_in_subprocess(cifar_dir, bad, timeout=120):
    """load_dataset in a child process, so that a crash or a hang fails the test and not
    pytest: its one-line DataError (which must name ``bad``), the seconds the load took
    and how many MiB its peak memory grew by."""
    src = str(pathlib.Path(splitfed.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(cifar_dir)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    *msg, seconds, grew = proc.stdout.splitlines()
    assert len(msg) == 1 and str(bad) in msg[0], proc.stdout[:2000]
    return msg[0], float(seconds), float(grew)


def test_cifar_key_of_a_million_nested_tuples_is_refused(cifar_dir):
    """A 1 MB key ((((...)))) a million deep: hashing it would recurse in C and crash."""
    bad = bad_batch(cifar_dir)
    bad.write_bytes(dict_with_key(b")" + b"\x85" * 1_000_000))
    msg, _, _ = load_cifar_in_subprocess(cifar_dir, bad)
    assert "refusing a dict key of type tuple" in msg, msg


def test_cifar_huge_memo_index_costs_no_memory(cifar_dir):
    """9 bytes that store the dict at memo index 2**26 (LONG_BINPUT)."""
    bad = bad_batch(cifar_dir)
    bad.write_bytes(b"\x80\x02}r" + struct.pack("<I", 1 << 26) + b".")
    msg, seconds, grew = load_cifar_in_subprocess(cifar_dir, bad)
    assert "missing keys" in msg and grew < 100 and seconds < 5, (msg, seconds, grew)


@pytest.mark.parametrize("raw", [
    dict_with_key(dag_tuple(40)),                                       # the key
    b"\x80\x02}X\x04\x00\x00\x00datacnumpy\ndtype\n" + dag_tuple(40) + b"\x85Rs.",  # a dtype
])
def test_cifar_shared_nested_tuples_are_refused_at_once(cifar_dir, raw):
    """A few hundred bytes naming 2**40 tuples through the memo: refused without visiting
    them (hashed as a key, converted as a dtype, or printed in the message)."""
    bad = bad_batch(cifar_dir)
    bad.write_bytes(raw)
    assert len(raw) < 400
    msg, seconds, _ = load_cifar_in_subprocess(cifar_dir, bad)
    assert "refusing" in msg and seconds < 5, (msg, seconds)


@pytest.mark.parametrize("where, batch", [
    ("key", {b"labels": [0, 1, 2], 10**5000: 1}),
    ("labels", {b"data": np.zeros((3, 3072), np.uint8), b"labels": [10**5000, 0, 1]}),
    ("labels", {b"data": np.zeros((3, 3072), np.uint8), b"labels": [2**64, 0, 1]}),
    ("meta", {b"label_names": 10**5000}),
])
@pytest.mark.parametrize("protocol", [2, 3])
def test_cifar_big_integers_are_refused_in_one_line(cifar_dir, where, batch, protocol):
    """Integers too long to print (more than 4300 digits) or to be a label."""
    bad = cifar_dir / "cifar-10-batches-py" / ("batches.meta" if where == "meta" else "test_batch")
    bad.write_bytes(pickle.dumps(batch, protocol=protocol))
    msg = load_cifar_error(cifar_dir, bad)
    assert "\n" not in msg and len(msg) < 1000, msg


def test_cifar_error_lists_a_few_of_many_keys(cifar_dir):
    bad = bad_batch(cifar_dir)
    dump(bad, {i: 0 for i in range(100_000)})
    msg = load_cifar_error(cifar_dir, bad)
    assert "missing keys" in msg and "100000 keys" in msg and len(msg) < 1000, msg[:2000]


@pytest.mark.parametrize("raw, why", [
    (b"\x80\x04}\x8f(K\x01\x90\x85K\x01s.", "EMPTY_SET"),                 # a set in a key
    (b"\x80\x04}(K\x01\x91\x85K\x01s.", "FROZENSET"),
    (b"\x80\x02}X\x04\x00\x00\x00datacnumpy\ndtype\n)\x81s.", "NEWOBJ"),
    (b"\x80\x02}X\x04\x00\x00\x00data\x82\x01s.", "EXT1"),
    (b"\x80\x02}X\x04\x00\x00\x00dataU\x01xQs.", "BINPERSID"),
    (b"\x80\x02}X\x04\x00\x00\x00data\x8a\x09" + b"\x01" * 9 + b"s.", "integer"),
    (b"\x80\x02}X\x04\x00\x00\x00data]K\x01bs.", "BUILD"),               # list.__dict__
    (b"\x80\x02}X\x04\x00\x00\x00datacnumpy\ndtype\n]K\x01bs.", "BUILD"),  # state on a class
    (b"\x80\x02K\x01K\x02K\x03s.", "dict"),                          # SETITEM on an int
    (b"\x80\x02}X\x04\x00\x00\x00dataK\x01\x85K\x02as.", "append"),     # tuple.append
    (b"(dI" + b"9" * 30 + b"\nI1\ns.", "integer of 30 characters"),      # protocol 0 text
    (b"(dL" + b"9" * 5000 + b"L\nI1\ns.", "integer of 5000 characters"),
    # a length past the end of the file: refused before anything of that size is allocated
    (b"\x80\x05\x96" + struct.pack("<Q", 1 << 36) + b"x" * 100, "truncated"),
])
def test_cifar_constructs_no_batch_uses_are_refused(tmp_path, raw, why):
    path = tmp_path / "batch"
    path.write_bytes(raw)
    with pytest.raises(DataError, match="refusing|truncated") as err:
        read_pickle(path)
    assert str(path) in str(err.value) and why in str(err.value), str(err.value)


def test_cifar_memo_is_bounded(tmp_path):
    path = tmp_path / "batch"
    path.write_bytes(b"\x80\x02]" + b"r" + b"".join(struct.pack("<I", i) + b"r"
                                                     for i in range((1 << 20) + 1))[:-1] + b".")
    with pytest.raises(DataError, match="refusing more than 1048576 memo entries") as err:
        read_pickle(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_cifar_batches_of_every_protocol_are_read(tmp_path, protocol):
    batch = {b"batch_label": b"training batch 1 of 5", "str key": None, 7: 1.5,
             b"data": np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072),
             b"labels": [0, 9], b"filenames": [b"a.png", b"b.png"],
             b"big": [2**63 - 1, -2**63], b"arr": np.arange(3, dtype=np.int64)}
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    got = read_pickle(path)
    assert got.keys() == batch.keys() and got[b"labels"] == [0, 9]
    assert got[b"big"] == batch[b"big"] and got[b"filenames"] == batch[b"filenames"]
    np.testing.assert_array_equal(got[b"data"], batch[b"data"])
    np.testing.assert_array_equal(got[b"arr"], batch[b"arr"])


# --------------------------------------------------------------------------- labels


@FUZZ
@given(labels=st.lists(st.integers(-3, 12), max_size=20), k=st.integers(1, 10))
def test_labels_tensor_range(labels, k):
    y = np.array(labels, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() >= k):
        with pytest.raises(DataError, match=rf"src: labels out of range \[0, {k}\)"):
            labels_tensor(y, k, "src")
    else:
        assert labels_tensor(y, k, "src").tolist() == labels


def test_labels_tensor_error_quotes_a_bounded_preview():
    """A label too long to print (more than 4300 digits) is quoted by its size."""
    with pytest.raises(DataError, match=r"^src: labels must be integers.*<int of 16610 bits>"):
        labels_tensor([10**5000, 0], 10, "src")


@FUZZ
@given(n_img=st.integers(1, 6), n_lbl=st.integers(0, 6))
def test_image_label_count_mismatch(tmp_path_factory, n_img, n_lbl):
    assume(n_img != n_lbl)
    folder = tmp_path_factory.mktemp("count")
    fake_idx(folder, gz=False, n_train=10, n_test=5)
    write(folder / "train-images-idx3-ubyte", idx_bytes(np.zeros((n_img, 28, 28))))
    write(folder / "train-labels-idx1-ubyte", idx_bytes(np.zeros(n_lbl)))
    with pytest.raises(DataError, match=f"has {n_img} images but .* has {n_lbl}"):
        load_dataset("fashion_mnist", str(folder))


# ------------------------------------------------- compressed and pickled payloads

def gzip_bomb(path, header: bytes, zeros: int, chunk: int = 1 << 24):
    """A gzip file of ``header`` then ``zeros`` zero bytes, written cheaply: one chunk of
    zeros is compressed once (ending in a full flush, so the compressed chunk is
    self-contained) and its bytes repeated. The trailer's CRC is not computed: a reader
    that refuses the file in time never gets there."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = comp.compress(header) + comp.flush(zlib.Z_FULL_FLUSH)
    block = comp.compress(b"\0" * chunk) + comp.flush(zlib.Z_FULL_FLUSH)
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head)
        for _ in range(zeros // chunk):
            f.write(block)
        f.write(comp.compress(b"\0" * (zeros % chunk)) + comp.flush())
        f.write(struct.pack("<II", 0, (len(header) + zeros) & 0xFFFFFFFF))
    return path


def test_ten_gigabyte_gzip_bomb_is_refused_at_once(tmp_path):
    header = bytes([0, 0, 8, 3]) + struct.pack(">III", 60000, 28, 28)   # declares 47 MB
    path = gzip_bomb(tmp_path / "train-images-idx3-ubyte.gz", header, 10 * 2**30)
    assert path.stat().st_size < 20 * 2**20                              # 10 GiB of zeros
    t0 = time.process_time()
    with pytest.raises(DataError, match="more than 47040000") as err:
        read_idx(path)
    assert time.process_time() - t0 < 1.0
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_absurd_declared_size_is_refused_before_inflating(tmp_path):
    header = bytes([0, 0, 8, 3]) + struct.pack(">III", 2**32 - 1, 2**16, 2**16)
    path = gzip_bomb(tmp_path / "x-idx3-ubyte.gz", header, 2**30)
    t0 = time.process_time()
    with pytest.raises(DataError, match="more than the .* accepted") as err:
        read_idx(path)
    assert time.process_time() - t0 < 0.5
    assert str(path) in str(err.value)


@FUZZ
@given(declared=st.integers(0, 5000), actual=st.integers(0, 5000),
       limit=st.integers(0, 4000))
def test_gzip_never_inflates_past_the_declared_size(tmp_path, declared, actual, limit):
    """With a lowered limit: refused iff the header declares more than the limit or the
    stream holds other than the declared bytes; at most declared + 1 bytes are read."""
    header = bytes([0, 0, 8, 1]) + struct.pack(">I", declared)
    path = write(tmp_path / "bomb", header + b"\x07" * actual, gz=True)
    reads = []
    real_open = gzip.open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        read = f.read
        f.read = lambda n=-1: reads.append(len(chunk := read(n))) or chunk
        return f

    gzip.open = counting_open
    try:
        out = read_idx(path, max_bytes=limit)
    except DataError as err:
        assert str(path) in str(err) and "\n" not in str(err)
        assert declared > limit or declared != actual
        out = None
    finally:
        gzip.open = real_open
    assert sum(reads) <= len(header) + min(declared, limit) + 1
    if out is not None:
        assert declared <= limit and declared == actual and out.size == declared


def test_bomb_in_a_data_dir_through_the_cli(tmp_path, capsys):
    fake_idx(tmp_path / "data", gz=True, n_train=20, n_test=5)
    header = bytes([0, 0, 8, 3]) + struct.pack(">III", 20, 28, 28)
    bomb = gzip_bomb(tmp_path / "data" / "train-images-idx3-ubyte.gz", header, 2**30)
    out = tmp_path / "runs"
    code = main(["run", "quick_digits", "data.name=mnist", f"data.data_dir={tmp_path}/data",
                 "model.name=mlp", f"out_dir={out}", "progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(bomb) in err, err
    assert not out.exists()


MARKER = "splitfed-pickle-payload-ran"
_RECONSTRUCT = np.zeros(1).__reduce__()[0]      # numpy's _reconstruct, whatever its module

PAYLOADS = [
    (os.system, ("touch {marker}",)),
    (subprocess.call, (["touch", "{marker}"],)),
    (builtins.exec, ("open('{marker}', 'w').close()",)),
    (builtins.eval, ("open('{marker}', 'w')",)),
    (builtins.open, ("{marker}", "w")),
    (builtins.getattr, (builtins, "exec")),
    (builtins.__import__, ("os",)),
    (functools.partial, (os.system, "touch {marker}")),
    (pathlib.Path.touch, (pathlib.Path("{marker}"),)),
    (np.load, ("{marker}",)),
    (np.fromfile, ("{marker}",)),
    (shutil.rmtree, ("{marker}",)),
    (codecs.decode, (b"x\x9c\x03\x00\x00\x00\x00\x01", "zlib")),
    (_codecs.encode, ("abc", "rot13")),
    (_codecs.encode, ("abc", "zlib")),
    (_RECONSTRUCT, (np.ndarray, (10**12,), b"b")),
    (_RECONSTRUCT, (np.matrix, (0,), b"b")),
]


class _Payload:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _fill(args, marker):
    if isinstance(args, str):
        return args.format(marker=marker)
    if isinstance(args, pathlib.Path):
        return pathlib.Path(str(args).format(marker=marker))
    if isinstance(args, (list, tuple)):
        return type(args)(_fill(a, marker) for a in args)
    return args


@FUZZ
@given(payload=st.sampled_from(PAYLOADS), protocol=st.integers(2, 5),
       where=st.sampled_from(["top", "data", "labels", "nested", "key"]))
def test_pickle_payloads_are_refused_and_never_run(tmp_path, payload, protocol, where):
    marker = tmp_path / MARKER
    fn, args = payload
    evil = _Payload(fn, _fill(args, str(marker)))
    ok = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    obj = {"top": evil, "data": {**ok, b"data": evil}, "labels": {**ok, b"labels": [0, evil]},
           "nested": {**ok, b"extra": [{b"x": (evil,)}]},
           "key": {**ok, b"k": {1: evil}}}[where]
    path = tmp_path / "data_batch_1"
    try:
        raw = pickle.dumps(obj, protocol=protocol)
    except Exception:  # noqa: BLE001 - some callables cannot be pickled by reference
        assume(False)
    path.write_bytes(raw)
    with pytest.raises(DataError) as err:
        read_pickle(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg and "refusing" in msg, msg
    assert not marker.exists()


def test_pickle_larger_than_the_limit_is_refused(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(VALID_TEST)
    with pytest.raises(DataError, match="more than the 10 a CIFAR batch") as err:
        read_pickle(path, max_bytes=10)
    assert str(path) in str(err.value)


def test_real_array_pickles_still_load(tmp_path):
    for protocol in (2, 3, 4, 5):
        obj = {b"data": np.arange(3072 * 2, dtype=np.uint8).reshape(2, 3072) % 7,
               b"labels": [3, 4], b"filenames": [b"a.png", "b.png"],
               b"batch_label": "training batch 1 of 5", b"x": np.float64(2.5)}
        path = tmp_path / f"b{protocol}"
        path.write_bytes(pickle.dumps(obj, protocol=protocol))
        got = read_pickle(path)
        assert np.array_equal(got[b"data"], obj[b"data"]) and got[b"labels"] == [3, 4]


def test_text_files_beyond_the_limit_or_not_utf8(tmp_path, monkeypatch):
    from splitfed.data import text
    root = tmp_path / "sst2"
    root.mkdir()
    (root / "train.tsv").write_text("sentence\tlabel\nsome words\t1\n")
    (root / "dev.tsv").write_bytes(b"sentence\tlabel\ncaf\xe9\t0\n")
    with pytest.raises(DataError, match="not UTF-8") as err:
        load_dataset("sst2", str(root))
    assert str(root / "dev.tsv") in str(err.value)
    monkeypatch.setattr(text, "MAX_TEXT_BYTES", 10)
    with pytest.raises(DataError, match="more than the 10") as err:
        load_dataset("sst2", str(root))
    assert str(root / "train.tsv") in str(err.value)


@pytest.mark.parametrize("protocol", [2, 3, 5])
def test_cifar_batch_of_no_images_says_so(cifar_dir, protocol):
    """numpy pickles an empty array's data as ``bytes()`` under protocol 2."""
    for i in range(1, 6):
        path = cifar_dir / "cifar-10-batches-py" / f"data_batch_{i}"
        path.write_bytes(pickle.dumps({b"data": np.zeros((0, 3072), np.uint8),
                                       b"labels": []}, protocol=protocol))
    msg = load_cifar_error(cifar_dir, cifar_dir / "cifar-10-batches-py" / "data_batch_1")
    assert msg.endswith("no images (b'data' is empty)"), msg


def test_cifar_bytes_is_admitted_only_empty(tmp_path):
    path = tmp_path / "batch"
    path.write_bytes(b"\x80\x02c__builtin__\nbytes\nK\x05\x85R.")     # bytes(5)
    with pytest.raises(DataError, match=r"refusing bytes\(\) with arguments"):
        read_pickle(path)


def test_cifar_images_not_in_c_order_are_named_so(cifar_dir):
    bad = bad_batch(cifar_dir)
    dump(bad, {b"data": np.asfortranarray(np.zeros((3, 3072), np.uint8)), b"labels": [0, 1, 2]})
    msg = load_cifar_error(cifar_dir, bad)
    assert msg == f"{bad}: b'data' is not a C-contiguous array (rows one after another, as the " \
                  "real files store them); not an array the file stores", msg


@pytest.mark.parametrize("labels, found", [
    (np.full(3, 2**64 - 1, np.uint64), "min 18446744073709551615, max 18446744073709551615"),
    (np.array([0, 2**63, 1], np.uint64), "min 0, max 9223372036854775808"),
    (np.array([0, 1e20, 1]), "min 0.0, max 1e+20"),
])
def test_cifar_labels_out_of_range_are_reported_as_the_file_holds_them(cifar_dir, labels,
                                                                         found):
    bad = bad_batch(cifar_dir)
    dump(bad, {b"data": np.zeros((3, 3072), np.uint8), b"labels": labels})
    msg = load_cifar_error(cifar_dir, bad)
    assert msg.endswith(f"labels out of range [0, 10): found {found}"), msg
