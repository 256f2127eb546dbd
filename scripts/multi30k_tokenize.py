"""Tokenize Multi30k's extra test sets the way its `tok/` files were made, to score them with
tokenized BLEU.

    pip install sacremoses
    python scripts/multi30k_tokenize.py --data /path/to/multi30k --out /tmp/m30k-tok
    tmt evaluate --run runs/multi30k-en-de-cpu --src /tmp/m30k-tok/test2017_flickr.en \
        --ref /tmp/m30k-tok/test2017_flickr.de --tokenize none --beam 5

Multi30k ships lowercased, Moses-tokenized text (`tok/`) only for train, valid and test2016; the
test sets of 2017 (Flickr and the ambiguous MSCOCO set) and 2018 come raw. The source repository
made `tok/` by lowercasing, normalising punctuation and running the Moses tokenizer (its
`scripts/task1-tokenize.sh`); this script does the same with sacremoses, the Python port of
those Moses scripts. Before it writes anything it runs the procedure on the raw files that do
have a `tok/` copy and prints how many lines differ (1 of the 4,028 lines of test2016 and
valid, both sides, on the distributed files), so the score of a tokenized extra test set is known to
be comparable with test2016's. Nothing here is used by tmt itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True,
                        help="a Multi30k folder: raw files on top, tok/ beside them")
    parser.add_argument("--out", type=Path, required=True,
                        help="directory to write the tokenized extra test sets into (created; existing files "
                        "are never overwritten)")
    return parser.parse_args(argv)


def make_tokenizer(lang: str):
    """The tok/ procedure for one language: a function from a raw line to its tokenized form."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    # Moses escapes XML special characters (' becomes &apos;); the tok/ files keep that form.
    return lambda line: tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True)


def read_lines(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def raw_files(data: Path) -> dict[str, list[Path]]:
    """The raw files on top of `data` in the languages of its tok/ files, as {split name: [file
    per language]}, e.g. {"test2017_flickr": [test2017_flickr.de, test2017_flickr.en]}."""
    langs = {path.suffix for path in (data / "tok").glob("*.*")}
    splits: dict[str, list[Path]] = {}
    for path in sorted(data.glob("*.*")):
        if path.suffix in langs:
            splits.setdefault(path.stem, []).append(path)
    return splits


def check(raw: Path, tok: Path) -> tuple[int, int]:
    """(lines that differ, lines) between the procedure applied to `raw` and the shipped `tok`."""
    tokenize = make_tokenizer(raw.suffix[1:])
    ours, theirs = [tokenize(line) for line in read_lines(raw)], read_lines(tok)
    if len(ours) != len(theirs):
        raise SystemExit(f"error: {raw} has {len(ours)} lines but {tok} has {len(theirs)}")
    return sum(a != b for a, b in zip(ours, theirs)), len(ours)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import sacremoses  # noqa: F401
    except ImportError:
        print("error: this script needs sacremoses: pip install sacremoses", file=sys.stderr)
        return 1
    splits = raw_files(args.data)
    # Training text is neither an extra test set nor needed for the check: 29,000 lines are slow,
    # and valid + test2016 already exercise every rule on both sides.
    splits.pop("train", None)
    if not splits:
        print(f"error: {args.data} has no raw <split>.<lang> files beside a tok/ folder", file=sys.stderr)
        return 1
    shipped = {name: paths for name, paths in splits.items() if all((args.data / "tok" / p.name).exists()
                                                                     for p in paths)}
    extra = {name: paths for name, paths in splits.items() if name not in shipped}
    if not shipped or not extra:
        print(f"error: {args.data} needs both raw files with a tok/ copy (to check the procedure) and raw "
              f"files without one (to tokenize)", file=sys.stderr)
        return 1
    targets = [args.out / p.name for paths in extra.values() for p in paths]
    existing = [str(t) for t in targets if t.exists()]
    if existing:
        print(f"error: would overwrite {', '.join(existing)}; choose another --out", file=sys.stderr)
        return 1

    for paths in shipped.values():
        for raw in paths:
            differ, total = check(raw, args.data / "tok" / raw.name)
            print(f"check  {raw.name:<24} {differ} of {total} lines differ from tok/{raw.name}")
    args.out.mkdir(parents=True, exist_ok=True)
    for paths in extra.values():
        for raw in paths:
            tokenize = make_tokenizer(raw.suffix[1:])
            lines = [tokenize(line) for line in read_lines(raw)]
            (args.out / raw.name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            print(f"wrote  {args.out / raw.name} ({len(lines)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
