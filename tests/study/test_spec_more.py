"""Study and sweep files refused before anything is built: a seed set twice (by ``seeds``
and by the grid, the overrides or a run's ``set``), and more runs than ``MAX_RUNS``."""

import pytest
import yaml

import splitfed.study.spec as spec_mod
from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.study import load_study, study_from_mapping
from splitfed.sweep import sweep_study

BASE = {"name": "tiny", "seed": 0, "rounds": 1,
        "data": {"name": "digits"},
        "partition": {"scheme": "iid", "num_clients": 3},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"batch_size": 16, "local_steps": 1, "lr": 0.1},
        "participation": {"mode": "full"}}


def _study(**over):
    return {"name": "s", "base_config": BASE, **over}


def _forbid_builds(monkeypatch):
    """Fail the test if any run's config is built."""
    def fail(*args, **kwargs):
        raise AssertionError("a run was built")
    monkeypatch.setattr(spec_mod, "_variant", fail)


# ------------------------------------------------------------------------------ seeds


@pytest.mark.parametrize("over, where", [
    ({"grid": {"seed": [1, 2]}}, "study.grid"),
    ({"grid": {"train.lr": [0.1, 0.2]}, "overrides": ["seed=7"]}, "study.overrides"),
    ({"runs": [{"label": "a", "set": ["seed=4"]}]}, "run 'a': set"),
    ({"runs": [{"label": "a"}], "grid": {"train.lr": [0.1, 0.2]},
      "overrides": ["~seed"]}, "study.overrides"),
])
def test_a_seed_set_besides_seeds_is_refused(over, where):
    with pytest.raises(ConfigError) as info:
        study_from_mapping(_study(seeds=[0], **over))
    message = str(info.value)
    assert message.startswith(where + ": 'seed' is set both here and by 'seeds'"), message
    assert "\n" not in message


def test_a_seed_axis_without_seeds_gives_each_point_its_seed():
    study = study_from_mapping(_study(grid={"seed": [1, 2]}))
    assert [(r.label, r.seed, r.config.seed) for r in study.runs] == [
        ("seed=1", 1, 1), ("seed=2", 2, 2)]
    assert len({r.run_dir for r in study.runs}) == 2


def test_seeds_replace_the_base_config_seed():
    study = study_from_mapping(_study(grid={"train.lr": [0.1, 0.2]}, seeds=[5, 6]))
    assert [r.config.seed for r in study.runs] == [5, 6, 5, 6]


@pytest.mark.parametrize("seeds", [[3, 3], [0, 1, 0]])
def test_a_seed_given_twice_in_seeds_is_refused(seeds):
    """Two runs of one variant at one seed would share their run directory (and count
    twice in the mean over seeds)."""
    with pytest.raises(ConfigError, match="study.seeds: expected a non-empty list of "
                                          "distinct seeds"):
        study_from_mapping(_study(grid={"train.lr": [0.1, 0.2]}, seeds=seeds))


def test_set_seed_on_the_command_line_with_seeds_in_the_file_is_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(grid={"train.lr": [0.1, 0.2]}, seeds=[0, 1])))
    with pytest.raises(ConfigError, match=r"study\.overrides: 'seed' is set both here"):
        load_study(path, overrides=["seed=3"])
    assert len(load_study(path, overrides=["rounds=2"]).runs) == 4


@pytest.mark.parametrize("key, axis, values", [("train.lr", "train.lr", [0.1, 0.2]),
                                               ("model.options.hidden", "model.hidden",
                                                [[8], [16]])])
def test_set_of_a_key_the_grid_sets_in_every_run_is_refused(tmp_path, key, axis, values):
    # the grid's values win, so the override would reach no run
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(grid={axis: values})))
    with pytest.raises(ConfigError, match=rf"--set {key}: the grid sets '{axis}' in every "
                                          r"run, so the override would reach none"):
        load_study(path, overrides=[f"{key}={values[0]}"])
    # a section around the axis still reaches the runs with its other keys
    study = load_study(path, overrides=["train={batch_size: 4}"])
    assert {r.config.train.batch_size for r in study.runs} == {4}


