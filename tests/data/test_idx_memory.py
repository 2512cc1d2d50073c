"""IDX data is read straight into one writable uint8 array: reading a file costs its
declared size (no chunks joined into a second copy), and the loaders' float conversion
needs no further uint8 copy."""

import gzip
import struct
import tracemalloc

import numpy as np
import pytest

from splitfed.data import read_idx
from splitfed.data import idx as idx_module
from splitfed.errors import DataError

MB = 1 << 20


def _header(dims):
    return b"\0\0\x08" + bytes([len(dims)]) + b"".join(struct.pack(">I", d) for d in dims)


def _write(path, dims, data: bytes):
    blob = _header(dims) + data
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(blob)
    else:
        path.write_bytes(blob)


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_read_idx_returns_a_writable_array_of_the_data(tmp_path, name):
    values = np.arange(2 * 3 * 4, dtype=np.uint8)
    _write(tmp_path / name, (2, 3, 4), values.tobytes())
    array = read_idx(tmp_path / name)
    assert array.flags.writeable and array.flags.c_contiguous
    np.testing.assert_array_equal(array, values.reshape(2, 3, 4))


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_reading_a_small_gzip_declaring_much_costs_its_declared_size_once(tmp_path, name):
    n = 16 * MB                                 # zeros: about 16 KB as gzip
    _write(tmp_path / name, (n // 784, 28, 28), bytes(n // 784 * 784))
    tracemalloc.start()
    try:
        array = read_idx(tmp_path / name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert array.nbytes == n // 784 * 784
    assert peak < n + 4 * MB        # joining chunks into bytes held two copies (2 n)


def test_a_truncated_gzip_is_refused_after_reading_what_it_holds(tmp_path):
    path = tmp_path / "images-idx3-ubyte.gz"
    _write(path, (100000, 28, 28), bytes(1000))
    with pytest.raises(DataError, match=r"need 78400000 data bytes, file has 1000$"):
        read_idx(path)


def test_an_allocation_the_machine_cannot_make_is_a_data_error(tmp_path, monkeypatch):
    path = tmp_path / "images-idx3-ubyte"
    _write(path, (2, 28, 28), bytes(2 * 784))

    def no_memory(shape, dtype=None):
        raise MemoryError

    monkeypatch.setattr(idx_module.np, "empty", no_memory)
    with pytest.raises(DataError, match=r"images-idx3-ubyte: IDX dims \(2, 28, 28\) need "
                                        r"1568 data bytes, more than this machine can"):
        read_idx(path)


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:118] . DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 4294967296 bytes")])
def test_a_data_set_larger_than_the_memory_is_one_line(monkeypatch, error):
    """Files within the limits may still declare more than this machine holds: the
    allocation that fails (numpy's MemoryError, torch's RuntimeError) is reported as
    the data set not fitting, not as a traceback."""
    from splitfed.data import load_dataset

    def loader(data_dir, rng):
        raise error

    from splitfed import registry
    monkeypatch.setitem(registry.registry("dataset"), "mnist", loader)
    with pytest.raises(DataError, match=r"^data\.name: this machine has not the memory to "
                                        r"load .*mnist.* its files declare more than fits$"):
        load_dataset("mnist", "/nowhere")


def test_a_loaders_other_runtime_error_is_not_taken_for_memory(monkeypatch):
    from splitfed import registry
    from splitfed.data import load_dataset

    def loader(data_dir, rng):
        raise RuntimeError("a bug")

    monkeypatch.setitem(registry.registry("dataset"), "mnist", loader)
    with pytest.raises(RuntimeError, match="a bug"):
        load_dataset("mnist", "/nowhere")


def _data_set(folder, train_images, test_images):
    """The four files of an IDX data set, headers only (the declared sizes are refused
    before any data is read): images of the dims given, labels of as many samples."""
    for (img, lbl), dims in ((("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                              train_images),
                             (("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
                              test_images)):
        _write(folder / (img + ".gz"), dims, b"")
        _write(folder / (lbl + ".gz"), dims[:1], b"")


def test_a_data_set_of_too_many_tiny_samples_is_refused_from_its_headers(tmp_path):
    """1x1 images take one byte each, but every sample costs tens of bytes of labels and
    index arrays: a data set's samples are bounded, train and test together."""
    from splitfed.data import load_dataset
    from splitfed.limits import MAX_SAMPLES

    _data_set(tmp_path, (MAX_SAMPLES, 1, 1), (1, 1, 1))
    with pytest.raises(DataError) as err:
        load_dataset("mnist", str(tmp_path))
    assert str(err.value) == (
        f"{tmp_path}/t10k-images-idx3-ubyte.gz: IDX dims (1, 1, 1) make the data set's "
        f"images {MAX_SAMPLES + 1} samples, more than the {MAX_SAMPLES} a data set may hold "
        "(train and test together)")


def test_a_data_set_whose_files_declare_too_much_together_is_refused(tmp_path):
    """Each file within the limit, the four together not."""
    _data_set(tmp_path, (600, 1000, 1000), (600, 1000, 1000))
    from splitfed.data import load_dataset

    with pytest.raises(DataError, match=r"^.*/t10k-images-idx3-ubyte.gz: IDX dims \(600, 1000, "
                                        r"1000\) make the data set's files declare 1200000600 "
                                        r"data bytes, more than the 1073741824 accepted"):
        load_dataset("mnist", str(tmp_path))


def test_a_partition_larger_than_the_memory_is_one_line(monkeypatch):
    from splitfed import experiment
    from splitfed.config import build_config
    from splitfed.rng import RandomStreams

    def no_memory(*args, **kwargs):
        raise MemoryError

    cfg = build_config({"name": "t", "data": {"name": "digits"},
                        "partition": {"scheme": "iid", "num_clients": 4}})
    bundle = experiment.load_data(cfg, RandomStreams(cfg.seed), experiment.torch.device("cpu"))
    monkeypatch.setattr(experiment, "partition", no_memory)
    with pytest.raises(DataError, match=r"^partition: this machine has not the memory to "
                                        r"partition the 1438 training samples of digits among "
                                        r"4 clients$"):
        experiment.client_data(cfg, bundle, RandomStreams(cfg.seed))
