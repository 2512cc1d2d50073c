"""The components ``splitfed list`` prints, and the catalog of the built-in ones.

Importing the registries imports torch, and listing the models' cuts builds every model:
about a second before anything is printed. ``catalog.json`` (next to this module, shipped
as package data) holds what ``splitfed list`` prints for splitfed's own components: each
algorithm's and transform's ``reference`` (and the transform's kind), the data set names,
each model's cuts (the text :func:`model_cuts` gives), the partitioners, the
participation modes and the clock profiles. ``splitfed list`` reads it when no plugin
is in play, and the live registries (:func:`live`) otherwise; both are printed by
:func:`render`. Importing this module imports neither torch nor the registries.

The file is generated from the registries. Regenerate it after adding, renaming or
removing a built-in component, or changing a ``reference`` or a model's blocks::

    python -m splitfed.catalog

(``--check``: only say whether it is up to date). ``tests/test_catalog.py`` fails while
it is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from splitfed.errors import SplitfedError, one_line

#: the command that regenerates the catalog (named by the test that checks it)
REGENERATE = "python -m splitfed.catalog"
#: the catalog of the built-in components
PATH = Path(__file__).with_name("catalog.json")
#: the modules whose dicts ``splitfed list`` prints: once one of them is imported (by a
#: plugin, or by the program calling the command line), the catalog may not be what the
#: dicts hold, and the live registries are listed
REGISTRY_MODULES = ("splitfed.algorithms", "splitfed.models", "splitfed.data",
                    "splitfed.data.partition", "splitfed.engine.profiles",
                    "splitfed.engine.participation")
#: the kinds of :mod:`splitfed.registry` whose plugin entries are marked, and the
#: catalog's key of each
KINDS = {"algorithm": "algorithms", "transform": "transforms", "dataset": "datasets",
         "model": "models", "partitioner": "partitioners", "clock profile": "clock profiles"}
#: the keys of a catalog
_KEYS = (*KINDS.values(), "participation")

#: models whose cuts ``splitfed list`` does not build the model for: their cuts depend on
#: their options, and building one imports an optional package (seconds);
#: ``splitfed config explain NAME`` builds it
_CUTS_ON_REQUEST = {"opt": "decoder blocks"}


def model_cuts(name: str, detail: bool = False) -> str:
    """``default cut K; valid cuts ...`` of model ``name``, built for a usual input (with
    ``detail``: what every cut means, for ``config explain``). A model that cannot be
    built here (a missing optional package) says why instead of failing the command."""
    from splitfed.models import build_model

    if not detail and name in _CUTS_ON_REQUEST:
        return (f"cuts: after one of its {_CUTS_ON_REQUEST[name]}, depending on its options "
                f"(splitfed config explain {name})")
    shapes = {"lenet5": [(1, 28, 28)], "alexnet": [(1, 28, 28)], "mlp": [(1, 28, 28)],
              "opt": [(2, 16)]}.get(name)     # opt: token ids + attention mask
    for shape in shapes or [(3, 32, 32), (1, 28, 28)]:
        try:
            m = build_model(name, shape, 10)
        except SplitfedError as e:
            if shapes is not None:
                return f"cannot be built here: {one_line(e, None)}"
            continue
        text = (f"default cut {m.default_cut}; valid cuts "
                + ", ".join(str(c) for c in m.valid_cuts))
        if detail:
            given = "x".join(str(s) for s in shape)
            text += f" (built for inputs {given} with its default options)" + "".join(
                f"\n    {k}: {m.cut_descriptions[k]}" for k in m.valid_cuts)
        return text
    return "cuts: depend on the input shape (it takes neither 3x32x32 nor 1x28x28 inputs)"


def live(builtin_only: bool = False) -> dict:
    """The catalog of what the registries hold now (imports them, and torch; builds every
    model but those of ``_CUTS_ON_REQUEST``). With ``builtin_only``, splitfed's own
    components only (as :func:`splitfed.explain.is_builtin` says): what ``catalog.json``
    holds."""
    from splitfed.algorithms import ALGORITHMS, TRANSFORMS
    from splitfed.data import DATASETS
    from splitfed.data.partition import PARTITIONERS
    from splitfed.engine.participation import sampler_names
    from splitfed.engine.profiles import GENERATORS
    from splitfed.engine.transforms import GradientTransform
    from splitfed.explain import is_builtin
    from splitfed.models import MODELS

    def own(kind: str, table: dict) -> dict:
        return {k: v for k, v in table.items() if not builtin_only or is_builtin(kind, k, v)}

    return {
        "algorithms": {k: f"{cls.reference}"
                       for k, cls in sorted(own("algorithm", ALGORITHMS).items())},
        "transforms": {k: {"kind": ("gradient" if issubclass(cls, GradientTransform)
                                    else "server step"),
                           "reference": f"{cls.reference}"}
                       for k, cls in sorted(own("transform", TRANSFORMS).items())},
        "datasets": sorted(own("dataset", DATASETS)),
        "models": {k: model_cuts(k) for k in sorted(own("model", MODELS))},
        "partitioners": sorted(own("partitioner", PARTITIONERS)),
        "participation": sampler_names(),
        "clock profiles": sorted(own("clock profile", GENERATORS)),
    }


def stored() -> dict | None:
    """The catalog of the built-in components (``catalog.json``); None when it cannot be
    read (an installation without it): the caller lists the live registries."""
    try:
        data = json.loads(PATH.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and sorted(data) == sorted(_KEYS) else None


def dumps(catalog: dict) -> str:
    """``catalog`` as ``catalog.json`` holds it."""
    return json.dumps(catalog, indent=1, ensure_ascii=False) + "\n"


def render(catalog: dict, origins: dict[str, dict[str, str]] | None = None) -> str:
    """The text of ``splitfed list`` for ``catalog`` (without its ``configs:`` line);
    ``origins``: kind -> name -> the plugin that registered it
    (:func:`splitfed.registry.plugin_entries`), marked ``[plugin ...]``."""
    origins = origins or {}

    def mark(kind: str, name: str) -> str:
        where = origins.get(kind, {}).get(name)
        return f" [plugin {where}]" if where else ""

    def names(kind: str) -> str:
        return ", ".join(k + mark(kind, k) for k in sorted(catalog[KINDS[kind]]))

    lines = ["algorithms:"]
    lines += [f"  {name:<14} {reference}" + mark("algorithm", name)
              for name, reference in sorted(catalog["algorithms"].items())]
    lines.append("transforms (gradient: algorithm.client_transforms; server step: "
                 "algorithm.server_transforms):")
    lines += [f"  {name:<14} {t['kind']:<12} {t['reference']}" + mark("transform", name)
              for name, t in sorted(catalog["transforms"].items(),
                                    key=lambda item: (item[1]["kind"] != "gradient",
                                                      item[0]))]
    lines.append("datasets:      " + names("dataset"))
    lines.append("models (cuts):")
    lines += [f"  {name:<14} {cuts}" + mark("model", name)
              for name, cuts in sorted(catalog["models"].items())]
    lines.append("partitioners:  " + names("partitioner"))
    lines.append("participation: " + ", ".join(catalog["participation"]))
    lines.append("clock profiles: " + names("clock profile"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m splitfed.catalog [--check]``: write ``catalog.json`` from the
    registries (built-in components only), or say whether it is up to date."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m splitfed.catalog",
                                description=f"regenerate {PATH.name} (the built-in "
                                            "components splitfed list prints)")
    p.add_argument("--check", action="store_true",
                   help=f"write nothing; exit 1 when {PATH.name} is stale")
    args = p.parse_args(argv)
    text = dumps(live(builtin_only=True))
    try:
        current = PATH.read_text(encoding="utf-8")
    except OSError:
        current = None
    if args.check:
        if current == text:
            print(f"{PATH} is up to date")
            return 0
        print(f"{PATH} is stale; regenerate it: {REGENERATE}", file=sys.stderr)
        return 1
    if current != text:
        PATH.write_text(text, encoding="utf-8")
        print(f"wrote {PATH}")
    else:
        print(f"{PATH} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
