"""A data set's or a partitioner's refusal of an option names the config key first
(``partition.max_tries: ...``, ``data.beta: ...``), as every other refusal does."""

from __future__ import annotations

import numpy as np
import pytest

from splitfed.data import load_dataset
from splitfed.data.partition import partition
from splitfed.data.text import WordTokenizer
from splitfed.errors import ConfigError

LABELS = np.repeat(np.arange(4), 25)


@pytest.mark.parametrize("scheme, options, key", [
    ("dirichlet", {"alpha": 0}, "partition.alpha"),
    ("dirichlet", {"alpha": 1.0, "max_tries": 0}, "partition.max_tries"),
    # a bound: 10**9 draws would keep a run (and its --dry-run) busy for weeks
    ("dirichlet", {"alpha": 1.0, "max_tries": 1001}, "partition.max_tries"),
    ("dirichlet", {"alpha": 1.0, "min_partition_size": 60}, "partition.min_partition_size"),
    ("dirichlet", {"alpha": 0.01, "min_partition_size": 33, "max_tries": 1},
     "partition.max_tries"),
    ("pathological", {"num_classes_per_partition": 5}, "partition.num_classes_per_partition"),
    ("pathological", {"num_classes_per_partition": 0}, "partition.num_classes_per_partition"),
    ("pathological", {"num_classes_per_partition": 1, "class_assignment_mode": "x"},
     "partition.class_assignment_mode"),
    ("shard", {"num_shards_per_partition": 0}, "partition.num_shards_per_partition"),
    ("shard", {"num_shards_per_partition": 60}, "partition.num_shards_per_partition"),
    ("shard", {"num_shards_per_partition": 2, "shard_size": 40}, "partition.shard_size"),
])
def test_partitioner_messages_name_the_key(scheme, options, key):
    with pytest.raises(ConfigError) as err:
        partition(LABELS, 3, scheme, np.random.default_rng(0), **options)
    assert str(err.value).startswith(f"{key}: "), str(err.value)


@pytest.mark.parametrize("name, options, key", [
    ("synthetic", {"beta": -1.0}, "data.beta"),
    ("synthetic", {"num_devices": 0}, "data.num_devices"),
    ("synthetic", {"test_fraction": 1.0}, "data.test_fraction"),
    ("synthetic", {"iid": "yes"}, "data.iid"),
    ("synthetic_text", {"seq_len": 1}, "data.seq_len"),
    ("synthetic_text", {"min_len": 1}, "data.min_len"),
    ("synthetic_text", {"marker": 10**9}, "data.marker"),
])
def test_data_set_messages_name_the_key(name, options, key):
    with pytest.raises(ConfigError) as err:
        load_dataset(name, None, **options)
    assert str(err.value).startswith(f"{key}: "), str(err.value)


def test_cifar100_label_mode_and_vocab_size_name_their_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.label_mode: must be 'fine' or 'coarse'"):
        load_dataset("cifar100", str(tmp_path), label_mode="foo")
    with pytest.raises(ConfigError, match=r"^data\.vocab_size: must be > "):
        WordTokenizer(["a b"], vocab_size=1)


@pytest.mark.parametrize("argv", [["--dry-run"], []])
def test_a_data_option_named_like_the_loaders_generator_is_unknown(tmp_path, capsys, argv):
    from splitfed.cli import main

    code = main(["run", "quick_digits", "rounds=1", "data.rng=5",
                 f"out_dir={tmp_path / 'runs'}", *argv])
    assert code == 2
    assert capsys.readouterr().err == ("splitfed: error: data: unknown option(s) rng for "
                                       "dataset 'digits'; allowed: none\n")
    assert not (tmp_path / "runs").exists()
