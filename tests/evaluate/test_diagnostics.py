"""Output diagnostics: each check flags what it names and nothing a good translation has."""

from __future__ import annotations

import pytest

from transformer_mt.evaluate.diagnostics import (CHECKS, diagnose, end_punctuation, has_loop, is_copy, is_untranslated,
                                               length_ratio, numbers, script, urls)

SOURCE, GOOD = "Where is the station?", "Dov'è la stazione?"


def test_a_good_translation_is_flagged_by_no_check():
    result = diagnose([SOURCE], [GOOD], [GOOD])
    assert result.flagged == {name: [] for name in CHECKS}


def test_copies_and_untranslated_output():
    assert is_copy(SOURCE, "where is the station") and not is_copy(SOURCE, GOOD) and not is_copy(SOURCE, "")
    assert is_untranslated("The red car is fast.", "La car red è fast.", "La macchina rossa è veloce.")
    assert not is_untranslated("The red car is fast.", "La macchina rossa è veloce.", "La macchina rossa è veloce.")
    # A name the reference keeps too is not left untranslated.
    assert not is_untranslated("Tom loves Mary.", "Tom ama Mary.", "Tom ama Mary.")


def test_script_of_the_letters():
    assert script("Привет, мир") == "CYRILLIC" and script("Ciao, mondo!") == "LATIN" and script("1, 2.") is None
    result = diagnose(["Hello.", "Thanks."], ["Привет.", "Grazie."], ["Ciao.", "Grazie."])
    assert result.flagged["wrong_script"] == [1]


@pytest.mark.parametrize("text, loop", [
    ("il il il gatto", True), ("il gatto il gatto il gatto", True), ("hehehehehe", True), ("zzzzzz", True),
    ("il gatto dorme sul divano", False), ("Man Man", False), ("1000000 euro", False), ("cocco", False),
])
def test_repeated_ngram_loops(text: str, loop: bool):
    assert has_loop(text) == loop


def test_length_ratio_outliers():
    assert length_ratio("ab cd", "abcd") == 1.0 and length_ratio("x", "") is None
    result = diagnose(["a", "b", "c"], ["Sì.", "Sì sì sì sì sì sì sì sì.", "Va bene."], ["Va bene.", "Sì.", "Va bene."])
    assert result.flagged["length_outliers"] == [1, 2]


def test_numbers_urls_and_end_punctuation_compared_with_the_source():
    assert numbers("1,000 people at 10:30") == numbers("1.000 persone alle 10.30")
    assert numbers("3 cats") != numbers("tre gatti")
    assert urls("see https://example.com/a.") == urls("vedi https://example.com/a")
    assert urls("mail me@example.com") != urls("scrivimi")
    assert end_punctuation('He said "yes?"') == "?" and end_punctuation("Ciao") is None
    assert end_punctuation("何?") == end_punctuation("Cosa？") == "?"
    result = diagnose(["It costs 5 euros.", "See www.tmt.org!", "Why?"], ["Costa 6 euro.", "Vedi!", "Perché."],
                      ["Costa 5 euro.", "Vedi www.tmt.org!", "Perché?"])
    assert (result.flagged["numbers"], result.flagged["urls"], result.flagged["punctuation"]) == ([1], [2], [3])


def test_chrf_by_source_length_bucket_and_the_report():
    sources = ["a b", "a b c d e f g", "a b c d e f g h i j k l"]
    hypotheses = ["Buongiorno.", "Sbagliato del tutto.", "Il caffè è caldo e la città è bella."]
    references = ["Buongiorno.", "Il gatto dorme.", "Il caffè è caldo e la città è bella."]
    result = diagnose(sources, hypotheses, references)
    assert [(label, n) for label, n, _ in result.buckets] == [("1-5", 1), ("6-10", 1), ("11-20", 1)]
    assert result.buckets[0][2] == pytest.approx(100) and result.buckets[1][2] < 30
    report = result.report()
    assert report["sentences"] == 3 and report["loops"] == {"count": 0, "lines": []}
    assert report["chrf_by_source_length"][0] == {"source_words": "1-5", "sentences": 1, "chrf": 100.0}
    assert result.rates()["copies"] == 0.0 and len(result.lines()) == len(CHECKS) + 1
