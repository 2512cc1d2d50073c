"""The axes of a sweep, read from the command line without importing torch, so that a
malformed value is answered at once (:mod:`splitfed.sweep`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from splitfed.configtools import value_text, yaml_load
from splitfed.errors import ConfigError


def set_keys(key: str, value: Any) -> list[str]:
    """The dotted keys that setting ``key`` to ``value`` sets: ``key`` itself, or, for a
    section written as a mapping (``train={lr: 0.3}``, merged into the config's section),
    the keys it sets inside it (``train.lr``)."""
    if isinstance(value, Mapping) and value:
        return [k for sub, v in value.items() for k in set_keys(f"{key}.{sub}", v)]
    return [key]


def axis_keys(key: str, values: Any) -> list[str]:
    """The dotted keys that an axis ``key`` sets in every run: those that each of its
    ``values`` sets (:func:`set_keys`); ``key`` itself when ``values`` is not a list."""
    if not isinstance(values, list) or not values:
        return [key]
    each = [set_keys(key, v) for v in values]
    return [k for k in each[0] if all(k in keys for keys in each[1:])]


def parse_axes(items: list[str]) -> tuple[dict[str, list[Any]], list[str]]:
    """``["train.lr=0.01,0.1", "rounds=5"]`` -> (axes ``{"train.lr": [0.01, 0.1]}``,
    overrides ``["rounds=5"]``). ConfigError names a malformed item, and a key given
    twice: an axis twice, or a value that an override sets and another item sets too
    (compared by the keys they set, :func:`set_keys`: ``train={lr: 0.3}`` sets
    ``train.lr``; an option spelled flat or under its section's ``options`` is one key,
    :func:`~splitfed.config.keys_overlap`), since one of them would reach no run."""
    from splitfed.config import keys_overlap

    axes: dict[str, list[Any]] = {}
    overrides: list[str] = []
    by_axis: set[str] = set()              # the keys that earlier axes set in every run
    by_override: set[str] = set()          # and that earlier overrides set
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"sweep: '{item}' must look like key.sub=v1,v2,... "
                              "(e.g. train.lr=0.01,0.1)")
        values = yaml_load(f"[{text}]", f"sweep: '{item}': cannot parse the values as YAML",
                           exponents=True)
        if not values:
            raise ConfigError(f"sweep: '{item}' gives no value; write key=v1,v2,...")
        single = len(values) == 1
        mine = set_keys(key, values[0]) if single else axis_keys(key, values)
        earlier = [*by_override, *(by_axis if single else ())]
        twice = [k for k in mine if any(keys_overlap(k, e) for e in earlier)]
        if key in axes or twice:
            twice = twice[0] if twice else key
            raise ConfigError(f"sweep: '{twice}' is given twice; give all its values at "
                              f"once, {twice}=v1,v2,...")
        (by_override if single else by_axis).update(mine)
        if single:
            overrides.append(item)
        else:
            check_distinct(values, f"sweep: '{item}'")
            check_axis_count(len(axes) + 1, "sweep")
            check_apart(key, list(axes), "sweep")
            axes[key] = values
    return axes, overrides


#: the most keys a grid may have (each run's label names every swept key, and the keys
#: are checked pairwise: 64 is far more than any study needs)
MAX_AXES = 64


def check_axis_count(count: int, where: str) -> None:
    """Refuse a grid of more than :data:`MAX_AXES` keys, before any pairwise check."""
    if count > MAX_AXES:
        raise ConfigError(f"{where}: {count} keys, more than the {MAX_AXES} a grid may have")


def check_apart(key: str, earlier: list[str], where: str) -> None:
    """Refuse an axis ``key`` that sets a value one of the ``earlier`` axes sets too
    (``train.lr`` and ``train``): one would silently replace the other's values in every
    run, and the runs' labels would name values they did not use."""
    from splitfed.config import keys_overlap

    for other in earlier:
        if keys_overlap(key, other):
            raise ConfigError(f"{where}: the axes '{other}' and '{key}' set the same value "
                              "(one is the other, or a section around it); the later "
                              "would replace the earlier's values in every run: give one "
                              "of them")


def check_distinct(values: list, where: str) -> None:
    """Refuse an axis with two values that would make the same run, or two runs of one
    label: the same value twice, one number written twice (``1,1.0``), or two values
    that read the same in a label (``inf,.inf``: text and a float). ``where`` starts
    the error (``sweep: 'train.lr=...'``, ``study.grid.train.lr``)."""
    seen: dict[Any, Any] = {}
    for v in values:
        keys = [("json", json.dumps(v, sort_keys=True, default=str)),
                ("text", value_text(v))]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            keys.append(("number", v))
        for kind, key in keys:
            if (kind, key) not in seen:
                continue
            first = seen[kind, key]
            why = {"json": f"{_described(v)} is given twice",
                   "text": f"{_described(first)} and {_described(v)} read the same in the "
                           "runs' labels",
                   "number": f"{_described(first)} and {_described(v)} are the same number"}
            raise ConfigError(f"{where} repeats a value: {why[kind]}; give each "
                              "value once")
        for key in keys:
            seen[key] = v


def _described(value: Any) -> str:
    if isinstance(value, str):
        return f"the text {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"the number {value_text(value)}"
    return value_text(value)
