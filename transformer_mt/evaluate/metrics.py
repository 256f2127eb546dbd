"""Corpus-level scores of translations with sacreBLEU: BLEU, chrF, chrF++ and TER with their
signatures, term accuracy against a glossary, and 95 % confidence intervals by sacreBLEU's
bootstrap resampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

METRICS = ("bleu", "chrf", "chrf++", "ter")  # TER is an error rate: lower is better
NAMES = {"bleu": "BLEU", "chrf": "chrF", "chrf++": "chrF++", "ter": "TER",  # as sacreBLEU prints them
         "terms": "Term accuracy"}  # with a glossary: evaluate/terms.py


@dataclass(frozen=True)
class MetricScore:
    """One metric's corpus score; with bootstrap resampling, the resamples' mean and the half-width
    of their 95 % interval (sacreBLEU's `μ ± ci`)."""

    value: float
    signature: str
    mean: float | None = None
    ci: float | None = None

    @property
    def interval(self) -> tuple[float, float] | None:
        """The 95 % confidence interval, (low, high), or None without resampling."""
        return None if self.mean is None else (self.mean - self.ci, self.mean + self.ci)

    def shown(self, name: str) -> str:
        """`BLEU = 31.20 (95% CI [29.84, 32.57])`, as the CLI prints it (a bound may be negative)."""
        line = f"{NAMES[name]} = {self.value:.2f}"
        return line + (f" (95% CI [{self.interval[0]:.2f}, {self.interval[1]:.2f}])" if self.interval else "")


@dataclass(frozen=True)
class Scores:
    """Each metric's `MetricScore`, by name (`METRICS`)."""

    by_metric: dict[str, MetricScore] = field(default_factory=dict)

    def __getitem__(self, name: str) -> MetricScore:
        return self.by_metric[name]

    @property
    def bleu(self) -> float:
        return self.by_metric["bleu"].value

    @property
    def chrf(self) -> float:
        return self.by_metric["chrf"].value

    @property
    def bleu_signature(self) -> str:
        return self.by_metric["bleu"].signature

    @property
    def chrf_signature(self) -> str:
        return self.by_metric["chrf"].signature

    def report(self) -> dict:
        """For JSON: `<metric>` (2 decimals), `<metric>_signature`, and `<metric>_ci95` [low, high] when resampled."""
        report = {}
        for name, result in self.by_metric.items():
            report[name] = round(result.value, 2)
            if result.interval:
                report[f"{name}_ci95"] = [round(bound, 2) for bound in result.interval]
            report[f"{name}_signature"] = result.signature
        return report


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


def sacrebleu_metrics(tokenize: str = "13a", names: Sequence[str] = METRICS) -> dict:
    """sacreBLEU's metric objects by name: BLEU with `tokenize` (`none` scores pre-tokenized text on
    purpose, without the "detokenize" warning), chrF, chrF++ (word bigrams too) and TER."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    build = {"bleu": lambda: BLEU(tokenize=tokenize, force=tokenize == "none"), "chrf": CHRF,
             "chrf++": lambda: CHRF(word_order=2), "ter": TER}
    return {name: build[name]() for name in names}


def term_metric(glossary, sources: Sequence[str]) -> tuple[str, object, list[list[str]]]:
    """Term accuracy's name, sacreBLEU metric and reference stream (each source's target terms) for
    a `data.glossary.Glossary` over `sources`."""
    from transformer_mt.evaluate.terms import TermAccuracy, term_references

    return "terms", TermAccuracy(glossary.case_sensitive), [term_references(glossary, sources)]


def reference_streams(references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One reference per hypothesis (a list of strings), or several such lists, as sacreBLEU's streams."""
    if not references or isinstance(references[0], str):
        return [list(references)]
    return [list(stream) for stream in references]


def score(hypotheses: list[str], references: Sequence[str] | Sequence[Sequence[str]], tokenize: str = "13a",
          n_bootstrap: int = 1, metrics: Sequence[str] = METRICS, glossary=None,
          sources: Sequence[str] | None = None) -> Scores:
    """`metrics` of detokenised hypotheses against one reference each, or several reference lists
    (sacreBLEU defaults); with a `glossary` and the `sources`, term accuracy (`terms`) too, when
    a source holds a term.
    `n_bootstrap` > 1: each score's 95 % interval from that many bootstrap resamples, seeded as
    sacreBLEU seeds them (`SACREBLEU_SEED`, default 12345)."""
    streams = reference_streams(references)
    chosen = [(name, metric, streams) for name, metric in sacrebleu_metrics(tokenize, metrics).items()]
    terms = term_metric(glossary, sources) if glossary is not None else None
    if terms is not None and any(terms[2][0]):  # some sentence calls for a term
        chosen.append(terms)
    results = {}
    for name, metric, streams in chosen:
        if n_bootstrap <= 1:
            results[name] = MetricScore(metric.corpus_score(hypotheses, streams).score, str(metric.get_signature()))
            continue
        # What `corpus_score(..., n_bootstrap=N)` does, but for its interval's mean, which fails
        # (statistics.mean) when resamples score as both float and numpy float32.
        import numpy as np
        from sacrebleu.significance import _bootstrap_resample, estimate_ci

        stats = metric._extract_corpus_statistics(hypotheses, streams)
        value = metric._aggregate_and_compute(stats).score
        metric.n_bootstrap = n_bootstrap  # both named in the signature, as corpus_score does
        metric.seed, resamples = _bootstrap_resample(stats, metric, n_bootstrap)
        mean, ci = estimate_ci(np.array([float(r.score) for r in resamples]))
        results[name] = MetricScore(float(value), str(metric.get_signature()), float(mean), float(ci))
    return Scores(results)


def pair_scores(sources: Sequence[str], hypotheses: list[str], references: Sequence[str] | Sequence[Sequence[str]],
                src_lang: str, tokenize: str = "13a") -> dict[str, dict]:
    """BLEU and chrF of each language pair of a multilingual set (against one reference each, or
    several reference lists), its sources grouped by their leading target-language tag (`en-ita`
    for `>>ita<<`), by pair name: {pair: {sentences, bleu, chrf}}; {} when no source begins with a tag."""
    from transformer_mt.data.tokenization import leading_tag

    streams = reference_streams(references)
    rows: dict[str, list[int]] = {}
    for i, source in enumerate(sources):
        tag = leading_tag(source)[0]  # `>>xxx<<` or None
        if tag is not None:
            rows.setdefault(f"{src_lang}-{tag[2:-2]}", []).append(i)
    pairs = {}
    for pair, own in sorted(rows.items()):
        scores = score([hypotheses[i] for i in own], [[stream[i] for i in own] for stream in streams], tokenize,
                       metrics=("bleu", "chrf"))
        pairs[pair] = {"sentences": len(own), "bleu": round(scores.bleu, 2), "chrf": round(scores.chrf, 2)}
    return pairs


def pair_line(pairs: dict[str, dict]) -> str:
    """Per-pair scores for a log line: `en-fra BLEU 12.30 chrF 40.10 (50); en-ita ...`."""
    return "; ".join(f"{pair} BLEU {s['bleu']:.2f} chrF {s['chrf']:.2f} ({s['sentences']})" for pair, s in pairs.items())
