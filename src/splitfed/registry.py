"""Plugins: register your own algorithms, transforms, models, data sets, partitioners and
clock profiles.

A plugin is a Python module that registers components with the decorators below when it
is imported::

    from splitfed import register_model

    @register_model("tiny_cnn")
    def tiny_cnn(input_shape, num_classes, *, width=8):
        ...                                    # returns a splitfed.models.BlockModel

Every command imports the plugins before it reads a config (see ``docs/extending.md``):

- the modules listed under ``plugins:`` in the config (module names such as
  ``my_lab.splitfed_plugin``, imported from the Python environment; never file paths);
- the modules given with ``--plugin MODULE`` on the command line (``run``, ``sweep``,
  ``study``, ``launch``, ``list``, ``partition``); they are added to the config's
  ``plugins``, so that ``--resume``, every run of a sweep or study and every process of
  ``launch`` imports them again;
- the entry points of the group ``splitfed.plugins`` of installed packages (imported by
  every command and by :func:`splitfed.config.build_config`, once per process).

The registries are the same dicts the package uses for its built-in components
(``splitfed.algorithms.ALGORITHMS``, ``splitfed.models.MODELS``,
``splitfed.data.DATASETS``, ``splitfed.data.partition.PARTITIONERS``,
``splitfed.engine.profiles.GENERATORS``, ``splitfed.algorithms.TRANSFORMS``); a registered
component is looked up, and its options are validated, exactly as a built-in one.
Registering a name that is taken (built in, or by another plugin) raises
:class:`~splitfed.errors.PluginError` naming the kind, the name, the module of the
component that holds it and the module registering it again, unless ``replace=True``.
A component is recorded as coming from the plugin being imported when the module that
registers it belongs to that plugin's package, else from that module itself (a package
the plugin imports, which registers its own components).

This module imports neither torch nor the registries until something is registered, so
``import splitfed`` stays light.
"""

from __future__ import annotations

import importlib
import sys
from splitfed.errors import PluginError, SplitfedError, describe, one_line
from splitfed.origins import (  # noqa: F401 - origin: splitfed.registry.origin
    LOADED_PLUGINS,
    ORIGINS,
    origin,
)

TYPE_CHECKING = False
if TYPE_CHECKING:                               # typing is not imported at run time
    from collections.abc import Callable, Iterable
    from typing import Any

#: the entry-point group whose entry points every command imports
ENTRY_POINT_GROUP = "splitfed.plugins"

#: kind -> (module of the registry, name of its dict)
_REGISTRIES = {
    "algorithm": ("splitfed.algorithms", "ALGORITHMS"),
    "model": ("splitfed.models", "MODELS"),
    "dataset": ("splitfed.data", "DATASETS"),
    "partitioner": ("splitfed.data.partition", "PARTITIONERS"),
    "clock profile": ("splitfed.engine.profiles", "GENERATORS"),
    "transform": ("splitfed.algorithms", "TRANSFORMS"),
}
#: the leading positional parameters each kind of function is called with; its other
#: parameters are its options (validated against the config's keys)
_LEADING = {
    "model": ("input_shape", "num_classes"),
    "dataset": ("data_dir", "rng"),
    "partitioner": ("labels", "num_clients", "rng"),
    "clock profile": ("num_clients", "rng"),
}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")

#: kind -> name -> where a component registered through this module came from (the plugin
#: as given, or the module that defined it); built-in components are not listed. It is
#: :data:`splitfed.origins.ORIGINS`, which the lower layers read for their errors.
_ORIGINS: dict[str, dict[str, str]] = ORIGINS
_ORIGINS.update({kind: {} for kind in _REGISTRIES})
#: the plugins being imported (innermost last), to record where registrations come from
_LOADING: list[str] = []
#: whether the entry points were loaded (the plugins imported so far, as given, are
#: :data:`splitfed.origins.LOADED_PLUGINS`, which provenance reads)
_ENTRY_POINTS_LOADED = False
#: registrations made so far (replacements included): a plugin whose import adds none is
#: reported (its ``@register_...`` lines live in a module it does not import)
_COUNT = [0]


