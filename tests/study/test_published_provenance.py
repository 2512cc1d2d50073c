"""docs/results: every published study is linked from the index (README.md), and its
``results.json`` carries the provenance of the code that made it, except those that
reproductions.md lists as made before provenance was recorded; that list names exactly
those, and its count is right."""

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
LISTED = re.compile(r"These (\d+) `results\.json`\s+files have no `provenance` key:(.*?)\.\s",
                    re.S)


def without_provenance() -> set[str]:
    return {p.parent.name for p in RESULTS.glob("*/results.json")
            if "provenance" not in json.loads(p.read_text())}


def test_the_list_of_studies_without_provenance_is_exact():
    text = (RESULTS / "reproductions.md").read_text()
    found = LISTED.search(text)
    missing = without_provenance()
    if not missing:
        assert found is None, "reproductions.md lists studies without provenance; none is left"
        return
    assert found, "reproductions.md must list the studies whose results.json lacks provenance"
    names = re.findall(r"`([\w.-]+)`", found.group(2))
    assert int(found.group(1)) == len(names)
    assert set(names) == missing


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*/results.json")),
                         ids=lambda p: p.parent.name)
def test_a_provenance_record_names_the_code(path):
    prov = json.loads(path.read_text()).get("provenance")
    if prov is None:
        pytest.skip("made before provenance was recorded (listed in reproductions.md)")
    # the digest of the package's files (``source``) came later than the git commit
    assert isinstance(prov.get("splitfed"), str) and (prov.get("source") or prov.get("commit"))


def test_every_published_study_is_linked_from_the_results_index():
    index = (RESULTS / "README.md").read_text()
    unlinked = [p.parent.name for p in sorted(RESULTS.glob("*/results.md"))
                if f"({p.parent.name}/results.md)" not in index]
    assert not unlinked, f"docs/results/README.md does not link: {unlinked}"
