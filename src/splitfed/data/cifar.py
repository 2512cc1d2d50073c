"""CIFAR-10 and CIFAR-100 from the standard "python version" pickles.

Each batch is a pickled dict with bytes keys: ``b'data'`` (uint8 [n, 3072]; per row the
1024 red, then 1024 green, then 1024 blue pixels of a 32x32 image, each plane row-major) and
the labels (``b'labels'`` for CIFAR-10, ``b'fine_labels'`` / ``b'coarse_labels'`` for
CIFAR-100). A row therefore reshapes directly to [3, 32, 32].

Pickles are read with a restricted unpickler that only resolves the numpy names an array needs,
so a tampered file cannot run code, and that builds only what a batch holds (dicts with keys
of plain types, lists, tuples, bytes, text, small integers and numpy arrays), so a small file
cannot make it crash, loop for hours or allocate gigabytes. The ``meta`` / ``batches.meta``
file (class names) is optional: without it CIFAR-10 uses its built-in names and CIFAR-100 has
``classes=None``.
"""

from __future__ import annotations

import io
import itertools
import pickle
import struct
import sys
from pathlib import Path

import numpy as np

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
from splitfed.errors import ConfigError, DataError, describe, preview

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]
_ALLOWED = {
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.numeric": {"_frombuffer"},
    "numpy._core.numeric": {"_frombuffer"},
    "_codecs": {"encode"},
    "__builtin__": {"bytes"},
    "builtins": {"bytes"},
}
#: the largest pickle read (CIFAR-100's train file is 155 MB)
MAX_PICKLE_BYTES = 1 << 30
#: the most memo entries a pickle may store (a batch stores about one per image, for its
#: file name: 50,000 in CIFAR-100's train file)
MAX_MEMO = 1 << 20
#: the longest integer a pickle may hold, in bytes (8: an int64; labels are below 100)
MAX_INT_BYTES = 8
#: the longest decimal integer of the text opcodes (INT, LONG): 20 digits and a sign
_MAX_INT_DIGITS = 21
#: the types a dict key may have: values hashed in time linear in their size (a tuple key
#: could nest a million levels deep, or share its parts so that hashing visits 2**40 of them)
_KEY_TYPES = (bytes, str, int, float, bool, type(None))
#: the longest type string accepted as a dtype ('u1', '<i8', b'b' in the real files)
_MAX_DTYPE_CHARS = 64


class _ArrayType:
    """What the unpickler gives for ``numpy.ndarray``: the subtype argument of
    ``_reconstruct``, and nothing else. ``numpy.ndarray`` itself is never handed out: a
    pickle that called it could make an array of any shape over a one-byte buffer (zero
    strides), which costs memory in full once the loader copies it."""

    def __call__(self, *args, **kwargs):
        raise pickle.UnpicklingError("refusing to call numpy.ndarray (only numpy's "
                                     "_reconstruct of an empty array is read)")

    def __repr__(self) -> str:
        return "numpy.ndarray"


_NDARRAY = _ArrayType()


def _dtype_spec(spec):
    """A dtype argument as the pickles of arrays give it: a dtype, or a short type string
    ('u1', b'b'). A list or tuple is refused: it can describe fields nested to any depth, or
    share one description among fields level after level, which numpy converts anew for
    every use (2**40 conversions from a few hundred bytes)."""
    if isinstance(spec, np.dtype) or (type(spec) in (str, bytes)
                                      and len(spec) <= _MAX_DTYPE_CHARS):
        return spec
    raise pickle.UnpicklingError(f"refusing a numpy dtype given as {type(spec).__name__} "
                                 f"{preview(spec)} (only a dtype or a short type string)")


def _plain_dtype(dtype):
    """``dtype`` if it is a plain scalar dtype (no fields, no subarray, no Python objects),
    as every array of a batch has; anything else is refused before an array uses it."""
    if not isinstance(dtype, np.dtype):
        raise pickle.UnpicklingError(f"refusing a numpy dtype given as {type(dtype).__name__}")
    if dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        raise pickle.UnpicklingError(f"refusing numpy dtype {preview(dtype)} (only plain "
                                     "scalar dtypes: no fields, subarrays or objects)")
    return dtype


