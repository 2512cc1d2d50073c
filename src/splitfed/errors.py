"""Exceptions raised by splitfed. Every user-facing error derives from SplitfedError;
SIGTERM becomes :class:`Terminated` while :func:`sigterm_interrupts` is active.
:func:`one_line` and :func:`describe` quote another library's exception in one of them;
:func:`is_out_of_memory` recognises a failed allocation, and :func:`out_of_memory_as`
turns one into a one-line error."""

from __future__ import annotations

import contextlib
import reprlib


def one_line(e: object, limit: int | None = 300) -> str:
    """An exception's message (or any object's text) on one line, every run of
    whitespace (newlines included) one space, cut at ``limit`` characters (None: whole):
    a third-party exception quoted in splitfed's one-line errors."""
    text = " ".join(str(e).split())
    return text if limit is None else text[:limit]


def describe(e: BaseException, limit: int | None = 300) -> str:
    """``Type: message`` of an exception on one line (:func:`one_line`, the message cut at
    ``limit`` characters)."""
    return f"{type(e).__name__}: {one_line(e, limit)}"


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says an allocation failed: Python's or numpy's ``MemoryError``,
    torch's ``OutOfMemoryError`` (a device), or the ``RuntimeError`` of torch's CPU
    allocator ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...")."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


@contextlib.contextmanager
def out_of_memory_as(error):
    """Within the block, a failed allocation (:func:`is_out_of_memory`) raises
    ``error(e)``, a one-line error saying what did not fit, in place of its traceback;
    other exceptions pass unchanged."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:  # numpy's, or torch's allocator's
        if not is_out_of_memory(e):
            raise
        raise error(e) from None


class _Preview(reprlib.Repr):
    """reprlib's bounded repr, also for byte strings (cut before they are printed) and
    integers too long to print (their size instead)."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, limit, limit, limit

    def repr_int(self, x, level):
        bits = x.bit_length()
        return f"<int of {bits} bits>" if bits > 256 else super().repr_int(x, level)

    def repr_bytes(self, x, level):
        text = repr(bytes(x[:self.maxstring]))
        return text if len(x) <= self.maxstring else text + "..."

    def repr_bytearray(self, x, level):
        return f"bytearray({self.repr_bytes(x, level)})"


def preview(value: object, limit: int = 60) -> str:
    """``value`` quoted for a one-line error, in at most about ``limit`` characters, in
    time and memory that do not grow with the value: containers are shown to three levels
    and their first few items, long texts and numbers cut; if even that fails, the type."""
    try:
        text = " ".join(_Preview(limit).repr(value).split())
    except Exception:  # a repr of anything may raise anything
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class SplitfedError(Exception):
    """Base class of all errors that splitfed raises on purpose."""


class ConfigError(SplitfedError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    The message names the offending key (dotted path) and what is allowed.
    """


class DataError(SplitfedError):
    """A data file is missing, truncated or malformed.

    The message names the file (or where the loader looked) and how to obtain the data.
    """


class FormatError(SplitfedError, ValueError):
    """A file or message is not in the safe format splitfed writes (:mod:`splitfed.safeio`):
    it holds something other than plain data and tensors, or it is torn or foreign."""


class AuthError(SplitfedError):
    """A peer did not prove the run's secret, or a message's HMAC is wrong."""


class RunInterrupted(SplitfedError):
    """The user interrupted a run (Ctrl-C). ``run_dir`` is the directory to resume, or
    None when nothing was written yet."""

    def __init__(self, run_dir=None):
        self.run_dir = run_dir
        hint = (f"; continue it with: splitfed run --resume {run_dir}" if run_dir is not None
                else "")
        super().__init__(f"interrupted{hint}")


class PluginError(ConfigError):
    """A plugin cannot be imported, or registers a component badly (a name that is taken,
    a function without the parameters its kind is called with). The message names the
    plugin or the kind and name of the component."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch system's stop), raised where the command is, so that it
    stops as on Ctrl-C (:func:`sigterm_interrupts`)."""


@contextlib.contextmanager
def sigterm_interrupts():
    """While active, SIGTERM raises :class:`Terminated`: the command stops as Ctrl-C
    stops it (a run keeps its last checkpoint). Yields a list that holds True once
    SIGTERM arrived (the exception may have been turned into another on its way up).
    Only where SIGTERM has its default action, in the main thread; a handler already
    there (the caller's, or an outer ``sigterm_interrupts``) stays."""
    import signal
    import threading

    seen: list[bool] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield seen
        return

    def on_sigterm(signum, frame):
        seen.append(True)
        raise Terminated

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
