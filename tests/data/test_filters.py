"""`data.filters`: each filter on small hand-made corpora (what it keeps and removes), the removed pairs'
files and counts, the cache key, the data report, and the bad inputs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.data.langid_sentences import SENTENCES
from tests.helpers import REPO, run_cli, write_corpus
from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import DataConfig
from transformer_mt.core.errors import ConfigError, DataError
from transformer_mt.data.corpus import count_words, load_corpus
from transformer_mt.data.filters import MAX_REMOVED_LINES, Pairs, build_filters, word_counts

NOISY = REPO / "transformer_mt" / "corpora" / "noisy_en_it"


def data_config(*filters, src_lang: str = "en", tgt_lang: str = "it", **data) -> DataConfig:
    """The `data` section with `filters`, checked as a config file's."""
    return config_from_dict({"data": {"path": "x", "src_lang": src_lang, "tgt_lang": tgt_lang,
                                      "filters": list(filters), **data}}).data


def removed(entry, pairs: list[tuple[str, str]], **data) -> list[tuple[str, str]]:
    """The pairs that the one filter `entry` removes from `pairs` (a training split)."""
    (one,) = build_filters(data_config(entry, **data))
    src, tgt = (pa.array(side, pa.string()) for side in zip(*pairs))
    gone = one.removed(one.scan(Pairs(src, tgt)))
    return [pair for pair, out in zip(pairs, gone) if out]


def test_dedup_removes_exact_and_normalised_repeats_keeping_the_first():
    pairs = [("Hello, world!", "Ciao, mondo!"), ("hello world", "ciao  mondo"), ("Hello, world!", "Ciao, mondo!"),
             ("Hello, world!", "Salve, mondo!"), ("Good night.", "Buonanotte.")]
    assert removed("dedup", pairs) == [pairs[1], pairs[2]]
    assert removed({"name": "dedup", "normalize": False}, pairs) == [pairs[2]]
    assert removed({"name": "dedup", "source_only": True}, pairs) == pairs[1:4]


def test_length_counts_words_or_characters_between_its_bounds():
    pairs = [("one two three", "uno due tre"), ("one", "uno"), ("a b c d e f", "a b c d e f g")]
    assert removed({"name": "length", "min_length": 2, "max_length": 6}, pairs) == [pairs[1], pairs[2]]
    assert removed({"name": "length", "unit": "characters", "max_length": 11}, pairs) == [pairs[0], pairs[2]]
    assert removed("length", pairs) == []  # 1 to 100 words


def test_length_ratio_compares_the_longer_side_with_the_shorter():
    pairs = [("one two", "uno due tre quattro"), ("one two", "uno due tre quattro cinque sei sette"), ("ab", "abcdefg")]
    assert removed("length_ratio", pairs) == [pairs[1]]
    assert removed({"name": "length_ratio", "max_ratio": 1.5}, pairs) == pairs[:2]
    assert removed({"name": "length_ratio", "unit": "characters"}, pairs) == pairs[1:]


def test_copies_removes_targets_equal_or_nearly_equal_to_their_source():
    pairs = [("The cat sleeps.", "the  cat sleeps."), ("I love Italian music.", "I love Italian musica."),
             ("I love Italian music.", "Amo la musica italiana."), ("Rome", "Roma")]
    assert removed("copies", pairs) == pairs[:2]
    assert removed({"name": "copies", "max_similarity": 0.7}, pairs) == [pairs[0], pairs[1], pairs[3]]


def test_characters_removes_control_characters_decoding_errors_few_letters_and_another_script():
    pairs = [("Fine, thanks.", "Bene, grazie."), ("Bell\x07", "Campana"), ("Caff\ufffd", "Caffè"),
             ("Room 12345", "Stanza 12345"), ("Hello", "Привет"), ("Tokyo", "Tokyo 東京")]
    assert removed("characters", pairs) == pairs[1:]
    assert removed({"name": "characters", "scripts": ["Latin", "Cyrillic"]}, pairs[4:5]) == []
    assert removed({"name": "characters", "min_letters": 0.1}, pairs[3:4]) == []
    assert removed("characters", [("Привет", "Привет")], src_lang="ru", tgt_lang="uk") == []
    assert removed("characters", [("Hello", "Привет")], src_lang="en_GB", tgt_lang="ru-RU") == []


def test_numbers_compares_the_numbers_of_both_sides_without_separators():
    pairs = [("It costs 1,000.50 euros.", "Costa 1.000,50 euro."), ("I have 3 cats.", "Ho 4 gatti."),
             ("Room 12, floor 3", "Piano 3, stanza 12"), ("Call me.", "Chiamami 2 volte."), ("No digits.", "Niente.")]
    assert removed("numbers", pairs) == [pairs[1], pairs[3]]