@pytest.mark.parametrize("item, key, axis", [
    ("train={lr: 0.3}", "train.lr", "train.lr"),
    ("train={lr: 0.3, batch_size: 4}", "train.lr", "train.lr"),
    ("model={options: {hidden: [4]}}", "model.options.hidden", "model.hidden"),
    ("model={hidden: [4]}", "model.hidden", "model.hidden")])
def test_set_of_a_section_holding_a_key_the_grid_sets_is_refused(tmp_path, item, key, axis):
    """A section written as a mapping is merged into the config's section: it sets the
    keys inside it, and one the grid sets in every run would reach none, as the same
    key written with dots would."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(grid={"train.lr": [0.1, 0.2],
                                                "model.hidden": [[8], [16]]})))
    with pytest.raises(ConfigError) as info:
        load_study(path, overrides=[item])
    assert str(info.value) == (f"--set {key} (in {item!r}): the grid sets '{axis}' in every "
                               "run, so the override would reach none; drop it or change "
                               "the grid")
    study = load_study(path, overrides=["train={batch_size: 4, local_steps: 2}"])
    assert {(r.config.train.batch_size, r.config.train.local_steps)
            for r in study.runs} == {(4, 2)}


def test_a_section_in_the_grid_or_the_runs_covers_only_the_keys_it_sets(tmp_path):
    """A grid value or a run's ``set`` item written as a section sets the keys inside it:
    --set of one of those is refused, of another key of the section it reaches the runs."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(grid={"train": [{"lr": 0.2},
                                                          {"lr": 0.3, "local_steps": 2}]})))
    with pytest.raises(ConfigError, match=r"^--set train\.lr: the grid sets 'train' in "
                                          "every run"):
        load_study(path, overrides=["train.lr=0.05"])
    study = load_study(path, overrides=["train.batch_size=4"])
    assert [(r.config.train.lr, r.config.train.batch_size) for r in study.runs] == [
        (0.2, 4), (0.3, 4)]
    runs = [{"label": "a", "set": ["train={lr: 0.3}"]},
            {"label": "b", "set": ["train={lr: 0.2, local_steps: 2}"]}]
    path.write_text(yaml.safe_dump(_study(runs=runs)))
    with pytest.raises(ConfigError, match=r"^--set train\.lr \(in 'train=\{lr: 0\.05\}'\): "
                                          "every run sets 'train' itself"):
        load_study(path, overrides=["train={lr: 0.05}"])
    study = load_study(path, overrides=["train.batch_size=4"])
    assert [(r.config.train.lr, r.config.train.batch_size) for r in study.runs] == [
        (0.3, 4), (0.2, 4)]


@pytest.mark.parametrize("key, own", [("train.lr", "train.lr"),
                                       ("train.lr", "train"),
                                       ("model.options.hidden", "model.hidden")])
def test_set_of_a_key_every_run_sets_itself_is_refused(tmp_path, key, own):
    """Each run's own ``set`` wins over --set, so a key all of them set would reach no
    run; one that some run leaves alone still reaches it."""
    value = {"train.lr": "0.3", "train": "{lr: 0.3}", "model.hidden": "[8]"}[own]
    runs = [{"label": "a", "set": [f"{own}={value}"]},
            {"label": "b", "set": ["rounds=2", f"{own}={value}"]}]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_study(runs=runs)))
    with pytest.raises(ConfigError, match=rf"^--set {key}: every run sets '{own}' itself "
                                          r"\(run 'a' and the rest\), so the override "
                                          r"would reach none"):
        load_study(path, overrides=[f"{key}={'[4]' if 'hidden' in key else '0.05'}"])
    path.write_text(yaml.safe_dump(_study(runs=[*runs, {"label": "c"}])))
    study = load_study(path, overrides=[f"{key}={'[4]' if 'hidden' in key else '0.05'}"])
    got = {r.label: (r.config.train.lr, r.config.model.options.get("hidden"))
           for r in study.runs}
    assert got["c"] == ((0.05, [16]) if key == "train.lr" else (0.1, [4]))
    # a section around the runs' own keys still reaches them with its other keys
    study = load_study(path, overrides=["train={batch_size: 4}"])
    assert {r.config.train.batch_size for r in study.runs} == {4}


