"""docs/results: every published study is linked from the index (README.md), and its
``results.json`` carries the provenance of the code that made it (every study published
before provenance was recorded has been rerun; docs/results/reproductions.md)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*/results.json")),
                         ids=lambda p: p.parent.name)
def test_a_provenance_record_names_the_code(path):
    prov = json.loads(path.read_text()).get("provenance")
    assert prov is not None, f"{path.parent.name}: results.json has no provenance record"
    # the digest of the package's files (``source``) came later than the git commit
    assert isinstance(prov.get("splitfed"), str) and (prov.get("source") or prov.get("commit"))


def test_every_published_study_is_linked_from_the_results_index():
    index = (RESULTS / "README.md").read_text()
    unlinked = [p.parent.name for p in sorted(RESULTS.glob("*/results.md"))
                if f"({p.parent.name}/results.md)" not in index]
    assert not unlinked, f"docs/results/README.md does not link: {unlinked}"
