"""Another library's exception quoted in splitfed's one-line errors: one helper
(:func:`splitfed.errors.describe`) writes ``Type: message`` for every site, the text
(tokenizers), transformer (checkpoints) and plugin-origin errors included; and an unknown
component name is refused naming its config key, as every one-line error names its key."""

import pytest

from splitfed.errors import describe, one_line


def test_one_line_joins_whitespace_and_cuts_at_the_limit():
    e = ValueError("  first\n\tsecond   third " + "x" * 400)
    assert one_line(e) == ("first second third " + "x" * 400)[:300]
    assert one_line(e, 10) == "first seco"
    assert one_line(e, None) == "first second third " + "x" * 400
    assert one_line(OSError()) == ""


def test_describe_is_the_type_and_the_one_line_message():
    assert describe(ValueError("no\n  such")) == "ValueError: no such"
    assert describe(RuntimeError("y" * 500), 200) == "RuntimeError: " + "y" * 200


@pytest.mark.parametrize("override, says", [
    ("partition.scheme=IID", "partition.scheme: unknown partition scheme 'IID'; known: iid, "),
    ("model.name=MLP", "model.name: unknown model 'MLP'; known models: "),
    ("data.name=nope", "data.name: unknown dataset 'nope'; known: "),
    ("clock.profile=nope", "clock.profile: unknown profile 'nope'; profiles: fixed, "),
    ("algorithm.name=nope", "algorithm.name: unknown algorithm 'nope'; available: "),
])
def test_an_unknown_name_is_one_line_naming_its_key(tmp_path, monkeypatch, capsys, override,
                                                   says):
    """Every unknown component name (a case variant of a known one too) is refused with
    the config key it was given for, then the names splitfed knows."""
    from splitfed.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "quick_digits", override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitfed: error: {says}") and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


def test_a_missing_partition_parameter_names_its_key(tmp_path, monkeypatch, capsys):
    """As an unknown one does (the config's check of the scheme's options)."""
    from splitfed.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "quick_digits", "~partition.alpha", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitfed: error: partition.alpha: partition scheme 'dirichlet': "
                          "missing ['alpha'] parameter(s); allowed: alpha, "), err
    assert len(err.splitlines()) == 1
    assert main(["run", "quick_digits", "partition.scheme=iid",
                 "~partition.min_partition_size", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("splitfed: error: partition.alpha: not an "
                                              "option of scheme 'iid'")
    assert not any(tmp_path.iterdir())
