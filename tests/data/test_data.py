"""Tests for corpus loading: local formats, hub failures, seeded carving and filtering."""

from __future__ import annotations

import gzip
import json
import logging
import socket
from pathlib import Path

import pytest

from transformer_mt.config.schema import DataConfig
from transformer_mt.core.errors import DataError
from transformer_mt.data import sources as data_sources
from transformer_mt.data.corpus import Corpus, count_words, load_corpus


def make_cfg(path: Path | str = "", **overrides) -> DataConfig:
    """A small DataConfig for an en→it corpus in `path`."""
    fields = dict(format="text", path=str(path), src_lang="en", tgt_lang="it", valid_size=2, test_size=2,
                  max_words=50, max_length_ratio=3.0)
    fields.update(overrides)
    return DataConfig(**fields)


def write_lines(path: Path, lines: list[str]) -> None:
    """Write UTF-8 lines, each ending in "\\n"; gzip when the name ends in .gz."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def write_text_split(directory: Path, split: str, pairs: list[tuple[str, str]], gz: bool = False) -> None:
    suffix = ".gz" if gz else ""
    write_lines(directory / f"{split}.en{suffix}", [s for s, _ in pairs])
    write_lines(directory / f"{split}.it{suffix}", [t for _, t in pairs])


def numbered_pairs(n: int) -> list[tuple[str, str]]:
    return [(f"sentence {i}", f"frase {i}") for i in range(n)]


def pairs_of(dataset) -> list[tuple[str, str]]:
    return list(zip(dataset["src"], dataset["tgt"]))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


# --- local formats -----------------------------------------------------------------------------

def test_a_run_whose_data_changed_since_it_was_read_is_warned_but_a_touched_file_is_not(data_dir, run_dir,
                                                                                         caplog):
    import os

    for split, n in (("train", 6), ("valid", 2), ("test", 2)):
        write_text_split(data_dir, split, numbered_pairs(n))
    load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    with caplog.at_level("WARNING", logger="transformer_mt.data.corpus"):
        for name in ("train.en", "train.it"):  # same bytes, a newer modification time: read again, unchanged
            os.utime(data_dir / name, ns=(1, 1))
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
        assert "changed" not in caplog.text
        write_text_split(data_dir, "train", numbered_pairs(7))  # one pair more
        corpus = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    assert len(corpus.train) == 7
    assert "the train split(s) changed since this run last read its data" in caplog.text


@pytest.mark.parametrize("manifest", ['{"format": 2}', '{"key": "k", "removed": {}, "digests": {"train": "x"}}'])
def test_a_damaged_corpus_manifest_is_read_again_not_an_internal_error(manifest, data_dir, run_dir):
    from transformer_mt.data.corpus import load_run_corpus

    for split, n in (("train", 6), ("valid", 2), ("test", 2)):
        write_text_split(data_dir, split, numbered_pairs(n))
    first = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    (run_dir / "corpus_cache" / "corpus.json").write_text(manifest, encoding="utf-8")
    for load in (load_run_corpus, load_corpus):
        assert pairs_of(load(make_cfg(data_dir), seed=1, run_dir=run_dir).test) == pairs_of(first.test)


def test_text_format_reads_gzipped_train_and_plain_valid_and_test(data_dir, run_dir):
    write_text_split(data_dir, "train", [("hello world", "ciao mondo"), ("good night", "buona notte")], gz=True)
    write_text_split(data_dir, "valid", [("yes", "sì")])
    write_text_split(data_dir, "test", [("no", "no")])

    corpus = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)

    assert isinstance(corpus, Corpus)
    assert pairs_of(corpus.train) == [("hello world", "ciao mondo"), ("good night", "buona notte")]
    assert pairs_of(corpus.valid) == [("yes", "sì")]
    assert pairs_of(corpus.test) == [("no", "no")]
    assert corpus.train.column_names == ["src", "tgt"]
    assert corpus.removed == {"empty": 0, "too_long": 0, "length_ratio": 0}
    assert not (run_dir / "splits.json").exists()  # nothing was carved


def test_text_format_strips_crlf_and_surrounding_whitespace(data_dir, run_dir):
    (data_dir / "train.en").write_bytes("  hello  \r\nbye\r\n".encode())
    (data_dir / "train.it").write_bytes("ciao\t\r\naddio\r\n".encode())
    write_text_split(data_dir, "valid", [("a", "b")])
    write_text_split(data_dir, "test", [("c", "d")])

    corpus = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.train) == [("hello", "ciao"), ("bye", "addio")]


def test_cr_only_line_breaks_are_refused_naming_the_file(data_dir, run_dir):
    # Old Mac files: read as one giant line, they were blamed on data.valid_size or data.max_words.
    (data_dir / "train.en").write_bytes(b"hello\rbye\rgood night\r")
    (data_dir / "train.it").write_bytes(b"ciao\raddio\rbuona notte\r")

    with pytest.raises(DataError, match=rf"{data_dir / 'train.en'}: its lines end in a carriage return \(\\r\) alone"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


@pytest.mark.parametrize("fmt", ["tsv", "jsonl"])
def test_cr_line_breaks_are_refused_in_every_format(data_dir, run_dir, fmt):
    lines = [f"s {i}\tf {i}" if fmt == "tsv" else json.dumps({"en": f"s {i}", "it": f"f {i}"}) for i in range(40)]
    (data_dir / f"train.{fmt}").write_bytes(("\r".join(lines) + "\r").encode())

    with pytest.raises(DataError, match=rf"train\.{fmt}: its lines end in a carriage return \(\\r\) alone"):
        load_corpus(make_cfg(data_dir, format=fmt), seed=1, run_dir=run_dir)


def test_a_stray_cr_inside_a_line_stays_text(data_dir, run_dir):
    (data_dir / "train.en").write_bytes(b"hello\rthere\r\nbye\rbye\rnow\n")  # stray "\r"s, a CRLF line end
    (data_dir / "train.it").write_bytes(b"ciao\naddio\n")
    write_text_split(data_dir, "valid", [("a", "b")])
    write_text_split(data_dir, "test", [("c", "d")])

    corpus = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    assert [src for src, _ in pairs_of(corpus.train)] == ["hello\rthere", "bye\rbye\rnow"]


@pytest.mark.parametrize("block_bytes", range(1, 9))
def test_crlf_split_across_read_blocks_is_still_a_line_end(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(data_sources, "READ_CHUNK_BYTES", block_bytes)
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"a\r\nbc\r\n\r\nd\r")  # a final "\r" ends the last line like "\n" would

    assert data_sources.read_lines(path) == ["a", "bc", "", "d"]


@pytest.mark.parametrize("fmt, name, gz", [("text", "dev", False), ("text", "validation", True), ("tsv", "dev", False),
                                           ("jsonl", "validation", False)])
def test_dev_and_validation_files_are_the_validation_split(data_dir, run_dir, fmt, name, gz):
    # A user walk: dev.en/dev.it were ignored in silence, and 1000 pairs carved from train instead.
    def write(split: str, pairs: list[tuple[str, str]]) -> None:
        if fmt == "text":
            write_text_split(data_dir, split, pairs, gz=gz)
        elif fmt == "tsv":
            write_lines(data_dir / f"{split}.tsv", [f"{s}\t{t}" for s, t in pairs])
        else:
            write_lines(data_dir / f"{split}.jsonl", [json.dumps({"en": s, "it": t}) for s, t in pairs])

    write("train", numbered_pairs(10))
    write(name, [("held out", "tenuta da parte")])

    corpus = load_corpus(make_cfg(data_dir, format=fmt), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.valid) == [("held out", "tenuta da parte")]
    assert len(corpus.train) == 8 and corpus.carved == ("test",)  # 10 rows less the 2 carved test rows
    assert set(json.loads((run_dir / "splits.json").read_text())) == {"source_rows", "seed", "test"}


@pytest.mark.parametrize("fmt", ["text", "tsv"])
def test_validation_files_under_two_names_are_refused_naming_them(data_dir, run_dir, fmt):
    if fmt == "text":
        write_text_split(data_dir, "train", numbered_pairs(10))
        write_text_split(data_dir, "dev", numbered_pairs(2))
        write_lines(data_dir / "valid.en.gz", ["a"])  # one file of a name is enough to make it a candidate
        in_use = ["dev.en", "dev.it", "valid.en.gz"]
    else:
        for name in ("train", "validation", "dev"):
            write_lines(data_dir / f"{name}.tsv", ["a\tb"] * 10)
        in_use = ["dev.tsv", "validation.tsv"]

    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(data_dir, format=fmt), seed=1, run_dir=run_dir)

    message = str(excinfo.value)
    assert message.startswith("ambiguous valid split")
    assert all(str(data_dir / name) in message for name in in_use)
    assert "valid.*, dev.* or validation.*" in message
    assert not (run_dir / "corpus_cache").exists()


def test_adding_dev_files_rebuilds_a_corpus_that_carved_its_validation_split(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(20))
    carved = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    assert carved.carved == ("valid", "test") and len(carved.valid) == 2
    # Another torchrun rank reads only the corpus files: their manifest records the carving.
    assert load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir, prepared=True).carved == ("valid", "test")

    write_text_split(data_dir, "dev", [("held out", "tenuta da parte")])
    again = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)  # the corpus key holds every split's files

    assert pairs_of(again.valid) == [("held out", "tenuta da parte")] and again.carved == ("test",)
    assert len(again.train) == 18  # the 2 rows carved as valid before are training rows again
    assert pairs_of(again.test) == pairs_of(carved.test)  # the test rows recorded in splits.json stay


def test_tsv_format_reads_pairs_verbatim_without_quoting_or_na_values(data_dir, run_dir):
    write_lines(data_dir / "train.tsv", ['"quoted" text\t"testo"', "NA\tnull", "a, b\tc; d"])
    write_lines(data_dir / "valid.tsv", ["x\ty"])
    write_lines(data_dir / "test.tsv", ["z\tw"])

    corpus = load_corpus(make_cfg(data_dir, format="tsv"), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.train) == [('"quoted" text', '"testo"'), ("NA", "null"), ("a, b", "c; d")]
    assert pairs_of(corpus.valid) == [("x", "y")]


@pytest.mark.parametrize("first, warned", [("EN\tit", True), ("source\ttarget", True), ("en\tciao", False)])
def test_a_tsv_header_row_is_read_as_a_pair_with_a_warning(first, warned, data_dir, run_dir, caplog):
    write_lines(data_dir / "train.tsv", [first, "hello\tciao"])
    write_lines(data_dir / "valid.tsv", ["good\tbuono"])
    write_lines(data_dir / "test.tsv", ["x\ty"])
    with caplog.at_level("WARNING", logger="transformer_mt.data.sources"):
        corpus = load_corpus(make_cfg(data_dir, format="tsv"), seed=1, run_dir=run_dir)
    assert pairs_of(corpus.train)[0] == tuple(first.split("\t"))  # kept: tmt never drops a line on a guess
    assert ("train.tsv:1 looks like a header row" in caplog.text) == warned, caplog.text
    assert "valid.tsv" not in caplog.text


def test_tsv_line_without_exactly_one_tab_names_file_and_line(data_dir, run_dir):
    write_lines(data_dir / "train.tsv", ["a\tb", "c\td\te"])

    with pytest.raises(DataError, match=r"train\.tsv:2: .*2 tabs"):
        load_corpus(make_cfg(data_dir, format="tsv"), seed=1, run_dir=run_dir)


def test_jsonl_format_accepts_translation_records_and_flat_records(data_dir, run_dir):
    write_lines(data_dir / "train.jsonl", [
        json.dumps({"translation": {"en": "the cat", "it": "il gatto"}}),
        json.dumps({"en": "the dog", "it": "il cane", "id": 7}),
        "",  # blank lines are skipped
        json.dumps({"en": None, "it": "niente"}),  # null counts as an empty side
    ])
    write_lines(data_dir / "valid.jsonl", [json.dumps({"en": "one", "it": "uno"})])
    write_lines(data_dir / "test.jsonl", [json.dumps({"translation": {"it": "due", "en": "two"}})])

    corpus = load_corpus(make_cfg(data_dir, format="jsonl"), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.train) == [("the cat", "il gatto"), ("the dog", "il cane")]
    assert pairs_of(corpus.valid) == [("one", "uno")]
    assert pairs_of(corpus.test) == [("two", "due")]
    assert corpus.removed["empty"] == 1


def test_jsonl_record_without_target_language_names_file_line_and_key(data_dir, run_dir):
    write_lines(data_dir / "train.jsonl", [json.dumps({"en": "a", "it": "b"}), json.dumps({"en": "c", "fr": "d"})])

    with pytest.raises(DataError, match=r"train\.jsonl:2: missing key 'it' \(data\.tgt_lang\)"):
        load_corpus(make_cfg(data_dir, format="jsonl"), seed=1, run_dir=run_dir)


def test_jsonl_line_breaks_inside_a_sentence_become_spaces(data_dir, run_dir):
    write_lines(data_dir / "train.jsonl", [json.dumps({"en": "Hello there.\r\nHow are you?", "it": "Ciao.\u2028 Come stai?"}),
                                           json.dumps({"en": "two\n\nparagraphs", "it": "due\nparagrafi"})])
    for split in ("valid", "test"):
        write_lines(data_dir / f"{split}.jsonl", [json.dumps({"en": "one", "it": "uno"})])
    corpus = load_corpus(make_cfg(data_dir, format="jsonl"), seed=1, run_dir=run_dir)
    assert pairs_of(corpus.train) == [("Hello there. How are you?", "Ciao. Come stai?"), ("two paragraphs", "due paragrafi")]


def test_jsonl_lone_surrogate_escape_names_file_line_and_language(data_dir, run_dir):
    write_lines(data_dir / "train.jsonl", ['{"en": "fine", "it": "bene"}', '{"en": "cut emoji \\ud83d", "it": "x"}'])
    with pytest.raises(DataError, match=r"train\.jsonl:2: 'en' is not valid Unicode"):
        load_corpus(make_cfg(data_dir, format="jsonl"), seed=1, run_dir=run_dir)


def test_damaged_gzip_file_is_named(data_dir, run_dir):
    write_text_split(data_dir, "train", [(f"sentence number {i}", f"frase numero {i}") for i in range(2000)], gz=True)
    packed = bytearray((data_dir / "train.en.gz").read_bytes())
    at = len(packed) * 3 // 10
    packed[at:at + 8] = b"\x00" * 8  # damage inside the deflate stream: zlib.error, not a CRC OSError
    (data_dir / "train.en.gz").write_bytes(bytes(packed))
    with pytest.raises(DataError, match=rf"{data_dir / 'train.en.gz'}: cannot read"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


def test_missing_train_file_error_names_plain_and_gz_paths(data_dir, run_dir):
    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)

    message = str(excinfo.value)
    for name in ("train.en", "train.en.gz", "train.it", "train.it.gz"):
        assert str(data_dir / name) in message


def test_split_with_only_one_language_file_names_the_missing_file(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(10))
    write_lines(data_dir / "valid.en", ["a"])

    with pytest.raises(DataError, match=r"valid\.it .*not found"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


def test_both_plain_and_gzipped_file_is_ambiguous(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(10))
    write_lines(data_dir / "train.en.gz", ["other"])

    with pytest.raises(DataError, match=r"both .*train\.en and .*train\.en\.gz exist"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


def test_mismatched_line_counts_error_names_both_files_and_counts(data_dir, run_dir):
    write_lines(data_dir / "train.en", ["a", "b", "c"])
    write_lines(data_dir / "train.it", ["a", "b"])

    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)

    message = str(excinfo.value)
    assert f"{data_dir / 'train.en'} has 3 lines" in message
    assert f"{data_dir / 'train.it'} has 2" in message


def test_invalid_utf8_error_names_file_and_line(data_dir, run_dir):
    write_lines(data_dir / "train.en", ["a", "b", "c"])
    (data_dir / "train.it").write_bytes(b"a\nb\n\xff\xfe broken\n")

    with pytest.raises(DataError, match=rf"{data_dir / 'train.it'}:3: not valid UTF-8"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


def test_utf8_error_in_a_later_read_chunk_names_the_right_line(data_dir, run_dir, monkeypatch):
    from transformer_mt.data import sources as data_sources

    monkeypatch.setattr(data_sources, "READ_CHUNK_BYTES", 16)  # many chunks of a few lines each
    write_lines(data_dir / "train.en", [f"line {i}" for i in range(40)])
    good = [f"riga {i}" for i in range(40)]
    (data_dir / "train.it").write_bytes("\n".join(good[:29]).encode() + b"\nbad \xff\n"
                                        + "\n".join(good[30:]).encode() + b"\n")

    with pytest.raises(DataError, match=rf"{data_dir / 'train.it'}:30: not valid UTF-8"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


def test_streaming_in_small_chunks_reads_the_same_pairs(data_dir, tmp_path, monkeypatch):
    from transformer_mt.data import sources as data_sources

    rows = [(f"\ufeffword {i}" if i == 0 else f" word {i}\r", f"parola {i} ") for i in range(57)]
    write_text_split(data_dir, "train", rows)
    expected = [(s.strip().removeprefix("\ufeff"), t.strip()) for s, t in rows]
    whole = pairs_of(load_corpus(make_cfg(data_dir), seed=1, run_dir=tmp_path / "whole").train)
    monkeypatch.setattr(data_sources, "READ_CHUNK_BYTES", 10)
    monkeypatch.setattr(data_sources, "CHUNK_ROWS", 4)
    chunks = list(data_sources.local_sources(make_cfg(data_dir))["train"].chunks())
    assert [len(src) for src, _ in chunks] == [4] * 14 + [1]  # read at the patched size
    chunked = pairs_of(load_corpus(make_cfg(data_dir), seed=1, run_dir=tmp_path / "chunked").train)
    assert whole == chunked
    assert len(whole) == 57 - 4 and set(whole) <= set(expected)  # less the 2 + 2 carved rows


def test_the_corpus_files_are_reused_until_a_source_file_changes(data_dir, run_dir, caplog):
    write_text_split(data_dir, "train", numbered_pairs(20))
    write_text_split(data_dir, "valid", numbered_pairs(3))
    write_text_split(data_dir, "test", numbered_pairs(3))
    first = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    manifest = (run_dir / "corpus_cache" / "corpus.json").read_bytes()
    with caplog.at_level("INFO", logger="transformer_mt.data.corpus"):
        again = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    assert "reusing the corpus" in caplog.text
    assert pairs_of(again.train) == pairs_of(first.train) and again.digests == first.digests
    assert (run_dir / "corpus_cache" / "corpus.json").read_bytes() == manifest

    write_text_split(data_dir, "train", numbered_pairs(21))  # another size and modification time
    changed = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    assert len(changed.train) == 21 and changed.digests["train"] != first.digests["train"]
    assert changed.digests["valid"] == first.digests["valid"]  # same text, same digest
    assert pairs_of(first.train) == numbered_pairs(20)  # the old files stay readable to whoever holds them
    assert sorted(p.name for p in run_dir.iterdir()) == ["corpus_cache"]  # no temporary folder left


def test_a_changed_filter_setting_rebuilds_the_corpus(data_dir, run_dir):
    write_text_split(data_dir, "train", [("a b c d", "a b c d"), ("a", "b")] + numbered_pairs(10))
    write_text_split(data_dir, "valid", numbered_pairs(2))
    write_text_split(data_dir, "test", numbered_pairs(2))
    assert len(load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir).train) == 12
    assert len(load_corpus(make_cfg(data_dir, max_words=3), seed=1, run_dir=run_dir).train) == 11


# --- carving valid/test from train -------------------------------------------------------------

def test_carved_splits_are_deterministic_disjoint_and_saved(data_dir, tmp_path):
    rows = numbered_pairs(20)
    write_text_split(data_dir, "train", rows)
    cfg = make_cfg(data_dir, valid_size=3, test_size=2)
    first_dir, second_dir = tmp_path / "run1", tmp_path / "run2"
    first_dir.mkdir()
    second_dir.mkdir()

    first = load_corpus(cfg, seed=7, run_dir=first_dir)
    second = load_corpus(cfg, seed=7, run_dir=second_dir)

    saved = json.loads((first_dir / "splits.json").read_text())
    assert saved["source_rows"] == 20 and saved["seed"] == 7
    assert pairs_of(first.valid) == [rows[i] for i in saved["valid"]]
    assert pairs_of(first.test) == [rows[i] for i in saved["test"]]
    # 20 rows = 3 valid + 2 test + 15 train, with no row in two splits
    assert (len(first.valid), len(first.test), len(first.train)) == (3, 2, 15)
    assert sorted(pairs_of(first.train) + pairs_of(first.valid) + pairs_of(first.test)) == sorted(rows)
    assert pairs_of(second.valid) == pairs_of(first.valid)
    assert pairs_of(second.test) == pairs_of(first.test)
    assert saved == json.loads((second_dir / "splits.json").read_text())


def test_carving_from_a_corpus_that_repeats_pairs_warns_that_they_leak_into_the_carved_splits(data_dir, run_dir,
                                                                                                tmp_path, caplog):
    """The same 10 pairs three times over: every carved pair is still in train (BLEU reads high)."""
    write_text_split(data_dir, "train", numbered_pairs(10) * 3)
    with caplog.at_level(logging.WARNING, logger="transformer_mt"):
        corpus = load_corpus(make_cfg(data_dir, valid_size=3, test_size=2), seed=1, run_dir=run_dir)
    warned = sorted(r.getMessage() for r in caplog.records if "carved from train also occur" in r.getMessage())
    distinct = {split: len(set(pairs_of(getattr(corpus, split)))) for split in ("test", "valid")}
    assert [line.split(" pairs carved")[0] for line in warned] == [f"{n} of the {n} distinct {split}"
                                                                   for split, n in distinct.items()]
    caplog.clear()
    unique = tmp_path / "unique"
    unique.mkdir()
    write_text_split(unique, "train", numbered_pairs(30))
    with caplog.at_level(logging.WARNING, logger="transformer_mt"):
        load_corpus(make_cfg(unique, valid_size=3, test_size=2), seed=1, run_dir=tmp_path / "run2")
    assert not [r for r in caplog.records if "carved from train also occur" in r.getMessage()]


def test_second_call_reuses_splits_json_even_with_another_seed(data_dir, run_dir, tmp_path):
    write_text_split(data_dir, "train", numbered_pairs(30))
    cfg = make_cfg(data_dir, valid_size=4, test_size=4)
    first = load_corpus(cfg, seed=1, run_dir=run_dir)
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    # Seed 2 carves other rows in a fresh run (checked so the reuse below is meaningful).
    assert pairs_of(load_corpus(cfg, seed=2, run_dir=fresh_dir).valid) != pairs_of(first.valid)

    again = load_corpus(cfg, seed=2, run_dir=run_dir)

    assert pairs_of(again.valid) == pairs_of(first.valid)
    assert pairs_of(again.test) == pairs_of(first.test)
    assert pairs_of(again.train) == pairs_of(first.train)


def test_only_the_missing_split_is_carved(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(10))
    write_text_split(data_dir, "test", [("t", "u")])

    corpus = load_corpus(make_cfg(data_dir, valid_size=3), seed=1, run_dir=run_dir)

    saved = json.loads((run_dir / "splits.json").read_text())
    assert set(saved) == {"source_rows", "seed", "valid"}
    assert (len(corpus.train), len(corpus.valid), pairs_of(corpus.test)) == (7, 3, [("t", "u")])


def test_splits_json_with_other_source_rows_raises(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(10))
    (run_dir / "splits.json").write_text(json.dumps({"source_rows": 11, "seed": 1, "valid": [0, 1], "test": [2, 3]}))

    with pytest.raises(DataError, match=r"training data changed .* records 11 train rows, now there are 10"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


def test_carving_more_rows_than_train_holds_names_the_size_keys(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(4))

    # 4 rows cannot give 2 valid + 2 test and still leave one to train on
    with pytest.raises(DataError, match=r"data\.valid_size=2 \+ data\.test_size=2"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


# --- filtering ---------------------------------------------------------------------------------

def test_filters_remove_the_right_pairs_and_count_them(data_dir, run_dir):
    train = [
        ("a b", "c d"),          # kept
        ("", "x"),               # empty
        ("x", "   "),            # empty once stripped
        ("a b c d", "a b c"),    # too_long: 4 words > max_words=3
        ("a", "b c d"),          # length_ratio: 3 / 1 = 3 > 2
        ("a", "b c"),            # kept: 2 / 1 = 2 is not above 2
        ("a b c", "d e f"),      # kept: 3 words is not above 3
    ]
    write_text_split(data_dir, "train", train)
    write_text_split(data_dir, "valid", [("v", "w"), ("", "g")])  # one empty pair
    write_text_split(data_dir, "test", [("t", "u")])

    corpus = load_corpus(make_cfg(data_dir, max_words=3, max_length_ratio=2.0), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.train) == [("a b", "c d"), ("a", "b c"), ("a b c", "d e f")]
    assert pairs_of(corpus.valid) == [("v", "w")]
    # empty: 2 in train + 1 in valid; too_long and length_ratio: 1 each, train only
    assert corpus.removed == {"empty": 3, "too_long": 1, "length_ratio": 1}


def test_in_scripts_without_spaces_each_character_is_a_word(data_dir, run_dir):
    assert count_words("I would like to eat an apple.") == 7
    assert count_words("我想吃一个苹果。") == 8  # seven ideographs and the full stop
    assert count_words("駅はどこですか") == 7  # kanji and kana
    assert count_words("I like 寿司 a lot") == 6
    train = [("I would like to eat an apple.", "我想吃一个苹果。"), ("Where is the station?", "车站在哪里？"),
             ("Hello", "你好，我的朋友们，今天天气很好。")]  # the last: 15 words against 1
    write_text_split(data_dir, "train", train)
    write_text_split(data_dir, "valid", [("v", "w")])
    write_text_split(data_dir, "test", [("t", "u")])

    corpus = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)  # the default ratio, 3

    assert pairs_of(corpus.train) == train[:2]
    assert corpus.removed == {"empty": 0, "too_long": 0, "length_ratio": 1}


def test_valid_and_test_are_not_length_filtered(data_dir, run_dir):
    long_pair = ("one two three four five six", "uno")  # 6 words > max_words, ratio 6
    write_text_split(data_dir, "train", [("a", "b")])
    write_text_split(data_dir, "valid", [long_pair])
    write_text_split(data_dir, "test", [long_pair])

    corpus = load_corpus(make_cfg(data_dir, max_words=3, max_length_ratio=2.0), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.valid) == [long_pair]
    assert pairs_of(corpus.test) == [long_pair]
    assert corpus.removed == {"empty": 0, "too_long": 0, "length_ratio": 0}


def test_no_training_pairs_left_names_the_filter_keys(data_dir, run_dir):
    write_text_split(data_dir, "train", [("a b c d", "e f g h"), ("", "x")])
    write_text_split(data_dir, "valid", [("v", "w")])
    write_text_split(data_dir, "test", [("t", "u")])

    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(data_dir, max_words=3), seed=1, run_dir=run_dir)

    message = str(excinfo.value)
    assert "no training pairs left after filtering (removed: empty=1, too_long=1, length_ratio=0)" in message
    assert "empty side" in message and "data.max_words" in message  # the filters that removed pairs
    assert "data.max_length_ratio" not in message


def test_empty_valid_split_raises(data_dir, run_dir):
    write_text_split(data_dir, "train", [("a", "b")])
    write_text_split(data_dir, "valid", [("", "w")])
    write_text_split(data_dir, "test", [("t", "u")])

    with pytest.raises(DataError, match="valid split"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)


# --- hub ---------------------------------------------------------------------------------------

def refuse_connection(*args, **kwargs):
    raise OSError("network is unreachable")


@pytest.mark.parametrize("offline_by", ["unreachable endpoint", "failing socket"])
def test_hub_format_fails_fast_with_advice_when_hub_is_unreachable(offline_by, run_dir, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)  # a proxy would skip the probe: datasets' own retries take ~25 s
    # Fast means the probe answers before `datasets` starts its retries: it must never be reached.
    monkeypatch.setattr(data_sources, "_load_hub_dataset", lambda cfg: pytest.fail("reached datasets.load_dataset"))
    if offline_by == "unreachable endpoint":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    else:
        monkeypatch.delenv("HF_ENDPOINT", raising=False)
        monkeypatch.setattr(socket, "create_connection", refuse_connection)
    cfg = make_cfg(format="hub", path="Helsinki-NLP/opus_books", hub_config="en-it")

    with pytest.raises(DataError) as excinfo:
        load_corpus(cfg, seed=1, run_dir=run_dir)

    message = str(excinfo.value)
    assert "'Helsinki-NLP/opus_books'" in message
    assert "data.format: text" in message and "HF_HUB_OFFLINE=1" in message


@pytest.mark.parametrize("offline, error", [
    (True, ConnectionError("Couldn't reach 'Helsinki-NLP/opus_books' on the Hub (OfflineModeIsEnabled)")),
    (False, ConnectionError("Couldn't reach 'Helsinki-NLP/opus_books' on the Hub (OfflineModeIsEnabled)")),
    (True, ValueError("BuilderConfig 'en-xx' not found (OfflineModeIsEnabled)")),  # cached, but no such config
])
def test_a_hub_dataset_missing_from_the_cache_in_offline_mode_gets_the_same_advice(offline, error, run_dir,
                                                                                   monkeypatch):
    datasets = pytest.importorskip("datasets")

    def not_cached(*args, **kwargs):  # what datasets raises offline for a dataset it has never downloaded
        raise error

    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    monkeypatch.setattr(data_sources, "_check_hub_reachable", lambda cfg: None)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(format="hub", path="Helsinki-NLP/opus_books", hub_config="en-it"), seed=1,
                    run_dir=run_dir)
    message = str(excinfo.value)
    assert "(OfflineModeIsEnabled). " in message or message.endswith("(OfflineModeIsEnabled).")
    expected = offline and isinstance(error, ConnectionError)
    assert ("only your HF cache was looked at" in message and "train.en/train.it" in message) == expected


@pytest.fixture
def hub_folder(tmp_path: Path, monkeypatch) -> Path:
    """A local dataset folder in the Hub layout: train.jsonl with a `translation` column only."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = tmp_path / "hub_dataset"
    folder.mkdir()
    write_lines(folder / "train.jsonl",
                [json.dumps({"translation": {"en": f"sentence {i}", "it": f"frase {i}"}}) for i in range(10)])
    return folder


