"""`data.filters`: rules that clean a corpus as it is read, each over a chunk of pairs at a time
(Arrow's RE2 regexes over the whole chunk where they can), and the pairs each removed, written for reading."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transformer_mt.config.schema import DataConfig, FilterEntry
from transformer_mt.core.errors import DataError

REMOVED_DIR = "removed"  # in corpus_cache/: `{split}.{filter}.tsv`, the pairs each filter removed
MAX_REMOVED_LINES = 10_000  # per file
# Kana and CJK ideographs, one word a character.
UNSPACED = "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\\x{20000}-\\x{2fa1f}]"
CONTROL = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\x{fffd}]"  # control characters (not tab or newlines), U+FFFD
MARKUP = r"<[A-Za-z!/][^<>]*>|&(?:#[0-9]+|#[xX][0-9A-Fa-f]+|[A-Za-z]+);"  # tags, comments, entities
URL_ONLY = r"^\s*(?:(?:https?|ftp)://\S+|www\.\S+|[^\s@]+@[^\s@]+\.[A-Za-z]{2,})\s*$"
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")  # 1,000.5 and 1.000,5 alike: compared without separators
# Each language's script(s) as RE2 names `characters` checks (ISO 639-1 codes).
SCRIPTS = {
    **dict.fromkeys("af ca cs cy da de en eo es et eu fi fr ga gl hr hu id is it lt lv ms mt nl no nb nn pl pt ro sk "
                    "sl sq sv sw tl tr vi".split(), "Latin"),
    **dict.fromkeys("be bg kk ky mk mn ru uk".split(), "Cyrillic"), "sr": "Cyrillic+Latin",
    "el": "Greek", "ar": "Arabic", "fa": "Arabic", "ur": "Arabic", "he": "Hebrew", "hi": "Devanagari",
    "mr": "Devanagari", "ne": "Devanagari", "bn": "Bengali", "ta": "Tamil", "te": "Telugu", "th": "Thai",
    "ka": "Georgian", "hy": "Armenian", "zh": "Han", "ja": "Han+Hiragana+Katakana", "ko": "Hangul+Han"}


@dataclass(frozen=True)
class FilterCount:
    """What one filter removed from one split: `removed` of the `seen` pairs that reached it."""

    filter: str  # its label: the name, or `name[i]` when `data.filters` names it twice
    split: str
    removed: int
    seen: int
    file: str  # the removed pairs' file, in corpus_cache/


class Filter:
    """One filter of `data.filters`: `scan` a chunk of pairs, then `removed` of the rows still kept."""

    def __init__(self, entry: FilterEntry, label: str, cfg: DataConfig):
        self.entry, self.label, self.splits = entry, label, entry.splits
        self.uses_held_out = False  # whether `removed` needs the validation and test pairs' scans

    def option(self, name: str, default):
        """The entry's option `name`, or the filter's default when unset."""
        value = getattr(self.entry, name)
        return default if value is None else value

    def scan(self, pairs: Pairs) -> np.ndarray:
        """(N,) bool: the pairs of the chunk this filter removes."""
        raise NotImplementedError

    def removed(self, scanned: np.ndarray, held_out: np.ndarray | None = None) -> np.ndarray:
        """(M,) bool: which of the rows still kept this filter removes, from their `scan` values in row order
        (`held_out`: with `uses_held_out`, the scan values of the validation and test pairs, when cleaning the
        training split)."""
        return scanned.astype(bool)


def build_filters(cfg: DataConfig) -> list[Filter]:
    """The filters of `cfg.filters`, in order; a language or script they cannot check is a DataError."""
    names = [entry.name for entry in cfg.filters]
    return [KINDS[entry.name](entry, entry.name if names.count(entry.name) == 1 else f"{entry.name}[{i}]", cfg)
            for i, entry in enumerate(cfg.filters)]


def base_code(lang: str) -> str:
    """`pt` of `pt_BR`, `pt-BR` or `PT`: the language of a code with its region."""
    return re.split("[-_]", lang.lower())[0]


def _pc():
    import pyarrow.compute as pc

    return pc


def counts(texts, pattern: str) -> np.ndarray:
    """(N,) int64: the matches of RE2 `pattern` in each string of an Arrow array."""
    return _pc().count_substring_regex(texts, pattern).to_numpy(zero_copy_only=False).astype(np.int64)


def matches(texts, pattern: str) -> np.ndarray:
    """(N,) bool: the strings of an Arrow array where RE2 `pattern` matches."""
    return _pc().match_substring_regex(texts, pattern).to_numpy(zero_copy_only=False)


def word_counts(texts) -> np.ndarray:
    """(N,) int64: `count_words` of each string of an Arrow array (Arrow's whitespace is `str.split`'s)."""
    pc = _pc()
    spaced = pc.utf8_trim_whitespace(pc.replace_substring_regex(texts, UNSPACED, " "))
    words = pc.list_value_length(pc.utf8_split_whitespace(spaced)).to_numpy(zero_copy_only=False).astype(np.int64)
    words[lengths(spaced, "characters") == 0] = 0  # Arrow splits "" into [""]; trimmed, no other empty words
    return counts(texts, UNSPACED) + words


def length_without(texts, pattern: str) -> np.ndarray:
    """(N,) int64: the characters of each string outside RE2 character class `pattern` (dropping its runs is
    several times faster than counting the others one match at a time)."""
    return lengths(_pc().replace_substring_regex(texts, pattern + "+", ""), "characters")


def lengths(texts, unit: str) -> np.ndarray:
    """(N,) int64: words (as `max_words` counts them) or characters of each string."""
    if unit == "words":
        return word_counts(texts)
    return _pc().utf8_length(texts).to_numpy(zero_copy_only=False).astype(np.int64)


class Pairs:
    """A chunk of pairs, `src` and `tgt` Arrow string arrays without nulls, and what several filters measure
    of its sides, each computed once (`side`: 0, the source, or 1, the target)."""

    def __init__(self, src, tgt):
        self.src, self.tgt = src, tgt
        self._measured: dict[tuple[str, int], object] = {}

    def __len__(self) -> int:
        return len(self.src)

    def _once(self, name: str, side: int, compute):
        if (name, side) not in self._measured:
            self._measured[name, side] = compute((self.src, self.tgt)[side])
        return self._measured[name, side]

    def words(self, side: int):
        """Arrow list array: each string's words (`str.split`'s; "" for a blank string)."""
        pc = _pc()
        return self._once("words", side, lambda texts: pc.utf8_split_whitespace(pc.utf8_trim_whitespace(texts)))

    def visible(self, side: int) -> np.ndarray:
        """(N,) int64: each string's characters but whitespace."""
        return self._once("visible", side, lambda _: lengths(_pc().binary_join(self.words(side), ""), "characters"))

    def lengths(self, unit: str) -> tuple[np.ndarray, np.ndarray]:
        """Both sides' `lengths` in `unit`, words or characters."""
        def count(side: int):
            return lambda texts: self._word_counts(side, texts) if unit == "words" else lengths(texts, unit)

        return tuple(self._once(f"{unit} counted", side, count(side)) for side in (0, 1))

    def _word_counts(self, side: int, texts) -> np.ndarray:
        if _pc().any(_pc().match_substring_regex(texts, UNSPACED)).as_py():
            return word_counts(texts)
        words = _pc().list_value_length(self.words(side)).to_numpy(zero_copy_only=False).astype(np.int64)
        words[self.visible(side) == 0] = 0
        return words

    def lowered(self, side: int):
        """The strings lowercased, with single spaces and none around: what `copies` compares."""
        return self._once("lowered", side, lambda _: _pc().utf8_lower(_pc().binary_join(self.words(side), " ")))

    def normalized(self, side: int):
        """`lowered`, punctuation and symbols dropped: what `dedup` compares."""
        pc = _pc()
        dropped = pc.replace_substring_regex(self.lowered(side), r"[\p{P}\p{S}]+", "")
        return pc.utf8_trim_whitespace(pc.replace_substring_regex(dropped, " {2,}", " "))