@pytest.mark.parametrize("items", [["train.lr=0.1,0.2", "seed=1,2"],
                                   ["train.lr=0.1,0.2", "seed=1"]])
def test_a_sweep_with_seed_and_seeds_is_refused(items):
    with pytest.raises(ConfigError, match=r"^sweep: 'seed' is given both as seed=\.\.\. "
                                          r"and by --seeds"):
        sweep_study("quick_digits", items, seeds=[5])
    assert sweep_study("quick_digits", items)["grid"]["train.lr"] == [0.1, 0.2]


def test_the_sweep_command_refuses_seed_and_seeds_and_writes_nothing(tmp_path, capsys):
    code = main(["sweep", "quick_digits", "rounds=1", "train.lr=0.1,0.2", "seed=1,2",
                 "--seeds", "5", "--jobs", "1", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "'seed' is given both" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- run count


def test_a_huge_grid_is_refused_before_any_run_is_built(monkeypatch):
    _forbid_builds(monkeypatch)
    grid = {f"k{i}.x": list(range(20)) for i in range(6)}
    with pytest.raises(ConfigError) as info:
        study_from_mapping(_study(grid=grid))
    assert str(info.value) == ("study: defines 64,000,000 runs, more than the 100,000 "
                               "allowed; use fewer values or seeds, or split it into several")


@pytest.mark.parametrize("over, count", [
    ({"grid": {"train.lr": [0.1, 0.2], "rounds": [1, 2]}}, 4),
    ({"grid": {"train.lr": [0.1, 0.2]}, "seeds": [0, 1]}, 4),
    ({"grid": {"train.lr": [0.1, 0.2]}, "runs": [{"label": "a"},
                                                 {"label": "b", "set": ["rounds=2"]}]}, 4),
    ({"runs": [{"label": "a"}, {"label": "b", "set": ["rounds=2"]}], "seeds": [0, 1]}, 4),
])
def test_the_limit_counts_points_runs_and_seeds(monkeypatch, over, count):
    monkeypatch.setattr(spec_mod, "MAX_RUNS", count)
    assert len(study_from_mapping(_study(**over)).runs) == count
    monkeypatch.setattr(spec_mod, "MAX_RUNS", count - 1)
    with pytest.raises(ConfigError, match=f"^study: defines {count} runs, more than the "
                                          f"{count - 1} allowed"):
        study_from_mapping(_study(**over))


def test_a_huge_sweep_is_refused_with_its_count(tmp_path, capsys, monkeypatch):
    _forbid_builds(monkeypatch)
    values = ",".join(str(v) for v in range(1, 21))
    items = [f"{key}={values}" for key in ("train.lr", "train.batch_size", "seed",
                                           "partition.alpha", "train.local_steps",
                                           "partition.num_clients")]
    code = main(["sweep", "quick_digits", "rounds=1", *items, "--out-dir",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err == ("splitfed: error: sweep: defines 64,000,000 runs, more "
                                 "than the 100,000 allowed; use fewer values or seeds, or "
                                 "split it into several\n")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="^sweep: defines 120,000 runs"):
        sweep_study("quick_digits", ["train.lr=" + values, "rounds=" + values],
                    seeds=list(range(300)))


# ---------------------------------------------------------------- options, two spellings

DIRICHLET = {**BASE, "partition": {"scheme": "dirichlet", "num_clients": 3,
                                   "options": {"alpha": 1.0}}}


@pytest.mark.parametrize("grid_key, set_key", [
    ("partition.alpha", "partition.options.alpha=0.3"),
    ("partition.options.alpha", "partition.alpha=0.3"),
    ("partition.alpha", "partition.options={alpha: 0.3}"),
])
def test_a_run_setting_a_grid_option_in_another_spelling_is_refused(grid_key, set_key):
    with pytest.raises(ConfigError, match="set both by the run and by the grid"):
        study_from_mapping({"name": "s", "base_config": DIRICHLET,
                            "grid": {grid_key: [0.1, 0.5]},
                            "runs": [{"label": "a", "set": [set_key]}]})


def test_a_grid_option_overrides_the_base_option_in_either_spelling():
    study = study_from_mapping({"name": "s", "base_config": DIRICHLET,
                                "grid": {"partition.options.alpha": [0.1, 0.5]},
                                "overrides": ["partition.alpha=9.0"]})
    assert [r.config.partition.options["alpha"] for r in study.runs] == [0.1, 0.5]


@pytest.mark.parametrize("grid, match", [
    ({"train.lr": [0.1, 0.2], "train": [{"lr": 0.3}, {"lr": 0.4}]},
     "study.grid: the axes 'train.lr' and 'train' set the same value"),
    ({"train": [{"lr": 0.3}, {"lr": 0.4}], "train.lr": [0.1, 0.2]},
     "study.grid: the axes 'train' and 'train.lr' set the same value"),
    ({"train.lr": [0.1, 0.1]}, "study.grid.train.lr: repeats a value"),
    ({"train.lr": ["1e-3", 0.001]}, "the runs 'train.lr=1e-3' and 'train.lr=0.001' have "
                                    "the same config"),
])
def test_a_grid_whose_runs_would_be_mislabelled_or_repeated_is_refused(grid, match):
    """Axes that set one value (the later replaced the earlier's, whose values the labels
    still named) and values that make one run twice are refused, as a sweep's are."""
    with pytest.raises(ConfigError, match=match):
        study_from_mapping(_study(grid=grid))


def test_two_runs_of_one_config_are_refused():
    with pytest.raises(ConfigError, match="the runs 'a' and 'b' have the same config"):
        study_from_mapping(_study(runs=[{"label": "a"}, {"label": "b", "set": ["rounds=1"]}]))


@pytest.mark.parametrize("head", ["", "---\n"])
def test_the_kept_copy_of_a_study_without_a_name_names_it(tmp_path, head):
    """A study named by its file name keeps a copy (study.yaml in its directory) that
    names it, so that running the copy reuses the study's runs instead of starting a
    study called 'study'."""
    path = tmp_path / "mystudy.yaml"
    path.write_text(head + "# my comment\nbase_config: {rounds: 1}\n"
                    "grid: {train.lr: [0.1, 0.2]}\n")
    study = load_study(path)
    assert study.name == "mystudy"
    copy = tmp_path / "copy" / "study.yaml"
    copy.parent.mkdir()
    copy.write_text(study.text)
    assert load_study(copy).name == "mystudy"
    assert yaml.safe_load(study.text)["grid"] == {"train.lr": [0.1, 0.2]}
    if not head:
        assert "# my comment" in study.text             # the file as written, named


def test_a_runs_panel_reads_its_grid_value_as_its_label_does():
    """``group_by`` a swept key: each run's panel is the value as the grid gives it (and
    its label reads it), not the value as the config stores it (``1`` is the float 1.0
    there)."""
    study = study_from_mapping(_study(grid={"train.lr": [1, 0.5], "rounds": [1, 2]},
                                      group_by="train.lr"))
    assert [(v.label, v.group, v.line_label) for v in study.variants] == [
        ("train.lr=1, rounds=1", "1", "rounds=1"), ("train.lr=1, rounds=2", "1", "rounds=2"),
        ("train.lr=0.5, rounds=1", "0.5", "rounds=1"),
        ("train.lr=0.5, rounds=2", "0.5", "rounds=2")]
    assert study.runs[0].config.train.lr == 1.0
