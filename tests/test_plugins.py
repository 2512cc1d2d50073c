"""Plugins: components registered outside the package, seen by every command.

The plugin is the example of docs/extending.md (``examples/plugin_example/splitfed_lab``:
a model with cut points, a data set read from CSV files, a partitioner, a clock profile,
a gradient transform, a server step and a split algorithm), copied into a temporary
directory and used through the command line from another working directory, with only
``PYTHONPATH`` (or an entry point) pointing at it; the data files are written by the
tests. Every code block of docs/extending.md is checked to be an excerpt of the example's
files, and the plugin's own conformance tests (``examples/plugin_example/tests``) run here too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import splitfed
from splitfed import registry
from splitfed.algorithms import ALGORITHMS, TRANSFORMS
from splitfed.algorithms.fedavg import FedAvg
from splitfed.data import DATASETS
from splitfed.data.partition import PARTITIONERS
from splitfed.engine.profiles import GENERATORS
from splitfed.errors import ConfigError, DataError, PluginError
from splitfed.models import MODELS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin_example"
#: the algorithms that ran on the multi-process runtime before ``distributed`` existed
RUNTIME_ALGORITHMS = {"fedavg", "fedprox", "fedopt", "scaffold", "scaffold_plus", "clgsgd",
                      "server_only", "sl", "sflv1", "sflv2", "csefsl", "musplitfed", "gas"}


def write_csv_images(directory: Path, sizes=(("train.csv", 240), ("test.csv", 80)),
                     seed: int = 0) -> None:
    """A small data set in the format of the example's ``csv_images`` loader (one line
    per sample: the label, then 64 pixel values): class k has a bright row k."""
    gen = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name, n in sizes:
        y = gen.integers(0, 4, n)
        x = gen.normal(0.0, 0.5, (n, 8, 8))
        x[np.arange(n), y, :] += 1.0
        lines = [",".join([str(label)] + [f"{v:.3f}" for v in row])
                 for label, row in zip(y, x.reshape(n, -1))]
        (directory / name).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A directory holding the example plugin package, a working directory elsewhere
    with the data files (``work/data``), and the example config with and without its
    ``plugins`` line."""
    root = tmp_path_factory.mktemp("plugins")
    shutil.copytree(EXAMPLE / "splitfed_lab", root / "pkgs" / "splitfed_lab")
    work = root / "work"
    write_csv_images(work / "data")
    config = yaml.safe_load((EXAMPLE / "lab.yaml").read_text())
    config.update(rounds=2, progress=False)
    (work / "lab.yaml").write_text(yaml.safe_dump(config))
    bare = {k: v for k, v in config.items() if k != "plugins"}
    (work / "bare.yaml").write_text(yaml.safe_dump(bare))
    return root


def cli(lab: Path, *args: str, pythonpath: list[Path] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    paths = pythonpath if pythonpath is not None else [lab / "pkgs"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "splitfed", *args], cwd=cwd or lab / "work",
                          env=env, capture_output=True, text=True, timeout=300)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_dir_of(proc: subprocess.CompletedProcess, cwd: Path) -> Path:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("run directory: "))
    return cwd / line.removeprefix("run directory: ")


def learned(rows: list[dict]) -> list[tuple]:
    return [(r["round"], r.get("train_loss"), r["test_acc"], r["test_loss"]) for r in rows]


# ------------------------------------------------------------- the command line