def registry(kind: str) -> dict:
    """The registry dict of ``kind`` (``"algorithm"``, ``"model"``, ``"dataset"``,
    ``"partitioner"``, ``"clock profile"`` or ``"transform"``): the package's own dict."""
    module, attr = _REGISTRIES[kind]
    return getattr(importlib.import_module(module), attr)


def plugin_entries(kind: str) -> dict[str, str]:
    """The components of ``kind`` registered by plugins: name -> where it came from."""
    return dict(_ORIGINS[kind])


def _key(kind: str, name: str) -> str:
    if (not isinstance(name, str) or not name or name[0] in ".+-"
            or not set(name) <= _NAME_CHARS):
        raise PluginError(f"register_{kind.replace(' ', '_')}: the name must be a non-empty "
                          f"string of letters, digits, '_', '.', '+', '-', got {name!r}")
    if kind != "dataset":
        return name
    from splitfed.data import dataset_key

    return dataset_key(name)


def _where(kind: str, name: str, obj: Any) -> str:
    known = _ORIGINS[kind].get(name)
    if known is not None:
        return f"plugin {known}"
    return f"built in, {getattr(obj, '__module__', None) or 'splitfed'}"


def _check_function(kind: str, name: str, fn: Any) -> None:
    import inspect

    what = f"register_{kind.replace(' ', '_')}({name!r})"
    if not callable(fn):
        raise PluginError(f"{what}: expected a function, got {fn!r}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise PluginError(f"{what}: cannot read the signature of {fn!r}") from None
    lead = _LEADING[kind]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if (len(params) < len(lead) or any(p.kind not in positional for p in params[:len(lead)])
            or [p.name for p in params[:len(lead)]] != list(lead)):
        given = ", ".join(p.name for p in params[:len(lead)])
        raise PluginError(f"{what}: {getattr(fn, '__name__', fn)} must take "
                          f"({', '.join(lead)}, ...) as its first positional parameters, "
                          f"in that order (it takes ({given}, ...)); splitfed passes them by "
                          "position, and the parameters after them are the options")
    if any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
           for p in params):
        raise PluginError(f"{what}: {getattr(fn, '__name__', fn)} must name its options "
                          "(no *args or **kwargs): they are checked against the config")
    if kind == "model" and any(p.kind is not inspect.Parameter.KEYWORD_ONLY
                               for p in params[len(lead):]):
        raise PluginError(f"{what}: the options of a model are keyword-only: "
                          "def builder(input_shape, num_classes, *, option=default)")
    _check_option_names(what, SECTIONS[kind], [p.name for p in params[len(lead):]])


#: the config section whose other keys are each kind's options (a transform has none: its
#: options are the keys of its entry in a transform list)
SECTIONS = {"model": "model", "dataset": "data", "partitioner": "partition",
            "clock profile": "clock", "algorithm": "algorithm"}


#: the keys of each section that splitfed reads itself (the fields of its config class,
#: splitfed.config; tests/test_plugin_errors.py checks that they agree)
SECTION_KEYS = {
    "data": ("name", "data_dir", "limit_train", "limit_test", "options"),
    "partition": ("scheme", "num_clients", "options"),
    "model": ("name", "cut", "options"),
    "algorithm": ("name", "client_transforms", "server_transforms", "options"),
    "clock": ("profile", "deadline", "over_select", "options"),
}


def _check_option_names(what: str, section: str, names: list[str]) -> None:
    """An option may not be named as one of the section's own keys (``data.limit_train``,
    ``model.cut``, ``clock.deadline``, ``algorithm.name``): the config's value of that key
    goes to splitfed, and the option would silently keep its default."""
    own = SECTION_KEYS[section]
    for name in names:
        if name in own:
            raise PluginError(f"{what}: the option {name!r} has the name of the key "
                              f"{section}.{name}, which splitfed reads itself, so the option "
                              "would never be set from a config; rename it")


