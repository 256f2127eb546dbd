"""What goes wrong in a set of translations, sentence by sentence: copies of the source, output left
untranslated or in another script, repeated n-gram loops, length-ratio outliers, numbers, URLs and
end punctuation that differ from the source, and chrF by source length."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

CHECKS = {  # name -> what it flags, as reports say it
    "copies": "copies of the source",
    "untranslated": "left untranslated",
    "wrong_script": "in another script than the references",
    "loops": "repeated n-gram loops",
    "length_outliers": "length ratio outliers",
    "numbers": "numbers differ from the source",
    "urls": "URLs differ from the source",
    "punctuation": "end punctuation differs from the source",
}
LENGTH_RATIO = (0.5, 2.0)  # hypothesis / reference characters outside this range: an outlier
BUCKETS = ((1, 5), (6, 10), (11, 20), (21, 40), (41, None))  # source words, both ends included

_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_URL = re.compile(r"(?:https?://|www\.)\S+|\b[\w.+-]+@[\w-]+\.[\w.-]+\b")
_CHARACTER_LOOP = re.compile(r"([^\W\d_]{1,4}?)\1{3,}")  # "hehehehe", "zzzz": a short piece 4 times or more
_END = {"?": "?", "？": "?", "!": "!", "！": "!", ".": ".", "。": ".", "…": "."}


def words(text: str) -> list[str]:
    """Lowercased words (letters and digits) of `text`."""
    return re.findall(r"\w+", text.lower())


def is_copy(source: str, hypothesis: str) -> bool:
    """The hypothesis is the source again (case, spaces and punctuation aside)."""
    return bool(words(hypothesis)) and words(hypothesis) == words(source)


def is_untranslated(source: str, hypothesis: str, reference: str) -> bool:
    """Not a copy, but most of the hypothesis's words (two or more, of letters) are source words
    that the reference does not use: left in the source language."""
    hyp = [w for w in words(hypothesis) if not w.isdigit()]
    src, ref = set(words(source)), set(words(reference))
    kept = [w for w in hyp if w in src and w not in ref]
    return not is_copy(source, hypothesis) and len(kept) >= 2 and len(kept) > len(hyp) / 2


def script(text: str) -> str | None:
    """The Unicode script most of the letters of `text` are in (LATIN, CYRILLIC, CJK, ...), or None."""
    counts = Counter(unicodedata.name(c, "?").split()[0] for c in text if c.isalpha())
    return counts.most_common(1)[0][0] if counts else None


def has_loop(hypothesis: str) -> bool:
    """A word n-gram (n = 1..4) three times in a row, or a piece of a word four times in a row."""
    tokens = hypothesis.split()
    for n in range(1, 5):
        for i in range(len(tokens) - 3 * n + 1):
            if tokens[i:i + n] == tokens[i + n:i + 2 * n] == tokens[i + 2 * n:i + 3 * n]:
                return True
    return bool(_CHARACTER_LOOP.search(hypothesis))


def length_ratio(hypothesis: str, reference: str) -> float | None:
    """Characters (spaces aside) of the hypothesis over the reference's; None for an empty reference."""
    ref = len("".join(reference.split()))
    return len("".join(hypothesis.split())) / ref if ref else None


def numbers(text: str) -> Counter:
    """The numbers in `text`, digits only (1,000 and 1.000 alike: separators differ by language)."""
    return Counter(re.sub(r"\D", "", n) for n in _NUMBER.findall(text))


def urls(text: str) -> Counter:
    """The URLs and e-mail addresses in `text`, without a trailing full stop or comma."""
    return Counter(u.rstrip(".,;:!?)") for u in _URL.findall(text))


def end_punctuation(text: str) -> str | None:
    """The kind of mark `text` ends with: "?", "!", "." (quotes and brackets aside), or None."""
    stripped = text.rstrip().rstrip("\"'»”’)]")
    return _END.get(stripped[-1:]) if stripped else None


@dataclass
class Diagnostics:
    """Each check's flagged sentences (line numbers from 1), and chrF by source length."""

    sentences: int
    flagged: dict[str, list[int]] = field(default_factory=dict)  # check name (`CHECKS`) -> lines
    buckets: list[tuple[str, int, float]] = field(default_factory=list)  # (label, sentences, chrF)

    def rates(self) -> dict[str, float]:
        """Each check's share of the sentences (0..1)."""
        return {name: len(lines) / self.sentences if self.sentences else 0.0 for name, lines in self.flagged.items()}

    def report(self, examples: int = 5) -> dict:
        """For JSON: each check's count and its first `examples` lines, and the buckets."""
        return {"sentences": self.sentences,
                **{name: {"count": len(lines), "lines": lines[:examples]} for name, lines in self.flagged.items()},
                "chrf_by_source_length": [{"source_words": label, "sentences": n, "chrf": round(chrf, 2)}
                                          for label, n, chrf in self.buckets]}

    def lines(self, examples: int = 5) -> list[str]:
        """The diagnostics as lines of text: each check's count and first lines, then the buckets."""
        out = []
        for name, lines in self.flagged.items():
            shown = f"  (lines {', '.join(map(str, lines[:examples]))}{', ...' if len(lines) > examples else ''})" \
                if lines else ""
            out.append(f"{CHECKS[name]:<42}{len(lines):>5}{shown}")
        out.append("chrF by source length: " + ", ".join(f"{label} words {chrf:.1f} ({n})"
                                                         for label, n, chrf in self.buckets))
        return out

    def examples(self, sources: list[str], hypotheses: list[str], count: int = 2) -> str:
        """The first `count` flagged sentences of each check, as TensorBoard text (markdown)."""
        blocks = []
        for name, lines in self.flagged.items():
            for line in lines[:count]:
                blocks.append(f"**{CHECKS[name]}**, line {line}\n\n    source:     {sources[line - 1]}\n"
                              f"    hypothesis: {hypotheses[line - 1]}")
        return "\n\n".join(blocks)


def diagnose(sources: list[str], hypotheses: list[str], references: list[str]) -> Diagnostics:
    """Run every check over aligned sources, hypotheses and references (one reference each)."""
    import sacrebleu

    result = Diagnostics(len(hypotheses), {name: [] for name in CHECKS})
    scripts = Counter(script(ref) for ref in references)
    scripts.pop(None, None)
    target_script = scripts.most_common(1)[0][0] if scripts else None
    low, high = LENGTH_RATIO
    for line, (src, hyp, ref) in enumerate(zip(sources, hypotheses, references), start=1):
        ratio = length_ratio(hyp, ref)
        found = {
            "copies": is_copy(src, hyp),
            "untranslated": is_untranslated(src, hyp, ref),
            "wrong_script": target_script is not None and script(hyp) not in (None, target_script),
            "loops": has_loop(hyp),
            "length_outliers": ratio is not None and not low <= ratio <= high,
            "numbers": numbers(src) != numbers(hyp),
            "urls": urls(src) != urls(hyp),
            "punctuation": end_punctuation(src) != end_punctuation(hyp),
        }
        for name, flagged in found.items():
            if flagged:
                result.flagged[name].append(line)
    chrf = sacrebleu.metrics.CHRF()
    for first, last in BUCKETS:
        members = [i for i, src in enumerate(sources)
                   if first <= len(src.split()) and (last is None or len(src.split()) <= last)]
        if members:
            score = chrf.corpus_score([hypotheses[i] for i in members], [[references[i] for i in members]]).score
            label = f"{first}-{last}" if last is not None else f"{first}+"
            result.buckets.append((label, len(members), score))
    return result