class Dedup(Filter):
    """A pair equal to an earlier kept pair (its source alone with `source_only`); with `held_out`, a training
    pair equal to a validation or test pair."""

    def __init__(self, entry: FilterEntry, label: str, cfg: DataConfig):
        super().__init__(entry, label, cfg)
        self.uses_held_out = self.option("held_out", False)

    def scan(self, pairs: Pairs) -> np.ndarray:
        pc = _pc()
        src, tgt = (pairs.normalized(0), pairs.normalized(1)) if self.option("normalize", True) else (pairs.src,
                                                                                                       pairs.tgt)
        keys = src if self.option("source_only", False) else pc.binary_join_element_wise(src, tgt, "\t")
        return np.fromiter((hash(key) for key in keys.to_pylist()), dtype=np.int64, count=len(keys))

    def removed(self, scanned: np.ndarray, held_out: np.ndarray | None = None) -> np.ndarray:
        out = np.ones(len(scanned), dtype=bool)
        out[np.unique(scanned, return_index=True)[1]] = False  # each key's first row stays
        if held_out is not None:
            out |= np.isin(scanned, held_out)
        return out


class Length(Filter):
    """A side shorter than `min_length` or longer than `max_length`."""

    def scan(self, pairs: Pairs) -> np.ndarray:
        unit = self.option("unit", "words")
        low, high = self.option("min_length", 1), self.option("max_length", 100 if unit == "words" else 1000)
        n_src, n_tgt = pairs.lengths(unit)
        return (np.minimum(n_src, n_tgt) < low) | (np.maximum(n_src, n_tgt) > high)


