"""Typed configuration: dataclasses loaded from YAML and overridden with ``key=value``.

A config is a tree of dataclasses. ``from_dict`` builds one from plain data (what
``yaml.safe_load`` returns) and is strict: unknown keys, missing required keys, wrong
types and out-of-range values raise :class:`ConfigError` with a message that names the
dotted key, e.g. ``train.lr: expected a float, got 'abc' (str)``.

Supported annotations: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
``Optional[X]`` / ``X | None``, unions of these (tried in order), ``list[X]``,
``tuple[X, ...]``, fixed tuples, ``dict[str, X]``, nested dataclasses and ``Any``.

Field metadata adds bounds and documentation::

    lr: float = field(default=0.1, metadata={"gt": 0, "help": "client learning rate"})

``ge``, ``gt``, ``le``, ``lt`` (numbers) and ``choices`` (a collection) are checked on the
value, or on each element of a list/tuple value; ``help`` is shown by :func:`describe`.

The models, optimizers and transforms compute in float32, so a finite float of a config
must be 0 or have a magnitude in float32's normal range, :data:`FLOAT32_TINY` ..
:data:`FLOAT32_MAX` (about 1.2e-38 .. 3.4e38): ``1e308`` would overflow and ``1e-320``
would become 0. This holds for the fields of every dataclass built here (in lists, tuples
and typed mappings too) and for the options of components (:func:`typed_options`); a
bounded number is also finite.

Typical use::

    data = merge(load_yaml("run.yaml"), parse_overrides(["train.lr=0.05"]))
    cfg = from_dict(RunConfig, data)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from splitfed.errors import ConfigError, PluginError, one_line
from splitfed.files import read_regular

_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}
_NAMES = {int: "an integer", float: "a float", bool: "a boolean (true/false)", str: "a string"}

#: float32's smallest normal and largest finite magnitudes: a config's float is 0 or lies
#: between them in magnitude (module doc)
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38
FLOAT_RANGE_TEXT = "0 or 1.2e-38 .. 3.4e38 in magnitude"


# --------------------------------------------------------------------- building


def from_dict(cls: type, data: Mapping[str, Any] | None, path: str = "") -> Any:
    """Build the dataclass ``cls`` from ``data``, checking keys, types and bounds.

    ``data=None`` means "no keys given" (every field takes its default). ``path`` is the
    dotted prefix used in error messages. Fields declared with ``init=False`` are not
    keys. A :class:`ConfigError` or ``ValueError`` raised by ``cls.__post_init__`` is
    re-raised as ``ConfigError`` prefixed with ``path`` (or the class name at the top).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {show(data)}")
    fields = _init_fields(cls)
    _reject_unknown(cls, data, fields, path)
    hints = _type_hints(cls)
    kwargs = {}
    for f in fields:
        key = _join(path, f.name)
        if f.name in data:
            kwargs[f.name] = _field_value(hints[f.name], data[f.name], key, f.metadata)
        elif _has_default(f):
            continue
        else:
            raise ConfigError(f"missing required key '{key}'")
    return _construct(cls, kwargs, path)


