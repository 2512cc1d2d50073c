"""Where plugin components came from, for error messages.

kind -> name -> the plugin (as given) or module that registered the component; built-in
components are not listed. :mod:`splitfed.registry` fills it when a plugin registers a
component; the layers it registers into (models, data, engine) read it here, so that
they name a plugin in their errors without importing the registry, which imports them.
"""

from __future__ import annotations

#: kind -> name -> where a plugin component came from (kinds as splitfed.registry names them)
ORIGINS: dict[str, dict[str, str]] = {}


def origin(kind: str, name: str) -> str | None:
    """Where the plugin component ``name`` of ``kind`` came from (a module name or a file
    path); None for a built-in component (or an unknown name)."""
    return ORIGINS.get(kind, {}).get(name)