def _guard_dtype(dtype):
    """``numpy.dtype`` as the pickle of a dtype calls it: a type string, align, copy."""
    def guarded(spec, *args):
        if len(args) > 2:
            raise pickle.UnpicklingError(f"refusing numpy.dtype with {len(args) + 1} arguments")
        return _plain_dtype(dtype(_dtype_spec(spec), *args))
    return guarded


def _dtype_state(target: np.dtype, state) -> None:
    """The state BUILD may give the dtype ``target``: the one numpy pickles with it, its
    byte order aside. Any other (fields or a subarray, at offsets numpy does not check
    against the item size, or other sizes or flags) is refused: an array of such a dtype
    would read memory outside its own."""
    own = target.__reduce__()[2]
    order = state[1] if type(state) is tuple and len(state) == len(own) else None
    if isinstance(order, bytes):
        order = order.decode("latin-1")
    if not (type(order) is str and order in ("<", ">", "|", "=")
            and type(state[0]) is int and state[0] == own[0]
            and all(b is None and a is None or type(a) is int and type(b) is int and a == b
                    for a, b in zip(state[2:], own[2:]))):
        raise pickle.UnpicklingError(f"refusing numpy dtype state {preview(state)} (only "
                                     "that of a plain scalar dtype)")


def _guard_frombuffer(frombuffer):
    """numpy's ``_frombuffer`` (protocol-5 arrays) with a dtype :func:`_dtype_spec` admits."""
    def guarded(buf, dtype, *args):
        return frombuffer(buf, _plain_dtype(np.dtype(_dtype_spec(dtype))), *args)
    return guarded


def _guard_reconstruct(reconstruct):
    """numpy's ``_reconstruct`` as the pickles of arrays call it: an empty ndarray that
    ``__setstate__`` then fills; any other subtype or shape is refused (a shape would
    allocate memory before the data is seen)."""
    def guarded(subtype, shape, dtype):
        if subtype is not _NDARRAY or type(shape) is not tuple or shape != (0,):
            raise pickle.UnpicklingError(f"refusing numpy _reconstruct({subtype!r}, "
                                         f"{preview(shape)})")
        return reconstruct(np.ndarray, shape, _plain_dtype(np.dtype(_dtype_spec(dtype))))
    return guarded


def _empty_bytes(*args):
    """``bytes()`` as protocol-2 pickles write an empty byte string (an empty array's
    data), nothing else."""
    if args:
        raise pickle.UnpicklingError("refusing bytes() with arguments (only the empty "
                                     "byte string)")
    return b""