def _check_algorithm(name: str, cls: Any) -> None:
    import dataclasses

    from splitfed.engine.algorithm import Algorithm

    what = f"register_algorithm({name!r})"
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise PluginError(f"{what}: expected a subclass of splitfed.engine.algorithm."
                          f"Algorithm, got {cls!r}")
    if not _dataclass_type(cls.Options):
        raise PluginError(f"{what}: {cls.__name__}.Options must be a dataclass (its fields "
                          "are the algorithm's options), the class itself, not an "
                          "instance of it")
    _check_option_names(what, "algorithm", [f.name for f in dataclasses.fields(cls.Options)])
    if cls.round is Algorithm.round:
        raise PluginError(f"{what}: {cls.__name__} does not define round(self, env, state, t, "
                          "cohort) -> RoundResult, the method every algorithm implements")
    _check_method(what, cls, "round", ("env", "state", "t", "cohort"))


def _check_method(what: str, cls: type, method: str, params: tuple[str, ...]) -> None:
    """``cls.method`` can be called as splitfed calls it: ``(self, *params)`` by position;
    else a PluginError now, not a TypeError in the first round of a run."""
    import inspect

    fn = getattr(cls, method)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return                                 # not introspectable: called as it is
    try:
        sig.bind(*(("self",) + params))
    except TypeError:
        takes = ", ".join(str(p) for p in sig.parameters.values())
        raise PluginError(f"{what}: {cls.__name__}.{method} must take (self, "
                          f"{', '.join(params)}), splitfed passes them by position; it "
                          f"takes ({takes})") from None


def _dataclass_type(options: Any) -> bool:
    """``options`` is a dataclass class (``dataclasses.is_dataclass`` is true of an
    instance too, which would fail later, when the run's config is read)."""
    import dataclasses

    return isinstance(options, type) and dataclasses.is_dataclass(options)


def _check_transform(name: str, cls: Any) -> None:
    import dataclasses

    from splitfed.engine.transforms import GradientTransform, ServerStep

    what = f"register_transform({name!r})"
    if not (isinstance(cls, type) and issubclass(cls, (GradientTransform, ServerStep))):
        raise PluginError(f"{what}: expected a subclass of splitfed.engine.transforms."
                          f"GradientTransform or ServerStep, got {cls!r}")
    if not _dataclass_type(cls.Options):
        raise PluginError(f"{what}: {cls.__name__}.Options must be a dataclass (its fields "
                          "are the transform's options), the class itself, not an "
                          "instance of it")
    if cls.name != name:
        raise PluginError(f"{what}: the class's name attribute is {cls.name!r}; set "
                          f"name = {name!r} (it keys the transform's state)")
    if "name" in {f.name for f in dataclasses.fields(cls.Options)}:
        raise PluginError(f"{what}: the option 'name' is the key that names the transform in "
                          "algorithm.client_transforms / server_transforms; rename it")
    if issubclass(cls, GradientTransform) and cls.start is GradientTransform.start:
        raise PluginError(f"{what}: {cls.__name__} does not define start(self, env, state, t, "
                          "cohort, round_), the method every gradient transform implements")
    if issubclass(cls, ServerStep) and cls.update is ServerStep.update:
        raise PluginError(f"{what}: {cls.__name__} does not define update(self, ctx, model), "
                          "the method every server step implements")
    if issubclass(cls, GradientTransform):
        _check_method(what, cls, "start", ("env", "state", "t", "cohort", "round_"))
    else:
        _check_method(what, cls, "update", ("ctx", "model"))


