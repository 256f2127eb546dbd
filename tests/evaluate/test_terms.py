"""Term accuracy (evaluate/terms.py): the share of a glossary's target terms that translations hold,
counted over the sentences whose source holds the source term, as sacreBLEU scores and tests a metric."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformer_mt.data.glossary import holds_term, read_glossary
from transformer_mt.evaluate.comparison import paired_tests
from transformer_mt.evaluate.metrics import score
from transformer_mt.evaluate.terms import term_references

GLOSSARY = "train\ttreno\nstation\tstazione\nticket\tbiglietto\nNew York\tNew York\n"
SOURCES = ["The train is late.", "Where is the station?", "A ticket for the train, please.", "Hello.",
           "I live in New   York.", "The TRAIN station."]
HYPOTHESES = ["Il treno è in ritardo.", "Dov'è la fermata?", "Un biglietto per il treno, per favore.", "Ciao.",
              "Vivo a new york.", "La stazione dei treni."]
REFERENCES = ["Il treno è in ritardo.", "Dov'è la stazione?", "Un biglietto per il treno, per favore.", "Ciao.",
              "Vivo a New York.", "La stazione ferroviaria."]


@pytest.fixture
def glossary(tmp_path: Path):
    (tmp_path / "terms.tsv").write_text(GLOSSARY, encoding="utf-8")
    return lambda case="insensitive": read_glossary(tmp_path / "terms.tsv", case)


def test_term_accuracy_equals_a_hand_count(glossary):
    # By hand: treno ✓ | stazione ✗ | biglietto ✓, treno ✓ | none | New York ✓ (case ignored) |
    # treno ✗ ("treni" is another word), stazione ✓  ->  5 of 7.
    assert term_references(glossary(), SOURCES) == ["treno", "stazione", "biglietto\ttreno", "", "New York",
                                                    "treno\tstazione"]
    result = score(HYPOTHESES, REFERENCES, glossary=glossary(), sources=SOURCES, metrics=("bleu",))
    assert result["terms"].value == pytest.approx(100 * 5 / 7)
    assert "case:insensitive" in result["terms"].signature
    # Case-sensitive: "new york" no longer counts, and "The TRAIN station." calls for stazione only.
    strict = score(HYPOTHESES, REFERENCES, glossary=glossary("sensitive"), sources=SOURCES, metrics=("bleu",))
    assert strict["terms"].value == pytest.approx(100 * 4 / 6) and "case:sensitive" in strict["terms"].signature


def test_terms_match_whole_words_with_any_spacing():
    assert holds_term("Vivo a New\u00a0 York.", "New York") and holds_term("il treno.", "treno")
    assert not holds_term("i treni", "treno") and not holds_term("iltreno", "treno")
    assert not holds_term("Treno", "treno", case_sensitive=True) and holds_term("Treno", "treno")


def test_term_accuracy_has_a_bootstrap_interval_and_is_left_out_without_terms(glossary):
    result = score(HYPOTHESES * 20, REFERENCES * 20, glossary=glossary(), sources=SOURCES * 20, n_bootstrap=200,
                   metrics=("chrf",))
    low, high = result["terms"].interval
    assert low < result["terms"].value < high and "bs:200" in result["terms"].signature
    assert "Term accuracy = 71.43 (95% CI [" in result["terms"].shown("terms")
    none = score(["Ciao."], ["Ciao."], glossary=glossary(), sources=["Hello."], metrics=("bleu",))
    assert list(none.by_metric) == ["bleu"]


def test_paired_tests_of_term_accuracy_follow_the_terms(glossary):
    # Against the references (6 of 7 terms: "La stazione ferroviaria." has no treno), a system that misses 2.
    systems = [("misses", HYPOTHESES * 30), ("references", REFERENCES * 30), ("again", HYPOTHESES * 30)]
    comparison = paired_tests(systems, REFERENCES * 30, n_bootstrap=200, n_trials=500, metrics=("bleu",),
                              glossary=glossary(), sources=SOURCES * 30)
    misses, references, again = comparison.results["terms"]
    assert misses.score == pytest.approx(100 * 5 / 7) and references.score == pytest.approx(100 * 6 / 7)
    assert references.p_bootstrap < 0.01 and references.p_randomization < 0.01 and references.significant
    assert again.p_bootstrap == again.p_randomization == 1.0  # the baseline's translations, line for line
    assert "case:insensitive" in comparison.signatures["terms bootstrap"]