def _encode(text, encoding="utf-8", errors="strict"):
    """``_codecs.encode`` as Python 2 pickles use it (str -> latin-1 bytes), nothing else."""
    if not isinstance(text, str) or str(encoding).lower().replace("_", "-") not in (
            "latin1", "latin-1", "iso-8859-1"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with {encoding!r}")
    return text.encode("latin-1")




class _ExactReader(io.BytesIO):
    """A pickle's bytes for the pure-Python unpickler, which takes a short read as the whole
    value: reading past the end is an error."""

    def read(self, size=-1):
        data = super().read(size)
        if size is not None and 0 <= size != len(data):
            raise pickle.UnpicklingError("pickle data was truncated")
        return data


def _refused(opcode: str):
    def load(self):
        raise pickle.UnpicklingError(f"refusing pickle opcode {opcode}, which no CIFAR "
                                     "batch uses")
    return load


def _bounded_memo(load):
    def put(self):
        load(self)
        if len(self.memo) > MAX_MEMO:
            raise pickle.UnpicklingError(f"refusing more than {MAX_MEMO} memo entries")
    return put


def _key(key):
    if type(key) not in _KEY_TYPES:
        raise pickle.UnpicklingError(f"refusing a dict key of type {type(key).__name__} "
                                     "(only bytes, str, numbers and None)")
    return key


def _text_int(line: bytes) -> bytes:
    digits = line.strip().rstrip(b"L")
    if len(digits) > _MAX_INT_DIGITS:
        raise pickle.UnpicklingError(f"refusing an integer of {len(digits)} characters "
                                     f"(at most {_MAX_INT_DIGITS})")
    return digits


def _long_bytes(n: int) -> int:
    if not 0 <= n <= MAX_INT_BYTES:
        raise pickle.UnpicklingError(f"refusing an integer of {n} bytes "
                                     f"(at most {MAX_INT_BYTES})")
    return n


class _SafeUnpickler(pickle._Unpickler):
    """Python's pure-Python unpickler (its memo is a dict: a file cannot make it allocate by
    naming a large memo index), restricted to what a CIFAR batch holds:

    - globals: only the numpy and codec names an array's pickle needs (``_ALLOWED``), so no
      code named by the file runs (``os.system``, ``builtins.eval``, ...), and numpy's
      constructors only with the arguments arrays' pickles give them (``bytes`` only
      with none: protocol 2's empty byte string, an empty array's data);
    - dicts whose keys are bytes, str, numbers or None (hashed in linear time); items
      added only to dicts and lists; state set only on arrays and dtypes, and only that
      of plain scalar dtypes (no fields, subarrays or objects);
    - integers of at most 8 bytes; at most :data:`MAX_MEMO` memo entries;
    - no sets, persistent ids, extension codes, class instances or out-of-band buffers,
      which no batch contains.
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    for _op in ("EMPTY_SET", "ADDITEMS", "FROZENSET", "PERSID", "BINPERSID", "EXT1", "EXT2",
                "EXT4", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "NEXT_BUFFER", "READONLY_BUFFER"):
        dispatch[getattr(pickle, _op)[0]] = _refused(_op)
    for _op in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
        dispatch[getattr(pickle, _op)[0]] = _bounded_memo(dispatch[getattr(pickle, _op)[0]])
    del _op

    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()):
            if name == "encode":
                return _encode
            if name == "bytes":
                return _empty_bytes
            if name == "ndarray":
                return _NDARRAY
            found = super().find_class(module, name)
            guard = {"_reconstruct": _guard_reconstruct, "dtype": _guard_dtype,
                     "_frombuffer": _guard_frombuffer}.get(name)
            return guard(found) if guard else found
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def load_int(self):
        line = self.readline()
        if line in (b"00\n", b"01\n"):     # protocol 0's False and True
            self.append(line == b"01\n")
        else:
            self.append(int(_text_int(line), 0))
    dispatch[pickle.INT[0]] = load_int

    def load_long(self):
        self.append(int(_text_int(self.readline()), 0))
    dispatch[pickle.LONG[0]] = load_long

    def load_long1(self):
        n = _long_bytes(self.read(1)[0])
        self.append(pickle.decode_long(self.read(n)))
    dispatch[pickle.LONG1[0]] = load_long1

    def load_long4(self):
        n = _long_bytes(struct.unpack("<i", self.read(4))[0])
        self.append(pickle.decode_long(self.read(n)))
    dispatch[pickle.LONG4[0]] = load_long4

    def load_bytearray8(self):
        n, = struct.unpack("<Q", self.read(8))
        self.append(bytearray(self.read(n)))    # a read past the end fails before copying
    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8

    def _set_items(self, target, items):
        if type(target) is not dict:
            raise pickle.UnpicklingError(f"refusing to set items of a {type(target).__name__} "
                                         "(only of a dict)")
        if len(items) % 2:
            raise pickle.UnpicklingError("odd number of items for a dict")
        for i in range(0, len(items), 2):
            target[_key(items[i])] = items[i + 1]

    def load_dict(self):
        items = self.pop_mark()
        target = {}
        self._set_items(target, items)
        self.append(target)
    dispatch[pickle.DICT[0]] = load_dict

    def load_setitem(self):
        value, key = self.stack.pop(), self.stack.pop()
        self._set_items(self.stack[-1], [key, value])
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        items = self.pop_mark()
        self._set_items(self.stack[-1], items)
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def _list(self):
        target = self.stack[-1]
        if type(target) is not list:
            raise pickle.UnpicklingError(f"refusing to append to a {type(target).__name__} "
                                         "(only to a list)")
        return target

    def load_append(self):
        value = self.stack.pop()
        self._list().append(value)
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        items = self.pop_mark()
        self._list().extend(items)
    dispatch[pickle.APPENDS[0]] = load_appends

    def load_build(self):
        target = self.stack[-2]
        if not isinstance(target, (np.ndarray, np.dtype)):
            raise pickle.UnpicklingError(f"refusing BUILD on a {type(target).__name__} "
                                         "(only on a numpy array or dtype)")
        state = self.stack[-1]
        if isinstance(target, np.dtype):
            _dtype_state(target, state)
        elif type(state) is tuple and len(state) in (4, 5):  # ([version,] shape, dtype, ...)
            _plain_dtype(state[-3])
        else:
            raise pickle.UnpicklingError(f"refusing numpy array state {preview(state)}")
        pickle._Unpickler.load_build(self)
    dispatch[pickle.BUILD[0]] = load_build


def read_pickle(path: Path, max_bytes: int | None = None) -> dict:
    """The dict in a CIFAR pickle (bytes keys); DataError naming the file if it is not a
    regular file, is corrupt, larger than ``max_bytes`` (default :data:`MAX_PICKLE_BYTES`)
    or names anything but the numpy constructs of an array."""
    limit = MAX_PICKLE_BYTES if max_bytes is None else int(max_bytes)
    check_regular(path)             # a pipe or a device is never opened
    try:
        size = Path(path).stat().st_size
        if size > limit:
            raise DataError(f"{path}: {size} bytes, more than the {limit} a CIFAR batch "
                            "may have")
        with open_regular(Path(path)) as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise DataError(f"{path}: more than the {limit} bytes a CIFAR batch may have")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    unraisable = []                     # errors numpy reports while freeing what it built
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    unpickler, error = _SafeUnpickler(_ExactReader(raw), encoding="bytes"), None
    try:
        obj = unpickler.load()
    except Exception as e:  # corrupt pickles raise many types (EOFError, UnpicklingError, ...)
        error = e.with_traceback(None)  # its frames hold what the unpickler built
    finally:
        vars(unpickler).clear()         # so a failed load's stack and memo are freed here
        sys.unraisablehook = hook
    if error is not None:
        raise DataError(f"{path}: corrupt pickle ({describe(error)})") from error
    if unraisable:
        e = unraisable[0].exc_value
        raise DataError(f"{path}: corrupt pickle ({describe(e)})")
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return obj


def _read_batch(path: Path, label_keys: list[bytes],
                num_classes: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    batch = read_pickle(path)
    missing = [k for k in [b"data", *label_keys] if k not in batch]
    if missing:
        has = ", ".join(sorted(preview(k) for k in itertools.islice(batch, 10))) or "none"
        if len(batch) > 10:
            has += f", ... ({len(batch)} keys)"
        raise DataError(f"{path}: missing keys {missing}; has {has}")
    data = batch[b"data"]                   # an array in the real files, never a list (a
    if not isinstance(data, np.ndarray):    # list of references to one row expands)
        raise DataError(f"{path}: b'data' must be a numpy array, got "
                        f"{type(data).__name__}")
    if data.dtype.descr != [("", "|u1")] or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{path}: b'data' must be uint8 [n, 3072], got "
                        f"{preview(data.dtype)} {data.shape}")
    _check_stored(path, b"data", data)
    labels = []
    for k, n in zip(label_keys, num_classes):
        given = batch[k]                    # a list of ints (an array in some copies)
        if not isinstance(given, np.ndarray) and not (
                isinstance(given, list)
                and all(type(v) is int for v in given)):    # (not bool; no nested lists)
            raise DataError(f"{path}: {k!r} must be a list of integers, one per image")
        if isinstance(given, np.ndarray):
            _check_stored(path, k, given)
        y = labels_tensor(given, n, f"{path} {k!r}").numpy()
        if y.shape != (len(data),):
            raise DataError(f"{path}: {k!r} has shape {y.shape}, expected ({len(data)},)")
        labels.append(y)
    return data.reshape(-1, 3, 32, 32), labels


def _check_stored(path: Path, key: bytes, array: np.ndarray) -> None:
    """An array read from a pickle holds bytes the file stored: contiguous, and no larger
    than the file (no view that repeats a few bytes over a large shape)."""
    if not array.flags.c_contiguous:
        raise DataError(f"{path}: {key!r} is not a C-contiguous array (rows one after "
                        "another, as the real files store them); not an array the file "
                        "stores")
    size = Path(path).stat().st_size
    if array.nbytes > size:
        raise DataError(f"{path}: {key!r} declares {array.nbytes} bytes of array in a file of "
                        f"{size} bytes; not an array the file stores")


def _read_split(paths, label_keys, num_classes):
    parts = [_read_batch(p, label_keys, num_classes) for p in paths]
    x = np.concatenate([d for d, _ in parts])
    if len(x) == 0:
        raise DataError(f"{', '.join(str(p) for p in paths)}: no images (b'data' is empty)")
    ys = [np.concatenate([ls[i] for _, ls in parts]) for i in range(len(label_keys))]
    return x, ys


def _meta_names(dirs, name: str, key: bytes, num_classes: int) -> list[str] | None:
    for d in dirs:
        path = Path(d) / name
        if path.exists():           # a directory, a pipe or a device is refused
            try:
                check_regular(path)
            except DataError as e:
                raise DataError(f"{e}; fix or delete the file (it is optional)") from None
            names = read_pickle(path).get(key)
            if names is None:
                return None
            if not isinstance(names, (list, tuple)) or len(names) != num_classes:
                raise DataError(f"{path}: {key!r} must list {num_classes} class names, got "
                                f"{type(names).__name__} {preview(names)}; fix or delete "
                                "the file (it is optional)")
            if not all(isinstance(n, (str, bytes)) for n in names):
                raise DataError(f"{path}: {key!r} must list class names as text; fix or "
                                "delete the file (it is optional)")
            return [n.decode(errors="replace") if isinstance(n, bytes) else n
                    for n in names]
    return None


def _bundle(name, xtr, ytr, xte, yte, num_classes, classes) -> DataBundle:
    train_x, test_x = to_unit_float(xtr, 255.0), to_unit_float(xte, 255.0)
    standardise(train_x, test_x)
    train = ArrayDataset(train_x, labels_tensor(ytr, num_classes, name))
    test = ArrayDataset(test_x, labels_tensor(yte, num_classes, name))
    return DataBundle(name, train, test, num_classes, (3, 32, 32), classes)


def _dirs(data_dir, sub: str, how_to: str) -> list[Path]:
    if data_dir is None:
        raise DataError(f"this data set needs data_dir. {how_to}")
    return [Path(data_dir) / sub, Path(data_dir)]


def load_cifar10(data_dir: str | None, rng: np.random.Generator) -> DataBundle:
    """CIFAR-10, [N, 3, 32, 32]: data_batch_1..5 (50000 train) and test_batch (10000 test)."""
    how_to = ("Download cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) and "
              "extract it into data_dir, giving data_dir/cifar-10-batches-py/{data_batch_1..5, "
              "test_batch, batches.meta}.")
    dirs = _dirs(data_dir, "cifar-10-batches-py", how_to)
    train_paths = [find_file(f"data_batch_{i}", dirs, how_to) for i in range(1, 6)]
    test_paths = [find_file("test_batch", dirs, how_to)]
    xtr, (ytr,) = _read_split(train_paths, [b"labels"], [10])
    xte, (yte,) = _read_split(test_paths, [b"labels"], [10])
    classes = _meta_names(dirs, "batches.meta", b"label_names", 10) or list(CIFAR10_CLASSES)
    return _bundle("cifar10", xtr, ytr, xte, yte, 10, classes)


def load_cifar100(data_dir: str | None, rng: np.random.Generator,
                  label_mode: str = "fine") -> DataBundle:
    """CIFAR-100, [N, 3, 32, 32]: ``train`` (50000) and ``test`` (10000).

    ``label_mode="fine"`` gives the 100 classes, ``"coarse"`` the 20 superclasses.
    """
    if label_mode not in ("fine", "coarse"):
        raise ConfigError(f"data.label_mode: must be 'fine' or 'coarse', got {label_mode!r}")
    how_to = ("Download cifar-100-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) "
              "and extract it into data_dir, giving data_dir/cifar-100-python/{train, test, meta}.")
    dirs = _dirs(data_dir, "cifar-100-python", how_to)
    n = 100 if label_mode == "fine" else 20
    key = f"{label_mode}_labels".encode()
    xtr, (ytr,) = _read_split([find_file("train", dirs, how_to)], [key], [n])
    xte, (yte,) = _read_split([find_file("test", dirs, how_to)], [key], [n])
    classes = _meta_names(dirs, "meta", f"{label_mode}_label_names".encode(), n)
    return _bundle("cifar100", xtr, ytr, xte, yte, n, classes)


#: the options' help (``splitfed config explain NAME``, docs/config.md)
load_cifar100.option_help = {
    "label_mode": "fine (the 100 classes) or coarse (the 20 superclasses)",
}