def test_html_removes_markup_entities_and_url_only_sides():
    pairs = [("<p>Hello</p>", "Ciao"), ("Fish &amp; chips", "Pesce e patatine"), ("www.example.com", "Benvenuti"),
             ("Write to info@example.com today.", "Scrivi a info@example.com oggi."), ("If a < b then", "Se a < b"),
             ("https://example.com/a", "https://example.com/a")]
    assert removed("html", pairs) == [pairs[0], pairs[1], pairs[2], pairs[5]]
    assert removed({"name": "html", "urls": False}, pairs) == pairs[:2]


def test_the_language_filter_identifies_short_sentences_in_five_languages():
    """py3langid on 20 short sentences (4-9 words) in each of English, Italian, German, French and Spanish:
    all 100 are identified correctly (measured: 100/100), so none is removed as the language expected;
    as the wrong target of an English-Italian corpus, the German, French and Spanish ones are removed
    at the default min_confidence 0.5 (measured: 59/60; one Spanish sentence is identified with less)."""
    pytest.importorskip("py3langid")
    english = SENTENCES["en"]
    wrong = 0
    for lang, sentences in SENTENCES.items():
        pairs = list(zip(english, sentences))
        assert removed({"name": "language", "min_confidence": 0, "languages": ["en", lang]}, pairs) == [], lang
        if lang not in ("en", "it"):
            wrong += len(removed("language", pairs))
    assert wrong >= 57  # 95% of 60
    pairs = list(zip(english, SENTENCES["it"]))
    assert removed("language", pairs) == []
    assert removed({"name": "language", "languages": ["it", "en"]}, pairs) == pairs  # sides the other way round


def test_the_language_filter_without_py3langid_says_how_to_install_it(monkeypatch):
    from transformer_mt.data import filters

    monkeypatch.setattr(filters, "_identifier", lambda: __import__("no_such_module_here"))
    with pytest.raises(DataError, match=r"the language filter needs py3langid: pip install 'transformer-mt\[langid\]'"):
        build_filters(data_config("language"))


def test_a_language_or_script_a_filter_cannot_check_is_one_line_naming_it():
    pytest.importorskip("py3langid")
    with pytest.raises(DataError, match=r"cannot identify 'xx' \(from src_lang/tgt_lang\)"):
        build_filters(data_config("language", src_lang="xx"))
    with pytest.raises(DataError, match="knows no script for the language 'xx'; set its scripts"):
        build_filters(data_config("characters", src_lang="xx"))
    with pytest.raises(DataError, match="'Latn' is not a Unicode script name"):
        build_filters(data_config({"name": "characters", "scripts": ["Latn", "Latin"]}))


@pytest.mark.parametrize("filters, message", [
    (["dedpu"], "data.filters[0].name: 'dedpu' is not a filter (did you mean 'dedup'?)"),
    ([{"name": "length", "max_ratio": 2}], "data.filters[0].max_ratio: not an option of the length filter "
                                           "(its options are unit, min_length, max_length)"),
    (["html", {"name": "length", "max_lenght": 9}], "data.filters[1].max_lenght: unknown key (did you mean "
                                                    "'max_length'?)"),
    ([{"name": "copies", "max_similarity": 1.5}], "data.filters[0].max_similarity: must be in [0, 1], got 1.5"),
    ([{"name": "dedup", "splits": ["train", "dev"]}],
     "data.filters[0].splits: 'dev' (str) is not one of train, valid, test"),
    ([{"max_length": 9}], "data.filters[0].name: missing"),
])
def test_a_filter_or_option_that_does_not_exist_is_a_config_error(filters, message):
    with pytest.raises(ConfigError) as err:
        data_config(*filters)
    assert message in str(err.value)


def test_word_counts_over_a_chunk_are_count_words():
    texts = ["I would like to eat an apple.", "我想吃一个苹果。", "I like 寿司 a lot", "",
             "  a\u00a0b\u2003c\x1cd\x85e  ",
             "tab\tand\nnewline\x0bvertical", " \u2003 ", "trailing \u3000", "\x1c lead\x1f  and  inner\x85"]
    assert word_counts(pa.array(texts)).tolist() == [len(t.split()) if not any("\u3040" <= c for c in t.strip())
                                                     else count_words(t) for t in texts]
    assert word_counts(pa.array(texts)).tolist() == [7, 8, 6, 0, 5, 4, 0, 1, 3]


# --- the corpus, its removed pairs and its report ---------------------------------------------