@functools.lru_cache(maxsize=256)
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per class (a study builds thousands of
    configs; resolving the annotations was a third of the time)."""
    return typing.get_type_hints(cls)


def _construct(cls: type, kwargs: dict, path: str) -> Any:
    try:
        return cls(**kwargs)
    except ValueError as err:  # ConfigError is a ValueError
        if not path and isinstance(err, ConfigError):
            raise                       # the whole config's own check names its keys
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _reject_unknown(cls: type, data: Mapping, fields: list, path: str) -> None:
    allowed = [f.name for f in fields]
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{path or cls.__name__}: keys must be strings, got {show(key)}")
        if key not in allowed:
            owner = path or f"{cls.__name__} (top level)"
            if not allowed:
                raise ConfigError(f"unknown key '{_join(path, key)}'; {owner} takes no "
                                  "keys (no options)")
            msg = f"unknown key '{_join(path, key)}'; allowed keys of {owner}: "
            raise ConfigError(msg + ", ".join(allowed) + _suggest(key, allowed))


def _suggest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _field_value(tp: Any, value: Any, key: str, meta: Mapping) -> Any:
    try:
        out = _convert(tp, value, key)
    except ConfigError as err:
        allowed = bounds_text(meta)
        if allowed and str(err).startswith(f"{key}: expected"):
            raise ConfigError(f"{err} (allowed: {allowed})") from None
        raise
    check_bounds(out, key, meta)
    _check_floats(tp, out, key)
    return out


def typed_options(fn: Callable, options: dict[str, Any], section: str) -> dict[str, Any]:
    """``options`` of the component function ``fn`` (a partitioner, a clock profile, a
    model, a data set, ...) checked against the types of its parameters, as the config's
    own keys are. ConfigError names ``section.key`` and what is allowed.

    - ``bool`` (or no annotation and a default of ``True`` or ``False``): a boolean (a
      string such as ``maybe`` is not taken as true);
    - ``float``: a number, not a boolean; a numeric string (YAML 1.1 reads ``1e-9`` as a
      string) becomes a float, an integer stays an integer; a finite one must be 0 or
      within float32's range (:data:`FLOAT32_TINY` .. :data:`FLOAT32_MAX` in magnitude;
      infinity and NaN are left to the component, which refuses them where they have no
      meaning);
    - ``int``: an integer, not a boolean, a float or a string;
    - ``str``: a string (a number or a list is refused, not converted);
    - ``float | None``, ``int | None``, ``str | None`` (``Optional``): null or as above;
    - ``list[X]``, ``tuple[X, ...]``, ``Sequence[X]`` of ``int``, ``float`` or ``bool``: a
      list whose every element is as above (the list is passed on as given).

    A finite float anywhere in any other value must still be 0 or within float32's
    range. An option annotated with a class no config value is an instance of
    (``object``, ``torch.Tensor``) is a :class:`~splitfed.errors.PluginError` naming it
    when it is set. Keys that are not parameters of ``fn`` are passed on unchanged for
    the component to refuse."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(options)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: no types
        hints = {}
    out = dict(options)
    for key, value in options.items():
        param = params.get(key)
        if param is None:
            continue
        hint = hints.get(key, param.annotation)
        if hint is inspect.Parameter.empty and isinstance(param.default, bool):
            hint = bool
        out[key] = _typed_option(hint, value, f"{section}.{key}")
    return out


_SEQUENCES = (list, tuple, Sequence, typing.Sequence)


def _typed_option(hint: Any, value: Any, key: str) -> Any:
    """``value`` of an option annotated ``hint`` (see :func:`typed_options`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if (origin is Union or origin is types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if value is None:
            return None
        if len(rest) == 1 and _typed_kind(rest[0]):
            return _typed_option(rest[0], value, key)
    if hint is bool or hint is int:
        return _convert(hint, value, key)
    if hint is float:
        return _option_float(value, key)
    if hint is str:
        if not isinstance(value, str):
            raise _type_error(key, _NAMES[str], value)
        return value
    item = _sequence_item(hint)
    if item is not None:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, f"a list ({type_name(hint)})", value)
        for i, v in enumerate(value):
            _typed_option(item, v, f"{key}[{i}]")
        return value
    if (isinstance(hint, type) and hint is not inspect.Parameter.empty
            and (hint is object or not any(issubclass(t, hint) for t in _YAML_TYPES))):
        raise _untyped(key, hint)
    _check_floats(Any, value, key)
    return value


#: the types of the values a config file holds
_YAML_TYPES = (bool, int, float, str, list, dict, type(None))


def _typed_kind(hint: Any) -> bool:
    """Whether :func:`_typed_option` checks an option annotated ``hint``."""
    return hint in (bool, int, float, str) or _sequence_item(hint) is not None


def _sequence_item(hint: Any) -> Any:
    """``X`` of ``list[X]``, ``tuple[X, ...]`` or ``Sequence[X]`` with ``X`` one of
    ``bool``, ``int``, ``float``; None for any other annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin not in _SEQUENCES:
        return None
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            return None
        args = args[:1]
    if len(args) == 1 and args[0] in (bool, int, float):
        return args[0]
    return None


