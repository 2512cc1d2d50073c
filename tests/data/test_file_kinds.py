"""A directory, a pipe or a device where a data file is expected: refused in one line
naming it as not a regular file, before it is opened (a pipe with no writer would block
the open for ever), never reported as missing nor silently skipped."""

import errno
import os
import threading
import time

import pytest

from splitfed.data import load_dataset
from splitfed.errors import DataError
from tests.data.test_data_loaders import IDX_NAMES, fake_cifar10, fake_idx

KINDS = {
    "directory": os.mkdir,
    "pipe": os.mkfifo,
    "device": lambda path: os.symlink(os.devnull, path),
}


def make(path, kind):
    if path.exists():
        path.unlink()
    KINDS[kind](path)


class PipeWriter:
    """Opens the pipe ``path`` for writing and closes it again, over and over until
    stopped: a reader blocked in its open is then let through (and reads nothing), so a
    loader that opens the pipe ends instead of waiting for ever."""

    def __init__(self, path):
        self.path, self.stop = path, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            try:
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as e:
                if e.errno not in (errno.ENXIO, errno.ENOENT):
                    return
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def refused(data_name, data_dir, path):
    with pytest.raises(DataError) as err:
        load_dataset(data_name, str(data_dir))
    msg = str(err.value)
    assert msg == f"{path}: not a regular file (a directory, a pipe, a socket or a device)" or (
        msg.startswith(f"{path}: not a regular file") and "optional" in msg), msg


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("gz", [False, True])
def test_idx_file_that_is_not_a_regular_file(tmp_path, kind, gz):
    fake_idx(tmp_path, gz=gz)
    path = tmp_path / (IDX_NAMES["test"][1] + (".gz" if gz else ""))
    make(path, kind)
    with PipeWriter(path):
        refused("mnist", tmp_path, path)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", ["data_batch_3", "test_batch", "batches.meta"])
def test_cifar_file_that_is_not_a_regular_file(tmp_path, kind, name):
    """The class names (batches.meta) are optional, but a pipe or a device in their place
    is refused as the batches are, not ignored."""
    fake_cifar10(tmp_path, n=3)
    path = tmp_path / "cifar-10-batches-py" / name
    make(path, kind)
    with PipeWriter(path):
        refused("cifar10", tmp_path, path)


def _sst2(tmp_path):
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / name).write_text("sentence\tlabel\ngood\t1\nbad\t0\n")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sst2_tsv_that_is_not_a_regular_file(tmp_path, kind):
    _sst2(tmp_path)
    path = tmp_path / "dev.tsv"
    make(path, kind)
    with PipeWriter(path):
        refused("sst2", tmp_path, path)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sst2_parquet_that_is_not_a_regular_file_is_never_opened(tmp_path, kind):
    """A pipe named like a parquet split would block pyarrow's open with no writer (and
    no signal would end the wait); it is refused before anything opens it."""
    _sst2(tmp_path)
    (tmp_path / "train.tsv").unlink()
    path = tmp_path / "train-00000-of-00001.parquet"
    make(path, kind)
    with PipeWriter(path):
        refused("sst2", tmp_path, path)


def test_readers_refuse_a_pipe_before_opening_it(tmp_path):
    from splitfed.data import read_idx
    from splitfed.data.cifar import read_pickle

    path = tmp_path / "pipe"
    os.mkfifo(path)
    for read in (read_idx, read_pickle):
        with PipeWriter(path), pytest.raises(DataError, match=f"^{path}: not a regular file"):
            read(path)


CHECKERS = ("splitfed.data.datasets", "splitfed.data.idx", "splitfed.data.cifar",
            "splitfed.data.text")


@pytest.mark.parametrize("data_name, name", [
    ("mnist", IDX_NAMES["test"][1]),
    ("mnist", IDX_NAMES["test"][1] + ".gz"),
    ("cifar10", "cifar-10-batches-py/test_batch"),
    ("sst2", "dev.tsv"),
    ("sst2", "train-00000-of-00001.parquet"),
])
def test_a_file_swapped_for_a_pipe_after_the_check_is_refused_when_opened(
        tmp_path, monkeypatch, data_name, name):
    """The check that looks at a path runs before the open; a path swapped for a pipe in
    between (the check is skipped here, as if the swap came right after it) is refused
    on what was opened, in the same line, not read as an empty file."""
    if data_name == "mnist":
        fake_idx(tmp_path, gz=name.endswith(".gz"))
    elif data_name == "cifar10":
        fake_cifar10(tmp_path, n=3)
    else:
        _sst2(tmp_path)
        if name.endswith(".parquet"):
            (tmp_path / "train.tsv").unlink()
    for module in CHECKERS:
        monkeypatch.setattr(f"{module}.check_regular", lambda path: None)
    path = tmp_path / name
    make(path, "pipe")
    with PipeWriter(path):
        refused(data_name, tmp_path, path)
