"""Tests for the data loaders (IDX, CIFAR pickles, digits, synthetic) and the registry."""

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_float_close

from splitfed.data import DATASETS, dataset_names, load_dataset, read_idx
from splitfed.data.datasets import ArrayDataset
from splitfed.errors import ConfigError, DataError

IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(arr: np.ndarray, dtype_code: int = 0x08) -> bytes:
    """Encode ``arr`` in the IDX format: 0, 0, dtype code, ndim, big-endian uint32 dims, data."""
    head = bytes([0, 0, dtype_code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def write(path: Path, data: bytes, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def fake_idx(folder: Path, gz: bool, n_train=40, n_test=15, seed=0):
    """Write the four IDX files; return the raw arrays."""
    g = np.random.default_rng(seed)
    raw = {"train": (g.integers(0, 256, (n_train, 28, 28)), np.arange(n_train) % 10),
           "test": (g.integers(0, 256, (n_test, 28, 28)), g.integers(0, 10, n_test))}
    for split, (img_name, lbl_name) in IDX_NAMES.items():
        write(folder / img_name, idx_bytes(raw[split][0]), gz)
        write(folder / lbl_name, idx_bytes(raw[split][1]), gz)
    return raw


def expected_norm(train_raw, raw, scale=255.0):
    """Per-channel standardisation with the train mean/std, computed in float64."""
    tr = np.asarray(train_raw, np.float64) / scale
    axes = (0,) + tuple(range(2, tr.ndim))
    mean, std = tr.mean(axes, keepdims=True), tr.std(axes, keepdims=True)
    return (np.asarray(raw, np.float64) / scale - mean) / std


def standardise_bound(train_raw, raw, scale=255.0):
    """The float32 rounding error of ``expected_norm(train_raw, raw, scale)``.

    The loader computes u = x / scale and x' = (u - m) / s in float32, m and s the mean and
    the population std of a channel's n train values. Each elementwise operation rounds by
    at most eps/2 relative: u by eps/2 |u|, u - m by eps/2 |u - m| <= eps/2 (|u| + |m|),
    the quotient by eps/2 |x'|. The mean and the variance are sums of n non-negative terms,
    so a pairwise or blocked reduction leaves a relative error of at most eps log2(n) (less
    where it accumulates in float64), the std half the variance's plus its own rounding.
    Errors of u, u - m and m divide by s, relative errors of s and of the quotient multiply
    |x'|:

        |x'_32 - x'| <= eps (2 + log2 n) (max|u| / s + max|x'|).

    A wrong statistic is well above it: the sample std (n - 1) instead of the population
    std scales x' by 1 - 1/2n, a change of max|x'| / 2n, several times this bound at the n
    of these tests, and the test split's own statistics change x' by O(1).
    """
    tr = np.asarray(train_raw, np.float64) / scale
    n = tr.size // tr.shape[1]
    axes = (0,) + tuple(range(2, tr.ndim))
    m, s = tr.mean(axes), tr.std(axes)
    u = np.asarray(raw, np.float64) / scale
    lo, hi = u.min(axes), u.max(axes)
    u_max = np.maximum(np.abs(lo), np.abs(hi))
    x_max = np.maximum(np.abs(lo - m), np.abs(hi - m)) / s
    return standardise_error(n, np.max(u_max / s), np.max(x_max))


def standardise_error(n, u_over_s, x_max):
    """eps32 (2 + log2 n) (max|u| / s + max|x'|): see :func:`standardise_bound`."""
    return float(np.finfo(np.float32).eps) * (2 + np.log2(n)) * float(u_over_s + x_max)


def assert_standardised(got, train_raw, raw, scale=255.0):
    """``got`` is ``raw`` standardised with the statistics of ``train_raw``, within the
    float32 rounding of :func:`standardise_bound`."""
    want = expected_norm(train_raw, raw, scale)
    dev = np.abs(np.asarray(got, np.float64) - want).max()
    bound = standardise_bound(train_raw, raw, scale)
    assert dev <= bound, f"max|x' - expected| = {dev:.3g} > {bound:.3g}"


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name,sub", [("fashion_mnist", ""), ("fashion_mnist", "FashionMNIST/raw"),
                                      ("mnist", "mnist"), ("mnist", "MNIST/raw")])
def test_idx_loader_round_trip(tmp_path, gz, name, sub):
    raw = fake_idx(tmp_path / sub, gz)
    b = load_dataset(name, str(tmp_path))
    assert b.input_shape == (1, 28, 28) and b.num_classes == 10 and len(b.classes) == 10
    xtr = raw["train"][0]
    for split, ds in (("train", b.train), ("test", b.test)):
        x, y = raw[split]
        assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
        assert ds.x.shape == (len(x), 1, 28, 28)
        assert np.array_equal(ds.y.numpy(), y)
        assert_standardised(ds.x.numpy(), xtr[:, None], x[:, None])
    # the exact train mean is 0 and std 1; the float32 ones are off by the elementwise
    # rounding of standardise_bound plus the reductions' own (eps log2 n max|x'|, smaller)
    bound = 2 * standardise_bound(xtr[:, None], xtr[:, None])
    assert abs(b.train.x.mean().item()) <= bound
    assert abs(b.train.x.std(correction=0).item() - 1) <= bound


def test_fashion_class_names(tmp_path):
    fake_idx(tmp_path, gz=True)
    b = load_dataset("fashion-mnist", str(tmp_path))
    assert b.name == "fashion_mnist"
    assert b.classes[0] == "T-shirt/top" and b.classes[9] == "Ankle boot"


@pytest.mark.parametrize("data,problem", [
    (b"\x00\x00", "truncated"),
    (b"\x01\x00\x08\x01" + struct.pack(">I", 3) + b"abc", "magic"),
    (b"\x00\x01\x08\x01" + struct.pack(">I", 3) + b"abc", "magic"),
    (b"\x00\x00\x0d\x01" + struct.pack(">I", 3) + b"abcdefghijkl", "dtype"),
    (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "header"),
    (b"\x00\x00\x08\x03" + struct.pack(">II", 2, 2), "header"),   # one size short
    (b"\x00\x00\x08\x01" + struct.pack(">I", 5) + b"abc", "need 5 data bytes"),
    (b"\x00\x00\x08\x01" + struct.pack(">I", 2) + b"abc", "need 2 data bytes"),
    # more dims than an array can have (numpy: 64)
    (b"\x00\x00\x08\x41" + struct.pack(">I", 1) * 65 + b"a", "declares 65 dims"),
    (b"\x00\x00\x08\xff" + struct.pack(">I", 1) * 255 + b"a", "declares 255 dims"),
])
def test_read_idx_rejects_corrupt_files(tmp_path, data, problem):
    path = write(tmp_path / "bad-idx", data)
    with pytest.raises(DataError, match=problem) as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_corrupt_gzip_and_truncated_file_in_loader(tmp_path):
    raw = fake_idx(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        load_dataset("fashion_mnist", str(tmp_path))
    write(path.with_suffix(""), idx_bytes(raw["train"][0])[:-10])  # plain file is found first
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*need"):
        load_dataset("fashion_mnist", str(tmp_path))


def test_idx_labels_out_of_range_and_count_mismatch(tmp_path):
    raw = fake_idx(tmp_path, gz=False)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(np.full(15, 10)))
    with pytest.raises(DataError, match="out of range"):
        load_dataset("mnist", str(tmp_path))
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(raw["test"][1][:5]))
    with pytest.raises(DataError, match="15 images"):
        load_dataset("mnist", str(tmp_path))