def _option_float(value: Any, key: str) -> Any:
    """A component's float option: a number, not a boolean (a numeric string becomes a
    float, an integer stays one), 0 or within float32's range where it is finite."""
    number = _to_float(value, key)
    value = number if isinstance(value, str) else value
    check_float_range(number, key, value)
    return value


def check_float_range(number: float, key: str, shown: Any) -> None:
    """ConfigError naming ``key`` unless the float ``number`` is 0, within float32's
    range in magnitude, or not finite (infinity and NaN are left to the bounds or the
    component); ``shown``: the value as given."""
    if not math.isfinite(number) or number == 0 or FLOAT32_TINY <= abs(number) <= FLOAT32_MAX:
        return
    text = repr(shown)
    text = text if len(text) <= 40 else text[:37] + "..."
    raise ConfigError(f"{key}: {text} is outside float32's range ({FLOAT_RANGE_TEXT})")


def _check_floats(tp: Any, value: Any, key: str) -> None:
    """Every finite float of the converted ``value`` (annotated ``tp``), in lists, tuples
    and mappings too, is 0 or within float32's range (infinity and NaN are left to the
    bounds, which refuse them). The values of a ``dict[str, Any]`` are a component's
    options and are left to the component (:func:`typed_options`, or the options
    dataclass it builds)."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, float):
        check_float_range(value, key, value)
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, Mapping):
        item = args[1] if origin is dict and len(args) == 2 else Any
        if tp is not Any and item is Any:
            return
        for k, v in value.items():
            _check_floats(item, v, _join(key, str(k)))
    elif isinstance(value, (list, tuple)):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            items = list(args) if len(args) == len(value) else [Any] * len(value)
        else:
            items = [args[0] if origin in (list, tuple) and args else Any] * len(value)
        for i, (a, v) in enumerate(zip(items, value)):
            _check_floats(a, v, f"{key}[{i}]")


def bounds_text(meta: Mapping) -> str:
    """The bounds of a field's metadata as text, e.g. ``>= 1 and <= 1000000``."""
    parts = [f"{sign} {meta[n]}" for n, (sign, _) in _BOUNDS.items() if n in meta]
    return " and ".join(parts)


# ------------------------------------------------------------------ conversion


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Return ``value`` converted to the annotation ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else from_dict(tp, _mapping(value, key, tp), key)
    if origin is Literal:
        return _convert_literal(tp, value, key)
    if origin is Union or origin is types.UnionType:
        return _convert_union(tp, value, key)
    if tp in (list, tuple, dict) or origin in (list, tuple, dict):
        return _CONTAINERS[origin or tp](tp, value, key)
    if tp in _SCALARS:
        return _SCALARS[tp](value, key)
    raise _untyped(key, tp)


def _untyped(key: str, tp: Any) -> PluginError:
    return PluginError(f"{key}: its declared type {tp!r} is not one a config value can have "
                       "(bool, int, float, str, a Literal, a list, tuple or dict of these, a "
                       "dataclass, or a Union with None); change the option's annotation")


