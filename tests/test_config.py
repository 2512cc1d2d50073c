"""The run config: shipped configs load, bad input is refused with the key named."""

from pathlib import Path

import pytest

from splitfed.config import build_config, load_config, shipped_configs
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_loads_and_builds_its_algorithm(name):
    cfg = load_config(name)
    build_algorithm(cfg)


def test_override_and_option_folding():
    cfg = load_config("fedavg_fmnist", ["partition.alpha=0.1", "train.lr=1e-3", "rounds=3"])
    assert cfg.partition.options == {"alpha": 0.1}
    assert cfg.train.lr == 1e-3 and cfg.rounds == 3


FLAT = {"partition": {"scheme": "dirichlet", "num_clients": 10, "alpha": 1.0}}
NESTED = {"partition": {"scheme": "dirichlet", "num_clients": 10, "options": {"alpha": 1.0}}}


@pytest.mark.parametrize("raw,override,expected", [
    (FLAT, "partition.options={alpha: 0.5}", {"alpha": 0.5}),
    (NESTED, "partition.alpha=0.5", {"alpha": 0.5}),
    (NESTED, "partition.options.alpha=0.5", {"alpha": 0.5}),
    (FLAT, "partition.options.beta=2", {"alpha": 1.0, "beta": 2}),
    (NESTED, "~partition.alpha", {}),
    (FLAT, "~partition.options.alpha", {}),
    (NESTED, "~partition.options", {}),
    (FLAT, "partition.options=null", {}),
])
def test_an_option_is_one_key_flat_or_under_options(raw, override, expected):
    # the later source wins whichever spelling either used
    cfg = build_config(raw, [override])
    assert cfg.partition.options == expected and cfg.partition.scheme == "dirichlet"


def test_one_source_giving_an_option_twice_is_refused_unless_equal():
    both = {"partition": {"scheme": "dirichlet", "alpha": 1.0, "options": {"alpha": 0.5}}}
    with pytest.raises(ConfigError, match=r"partition\.alpha: given twice.*give it once"):
        build_config(both)
    same = {"partition": {"scheme": "dirichlet", "alpha": 0.5, "options": {"alpha": 0.5}}}
    assert build_config(same).partition.options == {"alpha": 0.5}


@pytest.mark.parametrize("overrides,fragment", [
    (["train.lrr=0.1"], "train.lrr"),
    (["rounds=many"], "rounds"),
    (["train.lr=-1"], "train.lr"),
    (["participation.mode=sometimes"], "participation.mode"),
    (["train.local_steps=5"], "local_epochs"),
    (["progress=3"], "progress"),
])
def test_bad_config_values_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config("fedavg_fmnist", overrides)


def test_unknown_algorithm_option_names_the_key():
    cfg = load_config("quick_digits", ["algorithm.global_lrr=0.5"])
    with pytest.raises(ConfigError, match="global_lrr"):
        build_algorithm(cfg)


def test_unknown_algorithm_lists_the_available_ones():
    cfg = load_config("quick_digits", ["algorithm.name=fedfoo"])
    with pytest.raises(ConfigError, match="fedavg"):
        build_algorithm(cfg)


def test_unknown_partition_option_names_the_key():
    cfg = load_config("quick_digits", ["partition.alhpa=0.3"])
    with pytest.raises(ConfigError, match="partition.alhpa"):
        build_environment(cfg)


def test_bad_cut_names_the_valid_cuts():
    cfg = build_config({"data": {"name": "digits"}, "model": {"name": "mlp", "cut": 9}})
    with pytest.raises(ConfigError, match="valid cuts"):
        build_environment(cfg)


def test_missing_config_file_lists_shipped_configs():
    with pytest.raises(ConfigError, match="fedavg_fmnist"):
        load_config("no_such_config")


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = readme.split("```bash\n")
    test_cmd = blocks[2].split("\n```")[0].strip()
    assert "pytest" in test_cmd
    assert test_cmd in ci


def test_check_against_data_batch_and_round_size():
    from splitfed.config import MAX_ROUND_SAMPLES, check_against_data
    cfg = build_config({"train": {"batch_size": 50, "local_steps": 2}})
    check_against_data(cfg, [30, 30], slots=2)                # B > a client's data: fine
    with pytest.raises(ConfigError, match=r"train.batch_size: 50 exceeds the 40 .*1\.\.40"):
        check_against_data(cfg, [20, 20], slots=2)
    big = build_config({"train": {"batch_size": 1000, "local_steps": 10**6}})
    with pytest.raises(ConfigError, match=f"train.local_steps: .*{MAX_ROUND_SAMPLES}"):
        check_against_data(big, [10**4], slots=1)
    epochs = build_config({"train": {"batch_size": 10, "local_epochs": 10**4}})
    with pytest.raises(ConfigError, match="train.local_epochs"):
        check_against_data(epochs, [10**4] * 2, slots=2)


