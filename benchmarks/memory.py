"""Peak memory of preparing a large corpus and starting to train on it (corpora larger than memory).

    python benchmarks/memory.py --pairs 10000000 --work /tmp/tmt-memory

Makes (once) a synthetic corpus of --pairs pairs with benchmarks/make_synthetic_corpus.py in
--work, then runs `python -m transformer_mt train` on it for --steps steps with a small model
and samples the memory of the training process (and of its tokenizing worker processes) from
/proc every 0.2 s. Reported:

- peak_rss_mb: the kernel's high-water mark of the training process (VmHWM), what `ps` and a
  job scheduler's memory limit see; it includes pages of memory-mapped files that happen to be
  resident (the Arrow files), which the kernel can drop at any time;
- peak_anon_mb: the sampled peak of its anonymous memory (RssAnon): the heap, numpy arrays,
  Python objects; what really has to fit in memory;
- peak_tree_rss_mb: the sampled peak of the RSS summed over the process and its children (the
  tokenizing workers); this counts pages they share (forked from the training process, or the
  same file mapped by several) once per process, so it overstates their sum;
- peak_tree_pss_mb / peak_tree_pss_anon_mb: the sampled peak of the proportional set size
  summed over the same processes (a shared page counted as 1/k in each of its k sharers), in
  all and of anonymous memory only: what the processes together hold.

Linux only (/proc). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from transformer_mt.core.run_layout import RunDir

from common import checkout_env, synthetic_corpus

SAMPLE_EVERY_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=10_000_000, help="training pairs (default 10 M)")
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpus and the run")
    parser.add_argument("--steps", type=int, default=20, help="training steps to take (default 20)")
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: automatic)")
    return parser.parse_args(argv)


def status_kb(pid: int) -> dict[str, int]:
    """The kB fields of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, RssFile, ...); {} once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0])
    return fields


def pss_kb(pid: int) -> tuple[int, int]:
    """(Pss, Pss_Anon) of a process in kB from /proc/<pid>/smaps_rollup; (0, 0) once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if line.endswith("kB")}
    return fields.get("Pss", 0), fields.get("Pss_Anon", 0)


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (reads /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def write_config(path: Path, corpus: Path, steps: int, num_proc: int | None) -> None:
    lines = ["name: memory", "seed: 1",
             "data: {format: text, path: %s, src_lang: en, tgt_lang: it%s}"
             % (corpus, f", num_proc: {num_proc}" if num_proc else ""),
             "tokenizer: {vocab_size: 8000, joint: true}",
             "model: {d_model: 64, n_heads: 2, n_layers: 1, d_ff: 128, max_len: 128}",
             f"train: {{max_steps: {steps}, batch_tokens: 4096, warmup_steps: 10, log_every_steps: 5, "
             f"eval_every_steps: {10 * steps}, save_every_steps: {10 * steps}, test_at_end: false, device: cpu}}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    corpus = synthetic_corpus(args.work, args.pairs)
    config, run_dir = args.work / "memory.yaml", args.work / "run"
    write_config(config, corpus, args.steps, args.num_proc)
    env = checkout_env(OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "transformer_mt", "train", "--config", str(config), "--run-dir", str(run_dir),
               "--overwrite"]
    started = time.perf_counter()
    log = open(args.work / "train-output.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    peak = {"hwm": 0, "anon": 0, "tree": 0, "pss": 0, "pss_anon": 0}
    while process.poll() is None:
        own = status_kb(process.pid)
        if own:
            peak["hwm"] = max(peak["hwm"], own.get("VmHWM", 0))
            peak["anon"] = max(peak["anon"], own.get("RssAnon", 0))
            tree = [process.pid, *children_of(process.pid)]
            peak["tree"] = max(peak["tree"], sum(status_kb(pid).get("VmRSS", 0) for pid in tree))
            pss = [pss_kb(pid) for pid in tree]
            peak["pss"] = max(peak["pss"], sum(total for total, _ in pss))
            peak["pss_anon"] = max(peak["pss_anon"], sum(anon for _, anon in pss))
        time.sleep(SAMPLE_EVERY_S)
    log.close()
    seconds = time.perf_counter() - started
    output = (args.work / "train-output.log").read_text(errors="replace")
    if process.returncode != 0:
        sys.exit(f"bench_memory: training failed (exit {process.returncode}); see {args.work / 'train-output.log'}:\n"
                 + output[-3000:])
    paths = RunDir(run_dir)
    disk = {name: sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
            for name, folder in (("corpus_cache", paths.corpus_cache), ("token_cache", paths.token_cache))}
    result = {"pairs": args.pairs, "steps": args.steps, "peak_rss_mb": round(peak["hwm"] / 1024),
              "peak_anon_mb": round(peak["anon"] / 1024), "peak_tree_rss_mb": round(peak["tree"] / 1024),
              "peak_tree_pss_mb": round(peak["pss"] / 1024), "peak_tree_pss_anon_mb": round(peak["pss_anon"] / 1024),
              "corpus_files_mb": round(disk["corpus_cache"]), "token_cache_mb": round(disk["token_cache"]),
              "wall_s": round(seconds)}
    print(f"{'pairs':>12} {'peak RSS':>10} {'peak anon':>10} {'tree RSS':>10} {'tree PSS':>10} {'PSS anon':>10} "
          f"{'corpus files':>13} {'token cache':>12} {'wall':>7}")
    print(f"{args.pairs:>12,} {result['peak_rss_mb']:>8,}MB {result['peak_anon_mb']:>8,}MB "
          f"{result['peak_tree_rss_mb']:>8,}MB {result['peak_tree_pss_mb']:>8,}MB {result['peak_tree_pss_anon_mb']:>8,}MB "
          f"{result['corpus_files_mb']:>11,}MB {result['token_cache_mb']:>10,}MB {result['wall_s']:>6}s")
    print(f"training log: {run_dir / 'train.log'}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