def test_hub_format_carves_valid_and_test_when_dataset_has_only_train(hub_folder, run_dir, monkeypatch):
    monkeypatch.setattr(socket, "create_connection", refuse_connection)  # a local folder needs no network
    cfg = make_cfg(format="hub", path=str(hub_folder))

    corpus = load_corpus(cfg, seed=1, run_dir=run_dir)

    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == (6, 2, 2)
    assert ("sentence 0", "frase 0") in pairs_of(corpus.train) + pairs_of(corpus.valid) + pairs_of(corpus.test)
    assert (run_dir / "splits.json").is_file()


def test_hub_loading_draws_no_bars_into_a_log_and_a_folder_it_cannot_read_is_a_data_error(hub_folder, tmp_path,
                                                                                            run_dir, capfd):
    """stderr is not a terminal here (a log file, CI): datasets' "Generating train split" bars went
    into it. A folder of .tsv files given as a hub dataset was an internal DatasetGenerationCastError
    (datasets takes each file's first pair for a header)."""
    load_corpus(make_cfg(format="hub", path=str(hub_folder)), seed=1, run_dir=run_dir)
    assert "Generating" not in capfd.readouterr().err
    folder = tmp_path / "tsv"
    folder.mkdir()
    for split, pairs in (("train", [("a", "b"), ("c", "d")]), ("valid", [("e", "f")]), ("test", [("g", "h")])):
        write_lines(folder / f"{split}.tsv", [f"{src}\t{tgt}" for src, tgt in pairs])
    with pytest.raises(DataError, match=r"datasets could not build a dataset from it \(All the data files must have "
                                        r"the same columns.*data.format: text, tsv or jsonl"):
        load_corpus(make_cfg(format="hub", path=str(folder)), seed=1, run_dir=tmp_path / "run2")


