"""Comparing systems on one test set: each one's scores with 95 % intervals and paired bootstrap and
approximate-randomisation p-values against the first (sacreBLEU's `PairedTest`), seed groups with
mean ± sd, and the sentences where each system gains or loses most."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformer_mt.evaluate.metrics import METRICS, NAMES, reference_streams, sacrebleu_metrics, term_metric

SIGNIFICANT = 0.05  # p below this: the difference from the first system is called significant


@dataclass
class SystemResult:
    """One system's score on one metric: the corpus score, the bootstrap mean and 95 % half-width,
    and (not for the first system) the p-values of its difference from the first."""

    score: float
    mean: float
    ci: float
    p_bootstrap: float | None = None
    p_randomization: float | None = None

    @property
    def significant(self) -> bool | None:
        """Whether both tests find the difference from the first system significant (None: the first)."""
        if self.p_bootstrap is None:
            return None
        return self.p_bootstrap < SIGNIFICANT and self.p_randomization < SIGNIFICANT


@dataclass
class Comparison:
    """Each system's results by metric (systems in the order given, the first the baseline), and
    the signatures of the tests."""

    names: list[str]
    results: dict[str, list[SystemResult]] = field(default_factory=dict)  # metric -> one per system, in order
    signatures: dict[str, str] = field(default_factory=dict)  # "<metric> bootstrap" / "<metric> randomization"


def paired_tests(systems: list[tuple[str, list[str]]], references: Sequence[str] | Sequence[Sequence[str]],
                 tokenize: str = "13a", n_bootstrap: int = 1000, n_trials: int = 10000,
                 metrics: Sequence[str] = METRICS, glossary=None, sources: Sequence[str] | None = None) -> Comparison:
    """sacreBLEU's paired bootstrap resampling (`n_bootstrap` resamples, which also give each
    system's 95 % interval) and approximate randomisation (`n_trials`) of every system against the
    first, on each metric, and on term accuracy with a `glossary` and the `sources`; seeded as
    sacreBLEU seeds them (`SACREBLEU_SEED`, default 12345). A system whose translations are the
    first's, line for line, differs by nothing: p = 1 (sacreBLEU counts no resample as at least as
    different, and would give its smallest p)."""
    from sacrebleu.significance import PairedTest

    comparison = Comparison([name for name, _ in systems])
    found = {}
    for test, samples in (("bs", n_bootstrap), ("ar", n_trials)):
        # Term accuracy reads other references (each sentence's terms): a test of its own.
        groups = [(sacrebleu_metrics(tokenize, metrics), reference_streams(references))]
        if glossary is not None:
            name, metric, streams = term_metric(glossary, sources)
            groups.append(({name: metric}, streams))
        for chosen, streams in groups:
            paired = PairedTest(systems, chosen, streams, test_type=test, n_samples=samples,
                                n_ar_confidence=-1 if test == "ar" else 0)
            signatures, scores = paired()
            # sacreBLEU names its results (BLEU, chrF2, chrF2++, TER): they come in the order asked.
            named = [key for key in scores if key != "System"]
            for metric, key in zip(chosen, named):
                found[(metric, test)] = scores[key]
                comparison.signatures[f"{metric} {'bootstrap' if test == 'bs' else 'randomization'}"] = \
                    str(signatures[key])
    for metric in [*metrics, *(["terms"] if glossary is not None else [])]:
        rows = []
        for i, (bootstrap, randomized) in enumerate(zip(found[(metric, "bs")], found[(metric, "ar")])):
            same = i > 0 and systems[i][1] == systems[0][1]
            rows.append(SystemResult(float(bootstrap.score), float(bootstrap.mean), float(bootstrap.ci),
                                     None if i == 0 else 1.0 if same else float(bootstrap.p_value),
                                     None if i == 0 else 1.0 if same else float(randomized.p_value)))
        comparison.results[metric] = rows
    return comparison


@dataclass(frozen=True)
class SeedGroup:
    """Systems trained with one config but for their seeds (and names): each metric's mean and
    sample standard deviation over them (sd None for a group of one)."""

    members: list[int]  # indices of the systems
    seeds: list[int | None]
    mean: dict[str, float]
    sd: dict[str, float | None]


def seed_groups(configs: list[dict | None], scores: dict[str, list[float]],
                ignored: tuple[str, ...] = ("seed", "name")) -> list[SeedGroup]:
    """Group systems whose configs (as `config_to_dict` gives them; None for a hypothesis file,
    a group of its own) differ in `ignored` keys at most, in the order first met."""
    from transformer_mt.config.schema import config_changes

    groups: list[list[int]] = []
    for i, config in enumerate(configs):
        home = None
        if config is not None:
            home = next((group for group in groups if configs[group[0]] is not None and not [
                key for key, _, _ in config_changes(configs[group[0]], config) if key not in ignored]), None)
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    result = []
    for members in groups:
        values = {metric: [scores[metric][i] for i in members] for metric in scores}
        result.append(SeedGroup(members, [configs[i].get("seed") if configs[i] else None for i in members],
                                {m: statistics.mean(v) for m, v in values.items()},
                                {m: statistics.stdev(v) if len(v) > 1 else None for m, v in values.items()}))
    return result


def config_differences(configs: list[dict | None]) -> list[list[tuple[str, object, object]]]:
    """Each system's config settings that differ from the first system's: (key, first's, its)."""
    from transformer_mt.config.schema import config_changes

    first = configs[0]
    return [config_changes(first, config) if first is not None and config is not None else [] for config in configs]


@dataclass(frozen=True)
class Segment:
    """A sentence where a system's sentence chrF differs most from the first system's."""

    line: int  # from 1
    gain: float  # the system's sentence chrF minus the first's
    hypothesis: str
    baseline: str
    reference: str


def winning_segments(hypotheses: list[str], baseline: list[str], references: Sequence[str] | Sequence[Sequence[str]],
                     count: int) -> tuple[list[Segment], list[Segment]]:
    """The `count` sentences where `hypotheses` beat `baseline` most by sentence chrF, and the
    `count` where the baseline beats them most (ties: the earlier line)."""
    streams = reference_streams(references)
    chrf = sacrebleu_metrics(names=("chrf",))["chrf"]
    segments = []
    for i, (hypothesis, base) in enumerate(zip(hypotheses, baseline)):
        refs = [stream[i] for stream in streams]
        gain = chrf.sentence_score(hypothesis, refs).score - chrf.sentence_score(base, refs).score
        segments.append(Segment(i + 1, gain, hypothesis, base, refs[0]))
    wins = sorted((s for s in segments if s.gain > 0), key=lambda s: (-s.gain, s.line))[:count]
    losses = sorted((s for s in segments if s.gain < 0), key=lambda s: (s.gain, s.line))[:count]
    return wins, losses


def metric_name(metric: str) -> str:
    """How tables name `metric`: BLEU, chrF, chrF++, TER."""
    return NAMES[metric]
