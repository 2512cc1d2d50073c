"""Text classification data: SST-2 (GLUE) and a synthetic marker task, as token tensors.

Every sample is one int64 tensor ``[2, L]``: row 0 the token ids (a leading BOS, then the
text, right-padded with PAD), row 1 the attention mask (1 = token, 0 = padding); the
input shape is ``(2, L)`` (:mod:`splitfed.models.transformer` reads it). Texts are
tokenised once, at load time.

Tokenizers. ``tokenizer=<dir>``: a local Hugging Face tokenizer directory
(``AutoTokenizer.from_pretrained(dir, local_files_only=True)``; e.g. the directory an OPT
checkpoint was saved to), right padding, truncation at ``max_len``; texts are encoded in
chunks, and a text longer than ``max(1024, 16 * max_len)`` characters from the prefix
whose ids no longer change when the cut is doubled (:func:`_stable_prefix`, a recorded
decision). Otherwise the built-in :class:`WordTokenizer`: lower-cased words and
punctuation (regex ``\\w+|[^\\w\\s]``), the ``vocab_size - 4`` most frequent words of
the *train* split (ties alphabetical; every word of every train text counts, streamed,
not listed) get ids 4.., everything else UNK (a text is split only up to the words
``max_len`` keeps); ids 0..3 are reserved as in OPT's vocabulary (0 ``<s>``, 1 PAD,
2 BOS ``</s>``, 3 UNK). Deterministic and offline; it is not OPT's BPE, so with the
built-in tokenizer a pretrained OPT's embeddings do not match the words (use it with
random initialisation, or give the checkpoint's tokenizer directory).

SST-2 (Socher et al. 2013, GLUE version): ``data_dir`` holds ``train.tsv`` and
``dev.tsv`` (tab-separated, header ``sentence<TAB>label``, as GLUE distributes them), or
the parquet files of the Hugging Face ``glue/sst2`` set (``train-*.parquet`` and
``validation-*.parquet``, columns ``sentence`` and ``label``; needs pandas and pyarrow).
GLUE's test split has no labels, so the dev split (872 sentences) is the test set, as in
paper 001 and MeZO. A split holds at most :data:`MAX_TEXT_SAMPLES` rows (GLUE's train
split has 67,349): a TSV file's lines are counted on its raw bytes and a parquet file's
rows read from its metadata (all of a split's files together) before any row becomes a
Python object, so a small file declaring millions of short rows is refused in bounded
memory. A split's sentences hold at most :data:`MAX_TEXT_BYTES` bytes of text (a TSV
file's size; a parquet file's sentences are read dictionary-encoded, batch by batch, and
their bytes counted before they are expanded, so one long sentence repeated on every row
is refused too, and reading stops at the budget whatever sizes the file declares).

Synthetic marker task (offline): random token sequences of random length; label 1 iff the
marker token occurs (exactly half the samples, one marker at a random position).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from splitfed.data.datasets import (
    ArrayDataset,
    DataBundle,
    check_file_size,
    check_regular,
    open_regular,
    int_option,
    labels_tensor,
)
from splitfed.errors import ConfigError, DataError, describe

PAD, BOS, UNK, FIRST_WORD = 1, 2, 3, 4
#: the largest text file read, and the most bytes of sentence text a split may hold
#: (GLUE's SST-2 train.tsv is 4 MB)
MAX_TEXT_BYTES = 1 << 28
#: the most bytes a parquet file may inflate to (pyarrow's metadata, read first)
MAX_PARQUET_BYTES = 1 << 30
MAX_LEN = 1 << 14
MAX_VOCAB = 1 << 20
#: the most rows (samples) a text split may hold, counted before the rows are read
MAX_TEXT_SAMPLES = 10**6
#: tokens (samples x max_len) a split may hold: 800 MB as int64 ids and mask
MAX_TOKENS = 5 * 10**7
_WORD = re.compile(r"\w+|[^\w\s]")
#: a text longer than this many characters is split into words one at a time, never
#: into a list of all its words (shorter ones are split with one ``findall``: the same words)
_LAZY_WORDS = 1 << 16
#: :func:`hf_encode` hands the tokenizer at most this many texts, of at most
#: :data:`_CHUNK_CHARS` characters together (plus one text), at a time
_CHUNK_TEXTS = 1024
_CHUNK_CHARS = 1 << 22
#: the most a tokenizer directory's normalizer may lengthen a text (lower-casing and accent
#: stripping lengthen few characters; NFKC a few rare ones up to 18 times, so a sentence
#: of nothing else would be refused); the text is measured :data:`_NORMALIZE_SLICE`
#: characters at a time
MAX_NORMALIZED_GROWTH = 16
_NORMALIZE_SLICE = 256
#: parquet rows decoded at a time while a file's bytes of text are counted
_PARQUET_BATCH_ROWS = 1024


class WordTokenizer:
    """Deterministic word-level tokenizer built from a list of texts (module docstring)."""

    def __init__(self, texts: Sequence[str], vocab_size: int = 8192):
        if vocab_size <= FIRST_WORD:
            raise ConfigError(f"data.vocab_size: must be > {FIRST_WORD}, got {vocab_size}")
        counts: Counter[str] = Counter()
        for t in texts:             # every word of every text counts, as a stream
            counts.update(self.words(t) if len(t) <= _LAZY_WORDS else self.iter_words(t))
        ranked = sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - FIRST_WORD]
        self.vocab = {w: i for i, w in enumerate(ranked, start=FIRST_WORD)}
        self.vocab_size = vocab_size

    @staticmethod
    def words(text: str) -> list[str]:
        return _WORD.findall(text.lower())

    @staticmethod
    def iter_words(text: str) -> Iterator[str]:
        """:meth:`words` one at a time (no list of them all: a long text's words would
        take many times its own memory)."""
        return (m.group() for m in _WORD.finditer(text.lower()))

    def encode(self, texts: Sequence[str], max_len: int) -> torch.Tensor:
        """``[N, 2, max_len]`` ids and mask: BOS, the words (truncated), PAD."""
        out = np.zeros((len(texts), 2, max_len), dtype=np.int64)
        out[:, 0] = PAD
        for i, text in enumerate(texts):
            words = islice(self.iter_words(text), max_len - 1)   # the words kept only
            ids = [BOS] + [self.vocab.get(w, UNK) for w in words]
            out[i, 0, : len(ids)] = ids
            out[i, 1, : len(ids)] = 1
        return torch.from_numpy(out)


def hf_encode(tokenizer_dir: str, texts: Sequence[str], max_len: int) -> torch.Tensor:
    """``[N, 2, max_len]`` with a local Hugging Face tokenizer (right padding, truncation
    at ``max_len``).

    Fast tokenizers encode a whole text before truncating it, so the texts go to the
    tokenizer in chunks (:data:`_CHUNK_TEXTS` texts, :data:`_CHUNK_CHARS` characters), and
    a text longer than :func:`_prefix_chars` characters is first cut to a prefix whose ids
    do not depend on the cut (:func:`_stable_prefix`): memory follows the kept tokens, not
    the length of the longest sentence."""
    if not isinstance(tokenizer_dir, str):
        raise ConfigError(f"data.tokenizer: expected the path of a tokenizer directory, got "
                          f"{tokenizer_dir!r}")
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise ConfigError(f"data.tokenizer: {path} is not a directory (tokenizers are "
                          "loaded from local directories only)")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("tokenizer directories need 'transformers': "
                          "pip install -e '.[llm]'") from e
    try:                            # local files only; never custom code (no remote code)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a directory transformers cannot read
        raise ConfigError(f"data.tokenizer: cannot load a tokenizer from {path}: "
                          f"{describe(e, 200)}") from None
    if tok.pad_token is None:
        raise ConfigError(f"data.tokenizer: the tokenizer in {path} has no padding token "
                          "(pad_token); give one that has (OPT's has)")
    tok.padding_side = "right"
    try:
        special = int(tok.num_special_tokens_to_add(pair=False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say
        special = 0
    if max_len <= special:
        raise ConfigError(f"data.max_len: {max_len} leaves no room for a sentence: the "
                          f"tokenizer in {path} adds {special} special tokens to each; "
                          f"give at least {special + 1}")
    normalizer = getattr(getattr(tok, "backend_tokenizer", None), "normalizer", None)
    out = torch.empty((len(texts), 2, max_len), dtype=torch.long)
    try:
        start, chunk, chars = 0, [], 0
        for i, text in enumerate(texts):
            size = len(text) if isinstance(text, str) else 0
            if normalizer is not None and size:
                size = _normalized_size(normalizer, text, path)
            if isinstance(text, str) and len(text) > _prefix_chars(max_len):
                text = _stable_prefix(tok, text, max_len)
            chunk.append(text)
            chars += size
            if len(chunk) == _CHUNK_TEXTS or chars > _CHUNK_CHARS or i == len(texts) - 1:
                enc = tok(chunk, padding="max_length", truncation=True, max_length=max_len,
                          return_attention_mask=True, return_tensors="pt")
                out[start:i + 1] = torch.stack([enc["input_ids"], enc["attention_mask"]],
                                               dim=1)
                start, chunk, chars = i + 1, [], 0
        return out
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a tokenizer that loads but cannot encode
        raise ConfigError(f"data.tokenizer: the tokenizer in {path} cannot encode the "
                          f"sentences at data.max_len {max_len}: {describe(e, 200)}") from None


def _normalized_size(normalizer, text: str, path: Path) -> int:
    """The characters of ``text`` after a fast tokenizer's ``normalizer``, which may not
    make it more than :data:`MAX_NORMALIZED_GROWTH` times longer (a normalizer can replace
    each character by any text: a small ``tokenizer.json`` could turn a sentence into
    millions of tokens). Measured slice by slice, so a normalizer that lengthens text is
    refused before it holds more than one slice's output."""
    limit = MAX_NORMALIZED_GROWTH * len(text) + _NORMALIZE_SLICE
    size = 0
    for at in range(0, len(text), _NORMALIZE_SLICE):
        size += len(normalizer.normalize_str(text[at:at + _NORMALIZE_SLICE]))
        if size > limit:
            raise ConfigError(
                f"data.tokenizer: the tokenizer in {path} makes a sentence of {len(text)} "
                f"characters more than {MAX_NORMALIZED_GROWTH} times longer before it "
                f"splits it ({size} characters from its first {at + _NORMALIZE_SLICE}); "
                "refused")
    return size