@pytest.mark.parametrize("name,advice", [("mnist", "MNIST/raw"),
                                         ("fashion_mnist", "apt-get install dataset-fashion-mnist"),
                                         ("cifar10", "cifar-10-batches-py"),
                                         ("cifar100", "cifar-100-python")])
def test_missing_directory_lists_paths(tmp_path, name, advice):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as err:
        load_dataset(name, str(missing))
    msg = str(err.value)
    assert advice in msg and str(missing) in msg
    if "mnist" in name:
        assert str(missing / "train-images-idx3-ubyte.gz") in msg
        assert str(missing / "train-images-idx3-ubyte") + ", " in msg
    assert "\n" not in msg


def test_mnist_needs_data_dir():
    with pytest.raises(DataError, match="data_dir"):
        load_dataset("mnist")


def test_registry_errors():
    assert set(dataset_names()) == set(DATASETS) >= {"fashion_mnist", "mnist", "cifar10",
                                                     "cifar100", "digits", "synthetic"}
    with pytest.raises(ConfigError, match="cifar10.*fashion_mnist"):
        load_dataset("imagenet")
    with pytest.raises(ConfigError, match="colour"):
        load_dataset("digits", colour=True)
    with pytest.raises(ConfigError, match="label_mode"):
        load_dataset("cifar100", "/nonexistent", label_mode="medium")


