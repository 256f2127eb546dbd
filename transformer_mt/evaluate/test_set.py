"""One test-set evaluation, for training's final test and `tmt evaluate`: translate the sources,
score the hypotheses against one or more references (with bootstrap intervals), and each language
pair's of a multilingual set, optionally COMET and diagnostics against the first reference, and write
the hypotheses, one a line."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformer_mt.core.files import write_lines
from transformer_mt.evaluate.comet import Comet, CometScore
from transformer_mt.evaluate.diagnostics import Diagnostics, diagnose
from transformer_mt.evaluate.metrics import Scores, pair_scores, score


@dataclass(frozen=True)
class SetEvaluation:
    """What `evaluate_test_set` measured and wrote."""

    hypotheses: list[str]
    scores: Scores
    output: Path  # the hypotheses file written
    seconds: float  # translating, scoring and writing
    comet: CometScore | None = None
    diagnostics: Diagnostics | None = None
    pairs: dict[str, dict] = field(default_factory=dict)  # `metrics.pair_scores`: {} without target-language tags


def evaluate_test_set(translate: Callable[[list[str]], list[str]], sources: list[str],
                      references: Sequence[Sequence[str]], output: Path, *, tokenize: str, n_bootstrap: int,
                      src_lang: str, comet: Comet | None = None, device=None,
                      diagnostics: bool = False, glossary=None) -> SetEvaluation:
    """Translate `sources` with `translate` (a `Translator`'s, or training's model), score them
    against each list of `references` (sacreBLEU's `tokenize`; intervals from `n_bootstrap` resamples
    when over 1), and BLEU and chrF of each language pair when sources begin with target-language tags
    (named from `src_lang`), and write them to `output`; with `comet` (scored on `device`) and
    `diagnostics`, those too, against the first reference; with a `glossary`, term accuracy."""
    started = time.perf_counter()
    hypotheses = translate(sources)
    scores = score(hypotheses, references, tokenize=tokenize, n_bootstrap=n_bootstrap, glossary=glossary,
                   sources=sources)
    pairs = pair_scores(sources, hypotheses, references, src_lang, tokenize)
    write_lines(output, hypotheses)
    seconds = time.perf_counter() - started
    comet_score = comet.score(sources, hypotheses, references[0], device=device) if comet is not None else None
    found = diagnose(sources, hypotheses, references[0]) if diagnostics else None
    return SetEvaluation(hypotheses, scores, output, seconds, comet_score, found, pairs)
