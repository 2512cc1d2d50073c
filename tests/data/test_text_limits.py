"""SST-2 files: a split's row count and bytes of text are checked before any row is read
into Python objects, so a small file declaring millions of rows, or repeating one long
sentence on every row, cannot use memory or tokenizing time without bound."""

import numpy as np
import pytest

from splitfed.data import load_dataset, text
from splitfed.errors import DataError

GLUE_TRAIN_ROWS = 67_349


def _write_tsv(path, n, end=b"\n"):
    path.write_bytes(b"sentence\tlabel" + end + b"".join(b"w%d\t%d" % (i, i % 2) + end
                                                        for i in range(n)))


def _fail(*args, **kwargs):
    raise AssertionError("the rows were read before the row count was checked")


@pytest.mark.parametrize("data, lines", [
    (b"", 0), (b"a", 1), (b"a\n", 1), (b"a\nb", 2), (b"a\r\nb\r\n", 2), (b"a\rb\r", 2),
    (b"a\r\n\r\nb", 3), (b"\n\n\n", 3), (b"a\r\r\nb", 3),
])
@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 1 << 24])
def test_line_count_matches_the_csv_rows(tmp_path, data, lines, chunk_bytes):
    path = tmp_path / "f.tsv"
    path.write_bytes(data)
    assert text._count_lines(path, chunk_bytes) == lines
    with open(path, newline="") as f:
        assert sum(1 for _ in text.csv.reader(f, delimiter="\t")) == lines


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_tsv_with_more_rows_than_a_split_may_hold_is_refused_unread(tmp_path, monkeypatch,
                                                                     end):
    monkeypatch.setattr(text, "MAX_TEXT_SAMPLES", 3)
    _write_tsv(tmp_path / "ok.tsv", 3, end)
    texts, labels = text._read_tsv(tmp_path / "ok.tsv")
    assert texts == ["w0", "w1", "w2"] and labels.tolist() == [0, 1, 0]
    _write_tsv(tmp_path / "train.tsv", 4, end)
    monkeypatch.setattr(text.csv, "reader", _fail)
    with pytest.raises(DataError, match=r"train.tsv: 4 rows, more than the 3 a text split"):
        text._read_tsv(tmp_path / "train.tsv")


def test_tsv_of_many_short_rows_is_refused_at_the_default_limit(tmp_path, monkeypatch):
    (tmp_path / "train.tsv").write_bytes(b"sentence\tlabel\n" + b"\t0\n" * (10**6 + 1))
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\na\t1\n")
    monkeypatch.setattr(text.csv, "reader", _fail)
    with pytest.raises(DataError, match=r"train.tsv: 1000001 rows, more than the 1000000 "):
        load_dataset("sst2", str(tmp_path))


def test_glue_sized_tsv_still_loads(tmp_path):
    assert text.MAX_TEXT_SAMPLES >= GLUE_TRAIN_ROWS
    _write_tsv(tmp_path / "train.tsv", GLUE_TRAIN_ROWS)
    _write_tsv(tmp_path / "dev.tsv", 872)
    bundle = load_dataset("sst2", str(tmp_path), max_len=2, vocab_size=8)
    assert len(bundle.train) == GLUE_TRAIN_ROWS and len(bundle.test) == 872


def _write_parquet(path, n):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"sentence": pa.array(["a"] * n).dictionary_encode(),
                      "label": pa.array(np.arange(n) % 2, pa.int64())})
    pq.write_table(table, path, compression="zstd")