class LengthRatio(Filter):
    """The longer side more than `max_ratio` times the shorter."""

    def scan(self, pairs: Pairs) -> np.ndarray:
        n_src, n_tgt = pairs.lengths(self.option("unit", "words"))
        return np.maximum(n_src, n_tgt) > self.option("max_ratio", 3.0) * np.maximum(np.minimum(n_src, n_tgt), 1)


class Copies(Filter):
    """A target equal or nearly equal to its source: the Indel similarity of the normalised sides,
    2 x their longest common subsequence / their lengths (rapidfuzz's `ratio`, every core)."""

    def scan(self, pairs: Pairs) -> np.ndarray:
        from rapidfuzz.distance import Indel
        from rapidfuzz.process import cpdist

        threshold = self.option("max_similarity", 0.9)
        src, tgt = pairs.lowered(0), pairs.lowered(1)
        n_src, n_tgt = lengths(src, "characters"), lengths(tgt, "characters")
        # The ratio is at most 2·min / (sum of the lengths): only pairs of close lengths need it.
        out = np.zeros(len(src), dtype=bool)
        candidates = np.flatnonzero(2 * np.minimum(n_src, n_tgt) >= threshold * np.maximum(n_src + n_tgt, 1))
        if len(candidates):
            similarity = cpdist(src.take(candidates).to_pylist(), tgt.take(candidates).to_pylist(),
                                scorer=Indel.normalized_similarity, workers=-1)
            out[candidates] = similarity >= threshold - 1e-9  # 9/10 computed as 0.8999...
        return out


class Language(Filter):
    """A side identified (py3langid, all its languages) as another language with `min_confidence` or more."""

    def __init__(self, entry: FilterEntry, label: str, cfg: DataConfig):
        super().__init__(entry, label, cfg)
        try:
            self.identifier = _identifier()
        except ImportError:
            raise DataError(f"data.filters: the {label} filter needs py3langid: pip install 'transformer-mt[langid]'") \
                from None
        self.languages = self.option("languages", (base_code(cfg.src_lang), base_code(cfg.tgt_lang)))
        known = set(self.identifier.nb_classes)
        for code in self.languages:
            if code not in known:
                source = f"{label}.languages" if entry.languages else "src_lang/tgt_lang"
                raise DataError(f"data.filters: the {label} filter cannot identify {code!r} (from {source}); set its "
                                f"languages to two of the ISO 639-1 codes py3langid knows, e.g. [en, it]")

    def scan(self, pairs: Pairs) -> np.ndarray:
        min_confidence = self.option("min_confidence", 0.5)
        out = np.zeros(len(pairs), dtype=bool)
        for side, lang in zip((pairs.src, pairs.tgt), self.languages):
            for i, text in enumerate(side.to_pylist()):
                if not out[i]:
                    found, probability = self.identifier.classify(text)
                    out[i] = found != lang and probability >= min_confidence
        return out


@functools.cache
def _identifier():
    """py3langid's identifier with probabilities, loaded once (a second)."""
    from py3langid import langid

    return langid.LanguageIdentifier.from_model_file(langid.MODEL_FILE, norm_probs=True)


class Characters(Filter):
    """A side with a control character or U+FFFD, too few letters, or too few letters in its script."""

    def __init__(self, entry: FilterEntry, label: str, cfg: DataConfig):
        super().__init__(entry, label, cfg)
        scripts = self.option("scripts", tuple(SCRIPTS.get(base_code(lang)) for lang in (cfg.src_lang, cfg.tgt_lang)))
        if None in scripts:
            lang = (cfg.src_lang, cfg.tgt_lang)[scripts.index(None)]
            raise DataError(f"data.filters: the {label} filter knows no script for the language {lang!r}; set its "
                            "scripts, e.g. scripts: [Latin, Cyrillic]")
        self.patterns = ["".join(rf"\p{{{name}}}" for name in side.split("+")) for side in scripts]  # inside [...]
        import pyarrow as pa

        for side, pattern in zip(scripts, self.patterns):
            try:
                counts(pa.array([""]), f"[{pattern}]")
            except pa.ArrowInvalid:
                raise DataError(f"data.filters: {label}.scripts: {side!r} is not a Unicode script name (e.g. Latin, "
                                "Cyrillic, Greek, Arabic, Han; several joined by +)") from None

    def scan(self, pairs: Pairs) -> np.ndarray:
        pc = _pc()
        out = np.zeros(len(pairs), dtype=bool)
        for i, (side, script) in enumerate(zip((pairs.src, pairs.tgt), self.patterns)):
            marked = pc.replace_substring_regex(side, r"[^\p{L}\p{M}]+", "")  # its letters and their marks
            letters = pc.replace_substring_regex(marked, r"\p{M}+", "")
            n_letters = lengths(letters, "characters")
            out |= matches(side, CONTROL)
            out |= lengths(marked, "characters") < self.option("min_letters", 0.5) * pairs.visible(i)
            out |= length_without(letters, f"[^{script}]") < self.option("min_script", 0.9) * n_letters
        return out


