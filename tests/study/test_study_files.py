"""A study directory, and its published copy, hold the study file as written and the base
config it names, so that the published study runs again as it is."""

import json

import pytest

import splitfed.study as study_mod
from splitfed.errors import ConfigError
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


def test_a_directory_in_the_way_of_the_base_copy_is_refused_before_any_run(
        tmp_path, monkeypatch):
    path = _write_study(tmp_path / "spec")
    (tmp_path / "out" / "tiny_study" / "base.yaml").mkdir(parents=True)
    monkeypatch.setattr(study_mod, "run_experiment",
                        lambda *a, **k: pytest.fail("a run was started"))
    with pytest.raises(ConfigError, match=r"base.yaml exists and is not a file"):
        run_study(path, out_dir=tmp_path / "out", jobs=1, quiet=True)
    assert not (tmp_path / "out" / "tiny_study" / "study.yaml").exists()


def test_a_base_named_study_yaml_is_refused(tmp_path):
    folder = tmp_path / "spec"
    path = _write_study(folder, {"name": "s", "base": "study.yaml",
                                 "runs": [{"label": "FL", "set": ["rounds=1"]}]})
    (folder / "main.yaml").write_text(path.read_text())
    (folder / "study.yaml").write_text((folder / "base.yaml").read_text())
    with pytest.raises(ConfigError, match="study.base: a base config named study.yaml"):
        load_study(folder / "main.yaml")


def test_a_rerun_replaces_links_in_the_study_directory_never_their_targets(tmp_path):
    # results.json, results.md, study.yaml and the plots are replaced at once (written
    # aside, then renamed), so a link planted in the study directory is replaced, and
    # the file it points to, outside the directory, is left alone
    path = _write_study(tmp_path / "spec")
    d = run_study(path, out_dir=tmp_path / "out", jobs=1, quiet=True).dir
    names = ["results.json", "results.md", "study.yaml",
             *(p.name for p in d.glob("accuracy_vs_*.png"))]
    victims = {}
    for name in names:
        victim = tmp_path / f"victim-{name}"
        victim.write_text("keep")
        (d / name).unlink()
        (d / name).symlink_to(victim)
        victims[name] = victim
    run_study(path, out_dir=tmp_path / "out", jobs=1, quiet=True)     # every run reused
    for name, victim in victims.items():
        assert victim.read_text() == "keep", name
        assert (d / name).is_file() and not (d / name).is_symlink(), name
    assert json.loads((d / "results.json").read_text())["runs"]
