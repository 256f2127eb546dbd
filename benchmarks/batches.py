"""Host time to build training batches from the token cache: what a GPU step replayed from a CUDA
graph waits for. Prepares a config's data in a scratch run directory, then times
`TokenizedSplit.batch` over the sampler's first batches, in memory and from the Arrow rows.

    python benchmarks/batches.py --config configs/multi30k-en-de.yaml \\
        --set data.path=/path/to/multi30k/tok

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from transformer_mt.config.loading import load_config
from transformer_mt.data import token_cache
from transformer_mt.data.batching import TokenBatchSampler
from transformer_mt.train.batches import resolve_batch_tokens
from transformer_mt.train.preparation import prepare_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="the tmt config whose data and batches to measure")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as tmt train --set does (repeatable)")
    parser.add_argument("--batches", type=int, default=300, help="batches timed per path (default 300)")
    parser.add_argument("--pad-to-multiple", type=int, default=8, help="as on a GPU (default 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg, _ = resolve_batch_tokens(load_config(args.config, args.overrides), torch.device("cpu"))  # `auto`: 4,096
    with tempfile.TemporaryDirectory(prefix="tmt-bench-batches-") as scratch:
        _, train, _, _ = prepare_data(cfg, Path(scratch), pad_to_multiple=args.pad_to_multiple)
        sampler = iter(TokenBatchSampler(train.lengths(), cfg.train.batch_tokens, cfg.seed, tie_break=train.tgt_len,
                                         pad_to_multiple=args.pad_to_multiple, max_length=cfg.model.max_len))
        batches = [next(sampler) for _ in range(args.batches)]
        in_memory = train._flat
        result = {"config": str(args.config), "batches": args.batches, "in_memory": in_memory is not None}
        for name, flat in (("in_memory_ms", in_memory), ("arrow_ms", None)):
            if name == "in_memory_ms" and flat is None:
                continue
            train._flat = flat
            started = time.perf_counter()
            for indices in batches:
                train.batch(indices, args.pad_to_multiple)
            result[name] = round(1e3 * (time.perf_counter() - started) / len(batches), 3)
        result["in_memory_max_ids"] = token_cache.IN_MEMORY_MAX_IDS
    print(json.dumps(result))


if __name__ == "__main__":
    main()