def test_hub_language_missing_from_translation_column_names_key_and_available_languages(hub_folder, run_dir):
    cfg = make_cfg(format="hub", path=str(hub_folder), tgt_lang="fr")

    with pytest.raises(DataError, match=r"data\.tgt_lang='fr' not in .*\(available: en, it\)"):
        load_corpus(cfg, seed=1, run_dir=run_dir)


def write_parquet_dataset(folder: Path, splits: dict[str, dict[str, list]]) -> Path:
    """A local dataset folder in the Hub layout: one `data/{split}-00000-of-00001.parquet` per split,
    with the given columns."""
    datasets = pytest.importorskip("datasets")
    for split, columns in splits.items():
        datasets.Dataset.from_dict(columns).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return folder


def test_hub_dataset_with_a_text_column_per_language_is_read(tmp_path, run_dir, monkeypatch):
    # Multi30k's shape on the Hub (`en`, `de` columns): it was refused for lacking a `translation` column.
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = write_parquet_dataset(tmp_path / "flat", {
        "train": {"en": ["the cat", "two\nlines", None, "the dog"], "it": ["il gatto", "due righe", "niente", "il cane"],
                  "id": [0, 1, 2, 3]},
        "validation": {"en": ["one"], "it": ["uno"], "id": [4]},
        "test": {"en": ["two"], "it": ["due"], "id": [5]},
    })

    corpus = load_corpus(make_cfg(format="hub", path=str(folder)), seed=1, run_dir=run_dir)

    # As a jsonl line {"en": .., "it": ..} would be: line breaks become spaces, a null side is empty.
    assert pairs_of(corpus.train) == [("the cat", "il gatto"), ("two lines", "due righe"), ("the dog", "il cane")]
    assert pairs_of(corpus.valid) == [("one", "uno")] and pairs_of(corpus.test) == [("two", "due")]
    assert corpus.removed["empty"] == 1 and corpus.carved == ()