def test_parquet_rows_are_checked_from_the_metadata_before_any_column_is_read(
        tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(text, "MAX_TEXT_SAMPLES", 3)
    _write_parquet(tmp_path / "ok.parquet", 3)
    texts, labels, size = text._read_parquet(tmp_path / "ok.parquet")
    assert texts == ["a"] * 3 and labels.tolist() == [0, 1, 0] and size == 3
    _write_parquet(tmp_path / "train-00000.parquet", 4)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", _fail)
    with pytest.raises(DataError, match=r"train-00000.parquet: 4 rows, more than the 3 "):
        text._read_parquet(tmp_path / "train-00000.parquet")


def test_parquet_split_counts_the_rows_of_all_its_files_before_reading_one(tmp_path,
                                                                        monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(text, "MAX_TEXT_SAMPLES", 3)
    _write_parquet(tmp_path / "train-00000-of-00002.parquet", 2)
    _write_parquet(tmp_path / "train-00001-of-00002.parquet", 2)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", _fail)
    with pytest.raises(DataError, match=r"train\*.parquet \(2 files\): 4 rows, more than the 3"):
        text._sst2_split(tmp_path, "train.tsv", "train")


def test_small_parquet_declaring_many_rows_is_refused_at_the_default_limit(tmp_path,
                                                                          monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    _write_parquet(tmp_path / "train-00000.parquet", 10**6 + 1)
    _write_parquet(tmp_path / "validation-00000.parquet", 1)
    assert (tmp_path / "train-00000.parquet").stat().st_size < 1 << 20
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", _fail)
    with pytest.raises(DataError, match=r"train-00000.parquet: 1000001 rows, more than the "
                                        r"1000000 a text split may hold"):
        load_dataset("sst2", str(tmp_path))


def _write_repeated(path, n, sentence, **options):
    """``n`` rows of the same ``sentence``, stored once (dictionary encoding by default)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    sentences = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)),
                                               pa.array([sentence]))
    if options:                     # an encoding other than the dictionary: plain strings
        sentences = sentences.cast(pa.string())
    pq.write_table(pa.table({"sentence": sentences,
                             "label": pa.array(np.arange(n) % 2, pa.int64())}),
                   path, compression="zstd", **options)


def test_one_long_sentence_on_every_row_is_counted_before_it_is_expanded(tmp_path,
                                                                        monkeypatch):
    # 10^5 rows of a 3 kB sentence: a 2 kB file whose rows hold 300 MB of text, which
    # pandas used to expand and the tokenizer to split word by word
    _write_repeated(tmp_path / "train-00000.parquet", 10**5, "good movie. " * 250)
    _write_repeated(tmp_path / "validation-00000.parquet", 1, "good")
    assert (tmp_path / "train-00000.parquet").stat().st_size < 1 << 16
    monkeypatch.setattr(text, "parquet_rows", _fail)
    with pytest.raises(DataError, match=r"train-00000.parquet: its sentences hold at least "
                                        r"270336000 bytes of text, more than the 268435456 "
                                        r"a text split may hold$"):
        load_dataset("sst2", str(tmp_path))


def test_a_splits_files_share_one_text_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "MAX_TEXT_BYTES", 5000)
    _write_repeated(tmp_path / "train-00000-of-00002.parquet", 6, "x" * 500)
    texts, labels, size = text._read_parquet(tmp_path / "train-00000-of-00002.parquet")
    assert texts == ["x" * 500] * 6 and labels.tolist() == [0, 1] * 3 and size == 3000
    _write_repeated(tmp_path / "train-00001-of-00002.parquet", 5, "y" * 500)
    with pytest.raises(DataError, match=r"train-00001-of-00002.parquet: its sentences hold "
                                        r"2500 bytes of text, more than the 2000 bytes its "
                                        r"split's other files left of the 5000 a text split"):
        text._sst2_split(tmp_path, "train.tsv", "train")


def test_delta_encoded_sentences_are_refused_before_they_are_decoded(tmp_path, monkeypatch):
    # each value extends its predecessor's prefix: 10^4 rows of 10 kB from a few kB
    pq = pytest.importorskip("pyarrow.parquet")
    _write_repeated(tmp_path / "train.parquet", 10**4, "w " * 5000, use_dictionary=False,
                    column_encoding={"sentence": "DELTA_BYTE_ARRAY"})
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", _fail)
    with pytest.raises(DataError, match=r"train.parquet: column 'sentence' is "
                                        r"DELTA_BYTE_ARRAY-encoded, whose decoded size"):
        text._read_parquet(tmp_path / "train.parquet")


@pytest.mark.parametrize("columns, says", [
    ({"sentence": ["a", "b"]}, r"no column 'label' of one value per row \(an SST-2 parquet "
                               r"file has the columns sentence and label\)"),
    ({"sentence": ["a", "b"], "label": [[0] * 1000, [1]]}, r"no column 'label' of one value"),
    ({"sentence": [1, 2], "label": [0, 1]}, r"column 'sentence' stores INT64, not text"),
    ({"sentence": ["a", "b"], "label": ["0", "1"]},
     r"column 'label' stores BYTE_ARRAY; labels are the integers 0 and 1"),
])
def test_parquet_columns_are_checked_from_the_metadata(tmp_path, monkeypatch, columns, says):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), tmp_path / "f.parquet")
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", _fail)
    with pytest.raises(DataError, match=r"f.parquet: " + says):
        text._read_parquet(tmp_path / "f.parquet")
