"""A local tokenizer directory that loads but cannot encode the sentences as a run needs
them (no attention mask among its outputs, more special tokens than ``data.max_len``
holds) is a one-line error naming the field, not a traceback nor sentences truncated to
their special tokens."""

import json

import pytest

from splitfed.data.text import hf_encode
from splitfed.errors import ConfigError

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

WORDS = "the movie is good bad".split()


def _tokenizer(path, special: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    if special:                                    # three special tokens per sentence
        t.post_processor = TemplateProcessing(single="<s> </s> $A </s>",
                                              special_tokens=[("<s>", 0), ("</s>", 2)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(path)
    return path


def test_more_special_tokens_than_max_len_is_refused(tmp_path):
    path = str(_tokenizer(tmp_path / "tok", special=True))
    for max_len in (2, 3):
        with pytest.raises(ConfigError, match=rf"^data\.max_len: {max_len} leaves no room "
                                              r"for a sentence: .* adds 3 special tokens"):
            hf_encode(path, ["the movie is good"], max_len)
    ids = hf_encode(path, ["the movie is good"], 5)
    assert ids.shape == (1, 2, 5) and ids[0, 0].tolist() == [0, 2, 4, 5, 2]


def test_a_tokenizer_that_names_no_attention_mask_still_gives_one(tmp_path):
    path = _tokenizer(tmp_path / "tok", special=False)
    config = path / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["model_input_names"] = ["input_ids"]
    config.write_text(json.dumps(data))
    ids = hf_encode(str(path), ["the movie", "good"], 4)
    assert ids[:, 1].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