def test_hub_dataset_without_either_shape_names_the_columns_and_both_shapes(tmp_path, run_dir, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = write_parquet_dataset(tmp_path / "en_de", {"train": {"en": ["a", "b"], "de": ["c", "d"]}})

    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(format="hub", path=str(folder)), seed=1, run_dir=run_dir)  # tgt_lang: it

    message = str(excinfo.value)
    assert f"hub dataset {str(folder)!r} split 'train' has neither a 'translation' column nor columns 'en' and 'it'" \
        in message
    assert "columns found: en, de" in message and "data.src_lang and data.tgt_lang" in message


def test_hub_language_column_that_is_not_text_is_named(tmp_path, run_dir, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = write_parquet_dataset(tmp_path / "ids", {"train": {"en": ["a", "b"], "it": [1, 2]}})

    with pytest.raises(DataError, match=r"split 'train': column 'it' holds Value\('int64'\), not text"):
        load_corpus(make_cfg(format="hub", path=str(folder)), seed=1, run_dir=run_dir)


def test_hub_dataset_with_a_loading_script_is_refused_with_workarounds(tmp_path, run_dir, monkeypatch):
    # A user walk: IWSLT/iwslt2017 ended in "tmt: internal error: RuntimeError: Dataset scripts are
    # no longer supported, but found iwslt2017.py". A local folder holding the script fails alike.
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = tmp_path / "iwslt2017"
    folder.mkdir()
    (folder / "iwslt2017.py").write_text("x\n")

    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(format="hub", path=str(folder)), seed=1, run_dir=run_dir)

    message = str(excinfo.value)
    assert message.startswith(f"data.path={str(folder)!r}: this dataset is defined by a loading script (iwslt2017.py)")
    assert "If the dataset has a Parquet conversion on the hub" in message
    assert "data.revision: refs/convert/parquet, data.hub_config: the configuration's folder" in message
    assert "data.format: text, tsv or jsonl" in message


