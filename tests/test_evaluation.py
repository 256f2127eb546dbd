"""Scoring: sacreBLEU BLEU/chrF with signatures; tokenized BLEU on tokenized text stays quiet."""

import logging

from transformer_mt.evaluation import score

# Lowercased, tokenized text as in Multi30k's tok/ files: every line ends in " ." (sacreBLEU
# warns about that from 100 such lines on, unless told the text is tokenized on purpose).
REFERENCES = [f"ein mann mit {n} hunden steht auf der straße ." for n in range(120)]
HYPOTHESES = [f"ein mann mit {n} hunden geht auf der straße ." for n in range(120)]


def test_tokenized_bleu_does_not_warn_and_scores_like_plain_sacrebleu(caplog, capsys):
    import sacrebleu

    with caplog.at_level(logging.WARNING):
        scores = score(HYPOTHESES, REFERENCES, tokenize="none")
    assert "detokenize" not in caplog.text + "".join(capsys.readouterr())
    plain = sacrebleu.metrics.BLEU(tokenize="none")
    assert scores.bleu == plain.corpus_score(HYPOTHESES, [REFERENCES]).score
    assert scores.bleu_signature == str(plain.get_signature()) and "tok:none" in scores.bleu_signature
    assert 0 < scores.bleu < 100 and 0 < scores.chrf < 100


def test_raw_text_is_scored_with_13a_by_default():
    scores = score(["Ciao, mondo!"], ["Ciao, mondo!"])
    assert round(scores.bleu, 6) == 100 and "tok:13a" in scores.bleu_signature