def _caller() -> str | None:
    """The module whose code calls the registration (the first frame outside this
    module), or None when it cannot be told."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return None if frame is None else frame.f_globals.get("__name__")


def _origin(caller: str | None, obj: Any) -> str:
    """Where a registration comes from: the plugin being imported when the registering
    module belongs to it (the same top-level package), else the registering module (a
    module the plugin imported: another package, which registered on its own)."""
    if _LOADING:
        if caller is None:
            return _LOADING[-1]
        for spec in reversed(_LOADING):
            base = spec.split(":")[0]
            if caller.split(".")[0] == base.split(".")[0]:
                return spec
        return caller
    return getattr(obj, "__module__", None) or caller or "?"


def _register(kind: str, name: str, obj: Any, replace: bool) -> Any:
    key = _key(kind, name)
    if kind == "algorithm":
        _check_algorithm(key, obj)
    elif kind == "transform":
        _check_transform(key, obj)
    else:
        _check_function(kind, key, obj)
    table = registry(kind)
    caller = _caller()
    if key in table and not replace:
        again = caller or getattr(obj, "__module__", None) or "?"
        raise PluginError(f"{kind} {key!r} is already registered ({_where(kind, key, table[key])})"
                          f" and {again} registers it again; choose another name, or pass "
                          f"replace=True to register_{kind.replace(' ', '_')} to replace it")
    table[key] = obj
    _ORIGINS[kind][key] = _origin(caller, obj)
    _COUNT[0] += 1
    return obj


def _decorator(kind: str, name: str, obj: Any, replace: bool):
    if obj is not None:
        return _register(kind, name, obj, replace)

    def decorate(target):
        _register(kind, name, target, replace)
        return target
    return decorate


def register_algorithm(name: str, cls: type | None = None, *, replace: bool = False):
    """Register an algorithm class (a subclass of
    :class:`~splitfed.engine.algorithm.Algorithm` whose ``Options`` dataclass holds its
    options) as ``algorithm.name: NAME``. Use as ``@register_algorithm("name")`` or
    ``register_algorithm("name", cls)``. Set the class attribute ``distributed = True``
    when every client computation goes through the engine's placed primitives, so that
    ``splitfed launch`` runs it (a subclass of a built-in algorithm inherits it)."""
    return _decorator("algorithm", name, cls, replace)


def register_model(name: str, builder: Callable | None = None, *, replace: bool = False):
    """Register ``builder(input_shape, num_classes, *, options...) -> BlockModel`` as
    ``model.name: NAME``; its keyword-only parameters are the model's options."""
    return _decorator("model", name, builder, replace)


def register_dataset(name: str, loader: Callable | None = None, *, replace: bool = False):
    """Register ``loader(data_dir, rng, options...) -> DataBundle`` as ``data.name: NAME``
    (matched case-insensitively, ``-`` read as ``_``); its parameters after ``rng`` are
    the data set's options."""
    return _decorator("dataset", name, loader, replace)


def register_partitioner(name: str, fn: Callable | None = None, *, replace: bool = False):
    """Register ``fn(labels, num_clients, rng, params...) -> list of index arrays`` as
    ``partition.scheme: NAME``; its parameters after ``rng`` are the scheme's options."""
    return _decorator("partitioner", name, fn, replace)


def register_clock_profile(name: str, fn: Callable | None = None, *, replace: bool = False):
    """Register ``fn(num_clients, rng, *, options...) -> Profiles`` as
    ``clock.profile: NAME``; its parameters after ``rng`` are the profile's options."""
    return _decorator("clock profile", name, fn, replace)


def register_transform(name: str, cls: type | None = None, *, replace: bool = False):
    """Register a gradient transform or a server step (a subclass of
    :class:`~splitfed.engine.transforms.GradientTransform` or
    :class:`~splitfed.engine.transforms.ServerStep` with ``name = NAME`` and an
    ``Options`` dataclass) for ``algorithm.client_transforms`` / ``server_transforms``:
    ``[{name: NAME, option: value}]``."""
    return _decorator("transform", name, cls, replace)


# ------------------------------------------------------------------- loading plugins


