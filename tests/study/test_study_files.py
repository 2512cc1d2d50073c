"""A study directory, and its published copy, hold the study file as written and the base
config it names, so that the published study runs again as it is."""

import json

from splitfed.study import load_study, publish, run_study
from splitfed.study.reuse import config_identity
from tests.study.test_study import BASE, _write_study


def _identities(study):
    return [(r.label, r.seed, config_identity(r.config)) for r in study.runs]


def test_study_yaml_and_its_base_are_written_and_published(tmp_path):
    path = _write_study(tmp_path / "spec")
    result = run_study(path, out_dir=tmp_path / "out", jobs=1, quiet=True)
    d = result.dir
    assert (d / "study.yaml").read_text() == path.read_text()
    assert (d / "base.yaml").read_text() == (path.parent / "base.yaml").read_text()
    assert json.loads((d / "results.json").read_text())["base_file"] == "base.yaml"
    target = publish(d, tmp_path / "pub")
    written = {p.name for p in d.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert {"results.md", "results.json", "study.yaml", "base.yaml"} <= written
    assert {p.name for p in target.iterdir()} == written
    assert not (target / "runs").exists()
    # the published copy describes the same runs as the original file
    again = load_study(target / "study.yaml", out_dir=tmp_path / "out")
    assert _identities(again) == _identities(load_study(path, out_dir=tmp_path / "out"))


def test_a_shipped_base_or_a_mapping_writes_only_the_study(tmp_path):
    study = {"name": "inline", "base_config": dict(BASE), "overrides": ["rounds=1"],
             "runs": [{"label": "FL", "set": ["algorithm.name=fedavg"]}]}
    result = run_study(study, out_dir=tmp_path / "out", jobs=1, quiet=True)
    names = {p.name for p in result.dir.iterdir()}
    assert "study.yaml" in names and "base.yaml" not in names
    assert "base_file" not in json.loads((result.dir / "results.json").read_text())
    assert load_study(result.dir / "study.yaml").runs[0].config.rounds == 1
