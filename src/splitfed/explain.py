"""Every config key, explained: generated from the code, never written by hand.

The keys of the config's sections come from the dataclasses of :mod:`splitfed.config`
(type, default, the bounds of the field's metadata, its ``help``); the options of the
components a config chooses come from the components themselves: an algorithm's or a
transform's ``Options`` dataclass, and the parameters (with their defaults and
annotations) of a model builder, a data set loader, a partitioner or a clock profile,
after the leading ones every such function takes (:mod:`splitfed.registry`), with the
help the function gives them in its ``option_help`` attribute (a dict: option name ->
one line, e.g. ``fixed.option_help = {"uplink": "..."}``), as plugins' functions may too.

- :func:`explain` is ``splitfed config explain [NAME]`` (plain text): every section,
  or one section or component;
- :func:`markdown` is ``docs/config.md``: every section, then every built-in algorithm,
  transform, model, data set, partitioner and clock profile with its options. Plugins'
  components are left out (``builtin_only``), so that an installed plugin does not
  change the document. Regenerate it with::

      python -m splitfed.explain > docs/config.md

The functions return text and write nothing; importing this module is light (the
registries, and with them torch, are imported when a component is looked up).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass

from splitfed.errors import ConfigError
from splitfed.registry import SECTIONS

#: the command that regenerates docs/config.md (named by the test that checks it)
REGENERATE = "python -m splitfed.explain > docs/config.md"

#: kinds of components (as :mod:`splitfed.registry` names them), in the order they are
#: documented: kind -> (plural for headings, the config key that chooses one, the section
#: whose other keys are its options)
KINDS = {kind: (plural, chooser, SECTIONS.get(kind)) for kind, plural, chooser in (
    ("algorithm", "algorithms", "algorithm.name"),
    ("transform", "transforms", "algorithm.client_transforms / server_transforms"),
    ("model", "models", "model.name"),
    ("dataset", "data sets", "data.name"),
    ("partitioner", "partitioners", "partition.scheme"),
    ("clock profile", "clock profiles", "clock.profile"),
)}
#: how the text names a component of each kind
_LABELS = {"dataset": "data set"}

#: what each section is for (the dataclasses' own docstrings win where they have one)
_SECTION_TEXT = {
    "run": "top-level keys of the config (no section)",
    "algorithm": "the algorithm and the transforms added to it; any other key is an "
                 "option of the chosen algorithm",
    "data": "the data set; any other key is an option of the chosen data set",
    "partition": "how the training set is split among the clients; any other key is an "
                 "option of the chosen scheme",
    "model": "the model and where split algorithms cut it; any other key is an option "
             "of the chosen model",
    "train": "the clients' local training",
    "participation": "which clients take part in each round",
    "engine": "where and how the simulation computes",
    "server_data": "the server's own data for hybrid FL (paper 004)",
    "clock": "simulated time; any other key is an option of the chosen profile",
}


@dataclass
class Key:
    """One key: its dotted name, type, default (as YAML; ``required`` when it has none),
    bounds and help."""

    name: str
    type: str
    default: str
    bounds: str = ""
    help: str = ""


@dataclass
class Component:
    """A registered component and what explains it."""

    kind: str
    name: str
    summary: str
    facts: list[str]
    keys: list[Key]
    plugin: str | None = None
    details: str = ""           # the rest of the function's docstring


# ------------------------------------------------------------------------ the sections


def sections() -> dict[str, type]:
    """Section name -> dataclass: ``run`` (the top-level keys of
    :class:`~splitfed.config.RunConfig`), then every nested section, in field order."""
    from splitfed.config import RunConfig

    hints = typing.get_type_hints(RunConfig)
    out: dict[str, type] = {"run": RunConfig}
    for f in dataclasses.fields(RunConfig):
        if f.init and dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = hints[f.name]
    return out


def section_keys(section: str) -> list[Key]:
    """The keys of ``section`` (of :func:`sections`), dotted as a config names them."""
    cls = sections()[section]
    prefix = "" if section == "run" else section
    keys = dataclass_keys(cls, prefix)
    if section == "run":
        keys = [k for k in keys if k.name not in sections()]
    return keys


def dataclass_keys(cls: type, prefix: str = "") -> list[Key]:
    """The init fields of the dataclass ``cls`` as :class:`Key` (nested dataclasses are
    one key each, of their class's type)."""
    from splitfed.configtools import type_name

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        meta = f.metadata
        if f.default is not dataclasses.MISSING:
            default = yaml_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = yaml_value(f.default_factory())
        else:
            default = "required"
        out.append(Key(_join(prefix, f.name), type_name(hints[f.name]), default,
                       _bounds(meta), _one_line(meta.get("help", ""))))
    return out


def _bounds(meta) -> str:
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{sign} {meta[n]}" for n, sign in signs.items() if n in meta]
    if "choices" in meta:
        parts.append("one of " + ", ".join(yaml_value(c) for c in meta["choices"]))
    return ", ".join(parts)


def yaml_value(value) -> str:
    """``value`` as it would be written in a config (YAML flow style): ``null``,
    ``true``, ``0.01``, ``[200, 200]``, ``fine``."""
    import yaml

    from splitfed.configtools import _plain

    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


# ---------------------------------------------------------------------- the components


def registry(kind: str) -> dict:
    """The registry of ``kind`` (:func:`splitfed.registry.registry`)."""
    from splitfed.registry import registry as get

    return get(kind)


def is_builtin(kind: str, name: str, obj) -> bool:
    """Whether ``obj`` (registered as ``name``) is one of splitfed's own components: not
    registered by a plugin, and defined in a module of the package."""
    from splitfed.registry import origin

    module = getattr(obj, "__module__", None) or ""
    return origin(kind, name) is None and module.startswith("splitfed.")


def component_names(kind: str, builtin_only: bool = False) -> list[str]:
    """The registered names of ``kind``, sorted (only splitfed's own with
    ``builtin_only``)."""
    table = registry(kind)
    return sorted(n for n, obj in table.items()
                  if not builtin_only or is_builtin(kind, n, obj))


def component(kind: str, name: str) -> Component:
    """What explains the component ``name`` of ``kind``: a summary, facts and keys."""
    from splitfed.registry import origin

    obj = registry(kind)[name]
    _, chooser, section = KINDS[kind]
    details = ""
    if kind in ("algorithm", "transform"):
        summary = _one_line(getattr(obj, "reference", "") or "")
        keys = dataclass_keys(obj.Options, section or "")
        facts = _class_facts(kind, obj)
    else:
        summary = _doc_summary(obj, module=is_builtin(kind, name, obj))
        details = "\n\n".join(_one_line(p) for p in (inspect.getdoc(obj) or "").split("\n\n")[1:])
        keys = function_keys(kind, obj, section)
        facts = [f"`{chooser}: {name}`"]
    return Component(kind, name, summary, facts, keys, origin(kind, name), details)


def _class_facts(kind: str, cls) -> list[str]:
    if kind == "transform":
        from splitfed.engine.transforms import GradientTransform

        gradient = issubclass(cls, GradientTransform)
        where = "client_transforms" if gradient else "server_transforms"
        what = "gradient transform (clients' local steps)" if gradient else (
            "server step (the round's aggregate)")
        facts = [f"{what}: `algorithm.{where}: [{{name: {cls.name}, option: value}}]`"]
        if getattr(cls, "needs_server_data", False):
            facts.append("trains on the server's own data (server_data section)")
        if gradient and not getattr(cls, "splits", True):
            facts.append("needs the whole model on the clients (FL algorithms only)")
        return facts
    kind_text = ("split: the clients hold the first `model.cut` blocks" if cls.split
                 else "federated: the clients hold the whole model" if cls.federated
                 else "no clients: the server trains alone")
    facts = [f"`algorithm.name: {cls.name}`", kind_text]
    facts.append("takes `algorithm.client_transforms` and `server_transforms`"
                 if cls.uses_transforms else "takes no transforms")
    if getattr(cls, "distributed", False):
        facts.append("runs under `splitfed launch` (multi-process)")
    return facts


def function_keys(kind: str, fn, section: str | None) -> list[Key]:
    """The options of a component function: its parameters after the leading ones
    (:data:`splitfed.registry._LEADING`), with their annotations and defaults and the
    help of the function's ``option_help`` attribute (a dict of option name to one line;
    names that are not options are ignored); those the function lists in its
    ``code_only`` attribute (passed by code, not by a config) are left out."""
    from splitfed.registry import _LEADING

    params = list(inspect.signature(fn).parameters.values())[len(_LEADING[kind]):]
    code_only = set(getattr(fn, "code_only", ()))
    helps = option_help(fn)
    out = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in code_only:
            continue
        default = "required" if p.default is p.empty else yaml_value(p.default)
        out.append(Key(_join(section or "", p.name), _annotation(p), default,
                       help=helps.get(p.name, "")))
    return out


def option_help(fn) -> dict[str, str]:
    """The ``option_help`` attribute of the component function ``fn``, each text on one
    line (empty when it has none, or when it is not a dict)."""
    helps = getattr(fn, "option_help", None)
    if not isinstance(helps, dict):
        return {}
    return {str(name): _one_line(text) for name, text in helps.items()}


def _annotation(p: inspect.Parameter) -> str:
    from splitfed.configtools import type_name

    if p.annotation is not p.empty:
        return p.annotation if isinstance(p.annotation, str) else type_name(p.annotation)
    value = p.default
    if value is p.empty or value is None:
        return "any"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _doc_summary(obj, *, module: bool = True) -> str:
    """The first paragraph of ``obj``'s docstring on one line; without one, that of its
    module (``module``: splitfed's own components, a module each) or a line saying so (a
    plugin's module may hold several components and describe none of them)."""
    doc = inspect.getdoc(obj) or ""
    if not doc and module:
        doc = inspect.getdoc(sys.modules.get(getattr(obj, "__module__", ""), None)) or ""
    if not doc:
        return "no description (its function has no docstring)"
    return _one_line(doc.split("\n\n")[0])


# ------------------------------------------------------------------------- looking up


def lookup(name: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``name`` as a section (its name, else None) and as components ([(kind, name)]:
    an algorithm and a transform may share a name). ConfigError, on one line, listing
    what exists when it is neither."""
    from splitfed.data import dataset_key

    found = []
    for kind in KINDS:
        key = dataset_key(name) if kind == "dataset" else name
        if key in registry(kind):
            found.append((kind, key))
    section = name if name in sections() else None
    if section is None and not found:
        raise ConfigError(f"config explain: unknown name {name!r}{_suggest(name)}; "
                          + "; ".join(f"{label}: {', '.join(names)}"
                                      for label, names in _catalogue()))
    return section, found


def _catalogue() -> list[tuple[str, list[str]]]:
    return [("sections", list(sections())),
            *((plural, component_names(kind)) for kind, (plural, _, _) in KINDS.items())]


def _suggest(name: str) -> str:
    every = [n for _, names in _catalogue() for n in names]
    close = difflib.get_close_matches(name, every, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ------------------------------------------------------------------------------ text


def explain(name: str | None = None) -> str:
    """``splitfed config explain [NAME]``: every section's keys and the names of the
    components (without ``name``), or the section or component(s) called ``name``."""
    if name is None:
        parts = [_section_text(s) for s in sections()]
        parts.append(_pointers())
        return "\n\n".join(parts) + "\n"
    section, found = lookup(name)
    parts = ([_section_text(section)] if section is not None else [])
    parts += [_component_text(component(kind, n)) for kind, n in found]
    return "\n\n".join(parts) + "\n"


def _section_text(section: str) -> str:
    head = f"{section}: {_section_summary(section)}"
    lines = [head, *(_key_text(k) for k in section_keys(section))]
    if section in _open_sections():
        kind = _open_sections()[section]
        plural = KINDS[kind][0]
        lines.append(f"  other keys: options of the chosen {_label(kind)} "
                     f"(splitfed config explain NAME); {plural}: "
                     f"{', '.join(component_names(kind))}")
    if section == "algorithm":
        lines.append(f"  transforms (client_transforms, server_transforms): "
                     f"{', '.join(component_names('transform'))}")
    return "\n".join(lines)


def _open_sections() -> dict[str, str]:
    return {section: kind for kind, (_, _, section) in KINDS.items() if section}


def _section_summary(section: str) -> str:
    cls = sections()[section]
    doc = cls.__doc__ or ""
    if doc and not doc.startswith(cls.__name__ + "("):     # not dataclass's own
        return _one_line(doc.split("\n\n")[0])
    return _SECTION_TEXT.get(section, "")


def _key_text(key: Key) -> str:
    line = f"  {key.name}: {key.type} = {key.default}"
    if key.bounds:
        line += f"  [{key.bounds}]"
    if not key.help:
        return line
    body = textwrap.fill(key.help, width=88, initial_indent=" " * 6,
                         subsequent_indent=" " * 6)
    return f"{line}\n{body}"


def _component_text(c: Component) -> str:
    head = f"{_label(c.kind)} {c.name}" + (f" [plugin {c.plugin}]" if c.plugin else "")
    lines = [head + (f": {c.summary}" if c.summary else "")]
    lines += [f"  {fact.replace('`', '')}" for fact in c.facts]
    lines += [textwrap.fill(p, width=88, initial_indent="  ", subsequent_indent="  ")
              for p in c.details.split("\n\n") if p]
    if c.keys:
        lines.append("  options:")
        lines += ["  " + _key_text(k) for k in c.keys]
    else:
        lines.append("  options: none")
    return "\n".join(lines)


def _pointers() -> str:
    lines = ["components (their options: splitfed config explain NAME):"]
    for kind, (plural, chooser, _) in KINDS.items():
        lines.append(f"  {plural} ({chooser}): {', '.join(component_names(kind))}")
    return "\n".join(lines)


# -------------------------------------------------------------------------- markdown


def markdown(name: str | None = None, *, builtin_only: bool = True) -> str:
    """The reference as markdown: ``docs/config.md`` (every section, then every
    component of every kind; splitfed's own only with ``builtin_only``), or only the
    section or component(s) called ``name``."""
    if name is not None:
        section, found = lookup(name)
        parts = [_section_markdown(section, builtin_only)] if section is not None else []
        parts += [_component_markdown(component(kind, n), "##") for kind, n in found]
        return "\n\n".join(parts) + "\n"
    parts = [_PREAMBLE.strip(), "## Sections"]
    parts += [_section_markdown(s, builtin_only) for s in sections()]
    for kind, (plural, chooser, _) in KINDS.items():
        parts.append(f"## {plural[0].upper()}{plural[1:]}\n\nChosen with `{chooser}`.")
        parts += [_component_markdown(component(kind, n), "###")
                  for n in component_names(kind, builtin_only)]
    return "\n\n".join(parts) + "\n"


_PREAMBLE = f"""
# Configuration reference

<!-- Generated from the code by `{REGENERATE}`; do not edit by hand
(tests/test_explain.py fails when this file is stale). -->

Every key of a run's config: the sections' keys (type, default, bounds, what it does),
then the options of every built-in algorithm, transform, model, data set, partitioner
and clock profile. A config is YAML; every key can also be given on the command line as
`key=value` (`splitfed run CONFIG train.lr=0.05`). In the sections `algorithm`, `data`,
`partition`, `model` and `clock`, any key that is not listed is an option of the chosen
component (`model: {{name: mlp, hidden: [64]}}`); it may also be written under the
section's `options` (`partition.options.alpha` is `partition.alpha`): either spelling
replaces the other from a later source (a command-line override, a study's grid), and
one source giving both with different values is refused. `splitfed config explain [NAME]` prints
the same on the console, with the components of plugins; `splitfed config show CONFIG`
prints the resolved config a run would use, once its sections and its algorithm (name,
options, transforms) are checked; the options of the model, data set, partition and
clock profile are checked with the data, by `splitfed run CONFIG --dry-run` or the run.
"""


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_md(text)}`" if text else ""


def _keys_table(keys: list[Key]) -> str:
    rows = ["| key | type | default | bounds | description |",
            "|---|---|---|---|---|"]
    rows += [f"| {_code(k.name)} | {_code(k.type)} | {_code(k.default)} | "
             f"{_md(k.bounds)} | {_md(k.help)} |" for k in keys]
    return "\n".join(rows)


def _section_markdown(section: str, builtin_only: bool) -> str:
    title = "run (top level)" if section == "run" else section
    parts = [f"### {title}", _section_summary(section).rstrip(".") + ".",
             _keys_table(section_keys(section))]
    if section in _open_sections():
        kind = _open_sections()[section]
        names = ", ".join(f"`{n}`" for n in component_names(kind, builtin_only))
        parts.append(f"Other keys: the options of the chosen {_label(kind)} ({names}).")
    if section == "algorithm":
        names = ", ".join(f"`{n}`" for n in component_names("transform", builtin_only))
        parts.append(f"Transforms: {names}.")
    return "\n\n".join(parts)


def _component_markdown(c: Component, level: str) -> str:
    title = f"{level} {c.name}" + (f" (plugin {c.plugin})" if c.plugin else "")
    if level == "##":
        title = f"## {_label(c.kind)} {c.name}" + (f" (plugin {c.plugin})" if c.plugin else "")
    parts = [title]
    if c.summary:
        parts.append(c.summary)
    parts += [p for p in c.details.split("\n\n") if p]
    parts.append("\n".join(f"- {fact}" for fact in c.facts))
    parts.append(_keys_table(c.keys) if c.keys else "No options.")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- helpers


def _label(kind: str) -> str:
    return _LABELS.get(kind, kind)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


if __name__ == "__main__":
    sys.stdout.write(markdown())
