"""Scoring: sacreBLEU BLEU/chrF with signatures; tokenized BLEU on tokenized text stays quiet."""

import logging

from transformer_mt.evaluation import cross_attention_labels, score

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


def test_attention_labels_match_the_rows_and_columns_of_the_map():
    eos = "</s>"
    assert cross_attention_labels(["a", "b"], ["x", "y"], eos, max_len=8) == (["a", "b", eos], ["x", "y", eos])
    # A hypothesis that filled all max_len positions (no EOS generated): every piece, no EOS row.
    src, hyp = list("abcdefghij"), list("qrstuvwx")
    assert cross_attention_labels(src, hyp, eos, max_len=8) == (list("abcdefg") + [eos], hyp)
    assert cross_attention_labels(src, hyp[:7], eos, max_len=8)[1] == hyp[:7] + [eos]