def noisy_config(tmp_path: Path, *filters, **data) -> DataConfig:
    pairs = [("Hello!", "Ciao!"), ("hello", "ciao"), ("Good night.", "Buonanotte."), ("Good night.", "Buonanotte."),
             ("<b>Yes</b>", "<b>Sì</b>"), ("Thank you.", "Grazie."), ("Thanks.", "Thanks.")]
    valid = [("Hello!", "Ciao!"), ("<i>No</i>", "<i>No</i>")]
    if not (tmp_path / "data").exists():  # written once: the cache key holds the files' times
        write_corpus(tmp_path / "data", {"train": pairs, "valid": valid, "test": valid})
    return config_from_dict({"data": {"path": str(tmp_path / "data"), "filters": list(filters), **data}}).data


def test_the_removed_pairs_are_counted_and_written_per_filter_and_split(tmp_path: Path):
    cfg = noisy_config(tmp_path, "dedup", {"name": "html", "splits": ["train", "valid"]}, "copies",
                       max_filtered_share=1)
    corpus = load_corpus(cfg, 1, tmp_path / "run")
    assert list(zip(corpus.train["src"], corpus.train["tgt"])) == [("Hello!", "Ciao!"), ("Good night.", "Buonanotte."),
                                                                  ("Thank you.", "Grazie.")]
    assert corpus.valid["src"] == ["Hello!"] and len(corpus.test) == 2  # test: never filtered unless named
    got = [(c.filter, c.split, c.removed, c.seen) for c in corpus.filtered]
    assert got == [("dedup", "train", 2, 7), ("html", "train", 1, 5), ("copies", "train", 1, 4),
                   ("html", "valid", 1, 2)]
    folder = tmp_path / "run" / "corpus_cache" / "removed"
    assert (folder / "train.dedup.tsv").read_text(encoding="utf-8") == "hello\tciao\nGood night.\tBuonanotte.\n"
    assert (folder / "valid.html.tsv").read_text(encoding="utf-8") == "<i>No</i>\t<i>No</i>\n"
    assert sorted(path.name for path in folder.iterdir()) == ["train.copies.tsv", "train.dedup.tsv", "train.html.tsv",
                                                              "valid.html.tsv"]


def test_dedup_held_out_removes_training_pairs_that_repeat_a_validation_or_test_pair(tmp_path: Path):
    cfg = noisy_config(tmp_path, {"name": "dedup", "held_out": True}, max_filtered_share=1)
    corpus = load_corpus(cfg, 1, tmp_path / "run")
    # "Hello!"/"Ciao!" is a validation (and test) pair; "hello"/"ciao" the same once normalised.
    assert list(zip(corpus.train["src"], corpus.train["tgt"])) == [
        ("Good night.", "Buonanotte."), ("<b>Yes</b>", "<b>Sì</b>"), ("Thank you.", "Grazie."), ("Thanks.", "Thanks.")]
    assert corpus.valid["src"] == ["Hello!", "<i>No</i>"] and len(corpus.test) == 2  # held out, not filtered
    assert [(c.filter, c.split, c.removed) for c in corpus.filtered] == [("dedup", "train", 3)]
    carved = config_from_dict({"data": {"path": str(tmp_path / "data"), "valid_size": 2, "test_size": 2,
                                        "filters": [{"name": "dedup", "held_out": True, "normalize": False}]}}).data
    for name in ("valid.en", "valid.it", "test.en", "test.it"):
        (tmp_path / "data" / name).unlink()
    corpus = load_corpus(carved, 1, tmp_path / "run2")  # valid and test carved from train: no pair in both
    held = set(zip(corpus.valid["src"], corpus.valid["tgt"])) | set(zip(corpus.test["src"], corpus.test["tgt"]))
    assert not held & set(zip(corpus.train["src"], corpus.train["tgt"]))
    with pytest.raises(ConfigError, match=r"data.filters\[0\].held_out: not an option of the length filter"):
        data_config({"name": "length", "held_out": True})


def test_the_removed_pairs_file_keeps_the_first_lines_only(tmp_path: Path, monkeypatch):
    from transformer_mt.data import filters

    monkeypatch.setattr(filters, "MAX_REMOVED_LINES", 1)
    corpus = load_corpus(noisy_config(tmp_path, "dedup"), 1, tmp_path / "run")
    assert corpus.filtered[0].removed == 2
    assert (tmp_path / "run" / "corpus_cache" / "removed" / "train.dedup.tsv").read_text() == "hello\tciao\n"
    assert MAX_REMOVED_LINES == 10_000


def test_changing_the_filters_rebuilds_the_corpus_and_the_same_filters_reuse_it(tmp_path: Path, caplog):
    run = tmp_path / "run"
    assert len(load_corpus(noisy_config(tmp_path), 1, run).train) == 7
    assert len(load_corpus(noisy_config(tmp_path, "dedup"), 1, run).train) == 5
    assert len(load_corpus(noisy_config(tmp_path, {"name": "dedup", "normalize": False}), 1, run).train) == 6
    with caplog.at_level("INFO"):
        assert len(load_corpus(noisy_config(tmp_path, {"name": "dedup", "normalize": False}), 1, run).train) == 6
    assert "reusing the corpus read earlier" in caplog.text


