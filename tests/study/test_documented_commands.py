"""Every study command the docs give (the reproduction scoreboard, the study pages, the
README) names a study file of this repository that loads, writes under runs/ by default,
and every script they run exists: a result in the docs can be remade from a clone."""

import re
from pathlib import Path

import pytest

from splitfed.study import load_study

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
STUDY = re.compile(r"splitfed study\s+((?:studies|benchmarks)/[\w./-]+\.yaml)")
SCRIPT = re.compile(r"python (?:-m )?((?:studies|benchmarks)/[\w./-]+\.py)")


def mentions(pattern):
    return sorted({m for doc in DOCS for m in pattern.findall(doc.read_text(encoding="utf-8"))})


def test_the_scoreboard_gives_commands():
    # the patterns find what the scoreboard gives, so the checks below are not vacuous
    text = (ROOT / "docs" / "results" / "reproductions.md").read_text(encoding="utf-8")
    assert len(set(STUDY.findall(text))) >= 15
    assert STUDY.findall("`splitfed study\n  studies/p/a.yaml --jobs 2`") == ["studies/p/a.yaml"]


@pytest.mark.parametrize("path", mentions(STUDY))
def test_a_documented_study_loads_and_writes_under_runs(path):
    study = load_study(ROOT / path)
    assert study.dir.parts[0] == "runs", (path, study.dir)


@pytest.mark.parametrize("path", mentions(SCRIPT))
def test_a_documented_script_exists(path):
    assert (ROOT / path).is_file(), path
