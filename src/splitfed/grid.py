"""The axes of a sweep, read from the command line without importing torch, so that a
malformed value is answered at once (:mod:`splitfed.sweep`)."""

from __future__ import annotations

import json
from typing import Any

from splitfed.configtools import value_text, yaml_load
from splitfed.errors import ConfigError


def parse_axes(items: list[str]) -> tuple[dict[str, list[Any]], list[str]]:
    """``["train.lr=0.01,0.1", "rounds=5"]`` -> (axes ``{"train.lr": [0.01, 0.1]}``,
    overrides ``["rounds=5"]``). ConfigError names a malformed item."""
    axes: dict[str, list[Any]] = {}
    overrides: list[str] = []
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
        if key in axes or any(o.partition("=")[0] == key for o in overrides):
            raise ConfigError(f"sweep: '{key}' is given twice; give all its values at once, "
                              f"{key}=v1,v2,...")
        if len(values) == 1:
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