def add_plugin_argument(parser) -> None:
    """``--plugin MODULE`` (repeatable) on an ``argparse`` parser: the commands of
    ``splitfed`` and the worker of ``splitfed launch``."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE (a module name, from this Python environment) "
                             "first: it registers algorithms, transforms, models, data sets, "
                             "partitioners or clock profiles (repeat for several; recorded "
                             "in the config's plugins; docs/extending.md)")


def plugin_spec(spec: str) -> str:
    """A plugin as the config records it: a dotted module name, imported from the Python
    environment (an installed package, or a directory on ``PYTHONPATH``).

    A file path is refused: configs, study files and the ``config.yaml`` of a run
    directory are shared, and a config may choose among the code the user has installed,
    never bring its own (``docs/safety.md``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"plugins: expected a module name, got {spec!r}")
    spec = spec.strip()
    parts = spec.split(".")
    if not all(part.isidentifier() for part in parts) or parts[-1] == "py":
        raise PluginError(f"plugins: {spec!r} is not a module name (such as my_lab or "
                          "my_lab.plugins); a plugin is imported from this Python "
                          "environment: install its package or put its directory on "
                          "PYTHONPATH (a config cannot name a file to execute)")
    return spec


def _import_module(name: str):
    """``importlib.import_module(name)`` without the current directory on ``sys.path``
    (``python -m`` puts it there): a plugin comes from the Python environment, not from
    a module that happens to lie where a shared config is run (unless ``PYTHONPATH``
    names that directory)."""
    import os

    cwd = os.getcwd()
    given = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p}
    hidden = [p for p in sys.path if (p in ("", ".") or os.path.abspath(p) == cwd)
              and os.path.abspath(p or ".") not in given]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in hidden]
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved + [p for p in sys.path if p not in saved]


def _import(spec: str, what: str, load: Callable[[], Any]) -> Any:
    _LOADING.append(spec)
    try:
        return load()
    except SplitfedError as e:                  # e.g. a name clash while registering
        raise PluginError(f"{what} {spec}: {one_line(e, None)}") from e
    except (ImportError, SyntaxError) as e:
        raise PluginError(f"{what} {spec!r} cannot be imported: "
                          f"{describe(e, None)}") from e
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the plugin's code failed (or exited)
        raise PluginError(f"{what} {spec!r} failed while importing: "
                          f"{describe(e)}") from e
    finally:
        _LOADING.pop()


def load_plugins(specs: Iterable[str] | None) -> list[str]:
    """Import the plugins ``specs`` (module names) that this process has not imported yet,
    in order; returns them as :func:`plugin_spec` records them. A plugin that cannot be
    imported raises :class:`~splitfed.errors.PluginError` naming it; one whose import
    registers nothing (and that this process had not imported before) is named in a
    warning on stderr: the names a config gives it would be unknown."""
    out = []
    for raw in specs or ():
        spec = plugin_spec(raw)
        out.append(spec)
        if spec in LOADED_PLUGINS:
            continue
        fresh, before = spec not in sys.modules, _COUNT[0]
        _import(spec, "plugin", lambda s=spec: _import_module(s))
        LOADED_PLUGINS.append(spec)
        if fresh and _COUNT[0] == before:
            print(f"splitfed: warning: plugin {spec} registered nothing while imported "
                  "(no register_* call ran; a module holding them that it does not import "
                  "is not read)", file=sys.stderr, flush=True)
    return out


def load_entry_points() -> list[str]:
    """Import (once per process) the entry points of the group ``splitfed.plugins``; an
    entry point naming a callable (``pkg.module:register``) is also called. Their
    modules count as loaded plugins (:func:`loaded_plugins`), so that a run's provenance
    records their code. Returns the entry points' names."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return []
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        def load(ep=ep):
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj()
            return obj
        _import(ep.value, f"plugin (entry point {ep.name!r} of group {ENTRY_POINT_GROUP})",
                load)
        if ep.module not in LOADED_PLUGINS:
            LOADED_PLUGINS.append(ep.module)
        names.append(ep.name)
    return names


def loaded_plugins() -> list[str]:
    """The plugins imported by :func:`load_plugins` and :func:`load_entry_points` so far,
    in order (an entry point as its module)."""
    return list(LOADED_PLUGINS)