def cifar_row(red, green, blue):
    """One CIFAR row from three 32x32 planes: 1024 red, 1024 green, 1024 blue values."""
    return np.concatenate([red.ravel(), green.ravel(), blue.ravel()]).astype(np.uint8)


def hand_image():
    planes = [np.zeros((32, 32), np.uint8) for _ in range(3)]
    planes[0][0, 1] = 255   # red at row 0, column 1
    planes[1][2, 0] = 200   # green at row 2, column 0
    planes[2][31, 30] = 100  # blue at row 31, column 30
    return cifar_row(*planes)


def dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=3))


def fake_cifar10(root: Path, n=4, seed=0):
    g = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    train = []
    for i in range(1, 6):
        data = g.integers(0, 256, (n, 3072)).astype(np.uint8)
        if i == 1:
            data[0] = hand_image()
        labels = [int(v) for v in g.integers(0, 10, n)]
        dump(folder / f"data_batch_{i}", {b"batch_label": b"x", b"data": data, b"labels": labels})
        train.append((data, labels))
    test = g.integers(0, 256, (n, 3072)).astype(np.uint8), list(range(n))
    dump(folder / "test_batch", {b"data": test[0], b"labels": test[1]})
    names = [f"class{k}".encode() for k in range(10)]
    dump(folder / "batches.meta", {b"label_names": names, b"num_cases_per_batch": n})
    return np.concatenate([d for d, _ in train]), [v for _, lab in train for v in lab], test


def test_cifar10_round_trip_and_layout(tmp_path):
    xtr, ytr, (xte, yte) = fake_cifar10(tmp_path)
    b = load_dataset("cifar10", str(tmp_path))
    assert b.input_shape == (3, 32, 32) and b.classes[3] == "class3"
    assert b.train.x.shape == (20, 3, 32, 32) and b.test.x.shape == (4, 3, 32, 32)
    assert b.train.y.tolist() == ytr and b.test.y.tolist() == yte
    tr4 = xtr.reshape(-1, 3, 32, 32)
    assert_standardised(b.train.x.numpy(), tr4, tr4)
    assert_standardised(b.test.x.numpy(), tr4, xte.reshape(-1, 3, 32, 32))
    # hand-made image: undo the standardisation and check each plane landed where it should
    tr = xtr.astype(np.float64).reshape(-1, 3, 1024) / 255
    mean, std = tr.mean((0, 2)), tr.std((0, 2))
    img = np.rint((b.train.x[0].numpy() * std[:, None, None] + mean[:, None, None]) * 255)
    want = np.zeros((3, 32, 32))
    want[0, 0, 1], want[1, 2, 0], want[2, 31, 30] = 255, 200, 100
    np.testing.assert_array_equal(img, want)


def test_cifar10_directly_in_data_dir(tmp_path):
    fake_cifar10(tmp_path)
    flat = tmp_path / "flat"
    (tmp_path / "cifar-10-batches-py").rename(flat)
    (flat / "batches.meta").unlink()  # meta is optional
    b = load_dataset("cifar10", str(flat))
    assert len(b.train) == 20 and b.classes[0] == "airplane"


def test_cifar100_fine_and_coarse(tmp_path):
    g = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    splits = {}
    for split, n in (("train", 10), ("test", 5)):
        data = g.integers(0, 256, (n, 3072)).astype(np.uint8)
        fine = [int(v) for v in g.integers(0, 100, n)]
        coarse = [f // 5 for f in fine]
        dump(folder / split, {b"data": data, b"fine_labels": fine, b"coarse_labels": coarse})
        splits[split] = fine, coarse
    dump(folder / "meta", {b"fine_label_names": [f"f{k}".encode() for k in range(100)],
                           b"coarse_label_names": [f"c{k}".encode() for k in range(20)]})
    fine = load_dataset("cifar100", str(tmp_path))
    coarse = load_dataset("cifar100", str(tmp_path), label_mode="coarse")
    assert fine.num_classes == 100 and coarse.num_classes == 20
    assert fine.classes[99] == "f99" and coarse.classes[19] == "c19"
    assert fine.train.y.tolist() == splits["train"][0]
    assert coarse.test.y.tolist() == splits["test"][1]
    assert torch.equal(fine.train.x, coarse.train.x)


def test_cifar_corrupt_pickles(tmp_path):
    fake_cifar10(tmp_path)
    bad = tmp_path / "cifar-10-batches-py" / "test_batch"
    bad.write_bytes(pickle.dumps({b"data": 1}, protocol=3)[:-5])
    with pytest.raises(DataError, match="test_batch.*corrupt"):
        load_dataset("cifar10", str(tmp_path))
    bad.write_bytes(pickle.dumps(os.getcwd, protocol=3))  # a global outside the allow-list
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", str(tmp_path))
    dump(bad, {b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]})
    with pytest.raises(DataError, match=r"uint8 \[n, 3072\]"):
        load_dataset("cifar10", str(tmp_path))
    dump(bad, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})
    with pytest.raises(DataError, match="out of range"):
        load_dataset("cifar10", str(tmp_path))