class Numbers(Filter):
    """Sides with different numbers (digits compared without their `.` and `,` separators)."""

    def scan(self, pairs: Pairs) -> np.ndarray:
        src, tgt = pairs.src, pairs.tgt
        out = np.zeros(len(src), dtype=bool)
        digits = np.flatnonzero(matches(src, r"\p{Nd}") | matches(tgt, r"\p{Nd}"))
        for i, s, t in zip(digits, src.take(digits).to_pylist(), tgt.take(digits).to_pylist()):
            out[i] = _numbers(s) != _numbers(t)
        return out


def _numbers(text: str) -> set[str]:
    return {re.sub("[.,]", "", number) for number in NUMBER.findall(text)}


class Html(Filter):
    """Markup (tags, comments, entities) on a side; with `urls`, a side that is a URL or e-mail address alone."""

    def scan(self, pairs: Pairs) -> np.ndarray:
        src, tgt = pairs.src, pairs.tgt
        out = matches(src, MARKUP) | matches(tgt, MARKUP)
        if self.option("urls", True):
            out |= matches(src, URL_ONLY) | matches(tgt, URL_ONLY)
        return out


KINDS = {"dedup": Dedup, "length": Length, "length_ratio": LengthRatio, "copies": Copies, "language": Language,
         "characters": Characters, "numbers": Numbers, "html": Html}


def apply_filters(filters: list[Filter], split: str, scans: list[np.ndarray], selected: np.ndarray,
                  held_out: list[np.ndarray | None] | None = None) -> tuple[np.ndarray,
                                                                            list[tuple[Filter, np.ndarray, int]]]:
    """`selected` (N,) bool rows of a split less what each filter for `split` removes, in order (`held_out`:
    for the training split, each filter's scan values of the validation and test pairs, None where unused)
    -> (the rows kept, [(filter, the row numbers it removed, the rows it saw)])."""
    kept = selected.copy()
    removed = []
    for i, (one, scanned) in enumerate(zip(filters, scans)):
        if split not in one.splits:
            continue
        rows = np.flatnonzero(kept)
        gone = rows[one.removed(scanned[rows], held_out[i] if held_out else None)]
        kept[gone] = False
        removed.append((one, gone, len(rows)))
    return kept, removed


def write_removed(batches, rows: np.ndarray, path: Path) -> None:
    """The first `MAX_REMOVED_LINES` of `rows` (sorted) of a split's record `batches` as `source<TAB>target` lines."""
    import pyarrow as pa

    rows = rows[:MAX_REMOVED_LINES]
    start = 0
    with open(path, "w", encoding="utf-8") as out:
        for batch in batches:
            wanted = rows[np.searchsorted(rows, start):np.searchsorted(rows, start + batch.num_rows)] - start
            start += batch.num_rows
            if len(wanted):
                taken = batch.take(pa.array(wanted))
                for src, tgt in zip(taken.column("src").to_pylist(), taken.column("tgt").to_pylist()):
                    out.write(f"{_one_line(src)}\t{_one_line(tgt)}\n")


def _one_line(text: str) -> str:
    return re.sub(r"[\t\r\n]", " ", text)


def removed_examples(path: Path, n: int = 3) -> list[tuple[str, str]]:
    """The first `n` pairs of a removed-pairs file (none when it is missing)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for _, line in zip(range(n), f)]
    except OSError:
        return []
    return [tuple(line.split("\t", 1)) for line in lines]


def filter_counts(manifest: dict) -> tuple[FilterCount, ...]:
    """The counts a corpus manifest records (none before `data.filters`)."""
    return tuple(FilterCount(**entry) for entry in manifest.get("filtered", ()))


def counts_record(counts_: list[FilterCount]) -> list[dict]:
    """`FilterCount`s as the manifest keeps them."""
    return [dataclasses.asdict(count) for count in counts_]