def _prefix_chars(max_len: int) -> int:
    """The characters of a text that :func:`hf_encode` encodes whole; a longer text is cut
    first (:func:`_stable_prefix`). 16 characters per token: no SST-2 sentence comes
    near it (GLUE's longest has 268 characters)."""
    return max(1024, 16 * max_len)


def _stable_prefix(tok, text: str, max_len: int) -> str:
    """The prefix of ``text`` that :func:`hf_encode` encodes in its place: ``text[:k]``
    for ``k`` = :func:`_prefix_chars` (``max_len``), doubled until ``text[:k]`` fills all
    ``max_len`` tokens and ``text[:2k]`` gives the same ids and mask (the ids no longer
    depend on where the text is cut), or until ``k`` covers the whole text (then the text
    itself). The tokenizer so sees at most about 4 ``k`` characters of a long text.

    A recorded decision, not a proof: the ids are taken to be the whole text's once
    doubling the cut no longer changes them. They are whenever the first ``max_len``
    tokens depend on at most ``k`` characters of text after them, which holds for
    tokenizers that split text into words first (BPE, WordPiece, Unigram; OPT's and
    GPT-2's byte-level BPE looks one character past a word) unless one word is longer
    than ``k`` characters; a tokenizer whose first tokens depend on text farther on
    could give other ids than the whole text's."""
    def ids(prefix: str):
        enc = tok(prefix, truncation=True, max_length=max_len, return_attention_mask=True)
        return list(enc["input_ids"]), list(enc["attention_mask"])

    k = _prefix_chars(max_len)
    short = ids(text[:k])
    while 2 * k < len(text):
        longer = ids(text[:2 * k])
        if len(short[0]) == max_len and longer == short:
            return text[:k]
        k, short = 2 * k, longer
    return text


