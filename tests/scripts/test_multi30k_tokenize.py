"""scripts/multi30k_tokenize.py: the tok/ procedure, its self-check, and that it never overwrites."""

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import REPO

pytest.importorskip("sacremoses")

SCRIPT = REPO / "scripts" / "multi30k_tokenize.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("multi30k_tokenize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


@pytest.fixture
def corpus(tmp_path):
    """A Multi30k-shaped folder: test2016 raw with its tok/ copy (as the source repository made
    it), an extra test set raw only, and a file that is not a language."""
    data = tmp_path / "multi30k"
    write(data / "test.en", ["A man in an orange hat starring at something.", "A kid's table."])
    write(data / "tok" / "test.en", ["a man in an orange hat starring at something .", "a kid &apos;s table ."])
    write(data / "test.de", ["Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.", "Ein Kindertisch."])
    write(data / "tok" / "test.de", ["ein mann mit einem orangefarbenen hut , der etwas anstarrt .",
                                     "ein kindertisch ."])
    write(data / "test2017_flickr.en", ['A man\'s hat says "Stop", & smiles.'])
    write(data / "test2017_flickr.de", ["Ein Hund läuft „schnell“ über saftig-grünes Gras."])
    write(data / "SOURCE.md", ["# not a corpus file"])
    return data


def test_tokenizes_extra_test_sets_like_tok(script, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert script.main(["--data", str(corpus), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0 of 2 lines differ from tok/test.en" in printed
    assert "0 of 2 lines differ from tok/test.de" in printed
    assert sorted(p.name for p in out.iterdir()) == ["test2017_flickr.de", "test2017_flickr.en"]
    # Lowercased, punctuation normalised (the comma moves inside the quotes in English, German
    # quotes become "), Moses-tokenized with XML escapes; hyphenated words stay whole.
    assert (out / "test2017_flickr.en").read_text() == "a man &apos;s hat says &quot; stop , &quot; &amp; smiles .\n"
    assert (out / "test2017_flickr.de").read_text() == "ein hund läuft &quot; schnell &quot; über saftig-grünes gras .\n"


def test_check_counts_lines_that_differ(script, corpus):
    write(corpus / "tok" / "test.en", ["a man in an orange hat starring at something.", "a kid &apos;s table ."])
    assert script.check(corpus / "test.en", corpus / "tok" / "test.en") == (1, 2)


def test_never_overwrites(script, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    write(out / "test2017_flickr.de", ["mine"])
    assert script.main(["--data", str(corpus), "--out", str(out)]) == 1
    assert "would overwrite" in capsys.readouterr().err
    assert (out / "test2017_flickr.de").read_text() == "mine\n"
    assert not (out / "test2017_flickr.en").exists()


def test_folder_without_tok_is_refused(script, tmp_path, capsys):
    write(tmp_path / "raw" / "test.en", ["A dog."])
    assert script.main(["--data", str(tmp_path / "raw"), "--out", str(tmp_path / "out")]) == 1
    assert "tok/" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
