"""Plain data and tensors to bytes and back, with no code path on loading.

Checkpoints (:mod:`splitfed.checkpoint`) and the multi-process runtime's messages hold
nested containers of tensors, numpy arrays and plain values. Python's pickle (and
PyTorch's unrestricted loading mode) can run arbitrary code while loading, so a shared
file or a message from the network could take over the process. Here:

- :func:`encode` turns a value into what PyTorch's restricted loader accepts: ``None``,
  ``bool``, ``int``, ``float``, ``str``, ``bytes``, tensors, and lists, tuples and dicts
  of these (keys: ``str``, ``int``, ``float``, ``bool`` or ``None``). A numpy array becomes
  a tagged dict ``{"__ndarray__": [dtype, shape, raw bytes]}`` (object arrays are refused)
  and a numpy scalar a Python number. Anything else (a class instance, a function)
  raises :class:`TypeError` naming where it sits: such a value cannot be written.
- :func:`dumps`/:func:`save` write with ``torch.save``; :func:`loads`/:func:`load` read with
  ``torch.load(weights_only=True)``, whose unpickler only builds the types above and
  refuses every other global, then :func:`decode` restores the numpy arrays. A file
  that holds anything else raises :class:`~splitfed.errors.FormatError`; nothing in it
  is executed.
"""

from __future__ import annotations


import io
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from splitfed.errors import FormatError
from splitfed.files import (  # noqa: F401 - re-exported (they need no torch)
    MAX_JSON_DEPTH,
    NOT_REGULAR,
    loads_json,
    read_regular,
)

TAG = "__ndarray__"
_SCALARS = (type(None), bool, int, float, str, bytes)
_KEYS = (str, int, float, bool, type(None))


def encode(obj: Any, where: str = "value") -> Any:
    """``obj`` as containers of plain values and tensors (see the module doc)."""
    if isinstance(obj, _SCALARS) or isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"{where}: numpy arrays of Python objects cannot be saved")
        arr = np.ascontiguousarray(obj)
        return {TAG: [arr.dtype.str, list(arr.shape), arr.tobytes()]}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = k.item() if isinstance(k, np.generic) else k
            if not isinstance(key, _KEYS):
                raise TypeError(f"{where}: dict key {k!r} of type {type(k).__name__} "
                                "cannot be saved")
            out[key] = encode(v, f"{where}[{key!r}]")
        return out
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(encode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be "
                    "saved; only plain data, tensors and numpy arrays can")


def unsaveable(obj: Any, where: str = "value", also: tuple[type, ...] = ()) -> str | None:
    """Where in ``obj`` the first value :func:`encode` cannot write sits, with its type
    (``value['x'][2]: a builtins.object``); None when every value can be written.
    ``also``: further types the caller writes itself (a checkpoint stores modules and
    optimizers as their ``state_dict()``). It walks the containers without copying."""
    stack = [(obj, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, (*_SCALARS, torch.Tensor, np.generic, *also)):
            continue
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                return f"{at}: a numpy array of Python objects"
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                key = k.item() if isinstance(k, np.generic) else k
                if not isinstance(key, _KEYS):
                    return f"{at}: the dict key {k!r:.40} (a {type(k).__name__})"
                stack.append((v, f"{at}[{key!r}]"))
            continue
        if isinstance(value, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
            continue
        return f"{at}: a {type(value).__module__}.{type(value).__qualname__}"
    return None


def decode(obj: Any, _seen: set | None = None) -> Any:
    """Inverse of :func:`encode`: tagged dicts back to numpy arrays.

    A pickle can refer to one container (or one array's bytes) many times for a few
    bytes each; copied at every reference, a file of kilobytes would expand to gigabytes
    (the "billion laughs"). :func:`encode` never writes a shared container, so one met
    twice raises :class:`FormatError` before anything is expanded."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, (dict, list, tuple)) and len(obj):
        if id(obj) in seen:
            raise FormatError("a container is referred to more than once (splitfed never "
                              "writes that; a crafted file could expand without bound)")
        seen.add(id(obj))
    if isinstance(obj, dict):
        if len(obj) == 1 and TAG in obj:
            spec = obj[TAG]
            raw = spec[2] if isinstance(spec, list) and len(spec) == 3 else None
            if isinstance(raw, bytes) and len(raw):
                if id(raw) in seen:
                    raise FormatError("a stored numpy array's bytes are referred to more "
                                      "than once (splitfed never writes that)")
                seen.add(id(raw))
            return _array(spec)
        return {k: decode(v, seen) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, seen) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode(v, seen) for v in obj)
    return obj


def _array(spec: Any) -> np.ndarray:
    try:
        dtype, shape, raw = spec
        dt = np.dtype(str(dtype))
        if dt.hasobject or not isinstance(raw, bytes):
            raise ValueError("not a plain numeric array")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError("negative dimension")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    except (TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"a stored numpy array is malformed ({e})") from None


def save(obj: Any, fh: BinaryIO | str | Path) -> None:
    """Write ``encode(obj)`` with ``torch.save`` to a binary file handle or path.

    A write that fails (a full disk, a file size limit) raises its ``OSError``: torch's
    archive writer answers it, as it closes the archive, with a ``RuntimeError`` about
    the file position that would hide it (a path is opened here, as torch's own file
    writer for a path gives no error number at all)."""
    if isinstance(fh, (str, Path)):
        with open(fh, "wb") as f:
            save(obj, f)
        return
    try:
        torch.save(encode(obj), fh)
    except RuntimeError as e:
        cause = _os_error(e)
        if cause is None:
            raise
        raise cause from None


def _os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` that ``e`` was raised while handling, if any (a bounded walk)."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    save(obj, buf)
    return buf.getvalue()


def load(fh: BinaryIO | str | Path, what: str = "file") -> Any:
    """Read what :func:`save` wrote, with PyTorch's restricted (weights-only) loader.

    Raises :class:`FormatError` naming ``what`` when the data is torn, foreign, or holds
    anything but plain data and tensors; nothing in it is executed."""
    try:
        obj = torch.load(fh, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the restricted unpickler raises many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Weights only load failed" in first or "Unsupported global" in str(e):
            reason = "it holds objects other than plain data and tensors, refused unread"
        else:
            reason = f"{type(e).__name__}: {first[:200]}"
        raise FormatError(f"{what}: not a splitfed data file ({reason})") from None
    try:
        return decode(obj)
    except FormatError as e:
        raise FormatError(f"{what}: not a splitfed data file ({e})") from None


def loads(data: bytes, what: str = "message") -> Any:
    return load(io.BytesIO(data), what)
