"""Data preparation at scale: raw text to the first training step, and the tokenizing ceiling.

    python benchmarks/prepare.py --pairs 1000000 --work /tmp/tmt-prepare
    python benchmarks/prepare.py --pairs 10000000 --work /tmp/tmt-prepare

Makes (once) a synthetic corpus of --pairs pairs with benchmarks/make_synthetic_corpus.py in
--work, then runs `python -m transformer_mt train` on it in a new run directory for one step
with a small model (tmt's defaults otherwise: a joint BPE of 8,000, `data.num_proc` and
`tokenizer.max_train_pairs` unset) and times its phases by the moment each log line arrives:

- read_s: start (the interpreter and imports included) to the corpus read into Arrow and filtered;
- bpe_s: training the BPE (on `tokenizer.max_train_pairs`'s sample);
- tokenize_s: the train and valid splits encoded into the token cache;
- first_step_s: the data report, the model and its first update;
- total_s / pairs_per_s: all of it, and the training pairs per second of it.

peak_rss_mb is the high-water mark of the largest of the training process and its tokenizing
processes (`getrusage`'s `ru_maxrss`; it counts resident pages of the memory-mapped Arrow files).
Then, in this process, the ceiling: the run's own tokenizers' `encode_batch` (Rust threads on
every core, nothing else) over the same training pairs, read from the run's corpus cache,
`encode_batch_pairs_per_s`; `tokenize_vs_encode_batch` is tmt's tokenizing rate over it.
Linux or macOS. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import checkout_env, commit, cpu_name, synthetic_corpus

# The log line that ends each phase, in order.
PHASES = (("read_s", "corpus: "), ("bpe_s", "trained BPE tokenizers"), ("tokenize_s", "valid split: tokenized"),
          ("first_step_s", "step 1/1"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1_000_000, help="training pairs (default 1 M)")
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpus and the runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the run, as tmt train's --set (repeatable)")
    return parser.parse_args(argv)


def write_prepare_config(path: Path, corpus: Path) -> None:
    lines = ["name: prepare", "seed: 1",
             f"data: {{format: text, path: {corpus}, src_lang: en, tgt_lang: it}}",
             "tokenizer: {vocab_size: 8000, joint: true}",
             "model: {d_model: 64, n_heads: 2, n_layers: 1, d_ff: 128, max_len: 128}",
             "train: {max_steps: 1, batch_tokens: 4096, warmup_steps: 0, log_every_steps: 1, eval_every_steps: 10, "
             "save_every_steps: 10, test_at_end: false, device: cpu}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_tmt(config: Path, run_dir: Path, overrides: list[str], log: Path) -> tuple[dict[str, float], int]:
    """`tmt train` on `config` -> (seconds of each of PHASES, peak RSS in MB of its largest process)."""
    command = [sys.executable, "-m", "transformer_mt", "train", "--config", str(config), "--run-dir", str(run_dir),
               "--no-progress", *[arg for override in overrides for arg in ("--set", override)]]
    started = time.perf_counter()
    ends: dict[str, float] = {}
    with open(log, "w", encoding="utf-8", buffering=1) as saved:  # line by line: follow it with tail -f
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=checkout_env(OMP_NUM_THREADS="1"))
        for line in process.stdout:
            saved.write(line)
            for name, marker in PHASES:
                if name not in ends and marker in line:
                    ends[name] = time.perf_counter() - started
        process.wait()
    if process.returncode != 0 or len(ends) != len(PHASES):
        sys.exit(f"prepare: tmt train failed or logged no {[m for n, m in PHASES if n not in ends]} "
                 f"(exit {process.returncode}); see {log}:\n" + log.read_text()[-3000:])
    phases, before = {}, 0.0
    for name, _ in PHASES:
        phases[name], before = round(ends[name] - before, 1), ends[name]
    kilobytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: kB; macOS: bytes
    return phases, round(kilobytes / (2**20 if sys.platform == "darwin" else 2**10))


def encode_batch_rate(run_dir: Path) -> float:
    """Training pairs per second of the run's tokenizers' `encode_batch` alone, both sides, over its corpus cache."""
    import pyarrow as pa

    from transformer_mt.core.run_layout import RunDir
    from transformer_mt.data.tokenization import TokenizerPair

    tokenizers = TokenizerPair.load(run_dir)
    pairs, seconds = 0, 0.0
    with pa.OSFile(str(RunDir(run_dir).corpus_cache / "train.arrow")) as source:
        for batch in pa.ipc.open_stream(source):
            src, tgt = batch.column("src").to_pylist(), batch.column("tgt").to_pylist()
            started = time.perf_counter()
            tokenizers.src.encode_batch(src, add_special_tokens=False)
            tokenizers.tgt.encode_batch(tgt, add_special_tokens=False)
            seconds += time.perf_counter() - started
            pairs += len(src)
    return pairs / seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    corpus = synthetic_corpus(args.work, args.pairs)
    config, run_dir = args.work / "prepare.yaml", args.work / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    write_prepare_config(config, corpus)
    load_before = os.getloadavg()[0]
    phases, peak_rss_mb = run_tmt(config, run_dir, args.set, args.work / "train-output.log")
    total = sum(phases.values())
    ceiling = encode_batch_rate(run_dir)
    tokenize_rate = args.pairs / phases["tokenize_s"]
    result = {"benchmark": "prepare", "pairs": args.pairs, **phases, "total_s": round(total, 1),
              "pairs_per_s": round(args.pairs / total), "tokenize_pairs_per_s": round(tokenize_rate),
              "encode_batch_pairs_per_s": round(ceiling), "tokenize_vs_encode_batch": round(tokenize_rate / ceiling, 2),
              "peak_rss_mb": peak_rss_mb, "overrides": args.set, "cores": os.cpu_count(),
              "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)], "cpu": cpu_name(),
              "commit": commit()}
    print(f"training log: {run_dir / 'train.log'}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