def _type_error(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {show(value)}")


def show(value: Any) -> str:
    """``value`` for a message: its repr, cut at 60 characters, and its type."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise _type_error(key, _NAMES[int], value)


#: a number written as text: a decimal (``2e5``, ``-0.5``), or ``inf`` / ``nan`` words
#: (Python's float() also takes ``1_0``, other scripts' digits and surrounding spaces)
NUMBER_TEXT = re.compile(r"[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|inf|infinity|nan)",
                         re.ASCII | re.IGNORECASE)


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a number (not a boolean) or a number's text
    (:data:`NUMBER_TEXT`; PyYAML reads ``1e-3`` and ``inf`` as strings), else None; an
    integer beyond any float becomes an infinity of its sign."""
    if isinstance(value, bool) or not (isinstance(value, (int, float))
                                       or isinstance(value, str)
                                       and NUMBER_TEXT.fullmatch(value)):
        return None
    try:
        return float(value)
    except OverflowError:                          # an integer beyond any float
        return math.inf if value > 0 else -math.inf


def _to_float(value: Any, key: str) -> float:
    number = as_number(value)
    if number is None:
        raise _type_error(key, _NAMES[float], value)
    if math.isinf(number) and isinstance(value, int):
        raise ConfigError(f"{key}: {show(value)} is outside float32's range "
                          f"({FLOAT_RANGE_TEXT})")
    return number


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _type_error(key, _NAMES[bool], value)


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    raise _type_error(key, _NAMES[str] + " (quote it in YAML)", value)


_SCALARS = {int: _to_int, float: _to_float, bool: _to_bool, str: _to_str}


def _convert_literal(tp: Any, value: Any, key: str) -> Any:
    allowed = typing.get_args(tp)
    for option in allowed:
        if _same(value, option):
            return option
    hint = _suggest(value, [a for a in allowed if isinstance(a, str)]) if isinstance(
        value, str) else ""
    options = ", ".join(repr(a) for a in allowed)
    raise ConfigError(f"{key}: expected one of {options}, got {show(value)}{hint}")


def _convert_union(tp: Any, value: Any, key: str) -> Any:
    arms = typing.get_args(tp)
    if value is None and type(None) in arms:
        return None
    for arm in arms:
        if arm is type(None):
            continue
        try:
            return _convert(arm, value, key)
        except ConfigError:
            continue
    raise _type_error(key, type_name(tp), value)


def _mapping(value: Any, key: str, tp: Any) -> Mapping:
    if isinstance(value, Mapping):
        return value
    raise _type_error(key, f"a mapping ({type_name(tp)})", value)


def _sequence(value: Any, key: str) -> Sequence:
    if isinstance(value, (list, tuple)):
        return value
    raise _type_error(key, "a list", value)


def _convert_list(tp: Any, value: Any, key: str) -> list:
    (item,) = typing.get_args(tp) or (Any,)
    return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(_sequence(value, key))]


def _convert_tuple(tp: Any, value: Any, key: str) -> tuple:
    args = typing.get_args(tp) or (Any, ...)
    seq = _sequence(value, key)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(seq))
    if len(seq) != len(args):
        raise _type_error(key, f"a list of {len(args)} items", value)
    return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, seq)))


def _convert_dict(tp: Any, value: Any, key: str) -> dict:
    _, item = typing.get_args(tp) or (str, Any)
    out = {}
    for k, v in _mapping(value, key, tp).items():
        if not isinstance(k, str):
            raise ConfigError(f"{key}: keys must be strings, got {show(k)}")
        out[k] = _convert(item, v, _join(key, k))
    return out


_CONTAINERS = {list: _convert_list, tuple: _convert_tuple, dict: _convert_dict}


def check_bounds(value: Any, key: str, meta: Mapping) -> None:
    """``value`` (a number, or a list or tuple of them; None passes) within the bounds of
    a field's metadata (``ge``, ``gt``, ``le``, ``lt``, ``choices``), else
    :class:`ConfigError` naming ``key``: the check every config value gets."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if isinstance(value, (list, tuple)) else key
        if item is not None:
            _check_item(item, where, meta)


def _check_item(item: Any, key: str, meta: Mapping) -> None:
    for name, (sign, ok) in _BOUNDS.items():
        if name not in meta:
            continue
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise _type_error(key, "a number", item)
        if isinstance(item, float) and math.isinf(item):   # a bounded number is finite
            allowed = bounds_text(meta)
            raise ConfigError(f"{key}: must be a finite number ({allowed}), got {item!r}")
        if not ok(item, meta[name]):
            allowed = bounds_text(meta)
            span = f" (allowed: {allowed})" if " and " in allowed else ""
            raise ConfigError(f"{key}: must be {sign} {meta[name]}, got {item!r}{span}")
    if "choices" in meta and not any(_equal(item, c) for c in meta["choices"]):
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(f"{key}: must be one of {allowed}, got {item!r}")


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same type (so ``True`` is not ``1`` and ``1.0`` is not ``1``)."""
    return type(a) is type(b) and a == b


