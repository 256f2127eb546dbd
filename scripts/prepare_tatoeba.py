"""Make the Tatoeba English-Italian corpus of configs/tatoeba-en-it*.yaml from manythings.org's file.

    python scripts/prepare_tatoeba.py --download --out data/tatoeba-en-it
    python scripts/prepare_tatoeba.py --source ita-eng.zip --out data/tatoeba-en-it   # a copy you have

The source is `ita-eng.zip` (or the `ita.txt` inside it) from https://www.manythings.org/anki/:
English, a tab, Italian, and optionally a tab and the Tatoeba attribution, one pair per line
(CC-BY 2.0 France: attribute "Tatoeba (tatoeba.org), via manythings.org/anki"). The split:

1. each side stripped, runs of whitespace collapsed; pairs with an empty side and repeated pairs
   dropped (the first kept);
2. split by English sentence, so that no test source appears in training: the distinct English
   sentences, in order of first occurrence, are shuffled with `random.Random(seed)`, and whole
   groups go to `test` until it holds at least --test-size pairs, then to `valid`; the rest is
   `train`; each split keeps the file's order;
3. written as train.en.gz, train.it.gz, valid.en, valid.it, test.en, test.it.

manythings.org updates its file, so a newer download holds more pairs and splits differently from
the one the results pages report on.
"""

from __future__ import annotations

import argparse
import gzip
import io
import random
import re
import sys
import urllib.request
import zipfile
from pathlib import Path

URL = "https://www.manythings.org/anki/ita-eng.zip"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--source", type=Path, help="ita-eng.zip, or the ita.txt inside it")
    source.add_argument("--download", action="store_true", help=f"download {URL}")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the splits into (new or empty)")
    parser.add_argument("--test-size", type=int, default=5000, help="pairs in test, at least (default 5000)")
    parser.add_argument("--valid-size", type=int, default=5000, help="pairs in valid, at least (default 5000)")
    parser.add_argument("--seed", type=int, default=20240501, help="seed of the shuffle (default 20240501)")
    return parser.parse_args(argv)


def read_text(args: argparse.Namespace) -> str:
    """The pairs file's text, from the zip (downloaded or given) or the text file."""
    if args.download:
        request = urllib.request.Request(URL, headers={"User-Agent": "Mozilla/5.0 (tmt prepare_tatoeba)"})
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read()
    else:
        data = args.source.read_bytes()
    if data[:2] == b"PK":
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            name = next((n for n in archive.namelist() if n.endswith(".txt") and "_about" not in n), None)
            if name is None:
                raise SystemExit("prepare_tatoeba: the zip holds no pairs file (ita.txt)")
            data = archive.read(name)
    return data.decode("utf-8")


def clean_pairs(text: str) -> list[tuple[str, str]]:
    """(English, Italian) of every line, whitespace normalised, without empty sides or repeats."""
    pairs, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 2:
            raise SystemExit(f"prepare_tatoeba: line {number} has no tab between English and Italian")
        pair = tuple(re.sub(r"\s+", " ", side).strip() for side in fields[:2])
        if all(pair) and pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def split_by_source(pairs: list[tuple[str, str]], test_size: int, valid_size: int,
                    seed: int) -> dict[str, list[tuple[str, str]]]:
    """train/valid/test, every pair of one English sentence in one split, each in the file's order."""
    counts: dict[str, int] = {}
    for en, _ in pairs:
        counts[en] = counts.get(en, 0) + 1
    sentences = list(counts)  # first-occurrence order
    random.Random(seed).shuffle(sentences)
    home: dict[str, str] = {}
    held = {"test": 0, "valid": 0}
    for en in sentences:
        split = next((s for s, size in (("test", test_size), ("valid", valid_size)) if held[s] < size), "train")
        home[en] = split
        if split != "train":
            held[split] += counts[en]
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "valid": [], "test": []}
    for pair in pairs:
        splits[home[pair[0]]].append(pair)
    return splits


def write_splits(splits: dict[str, list[tuple[str, str]]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for index, lang in enumerate(("en", "it")):
            text = "".join(pair[index] + "\n" for pair in pairs)
            if split == "train":
                with gzip.open(out / f"train.{lang}.gz", "wt", encoding="utf-8") as f:
                    f.write(text)
            else:
                (out / f"{split}.{lang}").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"prepare_tatoeba: {args.out} is not empty; give a new folder")
    splits = split_by_source(clean_pairs(read_text(args)), args.test_size, args.valid_size, args.seed)
    if not splits["train"]:
        raise SystemExit("prepare_tatoeba: too few pairs for the test and valid sizes asked; nothing left to train")
    write_splits(splits, args.out)
    sizes = ", ".join(f"{split} {len(pairs):,}" for split, pairs in splits.items())
    print(f"prepare_tatoeba: {sizes} pairs in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
