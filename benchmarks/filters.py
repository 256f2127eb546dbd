"""How many pairs a second each filter of `data.filters` cleans (and the rule filters of `data.max_words`
and `data.max_length_ratio`), one core (`copies`: rapidfuzz's threads on every core), on pairs drawn from the
noisy demo corpus.

    python benchmarks/filters.py --pairs 200000

Each filter scans the pairs in chunks of --chunk, as the corpus is read, alone (what it measures of the
pairs is not shared with the filters before it, as it is when they run together); the language filter needs
py3langid (`pip install 'transformer-mt[langid]'`).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import pyarrow as pa

from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import FILTER_OPTIONS
from transformer_mt.data.corpus import rule_verdicts
from transformer_mt.data.filters import Pairs, build_filters

NOISY = Path(__file__).resolve().parents[1] / "transformer_mt" / "corpora" / "noisy_en_it"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--chunk", type=int, default=10_000)
    args = parser.parse_args()
    src, tgt = ((NOISY / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "it"))
    rows = [random.Random(0).randrange(len(src)) for _ in range(args.pairs)]
    src, tgt = pa.array([src[i] for i in rows]), pa.array([tgt[i] for i in rows])
    cfg = config_from_dict({"data": {"path": str(NOISY), "filters": list(FILTER_OPTIONS)}}).data
    scans = {"max_words, max_length_ratio": lambda pairs: rule_verdicts(pairs, cfg)}
    scans.update({one.label: one.scan for one in build_filters(cfg)})
    for name, scan in scans.items():
        start = time.perf_counter()
        for first in range(0, args.pairs, args.chunk):
            scan(Pairs(src.slice(first, args.chunk), tgt.slice(first, args.chunk)))
        print(f"{name:28} {args.pairs / (time.perf_counter() - start):>12,.0f} pairs/s")


if __name__ == "__main__":
    main()
