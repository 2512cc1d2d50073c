"""Another library's exception quoted in splitfed's one-line errors: one helper
(:func:`splitfed.errors.describe`) writes ``Type: message`` for every site, the text
(tokenizers), transformer (checkpoints) and plugin-origin errors included."""

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