def _equal(a: Any, b: Any) -> bool:
    """Equal, with booleans never equal to numbers (``2.0`` matches choice ``2``)."""
    return isinstance(a, bool) is isinstance(b, bool) and a == b


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------- to plain data


_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)   # libyaml where installed
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def yaml_round_trip(data: Any) -> Any:
    """``data`` written as YAML and read back (``yaml.safe_dump`` then ``safe_load``): the
    plain data a config file holds. Uses libyaml's parser and emitter where PyYAML has
    them (they give the same data, many times faster: a large study compares thousands
    of configs)."""
    return yaml.load(yaml.dump(data, Dumper=_SAFE_DUMPER, sort_keys=False),
                     Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader


def to_dict(obj: Any) -> dict:
    """Return the dataclass ``obj`` as a dict of YAML-safe values, in field order.

    Nested dataclasses become dicts, tuples become lists, numpy scalars become Python
    numbers; ``inf`` stays a float. ``from_dict(type(obj), to_dict(obj)) == obj``.
    Fields declared with ``init=False`` are left out.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {obj!r}")
    return {f.name: _plain(getattr(obj, f.name)) for f in _init_fields(type(obj))}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    return value


def value_text(value: Any) -> str:
    """How a config value reads in a label: ``0.1``, ``inf``, ``fedavg``, ``[16, 8]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix(
        "\n...").strip()


def dump_yaml(obj: Any, path: str | Path) -> None:
    """Write ``to_dict(obj)`` to ``path`` as YAML, keeping field order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_text(to_dict(obj), sort_keys=False), encoding="utf-8")


# ---------------------------------------------------------------- YAML and CLI

#: the largest YAML text read (a config, an override value): far above any real config
MAX_YAML_BYTES = 1 << 20
#: the deepest nesting of YAML collections accepted
MAX_YAML_DEPTH = 64


class _PlainLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases (``*name``) or merge keys (``<<``), without
    repeated keys and with bounded nesting.

    An alias repeats a node by reference, so a few hundred bytes of nested aliases
    expand to billions of nodes when a value is copied, compared or printed (the
    "billion laughs"). Configs never need one: an alias is refused at once, before
    anything is expanded."""

    def construct_object(self, node, deep=False):
        """A value its tag cannot be made of (``!!int abc``, ``!!bool maybe``, the date
        ``2001-13-45``) is a :class:`yaml.YAMLError` at the value's line, as a
        malformed document is."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError,
                OverflowError) as e:
            what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value as {node.tag.rsplit(':', 1)[-1]} "
                f"({one_line(what, 120)})", node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        """A mapping may not repeat a key (YAML's last-one-wins would hide a typo or a
        forgotten line), nor hold a merge key ``<<`` (the keys it merges in would be
        overridden by the mapping's own without a word, as a repeated key would be)."""
        if not isinstance(node, yaml.MappingNode):          # !!map or !!set on a list
            raise yaml.constructor.ConstructorError(
                None, None, f"expected a mapping for {node.tag}, found a "
                f"{node.id}", node.start_mark)
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None, None, "merge keys (<<) are not allowed in splitfed configs; write "
                    "the keys out", key_node.start_mark)
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} appears twice in one "
                        "mapping; keep one", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{event.anchor}) are not allowed in splitfed "
                "configs; write the value out", event.start_mark)
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth


