"""The axes of a sweep, read from the command line without importing torch, so that a
malformed value is answered at once (:mod:`splitfed.sweep`)."""

from __future__ import annotations

import json
from typing import Any

from splitfed.configtools import yaml_load
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
            if len({json.dumps(v, sort_keys=True, default=str) for v in values}) < len(values):
                raise ConfigError(f"sweep: '{item}' repeats a value")
            axes[key] = values
    return axes, overrides