def test_any_other_runtime_error_of_datasets_is_not_disguised_as_a_data_error(run_dir, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def fails(*args, **kwargs):
        raise RuntimeError("something tmt knows nothing about")

    monkeypatch.setattr(datasets, "load_dataset", fails)
    monkeypatch.setattr(data_sources, "_check_hub_reachable", lambda cfg: None)
    with pytest.raises(RuntimeError, match="knows nothing"):
        load_corpus(make_cfg(format="hub", path="IWSLT/iwslt2017"), seed=1, run_dir=run_dir)


def test_tmt_data_on_a_script_dataset_exits_1_with_one_error_line(tmp_path, monkeypatch, capsys):
    from tests.helpers import DEMO_CONFIG, run_cli

    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    (tmp_path / "iwslt2017").mkdir()
    (tmp_path / "iwslt2017" / "iwslt2017.py").write_text("x\n")

    code, out, err = run_cli(["data", "--config", str(DEMO_CONFIG), "--set", "data.format=hub",
                              "--set", f"data.path={tmp_path / 'iwslt2017'}"], monkeypatch, capsys, tmp_path)

    assert code == 1 and out == ""
    assert err.startswith("tmt: error: data.path=") and "loading script (iwslt2017.py)" in err
    assert "internal error" not in err and "Traceback" not in err


def test_a_parquet_conversion_reads_the_folder_of_the_hub_config(tmp_path, run_dir, monkeypatch):
    # refs/convert/parquet holds one folder per configuration and no card naming them, so
    # `datasets` would find only a `default` configuration (and mix every language pair in it).
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    converted = tmp_path / "converted"
    for config, tgt in (("iwslt2017-en-it", "it"), ("iwslt2017-en-de", "de")):
        for split in ("train", "validation", "test"):
            rows = {"translation": [{"en": f"{split} {i}", tgt: f"{tgt} {split} {i}"} for i in range(3)]}
            datasets.Dataset.from_dict(rows).to_parquet(str(converted / config / split / "0000.parquet"))

    cfg = make_cfg(format="hub", path=str(converted), hub_config="iwslt2017-en-it", revision="refs/convert/parquet")
    corpus = load_corpus(cfg, seed=1, run_dir=run_dir)

    assert pairs_of(corpus.train) == [(f"train {i}", f"it train {i}") for i in range(3)]
    assert pairs_of(corpus.valid) == [(f"validation {i}", f"it validation {i}") for i in range(3)]

    with pytest.raises(DataError, match="data.hub_config: with data.revision: refs/convert/parquet, name the"):
        load_corpus(make_cfg(format="hub", path=str(converted), revision="refs/convert/parquet"), seed=1,
                    run_dir=run_dir)  # read whole, its two language pairs would be one dataset


def test_iter_text_streams_every_row_or_only_the_given_ones(data_dir, run_dir, monkeypatch):
    import numpy as np

    from transformer_mt.data import sources as data_sources
    from transformer_mt.data.corpus import iter_text, sample_rows

    monkeypatch.setattr(data_sources, "CHUNK_ROWS", 4)  # several record batches
    rows = numbered_pairs(19)
    write_text_split(data_dir, "train", rows)
    write_text_split(data_dir, "valid", numbered_pairs(2))
    write_text_split(data_dir, "test", numbered_pairs(2))
    train = load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir).train
    assert list(iter_text(train, "src")) == [s for s, _ in rows]
    picked = np.array([0, 3, 4, 9, 18])
    assert list(iter_text(train, "tgt", picked)) == [rows[i][1] for i in picked]
    sample = sample_rows(19, 5, seed=7)
    assert len(sample) == 5 and list(sample) == sorted(set(sample.tolist())) and sample.max() < 19
    assert (sample == sample_rows(19, 5, seed=7)).all() and sample_rows(19, 19, seed=7) is None


def test_a_corpus_cache_folder_tmt_did_not_write_is_never_replaced(data_dir, run_dir):
    write_text_split(data_dir, "train", numbered_pairs(10))
    theirs = run_dir / "corpus_cache"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="tmt did not write it"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
    assert (theirs / "notes.txt").read_text() == "mine"


def test_a_directory_where_a_data_file_belongs_is_named(data_dir, run_dir):
    write_text_split(data_dir, "train", [("a", "b")] * 4)
    (data_dir / "valid.en").mkdir()
    (data_dir / "valid.it").mkdir()
    with pytest.raises(DataError, match=r"valid\.en is a directory, not a data file"):
        load_corpus(make_cfg(data_dir), seed=1, run_dir=run_dir)