def test_run_with_plugins_in_config_then_resume(lab):
    work = lab / "work"
    proc = cli(lab, "run", "lab.yaml", "out_dir=runs-config", "checkpoint_every=1")
    assert proc.returncode == 0, proc.stderr
    assert "fedavg on csv_images (tiny_cnn, 4 clients, label_blocks)" in proc.stdout
    run_dir = run_dir_of(proc, work)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["plugins"] == ["splitfed_lab"]
    assert saved["clock"]["profile"] == "two_tier"
    assert saved["algorithm"]["client_transforms"] == [{"name": "clip_norm", "max_norm": 1.0}]
    first = records(run_dir)
    assert [r["round"] for r in first] == [0, 1, 2]

    saved["rounds"] = 3                         # extend the finished run, then resume it
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    proc = cli(lab, "run", "--resume", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    resumed = records(run_dir)
    assert [r["round"] for r in resumed] == [0, 1, 2, 3]
    assert resumed[:3] == first
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == [2]

    straight = cli(lab, "run", "lab.yaml", "out_dir=runs-straight", "rounds=3")
    assert straight.returncode == 0, straight.stderr
    assert learned(records(run_dir_of(straight, work))) == learned(resumed)


def test_run_with_plugin_option_records_it(lab):
    work = lab / "work"
    refused = cli(lab, "run", "bare.yaml", "out_dir=runs-bare")
    assert refused.returncode == 2
    assert "unknown transform 'clip_norm'" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (work / "runs-bare").exists()

    proc = cli(lab, "run", "bare.yaml", "out_dir=runs-bare", "--plugin", "splitfed_lab")
    assert proc.returncode == 0, proc.stderr
    saved = yaml.safe_load((run_dir_of(proc, work) / "config.yaml").read_text())
    assert saved["plugins"] == ["splitfed_lab"]
    assert saved["algorithm"]["client_transforms"] == [{"name": "clip_norm", "max_norm": 1.0}]
    assert saved["data"]["name"] == "csv_images" and saved["model"]["name"] == "tiny_cnn"


@pytest.mark.parametrize("spec", ["./extra_model.py", "extra_model.py", "/tmp/x/evil",
                                  "a..b", "my-lab"])
def test_a_plugin_is_a_module_name_never_a_file(lab, tmp_path, spec):
    """A config (or a shared run directory's config.yaml) cannot name a file to run."""
    marker = tmp_path / "MARKER"
    (lab / "work" / "extra_model.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    for args in (["--plugin", spec], [f"plugins=[{spec}]"]):
        proc = cli(lab, "run", "lab.yaml", "out_dir=runs-file", "rounds=1", *args)
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "is not a module name" in line and "PYTHONPATH" in line
    assert not marker.exists() and not (lab / "work" / "runs-file").exists()
    (lab / "work" / "extra_model.py").unlink()


def test_a_module_beside_the_config_is_not_imported(lab, tmp_path):
    """``python -m`` puts the working directory on sys.path; plugins are not taken from it
    (a shared directory's module named by its config), only from the environment."""
    marker = tmp_path / "MARKER"
    (lab / "work" / "nearby_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    try:
        proc = cli(lab, "run", "lab.yaml", "out_dir=runs-near", "rounds=1",
                   "plugins=[splitfed_lab,nearby_mod]")
        assert proc.returncode == 2 and "No module named 'nearby_mod'" in proc.stderr
        assert not marker.exists() and not (lab / "work" / "runs-near").exists()
    finally:
        (lab / "work" / "nearby_mod.py").unlink()


def test_a_plugin_that_raises_is_one_line(lab, tmp_path):
    (tmp_path / "raising_mod.py").write_text("raise RuntimeError('broken plugin')\n")
    proc = cli(lab, "list", "--plugin", "raising_mod", pythonpath=[tmp_path, lab / "pkgs"])
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "'raising_mod' failed while importing: RuntimeError: broken plugin" in line


def test_list_marks_plugin_entries(lab):
    proc = cli(lab, "list", "--plugin", "splitfed_lab")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert ("  psl            Jeon and Kim 2020 (ICOIN), parallel split learning "
            "[plugin splitfed_lab]") in out
    assert "tiny_cnn       default cut 2; valid cuts 1, 2, 3 [plugin splitfed_lab]" in out
    for entry in ("csv_images", "label_blocks", "two_tier"):
        assert f"{entry} [plugin splitfed_lab]" in out
    assert "fedavg " in out and "lenet5" in out and "[plugin" not in out.split("fedavg ")[1][:80]
    # the transforms: name, kind, reference; the plugin's marked, built-in ones not
    transforms = out.split("transforms (")[1].split("datasets:")[0].splitlines()[1:]
    assert len(transforms) == len(TRANSFORMS) + 2
    clip = next(line for line in transforms if line.startswith("  clip_norm "))
    assert re.fullmatch(r"  clip_norm +gradient +Pascanu et al\. 2013 .* \[plugin "
                        r"splitfed_lab\]", clip), clip
    trimmed = next(line for line in transforms if line.startswith("  trimmed_mean "))
    assert re.fullmatch(r"  trimmed_mean +server step +Yin et al\. 2018 .* \[plugin "
                        r"splitfed_lab\]", trimmed), trimmed
    momentum = next(line for line in transforms if line.startswith("  momentum "))
    assert "server step" in momentum and "Hsu" in momentum and "[plugin" not in momentum


def test_sweep_and_study_with_plugins(lab):
    work = lab / "work"
    proc = cli(lab, "sweep", "bare.yaml", "model.width=4,6",
               "--out-dir", "sweeps", "--plugin", "splitfed_lab")
    assert proc.returncode == 0, proc.stderr
    sweep = json.loads((work / "sweeps" / "bare-sweep" / "sweep.json").read_text())
    assert "--plugin splitfed_lab" in sweep["command"]
    rows = sweep["runs"]
    assert [r["status"] for r in rows] == ["completed", "completed"]
    for run in (work / "sweeps" / "bare-sweep" / "runs").iterdir():
        assert yaml.safe_load((run / "config.yaml").read_text())["plugins"] == ["splitfed_lab"]

    study = {"name": "lab-study", "base": "bare.yaml", "plugins": ["splitfed_lab"],
             "grid": {"partition.scheme": ["label_blocks", "iid"]}, "out_dir": "studies"}
    (work / "study.yaml").write_text(yaml.safe_dump(study))
    proc = cli(lab, "study", "study.yaml")
    assert proc.returncode == 0, proc.stderr
    runs = sorted((work / "studies" / "lab-study" / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert yaml.safe_load((run / "config.yaml").read_text())["plugins"] == ["splitfed_lab"]
    again = cli(lab, "study", "study.yaml")      # finished runs are recognised and kept
    assert again.returncode == 0, again.stderr


def test_launch_runs_the_plugin_algorithm(lab):
    work = lab / "work"
    proc = cli(lab, "launch", "bare.yaml", "--nproc", "2", "--launcher", "spawn",
               "--plugin", "splitfed_lab", "out_dir=runs-launch")
    assert proc.returncode == 0, proc.stderr
    launched = run_dir_of(proc, work)
    assert yaml.safe_load((launched / "config.yaml").read_text())["plugins"] == [
        "splitfed_lab"]
    single = cli(lab, "run", "lab.yaml", "out_dir=runs-single")
    assert single.returncode == 0, single.stderr
    assert learned(records(launched)) == learned(records(run_dir_of(single, work)))


def test_entry_point_plugin(lab, tmp_path):
    dist = tmp_path / "splitfed_lab-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: splitfed-lab\n"
                                   "Version: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[splitfed.plugins]\nlab = splitfed_lab\n")
    paths = [tmp_path, lab / "pkgs"]
    proc = cli(lab, "list", pythonpath=paths)
    assert proc.returncode == 0, proc.stderr
    assert "two_tier [plugin splitfed_lab]" in proc.stdout
    proc = cli(lab, "run", "bare.yaml", "out_dir=runs-ep", "rounds=1", pythonpath=paths)
    assert proc.returncode == 0, proc.stderr
    # the installed plugin's code is part of the run's provenance, as --plugin's is
    summary = json.loads((run_dir_of(proc, lab / "work") / "summary.json").read_text())
    digest = summary["provenance"]["plugins"]["splitfed_lab"]
    assert len(digest) == 64 and digest != "unknown"


def test_unknown_plugin_is_one_line_and_writes_nothing(lab):
    work = lab / "work"
    proc = cli(lab, "run", "lab.yaml", "plugins=[no_such_plugin_mod]", "out_dir=runs-none")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("splitfed: error: ")
    assert "'no_such_plugin_mod'" in err[0] and "No module named" in err[0]
    assert not (work / "runs-none").exists()
    proc = cli(lab, "list", "--plugin", "no_such_plugin_mod")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no_such_plugin_mod" in proc.stderr and proc.stdout == ""


def test_plugin_name_clash_is_one_line(lab, tmp_path):
    (tmp_path / "clash_builtin.py").write_text(
        "from splitfed import register_algorithm\n"
        "from splitfed.algorithms.fedavg import FedAvg\n\n"
        "@register_algorithm('fedavg')\nclass Mine(FedAvg):\n    pass\n")
    (tmp_path / "clash_plugin.py").write_text(
        "from splitfed import register_model\n"
        "from splitfed_lab.models import tiny_cnn\n\n"
        "register_model('tiny_cnn', tiny_cnn)\n")
    paths = [tmp_path, lab / "pkgs"]
    proc = cli(lab, "list", "--plugin", "clash_builtin", pythonpath=paths)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "algorithm 'fedavg' is already registered (built in, splitfed.algorithms.fedavg)" \
        in line and "clash_builtin" in line and "replace=True" in line
    proc = cli(lab, "list", "--plugin", "splitfed_lab", "--plugin", "clash_plugin",
               pythonpath=paths)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "model 'tiny_cnn' is already registered (plugin splitfed_lab)" in line


# ------------------------------------------------------------- the registration API


def test_registries_are_the_packages_dicts():
    assert registry.registry("algorithm") is ALGORITHMS
    assert registry.registry("model") is MODELS
    assert registry.registry("dataset") is DATASETS
    assert registry.registry("partitioner") is PARTITIONERS
    assert registry.registry("clock profile") is GENERATORS
    assert splitfed.register_model is registry.register_model


def test_import_splitfed_does_not_import_torch():
    code = "import sys, splitfed; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_runtime_support_is_a_class_attribute(scratch):
    from splitfed.config import build_config
    from splitfed.runtime.session import check_supported, supported

    assert set(supported()) == RUNTIME_ALGORITHMS
    assert {n for n, c in ALGORITHMS.items() if c.distributed} == RUNTIME_ALGORITHMS

    @splitfed.register_algorithm("zz_local_only")
    class LocalOnly(FedAvg):
        distributed = False

    with pytest.raises(ConfigError, match="'zz_local_only' does not run on the multi-"):
        check_supported(build_config({"algorithm": {"name": "zz_local_only"}}))
    check_supported(build_config({"algorithm": {"name": "fedavg"}}))


def test_clash_and_replace(scratch):
    def builder(input_shape, num_classes, *, width=4):
        return MODELS["mlp"](input_shape, num_classes, hidden=[width])

    with pytest.raises(PluginError, match=r"model 'lenet5' is already registered \(built "
                                          r"in, splitfed.models.lenet\)"):
        splitfed.register_model("lenet5", builder)
    assert MODELS["lenet5"].__name__ == "lenet5"
    splitfed.register_model("zz_mlp", builder)
    with pytest.raises(PluginError, match=r"model 'zz_mlp' is already registered \(plugin "):
        splitfed.register_model("zz_mlp", builder)
    splitfed.register_model("zz_mlp", builder, replace=True)
    assert MODELS["zz_mlp"] is builder
    assert registry.origin("model", "zz_mlp") == __name__
    assert registry.origin("model", "lenet5") is None
    from splitfed.models import build_model

    assert build_model("zz_mlp", (1, 8, 8), 3, width=5).valid_cuts == [1]
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['depth'\]"):
        build_model("zz_mlp", (1, 8, 8), 3, depth=2)


def test_registered_functions_are_checked(scratch):
    with pytest.raises(PluginError, match="keyword-only"):
        splitfed.register_model("zz_bad", lambda input_shape, num_classes, width=3: None)
    with pytest.raises(PluginError, match=r"\(labels, num_clients, rng, \.\.\.\)"):
        splitfed.register_partitioner("zz_bad", lambda labels, rng: None)
    with pytest.raises(PluginError, match=r"must take \(data_dir, rng, \.\.\.\) as its first "
                                          r"positional parameters, in that order \(it takes "
                                          r"\(rng, n, \.\.\.\)\)"):
        splitfed.register_dataset("zz_bad", lambda rng, n=3: None)   # rng would get the dir
    with pytest.raises(PluginError, match=r"in that order \(it takes \(labels, rng, num"):
        splitfed.register_partitioner("zz_bad", lambda labels, rng, num_clients: None)
    with pytest.raises(PluginError, match="no \\*args or \\*\\*kwargs"):
        splitfed.register_clock_profile("zz_bad", lambda num_clients, rng, **kw: None)
    with pytest.raises(PluginError, match="subclass of splitfed.engine.algorithm"):
        splitfed.register_algorithm("zz_bad", object)

    class NoDataclass(FedAvg):
        class Options:
            pass

    with pytest.raises(PluginError, match="Options must be a dataclass"):
        splitfed.register_algorithm("zz_bad", NoDataclass)
    with pytest.raises(PluginError, match="name must be"):
        splitfed.register_dataset("", lambda data_dir, rng: None)
    assert not any("zz_bad" in registry.registry(k) for k in registry._REGISTRIES)


def test_dataset_names_are_normalised(scratch):
    @splitfed.register_dataset("My-Data")
    def load(data_dir, rng, size=3):
        raise AssertionError

    assert DATASETS["my_data"] is load
    from splitfed.data import dataset_options

    assert dataset_options("MY-DATA") == {"size": 3}
    with pytest.raises(PluginError, match="dataset 'my_data' is already registered"):
        splitfed.register_dataset("my_data", load)


#: the walkthrough's sections, in their order
SECTIONS = ["A custom model with cut points", "A custom data set",
            "A new FL variant as one gradient transform", "A new split algorithm",
            "A plugin package with an entry point", "Checking your algorithm"]


def test_the_docs_quote_the_example_files():
    """Every python block of docs/extending.md (and every block of another language that
    names a file) starts with ``# file: PATH``, PATH a file under examples/, and the rest
    of the block appears in that file verbatim: the page cannot go stale. Every module of
    the example that registers something, and its tests, are quoted."""
    text = (ROOT / "docs" / "extending.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert [h for h in headings if h in SECTIONS] == SECTIONS
    quoted = set()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)
    for lang, body in blocks:
        header, _, excerpt = body.partition("\n")
        if not header.startswith("# file: "):
            assert lang != "python", f"a python block names no file: {body[:120]!r}"
            continue
        path = ROOT / header.removeprefix("# file: ")
        assert path.resolve().is_relative_to(ROOT / "examples") and path.is_file(), header
        assert excerpt.strip() and excerpt in path.read_text(), (
            f"docs/extending.md quotes {path.relative_to(ROOT)} wrongly:\n{excerpt}")
        quoted.add(path.relative_to(EXAMPLE).as_posix())
    package = {f"splitfed_lab/{p.name}" for p in (EXAMPLE / "splitfed_lab").glob("*.py")
               if "@register_" in p.read_text() or p.name == "__init__.py"}
    assert package | {"tests/test_lab.py", "pyproject.toml", "lab.yaml",
                      "psl.yaml"} <= quoted, sorted(quoted)
    assert sum(lang == "python" for lang, _ in blocks) >= 8


# ------------------------------------------------------------- the examples


@pytest.mark.parametrize("config, overrides, line", [
    ("lab.yaml", ["algorithm.name=sflv2"],
     "sflv2 on csv_images (tiny_cnn, 4 clients, label_blocks): status completed"),
    ("psl.yaml", [], "psl on csv_images (tiny_cnn, 4 clients, iid): status completed"),
], ids=["clip_norm-on-sflv2", "psl"])
def test_the_example_configs_run(lab, config, overrides, line):
    """The example's own config files (not copies), run from another directory with the
    package on PYTHONPATH: the gradient transform on SFL-V2 (on FedAvg: the tests above)
    and the split algorithm, both on the plugin's model and data set."""
    work = lab / "work"
    proc = cli(lab, "run", str(EXAMPLE / config), *overrides, "rounds=2", "progress=false",
               f"out_dir=runs-{Path(config).stem}")
    assert proc.returncode == 0, proc.stderr
    assert line in proc.stdout
    run_dir = run_dir_of(proc, work)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["cut"] == (2 if config == "psl.yaml" else None)
    if config == "lab.yaml":
        assert saved["algorithm"]["client_transforms"] == [{"name": "clip_norm",
                                                             "max_norm": 1.0}]
    rows = records(run_dir)
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["participants"] == 4 and np.isfinite(r["train_loss"])
        assert r["bytes_up/activations"] > 0 and r["bytes_down/activation_grads"] > 0


# ------------------------------------------------------------- splitfed.testing


@pytest.fixture
def lab_in_process(scratch, monkeypatch):
    """The example plugin imported in this process (its registrations undone after)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for mod in [m for m in sys.modules if m.split(".")[0] == "splitfed_lab"]:
        monkeypatch.delitem(sys.modules, mod)
    import splitfed_lab

    yield splitfed_lab
    for mod in [m for m in sys.modules if m.split(".")[0] == "splitfed_lab"]:
        del sys.modules[mod]


def test_config_explain_shows_the_plugins_option_help(lab_in_process, capsys):
    """The example's clock profile documents its options (``two_tier.option_help``,
    docs/extending.md): ``config explain`` prints each help under its option."""
    from splitfed.cli import main

    assert main(["config", "explain", "two_tier"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("clock profile two_tier [plugin "), out
    assert ("    clock.slowdown: float = 10.0\n"
            "      how many times slower a slow client computes and uploads (>= 1)\n") in out
    assert "    clock.slow_fraction: float = 0.5\n      the chance that a client is slow" in out


def test_the_example_passes_the_conformance_checks(lab_in_process):
    """The plugin's own tests (examples/plugin_example/tests/test_lab.py, quoted in
    docs/extending.md): check_algorithm on psl, and on FedAvg and SFL-V2 with the
    plugin's transform."""
    from splitfed.testing import CHECKS, check_algorithm

    assert ALGORITHMS["psl"] is lab_in_process.psl.ParallelSplitLearning
    assert TRANSFORMS["clip_norm"] is lab_in_process.transforms.ClipNorm
    spec = importlib.util.spec_from_file_location("splitfed_lab_tests",
                                                  EXAMPLE / "tests" / "test_lab.py")
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    names = [n for n in vars(tests) if n.startswith("test_")]
    assert names == ["test_psl_conforms", "test_clip_norm_conforms_on_fedavg_and_sflv2"]
    for name in names:
        getattr(tests, name)()
    assert check_algorithm("psl", base=tests.CLIPPED,
                           checks=["deterministic", "participation_modes"]) == [
        "deterministic", "participation_modes"]
    assert "learns" in CHECKS


def test_clip_norm_clips_each_clients_gradient(lab_in_process):
    """Each client's gradient (all its parameters together) is scaled to norm c when it
    is longer, and left as it is otherwise."""
    transforms = lab_in_process.transforms
    clip = transforms.ClipNorm(transforms.ClipOptions(max_norm=1.0))
    update = clip.start(None, None, 1, None, None)
    grads = [torch.tensor([[3.0, 0.0], [0.3, 0.0]]), torch.tensor([[4.0], [0.4]])]
    params = [torch.zeros_like(g) for g in grads]
    out = update(["w", "b"], params, grads, np.array([2, 0]))
    assert torch.allclose(out[0], torch.tensor([[0.6, 0.0], [0.3, 0.0]]))
    assert torch.allclose(out[1], torch.tensor([[0.8], [0.4]]))


def test_the_csv_data_set(lab_in_process, tmp_path):
    """The loader reads the files its docstring describes (the ones the toy writer
    ``python -m splitfed_lab.stripes DIR`` and these tests write), and says what is
    wrong in one line otherwise."""
    from splitfed.data import load_dataset

    importlib.import_module("splitfed_lab.stripes").write_stripes(
        tmp_path / "toy", train_size=40, test_size=10)
    write_csv_images(tmp_path / "mine", (("train.csv", 30), ("test.csv", 6)))
    for directory, n_train, n_test in (("toy", 40, 10), ("mine", 30, 6)):
        bundle = load_dataset("csv_images", str(tmp_path / directory), shape=[1, 8, 8])
        assert bundle.train.x.shape == (n_train, 1, 8, 8)
        assert bundle.test.x.shape == (n_test, 1, 8, 8) and bundle.input_shape == (1, 8, 8)
        assert bundle.num_classes == int(bundle.train.y.max()) + 1
        assert bundle.train.y.dtype == torch.int64
        assert abs(float(bundle.train.x.mean())) < 1e-4     # standardised
    with pytest.raises(ConfigError, match="set data.data_dir"):
        load_dataset("csv_images", None)
    with pytest.raises(DataError, match="not found"):
        load_dataset("csv_images", str(tmp_path / "nowhere"))
    (tmp_path / "mine" / "test.csv").write_text("1,0.5,0.5\n")
    with pytest.raises(DataError, match="test.csv: not a CSV of label,1x8x8 values"):
        load_dataset("csv_images", str(tmp_path / "mine"))


@pytest.mark.parametrize("broken, failed", [("leaky", "non_sampled_clients_send_nothing"),
                                            ("frozen", "learns")])
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "unregistered"])
def test_a_broken_algorithm_fails_the_conformance_checks(scratch, broken, failed,
                                                         registered):
    """A broken FedAvg, registered under a test-only name, or given as a class that the
    checks register for the call only: one check fails, naming it and the algorithm."""
    import numpy as np

    from splitfed.testing import check_algorithm

    class Leaky(FedAvg):
        """Sends the global model to every client, sampled or not."""

        def round(self, env, state, t, cohort):
            env.transport.broadcast("model", np.arange(env.num_clients), state["model"])
            return super().round(env, state, t, cohort)

    class Frozen(FedAvg):
        """Its clients train, but the model it reports never moves from round 0's."""

        state_keys = ("model", "start")

        def init_state(self, env):
            state = super().init_state(env)
            return {**state, "start": {k: v.clone() for k, v in state["model"].items()}}

        def eval_model(self, env, state):
            env.model.load_state_dict(state["start"])
            return env.model

    cls = {"leaky": Leaky, "frozen": Frozen}[broken]
    name = f"zz_{broken}" if registered else cls.__name__   # the name used meanwhile
    if registered:
        splitfed.register_algorithm(name, cls)
    with pytest.raises(AssertionError) as info:
        check_algorithm(cls)
    (first, *lines) = str(info.value).splitlines()
    assert first == (f"algorithm {name!r} ({__name__}.{cls.__qualname__}) fails 1 of 6 "
                     f"conformance checks ({failed}):")
    assert len(lines) == 1 and lines[0].startswith(f"- {failed!r}: ")
    assert (name in ALGORITHMS) is registered   # a temporary registration is undone
    assert (registry.origin("algorithm", name) is not None) is registered
