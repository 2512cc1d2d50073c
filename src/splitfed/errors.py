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
