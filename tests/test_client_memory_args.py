"""benchmarks/client_memory.py refuses what it cannot measure with one argparse error
line (exit 2), not a traceback, and never measures blocks the model does not have."""

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.client_memory import build_client, main  # noqa: E402
from splitfed.errors import ConfigError  # noqa: E402


def refused(capsys, *argv):
    with torch.random.fork_rng(devices=[]), pytest.raises(SystemExit) as done:
        main(list(argv))
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("argv, message", [
    (["--method", "fedavg", "--seq-len", "0"],
     "argument --seq-len: expected a whole number >= 1, got '0'"),
    (["--method", "fedavg", "--batch-size", "-1"],
     "argument --batch-size: expected a whole number >= 1, got '-1'"),
    (["--method", "fedlora", "--lora-rank", "0"],
     "argument --lora-rank: expected a whole number >= 1, got '0'"),
    (["--method", "fedavg", "--option", "foo=1", "--seq-len", "8"],
     "model: unknown option(s) ['foo'] for model opt"),
    (["--method", "fedavg", "--option", "foo=[", "--seq-len", "8"],
     "argument --option: 'foo=[' does not give a YAML value"),
    (["--method", "musplitfed", "--cut", "9", "--option", "preset=tiny", "--seq-len", "8"],
     "--cut 9: model opt has 4 decoder blocks; give 1..4"),
    (["--method", "musplitfed", "--cut", "0", "--seq-len", "8"],
     "--cut 0: model opt has 4 decoder blocks; give 1..4"),
    (["--method", "musplitfed", "--cut", "3", "--option", "num_layers=2", "--seq-len", "8"],
     "--cut 3: model opt has 2 decoder blocks; give 1..2"),
    (["--method", "musplitfed", "--seq-len", "8"],
     "--cut: musplitfed needs the number of client blocks"),
])
def test_values_it_cannot_measure_are_one_argparse_error(capsys, argv, message):
    line = refused(capsys, *argv)
    assert line.startswith("python -m benchmarks.client_memory: error: ")
    assert message in line, line


def test_a_cut_within_the_model_builds_that_many_blocks():
    client, trainable = build_client("musplitfed", "opt", {"preset": "tiny"}, 8, 2, 4, 8)
    assert [n for n, _ in client.named_children()] == ["block1", "block2", "block3",
                                                      "block4"]
    assert trainable == []
    with pytest.raises(ConfigError, match="has 4 decoder blocks"):
        build_client("musplitfed", "opt", {"preset": "tiny"}, 8, 2, 5, 8)