#: YAML 1.2's integers (core schema): decimal (a leading zero is still decimal), 0o octal
#: and 0x hexadecimal. YAML 1.1's other forms, which PyYAML reads by default, change a
#: value without a word: 010 is 8 (octal), 1:20 is 80 and 1:20.5 is 80.5 (base 60),
#: 1_000 is 1000; here they are text, which a number field then refuses. Floats are
#: otherwise YAML 1.1's (1.5, .5, .inf, .nan; 1e-3 without a dot is text in a file).
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_11 = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
                           |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                           |[-+]?\.(?:inf|Inf|INF)
                           |\.(?:nan|NaN|NAN))$""", re.X)


#: the most digits an integer of a config may have (no field needs more than 20; Python
#: refuses to print one of more than 4300)
MAX_INT_DIGITS = 100


def _construct_int(loader, node) -> int:
    text = loader.construct_scalar(node)
    if len(text) > MAX_INT_DIGITS:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(text)} characters; at most {MAX_INT_DIGITS} "
            "are read", node.start_mark)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_PlainLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_PlainLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_11, list("-+0123456789."))
_PlainLoader.add_implicit_resolver(_INT_TAG, _INT_12, list("-+0123456789"))
_PlainLoader.add_constructor(_INT_TAG, _construct_int)


class _ValueLoader(_PlainLoader):
    """:class:`_PlainLoader` for the value of a ``key=value`` override, which also reads
    a number written with an exponent but without a dot (``1e-9``, ``-2E5``, ``1.5e3``)
    as a float, as YAML 1.2 does; YAML 1.1 reads those as strings. Quoted, it stays a
    string (``name='1e5'``)."""


_FLOAT_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_ValueLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_EXPONENT, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes every string :class:`_PlainLoader` or
    :class:`_ValueLoader` would read as something else (``'0o17'``, ``'1e5'``), beside
    those YAML 1.1 reads so (``'010'``, ``'yes'``): a config written and read back holds
    the same values."""


for _tag, _rx in [(_INT_TAG, _INT_12), (_FLOAT_TAG, _FLOAT_11), (_FLOAT_TAG, _FLOAT_EXPONENT)]:
    _Dumper.add_implicit_resolver(_tag, _rx, list("-+0123456789."))


def dump_text(data: Any, **options: Any) -> str:
    """``data`` (plain values) as YAML that :func:`yaml_load` reads back as the same
    values; ``options`` as ``yaml.dump``'s (``sort_keys``, ``default_flow_style``...)."""
    return yaml.dump(data, Dumper=_Dumper, **options)


