"""Write an N-pair synthetic parallel corpus in the layout tmt reads (train.<lang>, valid.<lang>, test.<lang>), for scale tests.

    python benchmarks/make_synthetic_corpus.py --pairs 10000000 --out /tmp/synth-10m

writes `train.en` / `train.it` (N lines each) and `valid.*` / `test.*` (1,000 lines each) into
--out. The "languages" are made up: a source word list of pronounceable words drawn with a
Zipf-like frequency, 3-40 words a sentence; the target maps every source word to its own
target word and swaps neighbouring word pairs, so the task is learnable and the target's
lengths track the source's like a real language pair. Seeded: the same arguments always write
the same bytes. Nothing here is used by tmt itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

SYLLABLES = [c + v for c in "bcdfglmnprstvz" for v in "aeiou"]  # 70 syllables
CHUNK_PAIRS = 100_000
EVAL_PAIRS = 1_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, required=True, help="training pairs to write")
    parser.add_argument("--out", type=Path, required=True, help="directory to write into (created; files already there are never replaced)")
    parser.add_argument("--vocab", type=int, default=30_000, help="distinct words per language (default 30,000)")
    parser.add_argument("--src-lang", default="en")
    parser.add_argument("--tgt-lang", default="it")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_words(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` distinct made-up words of 1-4 syllables, as a numpy array of str."""
    words: set[str] = set()
    while len(words) < n:
        n_syllables = rng.integers(1, 5, size=n)
        picks = rng.integers(0, len(SYLLABLES), size=(n, 4))
        words.update("".join(SYLLABLES[p] for p in row[:k]) for row, k in zip(picks, n_syllables))
    return rng.permutation(np.array(sorted(words)[:n], dtype=object))  # frequency unrelated to spelling


def sentence_pairs(n: int, src_words: np.ndarray, tgt_words: np.ndarray, rng: np.random.Generator
                   ) -> tuple[list[str], list[str]]:
    """`n` source sentences and their made-up translations."""
    lengths = np.clip(rng.lognormal(mean=2.6, sigma=0.5, size=n).astype(np.int64), 3, 40)  # median ~13 words
    ranks = rng.zipf(1.2, size=int(lengths.sum())) - 1  # word frequency falls off like natural text
    ids = ranks % len(src_words)
    src, tgt = [], []
    start = 0
    for length in lengths.tolist():
        sentence = ids[start:start + length]
        start += length
        src.append(" ".join(src_words[sentence]))
        swapped = sentence.copy()
        swapped[:length - length % 2] = sentence[:length - length % 2].reshape(-1, 2)[:, ::-1].ravel()
        tgt.append(" ".join(tgt_words[swapped]))
    return src, tgt


def write_split(out: Path, split: str, n: int, langs: tuple[str, str], words: tuple[np.ndarray, np.ndarray],
                rng: np.random.Generator) -> None:
    with open(out / f"{split}.{langs[0]}", "w", encoding="utf-8") as src_file, \
            open(out / f"{split}.{langs[1]}", "w", encoding="utf-8") as tgt_file:
        written = 0
        while written < n:
            src, tgt = sentence_pairs(min(CHUNK_PAIRS, n - written), *words, rng)
            src_file.write("\n".join(src) + "\n")
            tgt_file.write("\n".join(tgt) + "\n")
            written += len(src)
            if split == "train" and written % (10 * CHUNK_PAIRS) == 0:
                print(f"  {written:,} / {n:,} pairs", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pairs < 1:
        sys.exit("make_synthetic_corpus: --pairs must be at least 1")
    taken = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in (args.src_lang, args.tgt_lang)
             if (args.out / f"{split}.{lang}").exists()]
    if taken:  # a corpus of the user's, say: never written over
        sys.exit(f"make_synthetic_corpus: {args.out} already holds {', '.join(taken)}; choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    words = make_words(args.vocab, rng), make_words(args.vocab, rng)
    langs = (args.src_lang, args.tgt_lang)
    started = time.perf_counter()
    for split, n in (("valid", EVAL_PAIRS), ("test", EVAL_PAIRS), ("train", args.pairs)):
        write_split(args.out, split, n, langs, words, rng)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"wrote {args.pairs:,} training pairs ({size / 2**30:.2f} GiB in all) to {args.out} "
          f"in {time.perf_counter() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