def test_check_model_size_static_and_memory(monkeypatch):
    import splitfed.config as config
    cfg = build_config({"model": {"name": "mlp", "hidden": [4]}})
    config.check_model_size(cfg, 10**6, copies=4)
    with pytest.raises(ConfigError, match=r"model.options: mlp would have .*model.hidden"):
        config.check_model_size(cfg, config.MAX_MODEL_PARAMS + 1, copies=1)
    monkeypatch.setattr(config, "machine_memory", lambda: 10**8)
    with pytest.raises(ConfigError, match="engine.chunk_size"):
        config.check_model_size(cfg, 10**7, copies=4)


@pytest.mark.parametrize("device", ["meta", "meta:0", "mps", "xpu", "lazy", "cuda:9999"])
def test_an_unusable_device_is_refused_before_anything_is_written(tmp_path, capsys, device):
    from splitfed.cli import main
    code = main(["run", "quick_digits", "rounds=1", f"out_dir={tmp_path}",
                 f"engine.device={device}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("splitfed: error: engine.device")
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


@pytest.mark.parametrize("section, key", [("data", "name"), ("model", "cut"),
                                          ("partition", "num_clients"),
                                          ("algorithm", "client_transforms")])
def test_a_sections_own_key_under_its_options_is_refused(section, key):
    # it would reach the component as an option of the same name as the call's argument
    from splitfed.config import build_config

    with pytest.raises(ConfigError, match=rf"^{section}.options.{key}: '{key}' is a key of "
                                          rf"the {section} section, not an option"):
        build_config({"name": "t", section: {"options": {key: None}}})


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                 "can't allocate memory: you tried to allocate 256000000000 bytes. Error "
                 "code 12 (Cannot allocate memory)"),
    MemoryError()])
def test_an_algorithm_state_that_does_not_fit_in_memory_is_one_line(tmp_path, capsys,
                                                                     monkeypatch, failure):
    """SCAFFOLD keeps a control variate per client: with many clients of a large model its
    state cannot be allocated (1000 clients of a 64M-parameter MLP ask 256 GB, which the
    allocator refuses). That is a one-line error naming the number of clients, before
    anything is written, as for a model that does not fit, not a traceback."""
    from splitfed.algorithms.scaffold import ScaffoldControls
    from splitfed.cli import main

    def refuse(self, env, params):
        raise failure
    monkeypatch.setattr(ScaffoldControls, "init", refuse)
    for dry in ([], ["--dry-run"]):
        code = main(["run", "quick_digits", "rounds=1", f"out_dir={tmp_path}",
                     "algorithm.name=scaffold", *dry])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("splitfed: error: algorithm.name: algorithm 'scaffold': its "
                              "state does not fit in this machine's memory (")
        assert ("an allocation of 238.4 GiB failed" if isinstance(failure, RuntimeError)
                else "MemoryError") in err
        assert "grows with partition.num_clients (8)" in err and not any(tmp_path.iterdir())


def test_dotted_keys_overlap_and_cover_by_whole_parts():
    """Keys are compared part by part: ``train.lr`` and ``train.lr_decay`` are two
    values (both may be swept at once), ``train`` holds ``train.lr``, and an option is
    one key flat or under its section's ``options``."""
    from splitfed.config import key_covers, keys_overlap

    assert not keys_overlap("train.lr", "train.lr_decay")
    assert not keys_overlap("train.lr_decay", "train.lr")
    assert keys_overlap("train", "train.lr") and keys_overlap("train.lr", "train")
    assert keys_overlap("partition.alpha", "partition.options.alpha")
    assert key_covers("train", "train.lr") and key_covers("train.lr", "train.lr")
    assert not key_covers("train.lr", "train")
    assert not key_covers("train.lr", "train.lr_decay")
    assert key_covers("partition.options", "partition.alpha")


def test_a_sweep_over_a_key_and_a_longer_key_of_the_same_prefix_is_kept():
    from splitfed.grid import parse_axes

    axes, over = parse_axes(["train.lr=0.1,0.2", "train.lr_decay=0.9,0.99",
                             "train.lr_min=0.001"])
    assert list(axes) == ["train.lr", "train.lr_decay"] and over == ["train.lr_min=0.001"]
