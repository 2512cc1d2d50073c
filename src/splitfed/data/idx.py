"""IDX files (the MNIST format) and the MNIST / Fashion-MNIST loaders.

IDX layout, all integers big-endian: two zero bytes, a dtype code (0x08 = uint8, the only one
accepted here), the number of dimensions ``d``, then ``d`` uint32 sizes, then the
``prod(sizes)`` values in row-major order. A file may be plain or gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import math
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from splitfed.data.datasets import (
    ArrayDataset,
    DataBundle,
    check_regular,
    open_regular,
    find_file,
    labels_tensor,
    standardise,
    to_unit_float,
)
from splitfed.errors import DataError
from splitfed.limits import MAX_SAMPLES

FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
SYSTEM_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_LAYOUT = ("the four files train-images-idx3-ubyte, train-labels-idx1-ubyte, "
           "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (plain or .gz)")


#: the most data bytes an IDX file may declare, and a data set's four files together (1
#: GiB; MNIST's train images are 47 MB, EMNIST's largest split 550 MB): a header
#: declaring more is refused before anything is read or inflated
MAX_IDX_BYTES = 1 << 30
#: the most dimensions an IDX header may declare (images: 3, labels: 1; numpy takes 64)
MAX_IDX_DIMS = 16


@contextmanager
def _open(path: Path):
    """``path`` opened for reading (a regular file, :func:`open_regular`), inflated if it
    ends in ``.gz``."""
    with open_regular(path) as raw:
        if path.suffix != ".gz":
            yield raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as f:
            yield f


def _read_exactly(f, n: int) -> bytes:
    """Up to ``n`` bytes of ``f`` (fewer only at its end); never more."""
    parts, left = [], n
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_array(f, n: int) -> tuple[np.ndarray, int]:
    """A writable uint8 array of ``n`` bytes read from ``f`` straight into it (no chunk
    list to join, no copy), and how many bytes ``f`` had (fewer than ``n`` only at its
    end). The array is allocated before the read, but its pages take memory only as the
    data fills them, so a truncated file declaring much costs what it holds."""
    buf = np.empty(n, dtype=np.uint8)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got: got + min(n - got, 1 << 20)])
        if not k:
            break
        got += k
    return buf, got


def _parse_header(path: Path, f) -> tuple[tuple[int, ...], int]:
    """The dims and header length of the IDX stream ``f`` (read up to its data)."""
    head = _read_exactly(f, 4)
    if len(head) < 4:
        raise DataError(f"{path}: truncated IDX file ({len(head)} bytes, no header)")
    if head[0] != 0 or head[1] != 0:
        raise DataError(f"{path}: bad IDX magic number {head.hex()} (must start with 0000)")
    if head[2] != 0x08:
        raise DataError(f"{path}: IDX dtype code 0x{head[2]:02x}, expected 0x08 (uint8)")
    ndim = head[3]
    if ndim > MAX_IDX_DIMS:
        raise DataError(f"{path}: IDX header declares {ndim} dims; image and label files have "
                        f"at most {MAX_IDX_DIMS} (the file is corrupt or not an IDX file)")
    header = 4 + 4 * ndim
    raw = _read_exactly(f, 4 * ndim)
    if len(raw) < 4 * ndim:
        raise DataError(f"{path}: truncated IDX header ({ndim} dims need {header} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim))
    return dims, header


def idx_dims(path: Path) -> tuple[int, ...]:
    """The dims the header of the IDX file ``path`` declares (only the header is read);
    DataError naming the file if it is not a regular file or its header is malformed."""
    check_regular(path)
    try:
        with _open(path) as f:
            return _parse_header(path, f)[0]
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({e})") from e


def check_declared(paths: dict[str, tuple[Path, Path]], max_bytes: int | None = None,
                   max_samples: int | None = None) -> None:
    """The headers of a data set's IDX files (``{split: (images, labels)}``), read before
    any data: DataError naming the file that takes the data set past ``max_bytes`` data
    bytes (default :data:`MAX_IDX_BYTES`) or its images or labels past ``max_samples``
    samples (default :data:`~splitfed.limits.MAX_SAMPLES`), train and test together."""
    max_bytes = MAX_IDX_BYTES if max_bytes is None else int(max_bytes)
    max_samples = MAX_SAMPLES if max_samples is None else int(max_samples)
    total, samples = 0, [0, 0]
    for files in paths.values():
        for kind, path in enumerate(files):
            dims = idx_dims(path)
            total += math.prod(dims)
            samples[kind] += dims[0] if dims else 0
            if samples[kind] > max_samples:
                raise DataError(f"{path}: IDX dims {dims} make the data set's "
                                f"{('images', 'labels')[kind]} {samples[kind]} samples, more "
                                f"than the {max_samples} a data set may hold (train and test "
                                "together)")
            if total > max_bytes:
                raise DataError(f"{path}: IDX dims {dims} make the data set's files declare "
                                f"{total} data bytes, more than the {max_bytes} accepted "
                                "(all four files together)")


def read_idx(path: str | Path, max_bytes: int | None = None) -> np.ndarray:
    """The uint8 array stored in the IDX file ``path``; DataError naming the file if it is
    malformed or not a regular file.

    The header is read first: a file declaring more than ``max_bytes`` (default
    :data:`MAX_IDX_BYTES`) data bytes is refused before its data is read, and a gzip file
    is never inflated beyond the declared size plus one byte (a file holding more data
    than its header declares is refused, in a fraction of a second). Within the limit a few
    kilobytes of gzip may still declare up to ``max_bytes``: the data is read straight
    into one writable uint8 array, so reading costs the declared size once, and the
    loaders' float32 conversion (4 bytes a value) makes their peak about 5 times the
    declared size (the uint8 array and its float32 copy); labels become int64 (8 bytes a
    value), about 9 times a label file's declared size.
    """
    path = Path(path)
    limit = MAX_IDX_BYTES if max_bytes is None else int(max_bytes)
    check_regular(path)             # a pipe or a device is never opened
    try:
        with _open(path) as f:
            dims, header = _parse_header(path, f)
            expected = math.prod(dims)  # Python ints: no overflow for absurd header dims
            if expected > limit:
                raise DataError(f"{path}: IDX dims {dims} need {expected} data bytes, more "
                                f"than the {limit} accepted; the file is corrupt or not an "
                                "image/label file")
            if path.suffix != ".gz":
                size = path.stat().st_size - header
                if size != expected:
                    raise DataError(f"{path}: IDX dims {dims} need {expected} data bytes, "
                                    f"file has {size}")
            try:
                data, got = _read_array(f, expected)
            except MemoryError:
                raise DataError(f"{path}: IDX dims {dims} need {expected} data bytes, more "
                                "than this machine can allocate") from None
            extra = len(f.read(1)) if got == expected else 0
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    if got != expected or extra:
        has = f"{got}" if not extra else f"more than {expected}"
        raise DataError(f"{path}: IDX dims {dims} need {expected} data bytes, file has {has}")
    return data.reshape(dims)


def _read_split(img_path: Path, lbl_path: Path) -> tuple[np.ndarray, torch.Tensor]:
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3:
        raise DataError(f"{img_path}: expected 3 IDX dims [N, rows, cols], got {images.shape}")
    if labels.ndim != 1:
        raise DataError(f"{lbl_path}: expected 1 IDX dim [N], got {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{img_path} has {len(images)} images but {lbl_path} has {len(labels)}")
    if len(images) == 0 or min(images.shape[1:]) == 0:
        raise DataError(f"{img_path}: no image data (IDX dims {images.shape})")
    return images, labels_tensor(labels, 10, str(lbl_path))


def _load_idx_bundle(name: str, dirs: list[Path], how_to: str, classes) -> DataBundle:
    paths = {split: tuple(find_file(n, dirs, how_to, gz=True) for n in names)
             for split, names in FILES.items()}
    check_declared(paths)
    (xtr, ytr), (xte, yte) = (_read_split(*paths[s]) for s in ("train", "test"))
    if xtr.shape[1:] != xte.shape[1:]:
        raise DataError(f"{name}: train images {xtr.shape[1:]} but test images {xte.shape[1:]}")
    train_x = to_unit_float(xtr, 255.0).unsqueeze(1)
    test_x = to_unit_float(xte, 255.0).unsqueeze(1)
    standardise(train_x, test_x)
    train, test = ArrayDataset(train_x, ytr), ArrayDataset(test_x, yte)
    return DataBundle(name, train, test, 10, tuple(train_x.shape[1:]), classes)


def load_fashion_mnist(data_dir: str | None, rng: np.random.Generator) -> DataBundle:
    """Fashion-MNIST, [N, 1, 28, 28]; 60000 train / 10000 test images of 10 clothing classes.

    Looks in ``data_dir``, ``data_dir/fashion_mnist``, ``data_dir/fashion-mnist`` and
    ``data_dir/FashionMNIST/raw`` when ``data_dir`` is given, otherwise only in
    /usr/share/datasets/fashion-mnist (Debian package ``dataset-fashion-mnist``).
    """
    if data_dir is None:
        dirs = [SYSTEM_FASHION_DIR]
    else:
        base = Path(data_dir)
        dirs = [base, base / "fashion_mnist", base / "fashion-mnist", base / "FashionMNIST" / "raw"]
    how_to = ("Install it with `apt-get install dataset-fashion-mnist` (files land in "
              f"{SYSTEM_FASHION_DIR}) or put {_LAYOUT} into data_dir.")
    return _load_idx_bundle("fashion_mnist", dirs, how_to, list(FASHION_CLASSES))


def load_mnist(data_dir: str | None, rng: np.random.Generator) -> DataBundle:
    """MNIST digits, [N, 1, 28, 28].

    Looks in ``data_dir``, ``data_dir/mnist`` and ``data_dir/MNIST/raw``.
    """
    how_to = (f"Download the standard MNIST files and extract {_LAYOUT} into data_dir "
              "(or data_dir/mnist, data_dir/MNIST/raw).")
    if data_dir is None:
        raise DataError(f"mnist needs data_dir. {how_to}")
    base = Path(data_dir)
    dirs = [base, base / "mnist", base / "MNIST" / "raw"]
    return _load_idx_bundle("mnist", dirs, how_to, [str(d) for d in range(10)])