def test_limits(tmp_path):
    fake_idx(tmp_path, gz=False)
    full = load_dataset("mnist", str(tmp_path))
    a = load_dataset("mnist", str(tmp_path), rng=np.random.default_rng(3), limit_train=10,
                     limit_test=5)
    b = load_dataset("mnist", str(tmp_path), rng=np.random.default_rng(3), limit_train=10,
                     limit_test=5)
    assert len(a.train) == 10 and len(a.test) == 5
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    rows = {tuple(r) for r in full.train.x.flatten(1).tolist()}
    assert all(tuple(r) in rows for r in a.train.x.flatten(1).tolist())
    with pytest.raises(ConfigError, match="limit_train"):
        load_dataset("mnist", str(tmp_path), limit_train=41)
    with pytest.raises(ConfigError, match="limit_test"):
        load_dataset("mnist", str(tmp_path), limit_test=0)


def test_array_dataset_subset():
    ds = ArrayDataset(torch.arange(12.0).view(6, 2), torch.arange(6))
    sub = ds.subset(np.array([4, 1]))
    assert len(sub) == 2 and sub.y.tolist() == [4, 1] and sub.x[0].tolist() == [8.0, 9.0]
    with pytest.raises(DataError):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64))


def test_a_constant_channel_is_only_centred():
    """A channel whose train values are all equal has std 0: it is centred on the train
    mean and not scaled (no 0/0), while the other channels are standardised."""
    from splitfed.data.datasets import standardise

    train = torch.zeros(2, 2, 2)                                 # [N, C, pixels]
    train[:, 0] = torch.tensor([[0.0, 2.0], [4.0, 6.0]])
    train[:, 1] = 0.5
    test = torch.zeros(1, 2, 2)
    test[:, 0], test[:, 1] = 3.0, 1.5
    standardise(train, test)
    assert torch.equal(train[:, 1], torch.zeros(2, 2))
    assert torch.equal(test[:, 1], torch.ones(1, 2))           # 1.5 - 0.5, unscaled
    # channel 0: values 0, 2, 4, 6 have mean 3 and population std sqrt(5)
    # (x - m) / s in float32: a few roundings of values below 2, so 4 eps32 bounds them
    assert torch.equal(test[:, 0], torch.zeros(1, 2))
    want = (torch.tensor([0.0, 2, 4, 6], dtype=torch.float64) - 3) / 5 ** 0.5
    assert (train[:, 0].flatten().double() - want).abs().max() <= 4 * torch.finfo().eps * 2


def test_digits():
    b = load_dataset("digits")
    assert b.input_shape == (1, 8, 8)
    assert b.train.x.shape == (1438, 1, 8, 8) and b.test.x.shape == (359, 1, 8, 8)
    assert b.train.y.min() >= 0 and b.train.y.max() == 9
    assert np.all(np.bincount(b.test.y.numpy(), minlength=10) >= 30)  # stratified
    # standardised with the train mean and std: the train mean is 0 up to the rounding of
    # the same standardisation (pixels / 16, minus the mean, over the std) and of the mean,
    # done in float32 and in float64 on the same pixels
    from sklearn.datasets import load_digits as sk_load_digits

    from splitfed.data.digits import split_mask
    raw = sk_load_digits()
    pixels = torch.from_numpy(raw.images.astype(np.float32) / 16.0)[
        torch.from_numpy(~split_mask(np.asarray(raw.target)))]
    want, size = {}, None
    for dtype in (torch.float32, torch.float64):
        var, mean = torch.var_mean(pixels.to(dtype), correction=0)
        z = (pixels.to(dtype) - mean) / var.sqrt()
        want[dtype], size = z.mean(), z.abs().max().item()
    # the mean is of the order of the rounding of values of size max|z|
    assert_float_close(b.train.x.mean(), *want.values(), magnitude=size, what="train mean")
    assert torch.equal(load_dataset("digits").test.x, b.test.x)  # fixed split