def _count_lines(path: Path, chunk_bytes: int = 1 << 24) -> int:
    """The lines of the text file ``path`` as :mod:`csv` splits them (``\\n``, ``\\r\\n``
    or a lone ``\\r`` ends one; a last line without an end counts), from its raw bytes
    (read ``chunk_bytes`` at a time)."""
    lines, prev_cr, last = 0, False, b""
    with open_regular(path) as f:
        while chunk := f.read(chunk_bytes):
            lines += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            if prev_cr and chunk.startswith(b"\n"):    # a CRLF split between two chunks
                lines -= 1
            prev_cr, last = chunk.endswith(b"\r"), chunk[-1:]
    return lines + (1 if last not in (b"", b"\n", b"\r") else 0)


def _check_rows(source: str, rows: int) -> None:
    if rows > MAX_TEXT_SAMPLES:
        raise DataError(f"{source}: {rows} rows, more than the {MAX_TEXT_SAMPLES} a text "
                        "split may hold")


def _read_tsv(path: Path) -> tuple[list[str], np.ndarray]:
    check_file_size(path, MAX_TEXT_BYTES, "text file")
    try:
        _check_rows(str(path), _count_lines(path) - 1)      # the header is no row
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    try:
        with open_regular(path, "r", newline="", encoding="utf-8-sig") as f:  # BOM dropped
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from e
    except (OSError, csv.Error) as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    if not rows or [c.strip() for c in rows[0][:2]] != ["sentence", "label"]:
        raise DataError(f"{path}: expected a header 'sentence<TAB>label', "
                        f"got {rows[0] if rows else 'an empty file'}")
    bad = [i + 2 for i, r in enumerate(rows[1:])
           if len(r) < 2 or r[1].strip() not in ("0", "1")]
    if bad:
        raise DataError(f"{path}: malformed rows at lines {bad[:5]} (each row is "
                        "sentence<TAB>label, the label 0 or 1)")
    return [r[0] for r in rows[1:]], np.array([int(r[1]) for r in rows[1:]], dtype=np.int64)


