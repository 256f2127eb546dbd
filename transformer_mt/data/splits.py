"""Valid and test splits carved from train when the data has none of its own: a seeded choice of
train's rows (`data.valid_size`, `data.test_size`), recorded in the run's `splits.json` so that a
resumed run, `tmt evaluate` and a rebuilt corpus cache take the same rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from transformer_mt.config.schema import DataConfig
from transformer_mt.core.errors import DataError
from transformer_mt.core.files import write_text_atomic
from transformer_mt.core.run_layout import RunDir

logger = logging.getLogger(__name__)


def carving_plan(cfg: DataConfig, seed: int, n_rows: int, missing: set[str], run_dir: Path) -> dict[str, np.ndarray]:
    """Row indices of train to carve into each missing split, from `splits.json` when it exists."""
    sizes = {split: size for split, size in (("valid", cfg.valid_size), ("test", cfg.test_size)) if split in missing}
    if not sizes:
        return {}
    path = RunDir(run_dir).splits
    if path.is_file():
        plan = _load_split_plan(path, n_rows, list(sizes))
        logger.info("reusing the %s split(s) recorded in %s", "/".join(sizes), path)
        for split, size in sizes.items():
            if len(plan[split]) != size:
                logger.warning("%s keeps %d %s pairs although data.%s_size is now %d; start a new run "
                               "to re-split", path, len(plan[split]), split, split, size)
    else:
        plan = _make_split_plan(n_rows, sizes, seed)
        record = {"source_rows": n_rows, "seed": seed, **{split: indices.tolist() for split, indices in plan.items()}}
        write_text_atomic(path, json.dumps(record) + "\n")
        logger.info("carved %s from %d train rows (seed %d); indices saved to %s",
                    ", ".join(f"{len(plan[s])} {s}" for s in plan), n_rows, seed, path)
    return plan


def _make_split_plan(n_rows: int, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Pick disjoint, sorted row indices of size `sizes[split]` from a seeded sample of range(n_rows)."""
    if n_rows < 1 + sum(sizes.values()):
        keys = " + ".join(f"data.{split}_size={size}" for split, size in sizes.items())
        raise DataError(f"train has {n_rows} pairs, too few to carve {keys} and keep at least one for training; "
                        "lower those sizes or provide valid/test files")
    chosen = np.random.default_rng(seed).choice(n_rows, size=sum(sizes.values()), replace=False)
    plan, start = {}, 0
    for split, size in sizes.items():
        plan[split] = np.sort(chosen[start:start + size])
        start += size
    return plan


def _load_split_plan(path: Path, n_rows: int, needed: list[str]) -> dict[str, np.ndarray]:
    """Read carved indices from `path`, checking they still fit the current training data."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read the saved data split ({err}); delete it to re-split") from None
    if not isinstance(saved, dict):
        raise DataError(f"{path}: expected a JSON object with source_rows, seed and row indices")
    changed = f"the training data changed since {path} was made"
    if saved.get("source_rows") != n_rows:
        raise DataError(f"{changed}: it records {saved.get('source_rows')} train rows, now there are {n_rows}; "
                        "use the original data or start a new run")
    plan = {}
    for split in needed:
        indices = saved.get(split)
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < n_rows for i in indices):
            raise DataError(f"{changed}: it has no valid '{split}' row indices for {n_rows} rows")
        plan[split] = np.asarray(indices, dtype=np.int64)
    if len(np.unique(np.concatenate(list(plan.values())))) != sum(map(len, plan.values())):
        raise DataError(f"{path}: the carved splits overlap; delete it to re-split")
    return plan


def warn_of_repeated_pairs(train_path: Path, carved_paths: dict[str, Path]) -> None:
    """Warn when pairs carved into a split also occur in what train kept: a corpus that repeats
    pairs leaks them into the carved valid and test sets, and their BLEU then reads high. The
    paths are the corpus cache's Arrow streams (`src`, `tgt`), train read a batch at a time."""
    import pyarrow as pa

    def batches(path: Path):
        with pa.OSFile(str(path)) as source:
            yield from pa.ipc.open_stream(source)

    carved = {split: {pair for batch in batches(path) for pair in zip(*batch.to_pydict().values())}
              for split, path in carved_paths.items()}
    repeated = {split: set() for split in carved}
    for batch in batches(train_path):
        for pair in zip(*batch.to_pydict().values()):
            for split, pairs in carved.items():
                if pair in pairs:
                    repeated[split].add(pair)
    for split, pairs in repeated.items():
        if pairs:
            logger.warning("%d of the %d distinct %s pairs carved from train also occur in train (the corpus repeats "
                           "pairs): %s BLEU will read high; deduplicate the corpus, or give it %s files", len(pairs),
                           len(carved[split]), split, split, split)