def test_synthetic_deterministic_and_partition():
    opts = {"alpha": 0.5, "beta": 0.5, "num_devices": 8, "dim": 12, "num_classes": 5}
    a = load_dataset("synthetic", rng=np.random.default_rng(7), **opts)
    b = load_dataset("synthetic", rng=np.random.default_rng(7), **opts)
    c = load_dataset("synthetic", rng=np.random.default_rng(8), **opts)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert a.train.x.shape != c.train.x.shape or not torch.equal(a.train.x, c.train.x)
    assert a.input_shape == (12,) and a.num_classes == 5 and a.train.x.dtype == torch.float32
    assert len(a.natural_partition) == 8
    flat = np.concatenate(a.natural_partition)
    assert np.array_equal(np.sort(flat), np.arange(len(a.train)))
    for split in (a.train, a.test):
        assert split.y.min() >= 0 and split.y.max() < 5
    sizes = [len(p) for p in a.natural_partition]
    assert min(sizes) >= 40  # >= 50 samples per device, 80% to train


def test_synthetic_iid_and_limit():
    b = load_dataset("synthetic", rng=np.random.default_rng(0), iid=True, num_devices=5,
                     limit_train=100)
    assert len(b.train) == 100
    flat = np.concatenate(b.natural_partition)
    assert np.array_equal(np.sort(flat), np.arange(100))
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("synthetic", test_fraction=1.5)


def test_synthetic_feature_variances_are_the_diagonal_covariance():
    """x ~ N(v_k, Sigma) with Sigma_jj = j^-1.2 a *variance* (its standard deviation is
    j^-0.6). With iid=True every v_k is 0, so feature j's variance over all samples is
    j^-1.2; a sample variance of n draws has a relative standard error of
    sqrt(2 / (n - 1)), and five of those are allowed."""
    from splitfed.data.synthetic import generate

    devices = generate(np.random.default_rng(0), num_devices=40, dim=6, iid=True)
    x = np.concatenate([x for x, _ in devices])
    want = np.arange(1, 7, dtype=np.float64) ** -1.2
    tol = 5 * np.sqrt(2 / (len(x) - 1))
    assert tol < 0.2, len(x)
    np.testing.assert_allclose(x.var(axis=0) / want, 1.0, atol=tol)


def test_the_synthetic_marker_is_in_the_positive_samples_only():
    """Label 1 iff the marker occurs: once in each positive sample, never in a negative
    one (a small vocabulary, where a word drawn at random would often be the marker)."""
    b = load_dataset("synthetic_text", rng=np.random.default_rng(0), num_train=200,
                     num_test=60, seq_len=12, vocab_size=7, min_len=3, marker=5)
    for split in (b.train, b.test):
        ids, mask = split.x[:, 0], split.x[:, 1]
        assert torch.equal(((ids == 5) & (mask == 1)).sum(1), split.y)
        assert int(split.y.sum()) == len(split) // 2
        assert torch.all(ids[:, 0] == 2) and torch.all(ids[mask == 0] == 1)   # BOS, PAD


REAL_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not REAL_FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist():
    b = load_dataset("fashion_mnist")
    assert len(b.train) == 60000 and len(b.test) == 10000
    assert b.input_shape == (1, 28, 28) and b.train.x.shape[1:] == (1, 28, 28)
    assert np.array_equal(np.bincount(b.train.y.numpy()), np.full(10, 6000))
    # the exact train mean is 0: off by the rounding of the standardisation and the mean
    # (standardise_bound). Its terms from x' itself: the train pixels span 0..255, so
    # u = pixel / 255 spans [0, 1] and max|u| / s = 1 / s = max x' - min x'
    lo, hi = b.train.x.min().item(), b.train.x.max().item()
    bound = standardise_error(b.train.x.numel(), hi - lo, max(-lo, hi))
    assert abs(b.train.x.mean().item()) <= 2 * bound
