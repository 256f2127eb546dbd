"""Term accuracy: the share of a glossary's target terms that the translations contain, counted over
the sentences whose source holds the term's source term (exact match of the whole term: the WMT 2021
terminology task's exact-match accuracy). A sacreBLEU metric, so that its bootstrap intervals and
paired tests are sacreBLEU's, as BLEU's and chrF's are; its "references" are each sentence's target
terms (`term_references`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sacrebleu.metrics.base import Metric, Score, Signature

from transformer_mt.data.glossary import Glossary, holds_term

TERM_SEPARATOR = "\t"  # never inside a term: the glossary's own field separator


def term_references(glossary: Glossary, sources: Sequence[str]) -> list[str]:
    """Each source's target terms (`Glossary.targets`), tab-joined ("" for none)."""
    return [TERM_SEPARATOR.join(glossary.targets(source)) for source in sources]


class TermAccuracySignature(Signature):
    """sacreBLEU's signature, with how terms are matched: `case:insensitive` or `case:sensitive`."""

    def __init__(self, args: dict):
        super().__init__(args)
        self._abbr.update(case="c")
        self.info.update(case="sensitive" if args["case_sensitive"] else "insensitive")


class TermAccuracy(Metric):
    """Found terms ÷ terms, in percent; a sentence's statistics are [found, terms]."""

    _SIGNATURE_TYPE = TermAccuracySignature

    def __init__(self, case_sensitive: bool = False):
        super().__init__()
        self.case_sensitive = case_sensitive

    def _preprocess_segment(self, sent: str) -> str:
        return sent

    def _extract_reference_info(self, refs: Sequence[str]) -> dict:
        return {"terms": [term for ref in refs for term in ref.split(TERM_SEPARATOR) if term]}

    def _compute_segment_statistics(self, hypothesis: str, ref_kwargs: dict) -> list[int]:
        terms = ref_kwargs["terms"]
        return [sum(holds_term(hypothesis, term, self.case_sensitive) for term in terms), len(terms)]

    def _compute_score_from_stats(self, stats) -> Score:
        found, total = stats
        return Score("Term accuracy", 100.0 * float(found) / float(total) if total else 0.0)

    def _aggregate_and_compute(self, stats) -> Score:
        return self._compute_score_from_stats(np.sum(np.asarray(stats, dtype=float).reshape(-1, 2), axis=0))


def count_terms(glossary: Glossary, sources: Sequence[str]) -> int:
    """How many target terms the sources call for: term accuracy's denominator."""
    return sum(len(glossary.targets(source)) for source in sources)
