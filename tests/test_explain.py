"""``splitfed config explain`` and docs/config.md: every key, generated from the code."""

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from splitfed import explain
from splitfed.cli import main
from splitfed.config import RunConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_up_to_date(tmp_path):
    """docs/config.md is what ``python -m splitfed.explain`` prints, in a fresh process
    (built-in components only: no plugin of this process or of the environment)."""
    proc = subprocess.run([sys.executable, "-m", "splitfed.explain"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert DOC.is_file(), f"docs/config.md is missing; generate it: {explain.REGENERATE}"
    assert proc.stdout == DOC.read_text(encoding="utf-8"), (
        "docs/config.md is stale (a config key, an option or its help changed); "
        f"regenerate it from the repository root: {explain.REGENERATE}")


def test_every_section_key_and_component_option_is_explained():
    text, doc = explain.explain(), explain.markdown()
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        section = hints[f.name]
        if dataclasses.is_dataclass(section):
            for g in dataclasses.fields(section):
                assert f"  {f.name}.{g.name}: " in text
                assert f"| `{f.name}.{g.name}` |" in doc
        else:
            assert f"  {f.name}: " in text
    for kind in explain.KINDS:
        for name in explain.component_names(kind, builtin_only=True):
            assert f"### {name}\n" in doc, (kind, name)
    from splitfed.algorithms import ALGORITHMS, TRANSFORMS

    for name, cls in ALGORITHMS.items():
        shown = explain.explain(name)
        for g in dataclasses.fields(cls.Options):
            assert f"algorithm.{g.name}: " in shown
    for name, cls in TRANSFORMS.items():
        shown = explain.explain(name)
        for g in dataclasses.fields(cls.Options):
            assert f"    {g.name}: " in shown


def test_keys_show_type_default_bounds_and_help(capsys):
    assert main(["config", "explain"]) == 0
    out = capsys.readouterr().out
    assert "  train.batch_size: int = 32  [>= 1, <= 1000000]\n      B samples per step" in out
    assert "  participation.mode: 'full' | 'uniform' | 'with_replacement' | 'bernoulli' = full" \
        in out
    assert "algorithms (algorithm.name): " in out and "models (model.name): " in out
    assert main(["config", "explain", "train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train: ") and "participation." not in out


def test_components_show_their_options(capsys):
    assert main(["config", "explain", "fedopt"]) == 0       # an algorithm and a transform
    out = capsys.readouterr().out
    assert "algorithm fedopt: " in out and "transform fedopt: " in out
    assert "algorithm.server_optimizer: 'adam' | 'yogi' | 'adagrad' = adam" in out
    assert "server step (the round's aggregate): algorithm.server_transforms" in out
    assert main(["config", "explain", "dirichlet"]) == 0    # a partitioner's parameters
    out = capsys.readouterr().out
    assert "partition.alpha: float = required" in out
    assert "partition.min_partition_size: int = 10" in out
    assert main(["config", "explain", "Fashion-MNIST"]) == 0  # data set names as data.name
    assert "data set fashion_mnist" in capsys.readouterr().out
    assert main(["config", "explain", "fixed"]) == 0
    assert "clock.client_compute: float = 1000000000.0" in capsys.readouterr().out
    assert main(["config", "explain", "lenet5"]) == 0       # a model, with its cuts
    out = capsys.readouterr().out
    assert "options: none" in out and "cuts: default cut 2; valid cuts 1, 2, 3, 4" in out
    assert main(["config", "explain", "natural"]) == 0      # its natural= comes from code
    out = capsys.readouterr().out
    assert "options: none" in out and "partition.natural" not in out


def test_unknown_name_is_one_line_listing_what_exists(capsys):
    assert main(["config", "explain", "fedavgg"]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("splitfed: error: config explain: unknown name 'fedavgg' "
                           "(did you mean 'fedavg'?); sections: run, algorithm, ")
    for part in ("algorithms: ", "transforms: ", "models: ", "data sets: ",
                 "partitioners: ", "clock profiles: "):
        assert part in line


def test_markdown_of_one_name(capsys):
    assert main(["config", "explain", "--markdown", "sflv2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## algorithm sflv2\n")
    assert "| `algorithm.order` | `'iteration' \\| 'per_client'` | `iteration` |" in out


def _tiny(input_shape, num_classes, *, width: int = 4):
    """A plugin's model."""


@pytest.fixture
def plugin_model(monkeypatch):
    """A model registered as a plugin would register it (its origin recorded)."""
    from splitfed import registry
    from splitfed.models import MODELS

    monkeypatch.setitem(MODELS, "zz_tiny", _tiny)
    monkeypatch.setitem(registry._ORIGINS["model"], "zz_tiny", "my_lab")


def test_plugins_are_explained_but_stay_out_of_the_doc(plugin_model):
    assert "zz_tiny" in explain.explain("model")
    shown = explain.explain("zz_tiny")
    assert shown.startswith("model zz_tiny [plugin my_lab]: A plugin's model.")
    assert "model.width: int = 4" in shown
    assert "zz_tiny" not in explain.markdown()                 # docs/config.md
    assert "### zz_tiny (plugin my_lab)" in explain.markdown(builtin_only=False)


def test_components_defined_outside_the_package_stay_out_of_the_doc(monkeypatch):
    from splitfed.models import MODELS

    monkeypatch.setitem(MODELS, "zz_tiny", _tiny)             # no origin, not splitfed's
    assert "zz_tiny" not in explain.markdown()
    assert "zz_tiny" in explain.markdown(builtin_only=False)


def _bare(input_shape, num_classes, *, depth: int = 2):
    pass


def test_a_plugin_component_without_a_docstring_says_so(monkeypatch):
    """Not its module's docstring (this test module's), which may describe another
    component; splitfed's own models, a module each, keep theirs."""
    from splitfed import registry
    from splitfed.models import MODELS

    monkeypatch.setitem(MODELS, "zz_bare", _bare)
    monkeypatch.setitem(registry._ORIGINS["model"], "zz_bare", "my_lab")
    shown = explain.explain("zz_bare")
    assert shown.startswith("model zz_bare [plugin my_lab]: no description (its function "
                            "has no docstring)"), shown
    assert "model.depth: int = 2" in shown
    assert explain.explain("lenet5").startswith("model lenet5: LeNet-5")


def test_every_built_in_key_has_a_description():
    """Every key of docs/config.md says what it does: each section's fields have a
    ``help``, each built-in Options field too, and each built-in function's options are
    in its ``option_help`` (which names no parameter it lacks)."""
    missing = [key.name for section in explain.sections()
               for key in explain.section_keys(section) if not key.help]
    for kind in explain.KINDS:
        for name in explain.component_names(kind, builtin_only=True):
            c = explain.component(kind, name)
            missing += [f"{kind} {name}: {key.name}" for key in c.keys if not key.help]
    assert not missing, f"{len(missing)} keys without a description: {missing}"
    rows = [line for line in explain.markdown().splitlines() if line.startswith("| `")]
    assert rows and not [line for line in rows if line.endswith("|  |")]
    for kind in ("model", "dataset", "partitioner", "clock profile"):
        for name in explain.component_names(kind, builtin_only=True):
            fn = explain.registry(kind)[name]
            unknown = set(explain.option_help(fn)) - set(inspect.signature(fn).parameters)
            assert not unknown, f"{kind} {name}: option_help names no option {unknown}"


def test_a_plugin_functions_option_help_is_explained(scratch, capsys):
    """A plugin's function documents its options with ``option_help``: ``config explain``
    prints each line under its option; an option it leaves out has none, and a name that
    is not an option is ignored."""
    import splitfed

    @splitfed.register_clock_profile("zz_two_speed")
    def two_speed(num_clients, rng, *, slow=0.5, factor: float = 4.0, seed_shift=0):
        """Half the clients are slow."""

    two_speed.option_help = {"slow": "the share of slow clients (0 to 1)",
                             "factor": "how many times slower   a slow client\n computes",
                             "nothing": "not an option"}
    assert main(["config", "explain", "zz_two_speed"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert head.startswith("clock profile zz_two_speed [plugin "), head
    assert head.endswith(": Half the clients are slow."), head
    assert ("    clock.slow: float = 0.5\n"
            "      the share of slow clients (0 to 1)\n") in out
    assert ("    clock.factor: float = 4.0\n"
            "      how many times slower a slow client computes\n") in out
    assert "    clock.seed_shift: int = 0\n" in out
    assert "not an option" not in out and "clock.nothing" not in out
    shown = explain.markdown("zz_two_speed")
    assert "| `clock.slow` | `float` | `0.5` |  | the share of slow clients (0 to 1) |" in shown


def test_a_plugins_alias_of_a_built_in_function_stays_out_of_the_doc(scratch):
    """A plugin may register splitfed's own function under a new name: it is the
    plugin's component (defined in a splitfed module or not), so docs/config.md and
    catalog.json, which hold the built-in components, leave it out."""
    import splitfed
    from splitfed import catalog, explain
    from splitfed.models import MODELS

    splitfed.register_model("zz_alias", MODELS["mlp"])
    assert MODELS["zz_alias"].__module__.startswith("splitfed.")
    assert "zz_alias" in explain.component_names("model")
    assert "zz_alias" not in explain.component_names("model", builtin_only=True)
    assert "zz_alias" not in catalog.live(builtin_only=True)["models"]
