"""``splitfed list`` without torch: the catalog of the built-in components
(``src/splitfed/catalog.json``) is what the registries hold, the command reads it without
importing torch and prints what the registries would, and plugins are still listed."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from splitfed import catalog
from splitfed.registry import ENTRY_POINT_GROUP

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin_example"


def run_python(code: str, cwd: Path, pythonpath: list[Path] | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_catalog_is_up_to_date():
    """catalog.json is what ``python -m splitfed.catalog`` writes from the registries
    (built-in components only)."""
    expected = catalog.dumps(catalog.live(builtin_only=True))
    current = catalog.PATH.read_text(encoding="utf-8") if catalog.PATH.is_file() else ""
    diff = "".join(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                        "catalog.json", "registries", n=1))
    assert current == expected, (
        "src/splitfed/catalog.json is stale (a built-in component was added, renamed or "
        "removed, or its reference or cuts changed); regenerate it from the repository "
        f"root: {catalog.REGENERATE}\n{diff[:3000]}")
    assert catalog.stored() == json.loads(expected)


LIST_TWICE = """
import contextlib, io, json, sys
from splitfed.cli import main

def listed():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["list"]) == 0
    return out.getvalue()

fast = listed()
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")
                or m in ("splitfed.algorithms", "splitfed.models"))
import splitfed.algorithms  # the registries: list reads them from now on
live = listed()
print(json.dumps({"fast": fast, "live": live, "loaded": loaded}))
"""


def test_list_reads_the_catalog_without_torch_and_prints_what_the_registries_do(tmp_path):
    if entry_points(group=ENTRY_POINT_GROUP):
        pytest.skip(f"an installed package has {ENTRY_POINT_GROUP} entry points: "
                    "list imports them, and the registries with them")
    result = json.loads(run_python(LIST_TWICE, tmp_path).stdout)
    assert result["loaded"] == [], (
        "splitfed list imported torch or the registries: " + ", ".join(result["loaded"][:5]))
    assert result["fast"] == result["live"]
    assert "fedavg " in result["fast"] and "configs:       " in result["fast"]


def without_plugin_entries(text: str, plugin: str) -> str:
    """``text`` of ``splitfed list`` with ``plugin``'s entries taken out."""
    mark = re.escape(f" [plugin {plugin}]")
    lines = [line for line in text.splitlines(True)
             if not (line.startswith("  ") and line.rstrip("\n").endswith(f" [plugin {plugin}]"))]
    text = "".join(lines)
    text = re.sub(rf"[\w.+-]+{mark}, ", "", text)        # first or inside a list
    return re.sub(rf", [\w.+-]+{mark}", "", text)        # last of a list


@pytest.mark.parametrize("how", ["--plugin", "entry point"])
def test_plugins_are_listed_with_the_built_in_components(tmp_path, how):
    """A plugin given with ``--plugin`` or registered by an entry point: its components
    are listed and marked, and the rest is what ``splitfed list`` prints without it."""
    shutil.copytree(EXAMPLE / "splitfed_lab", tmp_path / "pkgs" / "splitfed_lab")
    work = tmp_path / "work"
    work.mkdir()
    paths = [tmp_path / "pkgs"]
    args = ["list", "--plugin", "splitfed_lab"]
    if how == "entry point":
        dist = tmp_path / "eps" / "splitfed_lab-0.1.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: splitfed-lab\n"
                                       "Version: 0.1.0\n")
        (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nlab = splitfed_lab\n")
        paths.insert(0, tmp_path / "eps")
        args = ["list"]
    code = f"import sys\nfrom splitfed.cli import main\nsys.exit(main({args!r}))\n"
    with_plugin = run_python(code, work, paths).stdout
    plain = run_python("import sys\nfrom splitfed.cli import main\nsys.exit(main(['list']))\n",
                       work, []).stdout
    for line in ("  psl            Jeon and Kim 2020 (ICOIN), parallel split learning "
                 "[plugin splitfed_lab]",
                 "  tiny_cnn       default cut 2; valid cuts 1, 2, 3 [plugin splitfed_lab]"):
        assert line + "\n" in with_plugin
    assert re.search(r"\n  clip_norm +gradient +Pascanu et al\. 2013 .* \[plugin "
                     r"splitfed_lab\]\n", with_plugin)
    for entry in ("csv_images", "label_blocks", "two_tier"):
        assert f"{entry} [plugin splitfed_lab]" in with_plugin
    assert without_plugin_entries(with_plugin, "splitfed_lab") == plain


def test_an_unreadable_catalog_is_not_used(tmp_path, monkeypatch):
    """An installation without a readable catalog lists the registries instead."""
    for text in (None, "not json", "[]", '{"algorithms": {}}'):
        path = tmp_path / "catalog.json"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(catalog, "PATH", path)
        assert catalog.stored() is None, text
