"""Damaged data files: every loader answers with a DataError naming the file and the cause,
never with a numpy, pickle, gzip or torch exception. Byte streams are fuzzed (random
truncation points, random byte flips in IDX headers and gzip streams, random pickles)."""

from __future__ import annotations

import builtins
import gzip
import os
import pickle
import re
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_data_loaders import IDX_NAMES, dump, fake_cifar10, fake_idx, idx_bytes, write

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
    (b"\x00\x00\x08\xff" + b"\x00" * 8, "truncated IDX header"),
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
    ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [[0], [1], [2]]}, "one integer"),
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


@pytest.mark.parametrize("names", [[b"a"] * 3, 7, {b"x": 1}])
def test_cifar_meta_with_wrong_class_names(cifar_dir, names):
    meta = cifar_dir / "cifar-10-batches-py" / "batches.meta"
    dump(meta, {b"label_names": names})
    msg = load_cifar_error(cifar_dir, meta)
    assert "10 class names" in msg and "optional" in msg


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
