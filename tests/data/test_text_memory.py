"""Tokenising and reading SST-2 text takes memory near the text's own size: the built-in
tokenizer splits only the words it keeps, a tokenizer directory sees long texts as a
bounded prefix and the texts in chunks, and a parquet file's sentences are counted batch
by batch, so nothing decodes far past the text limit. The ids stay those of encoding the
whole texts at once."""

import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch

from splitfed.data import text
from splitfed.data.text import BOS, FIRST_WORD, PAD, UNK, WordTokenizer, hf_encode
from splitfed.errors import ConfigError, DataError

WORDS = "the movie is good bad a film plot , . ! superb dull".split()


def _sentences(rng, n, longest):
    """``n`` sentences from a few to ``longest`` characters, some with long runs of
    spaces, long words, capitals and non-ASCII letters."""
    out = []
    for i in range(n):
        size = int(rng.integers(1, longest))
        words = rng.choice(WORDS + ["Σ'''a", "İx", "ΑΣ", "x" * 300, " " * 2000, "Good"],
                           size=max(1, size // 4))
        out.append(" ".join(words)[:size] if i % 3 else " ".join(words))
    return out + ["", " " * 5000 + "the movie", "good " * 4000]


def _old_word_ids(train, texts, vocab_size, max_len):
    """The built-in tokenizer as it was first written: every word listed, then cut."""
    counts = Counter(w for t in train for w in text._WORD.findall(t.lower()))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - FIRST_WORD]
    vocab = {w: i for i, w in enumerate(ranked, start=FIRST_WORD)}
    out = np.zeros((len(texts), 2, max_len), dtype=np.int64)
    out[:, 0] = PAD
    for i, t in enumerate(texts):
        ids = ([BOS] + [vocab.get(w, UNK) for w in text._WORD.findall(t.lower())])[:max_len]
        out[i, 0, : len(ids)] = ids
        out[i, 1, : len(ids)] = 1
    return vocab, torch.from_numpy(out)


@pytest.mark.parametrize("max_len", [2, 8, 64])
def test_word_ids_are_those_of_splitting_every_word(monkeypatch, max_len):
    monkeypatch.setattr(text, "_LAZY_WORDS", 100, raising=False)   # long texts streamed
    rng = np.random.default_rng(0)
    train, test = _sentences(rng, 40, 6000), _sentences(rng, 20, 6000)
    for vocab_size in (6, 12, 8192):
        tok = WordTokenizer(train, vocab_size)
        vocab, ids = _old_word_ids(train, test, vocab_size, max_len)
        assert tok.vocab == vocab
        assert torch.equal(tok.encode(test, max_len), ids)


def test_built_in_tokenizer_memory_follows_the_text_not_its_words():
    sentence = "Good movie " * 200_000                  # 2.2 MB, 400,000 words
    tracemalloc.start()
    try:
        tok = WordTokenizer([sentence, "bad"], 64)
        ids = tok.encode([sentence], 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids[0, 0].tolist() == [BOS] + [tok.vocab["good"], tok.vocab["movie"]] * 7 + [
        tok.vocab["good"]]
    # one lower-cased copy of the sentence; its list of words took 15 times the text
    assert peak < 3 * len(sentence), peak


def _bpe_tokenizer(path):
    """A small byte-level BPE (OPT's and GPT-2's kind), trained here, with a BOS."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(_sentences(np.random.default_rng(1), 200, 300), trainer)
    t.post_processor = TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="</s>",
                                         pad_token="<pad>").save_pretrained(path)
    return str(path)


def _word_level_tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    t = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(path)
    return str(path)


def _whole_texts_ids(path, texts, max_len):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.padding_side = "right"
    enc = tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
              return_attention_mask=True, return_tensors="pt")
    return torch.stack([enc["input_ids"], enc["attention_mask"]], dim=1).long()


@pytest.mark.parametrize("make", [_bpe_tokenizer, _word_level_tokenizer])
def test_tokenizer_ids_are_those_of_encoding_the_whole_texts(tmp_path, monkeypatch, make):
    path = make(tmp_path / "tok")
    monkeypatch.setattr(text, "_CHUNK_TEXTS", 7, raising=False)   # several chunks
    rng = np.random.default_rng(2)
    texts = _sentences(rng, 16, 8000) + ["the movie " * 2000 + "good"]
    for max_len in (4, 64, 300):
        assert torch.equal(hf_encode(path, texts, max_len),
                           _whole_texts_ids(path, texts, max_len)), max_len


def test_tokenizer_sees_a_bounded_prefix_of_a_long_text(tmp_path, monkeypatch):
    path = _bpe_tokenizer(tmp_path / "tok")
    from transformers import AutoTokenizer

    cls = next(c for c in type(AutoTokenizer.from_pretrained(path)).__mro__
               if "__call__" in c.__dict__)
    call, seen = cls.__call__, []

    def spy(self, texts, *args, **kwargs):
        seen.append(len(texts) if isinstance(texts, str) else sum(map(len, texts)))
        return call(self, texts, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", spy)
    sentence = "the movie is good . " * 100_000            # 2 MB, one sentence
    ids = hf_encode(path, [sentence, "bad"], 16)
    assert ids.shape == (2, 2, 16) and ids[0, 1].all()
    assert max(seen) <= 1 << 14, seen                     # it was the whole 2 MB


def test_a_parquet_file_is_decoded_only_up_to_the_text_limit(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # 30 MB of distinct sentences in a small file; the limit is 1 MiB
    pq.write_table(pa.table({"sentence": [f"{'x' * 1000}{i}" for i in range(30_000)],
                             "label": pa.array(np.arange(30_000) % 2)}),
                   tmp_path / "train.parquet", compression="zstd")
    monkeypatch.setattr(text, "MAX_TEXT_BYTES", 1 << 20)
    pool = pa.proxy_memory_pool(pa.default_memory_pool())   # this read's own peak
    default = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        with pytest.raises(DataError, match=r"train.parquet: its sentences hold (at least )?"
                                            r"\d+ bytes of text, more than the 1048576 a "
                                            r"text split may hold$"):
            text._read_parquet(tmp_path / "train.parquet")
    finally:
        pa.set_memory_pool(default)
    assert pool.max_memory() < 20 << 20, pool.max_memory()   # it decoded all 30 MB


def test_parquet_read_in_batches_gives_every_row(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(text, "_PARQUET_BATCH_ROWS", 7, raising=False)
    sentences = [f"s{i % 13}" * (i % 5) for i in range(100)]
    pq.write_table(pa.table({"label": pa.array(np.arange(100) % 2), "sentence": sentences}),
                   tmp_path / "f.parquet", row_group_size=30)
    texts, labels, size = text._read_parquet(tmp_path / "f.parquet")
    assert texts == sentences and labels.tolist() == (np.arange(100) % 2).tolist()
    assert size == sum(map(len, sentences))
    pq.write_table(pa.table({"label": pa.array([], pa.int64()),
                             "sentence": pa.array([], pa.string())}), tmp_path / "e.parquet")
    texts, labels, size = text._read_parquet(tmp_path / "e.parquet")
    assert texts == [] and labels.tolist() == [] and size == 0


def _growing_tokenizer(path, growth: int):
    """A word-level tokenizer whose normalizer puts ``growth`` characters (" good"
    repeated) in place of every character."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "good": 4}
    t = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.normalizer = normalizers.Replace(Regex("."), " good" * (growth // 5))
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(path)
    return str(path)


def test_a_tokenizer_that_multiplies_the_text_is_refused_in_little_memory(tmp_path):
    # 11 kB of tokenizer.json: each character becomes 2000 tokens, so 200 sentences of
    # 100 characters would be 40 million tokens (gigabytes) before truncation
    path = _growing_tokenizer(tmp_path / "tok", 10_000)
    texts = ["the movie is good " * 5 + "x" * 10] * 200
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"^data\.tokenizer: the tokenizer in .* makes "
                                              r"a sentence of 100 characters more than 16 "
                                              r"times longer before it splits it \(\d+ "
                                              r"characters from its first 256\); refused$"):
            hf_encode(path, texts, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_normalizer_that_lengthens_text_a_little_is_accepted(tmp_path):
    path = _growing_tokenizer(tmp_path / "tok", 10)       # " good good" per character
    ids = hf_encode(path, ["ab", "a" * 600], 6)
    assert torch.equal(ids, _whole_texts_ids(path, ["ab", "a" * 600], 6))
    assert ids[:, 0].tolist() == [[4, 4, 4, 4, 1, 1], [4] * 6]
