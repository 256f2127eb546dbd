"""A glossary of terms (source term TAB target term, a line each) and which of its terms a source
sentence holds: `read_glossary(path, case) -> Glossary`, `Glossary.matches(line) -> [(source, target)]`.
Decoding forces the target terms of a sentence's matches (`tmt translate --glossary`); term accuracy
can count them. Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.core.errors import DataError

GLOSSARY_CASES = ("insensitive", "sensitive")  # the first is the default


@dataclass(frozen=True)
class Term:
    """One glossary entry and the line (from 1) of the file it came from."""

    source: str
    target: str
    line: int


@dataclass(frozen=True)
class Glossary:
    """Terms read from `path`; source terms match whole words (Unicode word boundaries, any run of
    spaces between their words), letter case ignored unless `case_sensitive`."""

    path: Path
    terms: tuple[Term, ...]
    case_sensitive: bool = False

    def __post_init__(self):
        # Longest first: at one place, "New York City" wins over "New York".
        alternatives = sorted({_pattern(term.source) for term in self.terms}, key=len, reverse=True)
        pattern = rf"(?<!\w)(?:{'|'.join(alternatives)})(?!\w)" if alternatives else r"(?!)"
        object.__setattr__(self, "_regex", re.compile(pattern, 0 if self.case_sensitive else re.IGNORECASE))
        object.__setattr__(self, "_by_key", {self._key(term.source): term for term in self.terms})

    def _key(self, text: str) -> str:
        words = " ".join(text.split())
        return words if self.case_sensitive else words.casefold()

    def matches(self, source_line: str) -> list[tuple[str, str]]:
        """The (source term, target term) pairs whose source term occurs in `source_line`, as the
        glossary spells them, in order of first occurrence, each once. Matches do not overlap: where
        several terms start at one place, the longest wins."""
        found: dict[str, Term] = {}
        for match in self._regex.finditer(source_line):
            term = self._by_key.get(self._key(match.group()))
            if term is None:  # a case-folded spelling that IGNORECASE matches but casefold() maps elsewhere
                term = next(t for t in self.terms if re.fullmatch(_pattern(t.source), match.group(), re.IGNORECASE))
            found.setdefault(term.source, term)
        return [(term.source, term.target) for term in found.values()]

    def targets(self, source_line: str) -> list[str]:
        """The target terms a translation of `source_line` must contain (`matches`' second halves)."""
        return [target for _, target in self.matches(source_line)]


def _pattern(source: str) -> str:
    return r"\s+".join(re.escape(word) for word in source.split())


def holds_term(text: str, term: str, case_sensitive: bool = False) -> bool:
    """Whether `text` contains `term` as whole words (any run of spaces between its words), as a
    glossary matches its source terms: how term accuracy finds a target term in a translation."""
    flags = 0 if case_sensitive else re.IGNORECASE
    return re.search(rf"(?<!\w){_pattern(term)}(?!\w)", text, flags) is not None


def read_glossary(path: Path, case: str = GLOSSARY_CASES[0]) -> Glossary:
    """The glossary in `path`, UTF-8: a line `source term<TAB>target term` per entry, spaces around
    each term ignored; blank lines and lines starting with `#` skipped. Refused in one line naming the
    file and line: a line without a tab or with more than one, an empty term, a source term given twice
    (as `case` compares them), a line that is not UTF-8; a file without terms."""
    if case not in GLOSSARY_CASES:
        raise ValueError(f"case must be one of {GLOSSARY_CASES}, got {case!r}")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"glossary {path}: cannot read it ({err.strerror or err})") from None
    terms: list[Term] = []
    seen: dict[str, int] = {}
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"glossary {path} line {number}: not valid UTF-8 ({err.reason} at byte {err.start})"
                            ) from None
        line = line.removeprefix("\ufeff") if number == 1 else line
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            problem = "no tab" if len(fields) == 1 else f"{len(fields) - 1} tabs"
            raise DataError(f"glossary {path} line {number}: {problem}; write source term<TAB>target term")
        source, target = (" ".join(field.split()) for field in fields)
        if not source or not target:
            side = "source" if not source else "target"
            raise DataError(f"glossary {path} line {number}: the {side} term is empty")
        key = source if case == "sensitive" else source.casefold()
        if key in seen:
            raise DataError(f"glossary {path} line {number}: the source term {source!r} is already on line "
                            f"{seen[key]}")
        seen[key] = number
        terms.append(Term(source, target, number))
    if not terms:
        raise DataError(f"glossary {path}: no terms (a line is source term<TAB>target term)")
    return Glossary(path, tuple(terms), case == "sensitive")
