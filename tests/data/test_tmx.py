"""TMX files (as OPUS ships them) and damaged gzip files, read through `load_corpus`."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest

from transformer_mt.core.errors import DataError
from transformer_mt.data import sources as data_sources
from transformer_mt.data.corpus import load_corpus
from tests.data.test_data import data_dir, make_cfg, pairs_of, run_dir, write_lines  # noqa: F401 (fixtures)

HEADER = ('<?xml version="1.0" encoding="utf-8"?>\n<tmx version="1.4">\n<header creationtool="test" '
          'datatype="plaintext" segtype="sentence" adminlang="en" srclang="en" o-tmf="none"/>\n<body>\n')


def tmx(units: list[str]) -> str:
    """A TMX document of `<tu>` elements, one a line."""
    return HEADER + "".join(f"  <tu>{unit}</tu>\n" for unit in units) + "</body>\n</tmx>\n"


def tuv(lang: str, text: str, attribute: str = "xml:lang") -> str:
    return f'<tuv {attribute}="{lang}"><seg>{text}</seg></tuv>'


def write(path: Path, text: str) -> Path:
    data = text.encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def numbered_units(n: int) -> list[str]:
    return [tuv("en", f"sentence {i}") + tuv("it", f"frase {i}") for i in range(n)]


def test_tmx_languages_match_by_primary_subtag_in_any_case_and_only_the_text_of_a_segment_is_kept(
        data_dir, run_dir, caplog):
    write(data_dir / "train.tmx.gz", tmx([
        tuv("EN-us", "Hello <bpt i=\"1\">&lt;b&gt;</bpt>world<ept i=\"1\">&lt;/b&gt;</ept>!") + tuv("it", "Ciao\n mondo!"),
        tuv("it-IT", "Buona <hi>notte</hi>") + tuv("en", "Good night", attribute="lang"),  # TMX 1.1's `lang`
        tuv("de", "Hallo") + tuv("it", "ciao"),  # no English: skipped
        tuv("en_GB", "Thanks") + tuv("en", "Thank you") + tuv("IT", "Grazie"),  # the first English one
    ]))
    write(data_dir / "valid.tmx", tmx(numbered_units(2)))
    write(data_dir / "test.tmx", tmx(numbered_units(3)))
    with caplog.at_level(logging.WARNING, logger="transformer_mt.data.sources"):
        corpus = load_corpus(make_cfg(data_dir, format="tmx"), seed=1, run_dir=run_dir)

    assert pairs_of(corpus.train) == [("Hello world!", "Ciao mondo!"), ("Good night", "Buona notte"),
                                      ("Thanks", "Grazie")]
    assert pairs_of(corpus.valid) == [("sentence 0", "frase 0"), ("sentence 1", "frase 1")]
    assert len(corpus.test) == 3 and corpus.carved == ()
    assert "train.tmx.gz: skipped 1 <tu>(s) without both en and it" in caplog.text


def test_a_tmx_language_with_a_region_matches_that_region_only(tmp_path):
    path = write(tmp_path / "train.tmx", tmx([tuv("pt-PT", "autocarro") + tuv("pt_BR", "ônibus") + tuv("en", "bus"),
                                              tuv("pt", "olá") + tuv("en-GB", "hello")]))
    assert list(data_sources._tmx_pairs(path, "pt-BR", "en")) == [("ônibus", "bus")]
    assert list(data_sources._tmx_pairs(path, "pt", "en")) == [("autocarro", "bus"), ("olá", "hello")]


@pytest.mark.parametrize("name", ["en-it.tmx.gz", "Corpus.TMX"])
def test_a_tmx_file_as_data_path_is_the_training_split_with_valid_and_test_carved(tmp_path, run_dir, name):
    path = write(tmp_path / name, tmx(numbered_units(20)))
    corpus = load_corpus(make_cfg(path), seed=1, run_dir=run_dir)  # data.format: text, the default

    assert len(corpus.train) == 16 and len(corpus.valid) == 2 and len(corpus.test) == 2
    assert corpus.carved == ("valid", "test")
    assert sorted(pairs_of(corpus.train) + pairs_of(corpus.valid) + pairs_of(corpus.test)) == sorted(
        (f"sentence {i}", f"frase {i}") for i in range(20))


def test_any_other_file_as_data_path_is_refused(tmp_path, run_dir):
    path = write(tmp_path / "train.en", "hello\n")
    with pytest.raises(DataError, match=r"data.path: .*train\.en' is a file; expected a directory \(data.format: text\) or a \.tmx or \.tmx\.gz file"):
        load_corpus(make_cfg(path), seed=1, run_dir=run_dir)


def test_tmx_read_in_small_chunks_gives_the_same_pairs(data_dir, tmp_path, monkeypatch):
    write(data_dir / "train.tmx.gz", tmx(numbered_units(50)))
    write(data_dir / "valid.tmx", tmx(numbered_units(2)))
    write(data_dir / "test.tmx", tmx(numbered_units(2)))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    whole = pairs_of(load_corpus(make_cfg(data_dir, format="tmx"), seed=1, run_dir=tmp_path / "a").train)
    monkeypatch.setattr(data_sources, "CHUNK_ROWS", 7)
    monkeypatch.setattr(data_sources, "READ_CHUNK_BYTES", 64)
    assert pairs_of(load_corpus(make_cfg(data_dir, format="tmx"), seed=1, run_dir=tmp_path / "b").train) == whole
    assert whole == [(f"sentence {i}", f"frase {i}") for i in range(50)]


def test_tmx_pairs_leave_no_read_unit_in_the_tree(tmp_path, monkeypatch):
    """The streamed parse drops each `<tu>` once read: what stays in memory is one unit, not the file."""
    path = write(tmp_path / "train.tmx", tmx(numbered_units(30)))
    bodies = []
    real_iterparse = data_sources.ET.iterparse

    def spying(source, events):
        for event, element in real_iterparse(source, events):
            if element.tag == "body":
                bodies.append(element)
            yield event, element
            if event == "end" and element.tag == "tu":
                assert len(bodies[0]) <= 1  # at most the next unit, already begun

    monkeypatch.setattr(data_sources.ET, "iterparse", spying)
    assert len(list(data_sources._tmx_pairs(path, "en", "it"))) == 30
    assert bodies and len(bodies[0]) == 0


def test_broken_tmx_names_file_and_line(data_dir, run_dir):
    text = tmx(numbered_units(5)).replace("<tu><tuv xml:lang=\"en\"><seg>sentence 3</seg>",
                                           "<tu><tuv xml:lang=\"en\"><seg>sentence 3</sag>")
    write(data_dir / "train.tmx", text)
    with pytest.raises(DataError, match=rf"{data_dir / 'train.tmx'}:8: not valid TMX \(mismatched tag at column"):
        load_corpus(make_cfg(data_dir, format="tmx"), seed=1, run_dir=run_dir)


def test_a_tmx_cut_short_names_file_and_line(data_dir, run_dir):
    write(data_dir / "train.tmx", tmx(numbered_units(5))[:-40])
    with pytest.raises(DataError, match=rf"{data_dir / 'train.tmx'}:\d+: not valid TMX \(no element found"):
        load_corpus(make_cfg(data_dir, format="tmx"), seed=1, run_dir=run_dir)


def test_tmx_without_the_language_pair_names_the_languages_it_has(data_dir, run_dir):
    write(data_dir / "train.tmx", tmx([tuv("de", "Hallo") + tuv("fr", "Salut")]))
    with pytest.raises(DataError, match=r"train\.tmx: no <tu> has both data\.src_lang='en' and data\.tgt_lang='it' "
                                        r"\(the xml:lang of its <tuv>s: de, fr\)"):
        load_corpus(make_cfg(data_dir, format="tmx"), seed=1, run_dir=run_dir)


@pytest.mark.parametrize("fmt, name", [("text", "train.en.gz"), ("tsv", "train.tsv.gz"), ("jsonl", "train.jsonl.gz"),
                                       ("tmx", "train.tmx.gz")])
def test_a_truncated_gzip_file_names_the_file_and_the_line_where_it_broke(data_dir, run_dir, monkeypatch, fmt, name):
    n = 3000
    lines = {"text": [f"sentence number {i}" for i in range(n)],
             "tsv": [f"sentence number {i}\tfrase numero {i}" for i in range(n)],
             "jsonl": [f'{{"en": "sentence number {i}", "it": "frase numero {i}"}}' for i in range(n)],
             "tmx": tmx(numbered_units(n)).splitlines()}[fmt]
    if fmt == "text":
        write_lines(data_dir / "train.it.gz", [f"frase numero {i}" for i in range(n)])
    packed = gzip.compress("".join(line + "\n" for line in lines).encode("utf-8"))
    (data_dir / name).write_bytes(packed[:len(packed) // 2])  # a download cut short
    monkeypatch.setattr(data_sources, "READ_CHUNK_BYTES", 1024)
    with pytest.raises(DataError) as excinfo:
        load_corpus(make_cfg(data_dir, format=fmt), seed=1, run_dir=run_dir)
    message = str(excinfo.value)
    assert message.startswith(f"{data_dir / name}: cannot read from line ")
    line = int(message.split("from line ")[1].split()[0])
    assert 2 < line < len(lines)  # within the file, past its start
    assert "Compressed file ended before the end-of-stream marker was reached" in message