def test_filters_removing_too_much_or_everything_stop_naming_the_filter(tmp_path: Path):
    cfg = noisy_config(tmp_path, "dedup", {"name": "length", "max_length": 1})
    with pytest.raises(DataError, match=r"data.filters removed 4 of 7 training pairs \(57.1%: dedup 2, length 2\), "
                                        r"more than data.max_filtered_share=0.5"):
        load_corpus(cfg, 1, tmp_path / "run")
    raised = noisy_config(tmp_path, "dedup", {"name": "length", "max_length": 1}, max_filtered_share=0.6)
    assert len(load_corpus(raised, 1, tmp_path / "run").train) == 3
    everything = noisy_config(tmp_path, {"name": "length", "min_length": 5}, max_filtered_share=1)
    with pytest.raises(DataError, match=r"no training pairs left .*filters.length=7\); check data.filters.length's"):
        load_corpus(everything, 1, tmp_path / "run2")


def test_tmt_data_lists_each_filter_with_its_count_share_and_examples(tmp_path: Path, monkeypatch, capsys):
    config = tmp_path / "noisy.yaml"
    config.write_text((REPO / "configs" / "noisy-demo.yaml").read_text(encoding="utf-8").replace(
        "../transformer_mt/corpora/noisy_en_it", str(NOISY)).replace("    - language\n", ""), encoding="utf-8")
    code, out, err = run_cli(["data", "--config", str(config), "--quiet"], monkeypatch, capsys, tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[2].split() == ["data.filters", "split", "removed", "of", "share"]
    assert lines[5].split() == ["dedup", "train", "60", "754", "8.0%"]
    assert "  dedup e.g.  " in out and "THE RESTAURANT IS OPEN. → il ristorante è aperto." in out
    assert "Are you at home?\\x07 → Sei a casa?" in out  # a control character shown as its code
    assert "all removed pairs      with --removed DIR in DIR/, by tmt train in the run directory's" in out
    assert not (tmp_path / "runs").exists()


def test_tmt_data_removed_writes_the_removed_pairs_into_a_new_folder_only(tmp_path: Path, monkeypatch, capsys):
    config = tmp_path / "noisy.yaml"
    config.write_text(f"data: {{path: {NOISY}, filters: [dedup, copies]}}\ntokenizer: {{vocab_size: 500}}\n",
                      encoding="utf-8")
    code, out, err = run_cli(["data", "--config", str(config), "--quiet", "--removed", "out"], monkeypatch, capsys,
                             tmp_path)
    assert code == 0, err
    assert f"all removed pairs      in out{os.sep}{{split}}.{{filter}}.tsv" in out
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["train.copies.tsv", "train.dedup.tsv"]
    assert (tmp_path / "out" / "train.copies.tsv").read_text(encoding="utf-8").splitlines()[0] == (
        "Milan is in the north.\tMilan is in the north.")
    before = (tmp_path / "out" / "train.dedup.tsv").read_bytes()
    code, out, err = run_cli(["data", "--config", str(config), "--quiet", "--removed", "out"], monkeypatch, capsys,
                             tmp_path)
    assert code == 2 and err.strip() == "tmt: error: out already exists and is not an empty directory; choose " \
                                        "another --removed"
    assert (tmp_path / "out" / "train.dedup.tsv").read_bytes() == before


def test_the_noisy_demo_corpus_is_what_its_script_makes(tmp_path: Path):
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "tools" / "make_noisy_demo.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.en", "train.it", "valid.en", "test.it"):
        assert (tmp_path / name).read_bytes() == (NOISY / name).read_bytes(), name
    assert np.sum([1 for _ in open(NOISY / "train.en", encoding="utf-8")]) == 787


def test_summary_json_keeps_each_filters_counts(tmp_path: Path):
    from transformer_mt.train.preparation import preview_report

    cfg = config_from_dict({"data": {"path": str(NOISY), "filters": ["dedup", "copies"]},
                            "tokenizer": {"vocab_size": 500}, "train": {"device": "cpu"}})
    report, _, _ = preview_report(cfg, tmp_path / "runs" / "x", progress=False)
    assert report.to_dict()["filtered"] == [{"filter": "dedup", "split": "train", "removed": 62, "seen": 776},
                                            {"filter": "copies", "split": "train", "removed": 17, "seen": 714}]
    assert [example for one in report.filtered for example in one.examples][3] == (
        "Milan is in the north.", "Milan is in the north.")