def yaml_load(text: str, where: str, *, exponents: bool = False) -> Any:
    """Parse YAML ``text`` (safe types only, no aliases, bounded size and nesting);
    ConfigError names ``where`` and the line of the problem. ``exponents``: also read an
    unquoted ``1e-9`` as a float (as the value of a ``key=value`` override is read)."""
    loader = _ValueLoader if exponents else _PlainLoader
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters of YAML, more than the "
                          f"{MAX_YAML_BYTES} accepted")
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: {_yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None


def load_yaml(path: str | Path) -> dict:
    """Read a YAML file whose top level is a mapping; an empty file gives ``{}``.

    Raises ConfigError naming the path if the file is missing, cannot be parsed (with
    the line of the YAML error) or holds something other than a mapping.
    """
    return load_yaml_text(path)[0]


def load_yaml_text(path: str | Path) -> tuple[dict, str]:
    """:func:`load_yaml`'s mapping, and the text it was read from (read once: a file
    that changes meanwhile cannot give a text other than the one checked)."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise ConfigError(f"config file {path}: not a regular file (a directory, a pipe "
                              "or a device); give a YAML file")
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = read_regular(path, f"cannot parse {path}", MAX_YAML_BYTES, error=ConfigError)
        text = raw.decode("utf-8")
        data = yaml_load(text, f"cannot parse {path}")
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read {path}: not UTF-8 text (byte {err.start}: "
                          f"{err.reason}); save the file as UTF-8") from err
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from err
    if data is None:
        return {}, text
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data, text


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = one_line(getattr(err, "problem", None) or err, None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


class _Delete:
    """The value of a ``~key`` override: :func:`merge` removes the key."""

    def __repr__(self) -> str:
        return "<deleted>"

    def __copy__(self) -> _Delete:
        return self

    def __deepcopy__(self, memo) -> _Delete:
        return self


#: marks a key to remove (``~key`` on the command line)
DELETE = _Delete()


def parse_overrides(items: Sequence[str]) -> dict:
    """Turn ``["train.lr=0.1", "model.hidden=[64,32]"]`` into a nested dict.

    The key is split on dots; the value is parsed with ``yaml.safe_load``, so ``0.1`` is
    a float, ``[64,32]`` a list, ``true`` a bool, ``null`` None; a number with an
    exponent is a float also without a dot (``1e-9``; YAML 1.1 would read a string, and
    options of components would see one). An empty value
    (``key=``) is None, as an empty value is in a YAML file; write ``key=''`` for an
    empty string. ``~key`` (no ``=``) removes the key from the config it is merged into
    (:data:`DELETE`), e.g. ``~partition.alpha`` before ``partition.scheme=pathological``
    on a Dirichlet base. Later items win. ConfigError names the item when it has no
    ``=``, an empty key or key part, an unparsable value, or sets a key below a
    non-mapping value.
    """
    out: dict = {}
    for item in items:
        key, value = _split_item(item)
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {_quote(item)}: '{part}' was already set to a "
                                  "value")
        node[leaf] = value
    return out


def _split_item(item: str) -> tuple[str, Any]:
    if item.startswith("~") and "=" not in item:
        key = item[1:].strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {_quote(item)} must look like ~key.sub (removes "
                              "the key)")
        return key, DELETE
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {_quote(item)} must look like key.sub=value")
    return key, yaml_load(text, f"override {_quote(item)}: cannot parse value",
                          exponents=True)


def _quote(item: str, limit: int = 80) -> str:
    """``item`` quoted for a one-line message: line breaks and control characters
    escaped, shortened to about ``limit`` characters."""
    text = item.encode("unicode_escape").decode("ascii").replace("'", "\\'")
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"'{text}'"


def merge(base: Mapping, override: Mapping) -> dict:
    """Deep-merge ``override`` into ``base`` and return a new dict; inputs are untouched.

    Where both hold a mapping under the same key the mappings are merged recursively;
    otherwise the override's value replaces the base's (lists are replaced, not joined).
    A value :data:`DELETE` (a ``~key`` override) removes the key.
    """
    return _merge(base, override, "")


def _merge(base: Mapping, override: Mapping, path: str) -> dict:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        where = _join(path, str(key))
        if value is DELETE:
            if key not in out:
                raise ConfigError(f"override '~{where}': the config sets no key '{where}' "
                                  "(nothing to remove); check the name")
            del out[key]
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value, where)
        else:
            out[key] = _without_deletes(copy.deepcopy(value), where)
    return out


def _without_deletes(value: Any, path: str) -> Any:
    if isinstance(value, Mapping):
        for k, v in value.items():
            if v is DELETE:
                where = _join(path, str(k))
                raise ConfigError(f"override '~{where}': the config sets no key '{where}' "
                                  "(nothing to remove); check the name")
        return {k: _without_deletes(v, _join(path, str(k))) for k, v in value.items()}
    return value


# ------------------------------------------------------------------- describing


def type_name(tp: Any) -> str:
    """A short readable name for an annotation, e.g. ``list[int]`` or ``float | None``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(tp, "__name__", repr(tp))


def describe(cls: type, path: str = "") -> str:
    """List every key of the dataclass ``cls`` (dotted, nested ones expanded), one a line.

    Each line reads ``key: type = default  [bounds]  help``; ``required`` stands in for
    a missing default.
    """
    hints = typing.get_type_hints(cls)
    lines = []
    for f in _init_fields(cls):
        key, tp = _join(path, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{key}: {type_name(tp)}  {f.metadata.get('help', '')}".rstrip())
            lines.append(describe(tp, key))
        else:
            lines.append(_describe_field(key, tp, f))
    return "\n".join(lines)


def _describe_field(key: str, tp: Any, f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        default = repr(_plain(f.default))
    elif f.default_factory is not dataclasses.MISSING:
        default = repr(_plain(f.default_factory()))
    else:
        default = "required"
    bounds = [f"{sign} {f.metadata[n]}" for n, (sign, _) in _BOUNDS.items() if n in f.metadata]
    if "choices" in f.metadata:
        bounds.append("one of " + ", ".join(repr(c) for c in f.metadata["choices"]))
    text = f"{key}: {type_name(tp)} = {default}"
    text += f"  [{', '.join(bounds)}]" if bounds else ""
    return f"{text}  {f.metadata.get('help', '')}".rstrip()
