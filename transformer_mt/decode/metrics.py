"""Corpus-level scores of translations: sacreBLEU's BLEU and chrF with their signatures."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str


def bleu_tokenizer_problem(tokenize: str) -> str | None:
    """Why sacreBLEU cannot build its `tokenize` tokenizer here (ja-mecab, spm, ... need optional
    packages), or None: checked before hours of training or translating."""
    import sacrebleu  # here, not at the top: translating needs no scorer (start-up time)

    try:
        sacrebleu.metrics.BLEU(tokenize=tokenize)
    except (ImportError, RuntimeError, OSError) as err:
        # sacreBLEU's message spreads an install hint over several lines: keep it on one.
        return f"sacreBLEU cannot use the {tokenize!r} tokenizer here ({' '.join(str(err).split())})"
    return None


def score(hypotheses: list[str], references: list[str], tokenize: str = "13a") -> Scores:
    """BLEU and chrF of detokenised hypotheses against one reference each (sacreBLEU defaults).
    `tokenize="none"` scores pre-tokenized text on purpose, without sacreBLEU's "detokenize" warning."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU(tokenize=tokenize, force=tokenize == "none")
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return Scores(bleu_score.score, chrf_score.score, str(bleu.get_signature()), str(chrf.get_signature()))