def _parquet_rows_declared(path: Path) -> int:
    """The rows the parquet file ``path`` declares in its metadata (nothing else is read);
    DataError if it is too large, unreadable, declares more than
    :data:`MAX_PARQUET_BYTES` or :data:`MAX_TEXT_SAMPLES` rows, or its columns
    ``sentence`` and ``label`` are not what :func:`_check_parquet_columns` admits."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pandas and pyarrow (pip install "
                        "-e '.[data]')") from None
    check_file_size(path, MAX_TEXT_BYTES, "parquet file")
    try:
        with open_regular(path) as f:
            meta = pq.ParquetFile(f).metadata
        inflated = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        rows = int(meta.num_rows)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds on corrupt files
        raise DataError(f"{path}: not a readable parquet file "
                        f"({describe(e)})") from e
    if inflated > MAX_PARQUET_BYTES:
        raise DataError(f"{path}: declares {inflated} bytes of data, more than the "
                        f"{MAX_PARQUET_BYTES} accepted")
    _check_rows(str(path), rows)
    _check_parquet_columns(path, meta)
    return rows


def _check_parquet_columns(path: Path, meta) -> None:
    """From the metadata, before any value is decoded: ``sentence`` and ``label`` are
    flat columns of one value per row (a nested column's repetition could declare any
    number of values), ``sentence`` stores byte strings and is not DELTA_BYTE_ARRAY-
    encoded (each value there extends a prefix of the one before, so a few bytes can
    decode to gigabytes that the declared size does not count; a dictionary-encoded
    column's repeats are counted in :func:`_read_parquet`), and ``label`` stores numbers."""
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        columns = {group.column(j).path_in_schema: group.column(j)
                   for j in range(group.num_columns)}
        for name in ("sentence", "label"):
            column = columns.get(name)
            if column is None:
                raise DataError(f"{path}: no column '{name}' of one value per row (an SST-2 "
                                "parquet file has the columns sentence and label)")
            if column.num_values != group.num_rows:
                raise DataError(f"{path}: column '{name}' holds {column.num_values} values "
                                f"in {group.num_rows} rows; one value per row expected")
        kind = columns["sentence"].physical_type
        if kind != "BYTE_ARRAY":
            raise DataError(f"{path}: column 'sentence' stores {kind}, not text")
        if "DELTA_BYTE_ARRAY" in columns["sentence"].encodings:
            raise DataError(f"{path}: column 'sentence' is DELTA_BYTE_ARRAY-encoded, whose "
                            "decoded size the file does not declare; write it with "
                            "pyarrow's default (dictionary) encoding")
        kind = columns["label"].physical_type
        if kind not in ("INT32", "INT64", "FLOAT", "DOUBLE", "BOOLEAN"):
            raise DataError(f"{path}: column 'label' stores {kind}; labels are the "
                            "integers 0 and 1")


def _text_bytes(column) -> int:
    """The bytes of text in the pyarrow string ``column`` (an array or a chunked array;
    dictionary-encoded values counted per row, without decoding them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for chunk in getattr(column, "chunks", [column]):
        if pa.types.is_dictionary(chunk.type):
            lengths = pc.take(pc.binary_length(chunk.dictionary), chunk.indices)
        else:
            lengths = pc.binary_length(chunk)
        total += int(pc.sum(lengths, min_count=0).as_py())
    return total


def _read_parquet(path: Path, text_budget: int | None = None,
                  ) -> tuple[list[str], np.ndarray, int]:
    """The sentences, labels and bytes of text of the parquet file ``path``; DataError if
    the text is more than ``text_budget`` bytes (default :data:`MAX_TEXT_BYTES`: what the
    split's other files left). The rows are decoded :data:`_PARQUET_BATCH_ROWS` at a time
    and their bytes counted as they come (the sentences dictionary-encoded, so a file
    repeating one long sentence is counted before it is expanded), and reading stops at
    the batch that passes the budget: the sizes the file's metadata declares, which a
    forged file can understate, bound nothing."""
    budget = MAX_TEXT_BYTES if text_budget is None else text_budget
    rows = _parquet_rows_declared(path)
    try:
        import pandas  # noqa: F401 - the frame below
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pandas and pyarrow (pip install "
                        "-e '.[data]')") from None
    size, read, batches = 0, 0, []
    try:
        with open_regular(path) as f:
            reader = pq.ParquetFile(f, read_dictionary=["sentence"])
            for batch in reader.iter_batches(batch_size=_PARQUET_BATCH_ROWS,
                                             columns=["sentence", "label"], use_threads=False):
                sentence = batch.column("sentence")
                size += _text_bytes(sentence)
                read += batch.num_rows
                if size > budget:
                    break
                if pa.types.is_dictionary(sentence.type):   # a dictionary of this batch's
                    sentence = sentence.dictionary_decode().dictionary_encode()   # own only
                batches.append(pa.RecordBatch.from_arrays([sentence, batch.column("label")],
                                                          names=["sentence", "label"]))
        if size <= budget:
            schema = reader.schema_arrow
            schema = batches[0].schema if batches else pa.schema(
                [schema.field("sentence"), schema.field("label")])
            table = pa.Table.from_batches(batches, schema)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt files raise many kinds
        raise DataError(f"{path}: not a readable parquet file "
                        f"({describe(e)})") from e
    if size > budget:
        left = "" if budget == MAX_TEXT_BYTES else (f"{budget} bytes its split's other "
                                                    "files left of the ")
        some = "" if read >= rows else "at least "
        raise DataError(f"{path}: its sentences hold {some}{size} bytes of text, more than "
                        f"the {left}{MAX_TEXT_BYTES} a text split may hold")
    del batches
    texts, labels = parquet_rows(table.to_pandas(), path)
    return texts, labels, size


def parquet_rows(frame, path) -> tuple[list[str], np.ndarray]:
    """The sentences and labels of a parquet file's ``frame`` (columns ``sentence`` and
    ``label``): every sentence text, every label a whole number (a float column of whole
    numbers too; :func:`labels_tensor` then takes 0 / 1 only); DataError naming ``path``
    and the row otherwise."""
    sentences = frame["sentence"].tolist()
    for row, text in enumerate(sentences):
        if not isinstance(text, str):
            raise DataError(f"{path}: row {row} has no sentence text (got "
                            f"{type(text).__name__} {str(text)[:40]!r})")
    labels = np.asarray(frame["label"].tolist(), dtype=object)
    whole = [(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)))
             or (isinstance(v, (float, np.floating)) and float(v).is_integer())
             for v in labels]
    if not all(whole):
        row = whole.index(False)
        raise DataError(f"{path}: row {row} has the label {str(labels[row])[:40]!r}; "
                        "labels are the integers 0 and 1")
    return sentences, labels.astype(np.int64)


def _sst2_split(root: Path, tsv: str, parquet: str) -> tuple[list[str], np.ndarray]:
    if (root / tsv).exists():       # a directory or a pipe is refused, not skipped
        return _read_tsv(root / tsv)
    found = sorted(root.glob(f"{parquet}*.parquet"))
    if found:
        for p in found:             # before any is opened (a pipe would block the open)
            check_regular(p)
        if len(found) > 1:          # the split's files together, before any is read
            _check_rows(f"{root}/{parquet}*.parquet ({len(found)} files)",
                        sum(_parquet_rows_declared(p) for p in found))
        parts, budget = [], MAX_TEXT_BYTES
        for p in found:             # the split's text together at most MAX_TEXT_BYTES
            texts, labels, size = _read_parquet(p, budget)
            parts.append((texts, labels))
            budget -= size
        return [t for ts, _ in parts for t in ts], np.concatenate([y for _, y in parts])
    raise DataError(f"SST-2: neither {root / tsv} nor {root}/{parquet}*.parquet found; "
                    "download GLUE's SST-2 (train.tsv, dev.tsv) into data.data_dir")


def encode(train_texts, test_texts, tokenizer: str | None, max_len: int,
           vocab_size: int | None):
    """Token tensors of both splits (the built-in vocabulary from the train texts, of
    ``vocab_size`` words, 8192 when None; a tokenizer directory brings its own)."""
    max_len = int_option("data", "max_len", max_len, 2, MAX_LEN)
    if tokenizer is not None and vocab_size is not None:
        raise ConfigError("data.vocab_size: the tokenizer directory (data.tokenizer) "
                          "brings its own vocabulary; remove data.vocab_size (it sizes the "
                          "built-in tokenizer's)")
    vocab_size = int_option("data", "vocab_size", 8192 if vocab_size is None else vocab_size,
                            FIRST_WORD + 1, MAX_VOCAB)
    for texts in (train_texts, test_texts):
        if len(texts) * max_len > MAX_TOKENS:
            raise ConfigError(f"data: max_len={max_len} x {len(texts)} texts exceeds "
                              f"{MAX_TOKENS} tokens; lower data.max_len")
    if tokenizer is not None:
        return hf_encode(tokenizer, train_texts, max_len), hf_encode(tokenizer, test_texts,
                                                                       max_len)
    tok = WordTokenizer(train_texts, vocab_size)
    return tok.encode(train_texts, max_len), tok.encode(test_texts, max_len)


def load_sst2(data_dir: str | None, rng: np.random.Generator, tokenizer: str | None = None,
              max_len: int = 64, vocab_size: int | None = None) -> DataBundle:
    """SST-2 from GLUE files in ``data_dir`` (module docstring); dev split as test.
    ``vocab_size``: the built-in tokenizer's vocabulary (8192 when None); refused with
    ``tokenizer``, which brings its own."""
    if data_dir is None:
        raise ConfigError("sst2 needs data.data_dir: a directory with GLUE's SST-2 "
                          "train.tsv and dev.tsv (or the parquet files)")
    root = Path(data_dir)
    train_texts, ytr = _sst2_split(root, "train.tsv", "train")
    test_texts, yte = _sst2_split(root, "dev.tsv", "validation")
    for name, texts in (("train", train_texts), ("dev (the test set)", test_texts)):
        if not texts:
            raise DataError(f"SST-2 in {root}: the {name} split holds no rows")
    xtr, xte = encode(train_texts, test_texts, tokenizer, max_len, vocab_size)
    train = ArrayDataset(xtr, labels_tensor(ytr, 2, f"{root} train"))
    test = ArrayDataset(xte, labels_tensor(yte, 2, f"{root} dev"))
    return DataBundle("sst2", train, test, 2, (2, max_len), ["negative", "positive"])


def marker_sequences(rng: np.random.Generator, n: int, seq_len: int, vocab_size: int,
                     min_len: int, marker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of the synthetic marker task: ``[n, 2, seq_len]`` and labels."""
    x = np.full((n, 2, seq_len), 0, dtype=np.int64)
    x[:, 0] = PAD
    y = np.zeros(n, dtype=np.int64)
    y[rng.permutation(n)[: n // 2]] = 1
    words = np.array([w for w in range(FIRST_WORD, vocab_size) if w != marker])
    lengths = rng.integers(min_len, seq_len, size=n, endpoint=True)   # with the BOS
    for i in range(n):
        k = int(lengths[i])
        body = rng.choice(words, size=k - 1)
        if y[i]:
            body[rng.integers(k - 1)] = marker
        x[i, 0, :k] = np.concatenate([[BOS], body])
        x[i, 1, :k] = 1
    return torch.from_numpy(x), torch.from_numpy(y)


def load_synthetic_text(data_dir: str | None, rng: np.random.Generator,
                        num_train: int = 2000, num_test: int = 500, seq_len: int = 16,
                        vocab_size: int = 64, min_len: int = 4,
                        marker: int = FIRST_WORD) -> DataBundle:
    """The synthetic marker task (module docstring); ``data_dir`` is unused."""
    num_train = int_option("synthetic_text", "num_train", num_train, 1, MAX_TEXT_SAMPLES)
    num_test = int_option("synthetic_text", "num_test", num_test, 1, MAX_TEXT_SAMPLES)
    seq_len = int_option("synthetic_text", "seq_len", seq_len, 2, MAX_LEN)
    vocab_size = int_option("synthetic_text", "vocab_size", vocab_size, FIRST_WORD + 2,
                            MAX_VOCAB)
    min_len = int_option("synthetic_text", "min_len", min_len, 2, MAX_LEN)
    marker = int_option("synthetic_text", "marker", marker, FIRST_WORD, MAX_VOCAB)
    if max(num_train, num_test) * seq_len > MAX_TOKENS:
        raise ConfigError(f"data.seq_len: num_train/num_test x seq_len={seq_len} exceeds "
                          f"{MAX_TOKENS} tokens; lower data.num_train, data.num_test or "
                          "data.seq_len")
    if not FIRST_WORD <= marker < vocab_size or vocab_size < FIRST_WORD + 2:
        raise ConfigError(f"data.marker: need {FIRST_WORD} <= marker < vocab_size and "
                          f"vocab_size >= {FIRST_WORD + 2}; got marker={marker}, "
                          f"vocab_size={vocab_size}")
    if not 2 <= min_len <= seq_len:
        raise ConfigError(f"data.min_len: need 2 <= min_len <= seq_len, got {min_len}, "
                          f"{seq_len}")
    xtr, ytr = marker_sequences(rng, num_train, seq_len, vocab_size, min_len, marker)
    xte, yte = marker_sequences(rng, num_test, seq_len, vocab_size, min_len, marker)
    return DataBundle("synthetic_text", ArrayDataset(xtr, ytr), ArrayDataset(xte, yte), 2,
                      (2, seq_len), ["absent", "present"])


#: the options' help (``splitfed config explain NAME``, docs/config.md)
load_sst2.option_help = {
    "tokenizer": "a local Hugging Face tokenizer directory, e.g. the OPT checkpoint's (null: "
                 "the built-in word tokenizer, made from the train split)",
    "max_len": "L, tokens per sample with the leading BOS; longer texts are truncated (an "
               "integer from 2 to 16384)",
    "vocab_size": "the built-in tokenizer's vocabulary, ids 0-3 reserved (an integer from 5 "
                  "to 1048576; null: 8192; not with tokenizer)",
}

load_synthetic_text.option_help = {
    "num_train": "training samples, half of them with the marker (an integer from 1 to "
                 "1000000)",
    "num_test": "test samples, half of them with the marker (an integer from 1 to 1000000)",
    "seq_len": "L, tokens per sample with the leading BOS, padded (an integer from 2 to "
               "16384; num_train and num_test x seq_len at most 5e7 tokens)",
    "vocab_size": "token ids 0 .. vocab_size - 1, words drawn from id 4 on (an integer from "
                  "6 to 1048576)",
    "min_len": "the shortest sequence, BOS included; lengths are uniform in [min_len, "
               "seq_len] (2 <= min_len <= seq_len)",
    "marker": "the token id whose presence makes the label 1 (4 <= marker < vocab_size)",
}
