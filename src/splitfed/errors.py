"""Exceptions raised by splitfed. Every user-facing error derives from SplitfedError."""


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
