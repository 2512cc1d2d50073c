"""Where plugin components came from, for error messages.

kind -> name -> the plugin (as given) or module that registered the component; built-in
components are not listed. :mod:`splitfed.registry` fills it when a plugin registers a
component; the layers it registers into (models, data, engine) read it here, so that
they name a plugin in their errors without importing the registry, which imports them.
"""

from __future__ import annotations

from splitfed.errors import describe

#: kind -> name -> where a plugin component came from (kinds as splitfed.registry names them)
ORIGINS: dict[str, dict[str, str]] = {}
#: the plugins imported so far, in order (splitfed.registry.load_plugins appends to it;
#: the provenance of a run records them)
LOADED_PLUGINS: list[str] = []


def origin(kind: str, name: str) -> str | None:
    """Where the plugin component ``name`` of ``kind`` came from (a module name or a file
    path); None for a built-in component (or an unknown name)."""
    return ORIGINS.get(kind, {}).get(name)


def component(kind: str, name: str) -> str:
    """``kind 'name'``, with the plugin that registered it (for error messages)."""
    where = origin(kind, name)
    return f"{kind} {name!r}" + (f" (plugin {where})" if where else "")


def call_algorithm(name: str, during: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, the code of the algorithm registered as ``name`` (its
    class, or a method of it), as :func:`call_plugin` calls a component: a plugin
    algorithm's exception (also one splitfed's engine raised for what the algorithm gave
    it) becomes ``algorithm.name: algorithm 'x' (plugin p) failed in <during>: ValueError:
    ...``; a built-in algorithm's exceptions pass unchanged."""
    return _call("algorithm", name, "algorithm.name", f" in {during}", fn, *args, **kwargs)


def call_plugin(kind: str, name: str, field: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, the code of component ``name`` of ``kind``. When a plugin
    registered it, an exception of the plugin's own code (anything but splitfed's errors)
    becomes one :class:`~splitfed.errors.PluginError` naming ``field``, the component,
    its plugin and the exception, instead of a traceback through splitfed (the exception
    stays its ``__cause__``); a built-in component's exceptions pass unchanged."""
    return _call(kind, name, field, "", fn, *args, **kwargs)


def _call(kind: str, name: str, field: str, during: str, fn, *args, **kwargs):
    if origin(kind, name) is None:
        return fn(*args, **kwargs)
    from splitfed.errors import PluginError, SplitfedError

    try:
        return fn(*args, **kwargs)
    except SplitfedError:
        raise
    except Exception as e:  # noqa: BLE001 - the plugin's own failure, reported as such
        at = plugin_frame(e)
        raise PluginError(f"{field}: {component(kind, name)} failed{during}: "
                          + describe(e) + (f" (at {at})" if at else "")) from e


def plugin_frame(e: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``e``'s traceback in code that is neither
    splitfed's nor torch's, numpy's or Python's own: where in the plugin it happened (a
    plugin installed into site-packages too, which may lie inside Python's own
    directory)."""
    import os
    import sys
    import traceback

    skip = [os.path.dirname(os.path.abspath(__file__))]
    for lib in ("torch", "numpy"):
        module = sys.modules.get(lib)
        if getattr(module, "__file__", None):
            skip.append(os.path.dirname(os.path.abspath(module.__file__)))
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if frame.filename.startswith("<"):   # generated code (a dataclass's __init__)
            continue
        path = os.path.abspath(frame.filename)
        if not any(_under(path, d) for d in skip) and not _python_own(path):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _under(path: str, directory: str) -> bool:
    import os

    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _python_own(path: str, stdlib: str | None = None,
                sites: list[str] | None = None) -> bool:
    """Whether ``path`` is Python's standard library: under ``stdlib`` (default: the
    directory of ``os``) but not under one of the ``sites`` (default: the installation's
    site-packages directories, which can lie inside it, e.g. /usr/local/lib/python3.x/
    site-packages)."""
    import os
    import site
    import sysconfig

    if stdlib is None:
        stdlib = os.path.dirname(os.path.abspath(os.__file__))
    if sites is None:
        paths = sysconfig.get_paths()
        sites = [paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages",
                                                              list)()]
        user = getattr(site, "getusersitepackages", lambda: None)()
        sites += [user] if isinstance(user, str) else []
    return _under(path, stdlib) and not any(_under(path, os.path.abspath(d)) for d in sites)
