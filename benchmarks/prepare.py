"""Data preparation at scale: raw text to the first training step, and the tokenizing ceiling.

    python benchmarks/prepare.py --pairs 1000000 --work /tmp/tmt-prepare
    python benchmarks/prepare.py --pairs 10000000 --work /tmp/tmt-prepare
    python benchmarks/prepare.py --pairs 10000000 --work /tmp/tmt-prepare --opusfilter /opt/opusfilter/bin/opusfilter

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
With --filters, the run cleans the training pairs with the rule filters of `data.filters` that
OpusFilter also has (RULE_FILTERS; its read_s is then read and filter). --opusfilter COMMAND (the
`opusfilter` command of an environment of its own: `pip install opusfilter` brings scikit-learn,
pandas, lingua and more) implies --filters and then runs OpusFilter on the same training files:
its `remove_duplicates` step and one `filter` step with the matching filters (OPUSFILTER_FILTERS),
the filter step on as many processes as there are cores (its `default_n_jobs`), from the raw text
files to filtered ones, `opusfilter_s`; each tool's pairs kept are printed beside (the rules differ
in detail: OpusFilter's duplicates compare letters only, its `copies` is a Levenshtein ratio).
Linux or macOS. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import checkout_env, commit, cpu_name, synthetic_corpus

# tmt's rule filters that OpusFilter has too (not `language`: a model, not a rule), at their defaults, and
# OpusFilter's counterparts with the same settings (dedup: its remove_duplicates step, lowercased letters).
RULE_FILTERS = ("dedup", "length", "length_ratio", "copies", "characters", "numbers", "html")
OPUSFILTER_FILTERS = """\
        - LengthFilter: {unit: word, min_length: 1, max_length: 100}
        - LengthRatioFilter: {unit: word, threshold: 3}
        - SimilarityFilter: {unit: char, threshold: 0.9, lowercase: true}
        - CharacterScoreFilter: {scripts: [Latin, Latin], thresholds: [0.9, 0.9]}
        - NonZeroNumeralsFilter: {threshold: 0.5}
        - HtmlTagFilter: {}
"""

# The log line that ends each phase, in order.
PHASES = (("read_s", "corpus: "), ("bpe_s", "trained BPE tokenizers"), ("tokenize_s", "valid split: tokenized"),
          ("first_step_s", "step 1/1"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1_000_000, help="training pairs (default 1 M)")
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpus and the runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the run, as tmt train's --set (repeatable)")
    parser.add_argument("--filters", action="store_true", help=f"clean the pairs with {', '.join(RULE_FILTERS)}")
    parser.add_argument("--opusfilter", metavar="COMMAND",
                        help="OpusFilter's `opusfilter` command: time it on the same pairs (implies --filters)")
    args = parser.parse_args(argv)
    if args.opusfilter or args.filters:
        args.filters = True
        args.set = [f"data.filters=[{','.join(RULE_FILTERS)}]", *args.set]
    return args


def write_prepare_config(path: Path, corpus: Path) -> None:
    lines = ["name: prepare", "seed: 1",
             f"data: {{format: text, path: {corpus}, src_lang: en, tgt_lang: it}}",
             "tokenizer: {vocab_size: 8000, joint: true}",
             "model: {d_model: 64, n_heads: 2, n_layers: 1, d_ff: 128, max_len: 128}",
             "train: {max_steps: 1, batch_tokens: 4096, warmup_steps: 0, log_every_steps: 1, eval_every_steps: 10, "
             "save_every_steps: 10, test_at_end: false, device: cpu}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_tmt(config: Path, run_dir: Path, overrides: list[str], log: Path) -> tuple[dict[str, float], int, int]:
    """`tmt train` on `config` -> (seconds of each of PHASES, peak RSS in MB of its largest process, training
    pairs kept)."""
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
    kept = int(re.search(r"corpus: (\d+) train", log.read_text(encoding="utf-8")).group(1))
    return phases, round(kilobytes / (2**20 if sys.platform == "darwin" else 2**10)), kept


def run_opusfilter(command: str, corpus: Path, work: Path) -> tuple[float, int]:
    """OpusFilter's duplicates and filter steps from `corpus`'s training files -> (seconds, pairs kept)."""
    out = work / f"opusfilter-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir()
    train = [str(corpus / f"train.{lang}") for lang in ("en", "it")]
    (out / "config.yaml").write_text(
        f"common: {{output_directory: {out}, default_n_jobs: {os.cpu_count()}}}\n"
        "steps:\n"
        "  - type: remove_duplicates\n"
        f"    parameters: {{inputs: [{train[0]}, {train[1]}], outputs: [dedup.en, dedup.it], lowercase: true, "
        "letters_only: true}\n"
        "  - type: filter\n"
        "    parameters:\n"
        "      inputs: [dedup.en, dedup.it]\n"
        "      outputs: [filtered.en, filtered.it]\n"
        "      filters:\n" + OPUSFILTER_FILTERS, encoding="utf-8")
    started = time.perf_counter()
    with open(out / "opusfilter.log", "w", encoding="utf-8") as log:
        done = subprocess.run([command, str(out / "config.yaml")], stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"prepare: {command} failed (exit {done.returncode}); see {out / 'opusfilter.log'}")
    with open(out / "filtered.en", "rb") as kept:
        return seconds, sum(1 for _ in kept)


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
    phases, peak_rss_mb, kept = run_tmt(config, run_dir, args.set, args.work / "train-output.log")
    total = sum(phases.values())
    ceiling = encode_batch_rate(run_dir)
    tokenize_rate = kept / phases["tokenize_s"]  # the pairs the filters left
    result = {"benchmark": "prepare", "pairs": args.pairs, **phases, "total_s": round(total, 1),
              "pairs_per_s": round(args.pairs / total), "tokenize_pairs_per_s": round(tokenize_rate),
              "encode_batch_pairs_per_s": round(ceiling), "tokenize_vs_encode_batch": round(tokenize_rate / ceiling, 2),
              "peak_rss_mb": peak_rss_mb, "train_pairs_kept": kept}
    if args.opusfilter:
        seconds, opusfilter_kept = run_opusfilter(args.opusfilter, corpus, args.work)
        result.update(opusfilter_s=round(seconds, 1), opusfilter_pairs_kept=opusfilter_kept,
                      read_vs_opusfilter=round(seconds / phases["read_s"], 2))
    result.update({"overrides": args.set, "cores": os.cpu_count(),
              "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)], "cpu": cpu_name(),
              "commit": commit()})
    print(f"training log: {run_dir / 'train.log'}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
