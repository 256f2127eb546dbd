"""Decoding speed of tmt (greedy with and without the KV cache, beam 4) against CTranslate2 on the same model.

One process builds a randomly initialised tmt model of the preset's dimensions, with a BPE
vocabulary trained on the corpus's train split, exports it with `export_ctranslate2` (so both
engines run the same weights), and times every engine on the same source sentences after a
warm-up. Each sentence generates exactly `--gen-tokens` tokens in every engine (EOS is
suppressed), so all do the same work; the script checks the counts. Speed is generated target
tokens per second. Engines that decode the same batches are timed interleaved, batch by batch
in rotating order, so a change in the machine's load during the run hits them alike; CPU
time (process time, all threads) is reported beside wall time.

    python scripts/bench_decode.py                                   # demo corpus, cpu-small, 1 thread
    python scripts/bench_decode.py --data /work/shared/data/multi30k_en_de
    python scripts/bench_decode.py --device cuda --preset base --precision bf16 --threads 4

The last line of output is one JSON object; its headline keys are the figures at the largest
batch size, with every batch size under `by_batch_size`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.batching import pad_sequences
from transformer_mt.checkpoint import FORMAT_VERSION, save_atomic
from transformer_mt.config import Config, DataConfig, ModelConfig, TokenizerConfig, config_to_dict
from transformer_mt.data_sources import read_aligned_files
from transformer_mt.decoding import beam_search, greedy_decode
from transformer_mt.export import export_ctranslate2
from transformer_mt.model import Transformer
from transformer_mt.runtime import pick_device, pick_precision
from transformer_mt.tokenization import BOS_ID, EOS_ID, PAD_ID, TokenizerPair, train_tokenizers

DEMO_CORPUS = Path(__file__).resolve().parents[1] / "transformer_mt" / "corpora" / "demo_en_it"
PRESETS = {
    "cpu-small": {"model": ModelConfig(d_model=256, n_heads=4, n_layers=3, d_ff=1024, dropout=0.0), "vocab_size": 8000},
    "base": {"model": ModelConfig(d_model=512, n_heads=8, n_layers=6, d_ff=2048, dropout=0.0), "vocab_size": 8000},
}
CT2_COMPUTE_TYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
BEAM = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEMO_CORPUS,
                        help="corpus directory with train.<lang>[.gz] and test.<lang> (default: the demo corpus)")
    parser.add_argument("--src-lang", default="en", help="source language suffix (default en; the other is the target)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small", help="model dimensions")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--precision", choices=sorted(CT2_COMPUTE_TYPE), default="fp32",
                        help="tmt autocast dtype and CTranslate2 compute type (default fp32)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads and CTranslate2 intra_threads (default 1: fair and repeatable)")
    parser.add_argument("--gen-tokens", type=int, default=50, help="tokens generated per sentence (default 50)")
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes (default 1,32)")
    parser.add_argument("--n-sentences", type=int, default=1000,
                        help="sentences decoded per engine at batch sizes > 1 (default 1000)")
    parser.add_argument("--n-batch1", type=int, default=100, help="sentences decoded at batch size 1 (default 100)")
    parser.add_argument("--n-uncached", type=int, default=64,
                        help="sentences for the slow uncached reference at every batch size: evenly spaced "
                        "batches of the length-sorted set (default 64)")
    parser.add_argument("--warmup-batches", type=int, default=2, help="untimed batches before each timing (default 2)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print a torch.profiler table of tmt greedy (cached) over N batches of the "
                        "largest batch size (default 0: no profile)")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Timing:
    """One engine at one batch size: generated tokens over wall-clock seconds."""

    engine: str
    batch_size: int
    sentences: int
    tokens: int
    seconds: float  # wall clock
    cpu_seconds: float  # process time, all threads

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds


# --- setup -------------------------------------------------------------------------------------

def read_corpus(directory: Path, src_lang: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(target language, train pairs, test sources) from a corpus in the shared/data layout."""
    langs = sorted({p.name.split(".")[1] for p in directory.glob("train.*")})
    if src_lang not in langs or len(langs) != 2:
        sys.exit(f"{directory}: expected train.{src_lang} and one other train.<lang> file, found {langs}")
    tgt_lang = next(lang for lang in langs if lang != src_lang)
    train = read_aligned_files(_existing(directory / f"train.{src_lang}"), _existing(directory / f"train.{tgt_lang}"))
    test = read_aligned_files(_existing(directory / f"test.{src_lang}"), _existing(directory / f"test.{tgt_lang}"))
    return tgt_lang, train, [src for src, _ in test if src]


def _existing(path: Path) -> Path:
    gz = path.with_name(path.name + ".gz")
    return path if path.is_file() else gz


def build_run(run_dir: Path, args: argparse.Namespace) -> tuple[Transformer, TokenizerPair]:
    """A run directory (tokenizer + checkpoint) with a random model, as `tmt train` would leave one."""
    tgt_lang, train_pairs, _ = read_corpus(args.data, args.src_lang)
    preset = PRESETS[args.preset]
    cfg = Config(name="bench", seed=args.seed,
                 data=DataConfig(format="text", path=str(args.data), src_lang=args.src_lang, tgt_lang=tgt_lang),
                 tokenizer=TokenizerConfig(vocab_size=preset["vocab_size"], joint=True, min_frequency=2),
                 model=preset["model"])
    tokenizers = train_tokenizers(cfg.tokenizer, [s for s, _ in train_pairs], [t for _, t in train_pairs])
    tokenizers.save(run_dir)
    torch.manual_seed(args.seed)
    vocab_size = tokenizers.src.get_vocab_size()
    model = Transformer(cfg.model, vocab_size, vocab_size, PAD_ID)
    (run_dir / "checkpoints").mkdir()
    save_atomic({"model": model.state_dict(), "config": config_to_dict(cfg), "format_version": FORMAT_VERSION,
                 "model_args": {"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, "pad_id": PAD_ID}},
                run_dir / "checkpoints" / "best.pt")
    return model.eval(), tokenizers


def source_batches(sources: list[str], tokenizers: TokenizerPair, n: int, batch_size: int,
                   max_len: int) -> list[tuple[list[list[int]], list[list[str]]]]:
    """The first `n` sources (cycled if fewer), sorted by length and cut into batches of
    (ids + EOS for tmt, token strings for CTranslate2, which appends EOS itself)."""
    chosen = [sources[i % len(sources)] for i in range(n)]
    encodings = tokenizers.src.encode_batch(chosen, add_special_tokens=False)
    keep = max_len - 1
    pairs = sorted(((e.ids[:keep] + [EOS_ID], e.tokens[:keep]) for e in encodings), key=lambda p: len(p[0]))
    return [([ids for ids, _ in pairs[i:i + batch_size]], [toks for _, toks in pairs[i:i + batch_size]])
            for i in range(0, len(pairs), batch_size)]


def spread_subset(batches: list, n_sentences: int) -> list:
    """Evenly spaced batches holding about `n_sentences`: the batches are sorted by length, so
    the subset spans the same source lengths as the whole set."""
    batch_size = len(batches[0][0])
    full = [batch for batch in batches if len(batch[0]) == batch_size] or batches  # skip a short last batch
    k = max(1, min(len(full), round(n_sentences / batch_size)))
    return [full[round(i * (len(full) - 1) / (k - 1))] for i in range(k)] if k > 1 else full[:1]


def suppress_eos(model: Transformer) -> torch.utils.hooks.RemovableHandle:
    """Make EOS impossible, so every sentence runs to the length cap."""
    def hook(module, inputs, logits):
        logits[..., EOS_ID] = torch.finfo(logits.dtype).min
        return logits
    return model.output_proj.register_forward_hook(hook)


# --- engines: each decodes one batch and returns the generated lengths ------------------------

def tmt_engine(model: Transformer, device: torch.device, precision, n_tokens: int, *, beam: int,
               use_cache: bool) -> Callable:
    def run(ids: list[list[int]], tokens: list[list[str]]) -> list[int]:
        src_ids = pad_sequences(ids, PAD_ID).to(device)  # (B, S)
        with precision.autocast():
            if beam == 1:
                out = greedy_decode(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=n_tokens,
                                    use_cache=use_cache)
            else:
                out = [hyps[0].ids for hyps in beam_search(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID,
                                                           beam_size=beam, max_len_a=0, max_len_b=n_tokens)]
        return [len(ids) for ids in out]
    return run


def ct2_engine(translator, n_tokens: int, *, beam: int) -> Callable:
    def run(ids: list[list[int]], tokens: list[list[str]]) -> list[int]:
        results = translator.translate_batch(tokens, beam_size=beam, max_decoding_length=n_tokens,
                                             min_decoding_length=n_tokens)  # no EOS before the cap
        return [len(r.hypotheses[0]) for r in results]
    return run


def time_engines(runs: list[tuple[str, Callable]], batches: list, batch_size: int, n_tokens: int, warmup: int,
                 device: torch.device) -> list[Timing]:
    """Time engines on the same batches, interleaved: each batch is decoded by every engine in
    turn, the order rotating from batch to batch."""
    for _, run in runs:
        for ids, tokens in batches[:warmup]:
            run(ids, tokens)
    wall = dict.fromkeys((name for name, _ in runs), 0.0)
    cpu = dict(wall)
    lengths: dict[str, list[int]] = {name: [] for name, _ in runs}
    for i, (ids, tokens) in enumerate(batches):
        for name, run in runs[i % len(runs):] + runs[:i % len(runs)]:
            _sync(device)
            started, cpu_started = time.perf_counter(), time.process_time()
            lengths[name] += run(ids, tokens)
            _sync(device)
            wall[name] += time.perf_counter() - started
            cpu[name] += time.process_time() - cpu_started
    for name, got in lengths.items():
        if any(n != n_tokens for n in got):
            sys.exit(f"{name}: expected {n_tokens} tokens per sentence, got lengths {sorted(set(got))}")
    return [Timing(name, batch_size, len(lengths[name]), sum(lengths[name]), wall[name], cpu[name])
            for name, _ in runs]


def print_profile(run: Callable, batches: list) -> None:
    """Operator self-times of `run` over `batches`, largest first (wall clock, so on a shared
    machine read the shares, not the absolute times)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids, tokens in batches:
            run(ids, tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def same_greedy_output(model: Transformer, translator, tokenizers: TokenizerPair, batches: list,
                       device: torch.device, precision, n_tokens: int) -> tuple[int, int]:
    """(sentences of the first batch where both engines' natural greedy output agrees, sentences compared)."""
    ids, tokens = batches[0]
    with precision.autocast():
        expected = greedy_decode(model, pad_sequences(ids, PAD_ID).to(device), bos_id=BOS_ID, eos_id=EOS_ID,
                                 max_len_a=0, max_len_b=n_tokens)
    results = translator.translate_batch(tokens, beam_size=1, max_decoding_length=n_tokens, min_decoding_length=0)
    got = [[tokenizers.tgt.token_to_id(token) for token in r.hypotheses[0]] for r in results]
    return sum(a == b for a, b in zip(expected, got)), len(expected)


# --- main --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import ctranslate2  # the `bench` extra
    except ImportError:
        sys.exit("this benchmark needs CTranslate2: pip install ctranslate2")

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    precision = pick_precision(args.precision, device)
    batch_sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    n_tokens = args.gen_tokens

    with tempfile.TemporaryDirectory(prefix="tmt-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        setup_started = time.perf_counter()
        model, tokenizers = build_run(run_dir, args)
        model.to(device)
        export_ctranslate2(run_dir, Path(tmp) / "ct2")
        translator = ctranslate2.Translator(str(Path(tmp) / "ct2"), device=device.type, intra_threads=args.threads,
                                            inter_threads=1, compute_type=CT2_COMPUTE_TYPE[args.precision])
        _, _, sources = read_corpus(args.data, args.src_lang)
        setup_s = time.perf_counter() - setup_started
        vocab_size = tokenizers.src.get_vocab_size()
        print(f"# {args.preset}: d_model={model.cfg.d_model} layers={model.cfg.n_layers}+{model.cfg.n_layers} "
              f"heads={model.cfg.n_heads} d_ff={model.cfg.d_ff} vocab={vocab_size} (BPE on {args.data.name} train), "
              f"{model.num_parameters() / 1e6:.1f}M parameters; {len(sources)} test sources; setup {setup_s:.1f}s")

        check_batches = source_batches(sources, tokenizers, 32, 32, model.cfg.max_len)
        agree, compared = same_greedy_output(model, translator, tokenizers, check_batches, device, precision, n_tokens)
        print(f"# same greedy output (natural EOS, no suppression): {agree}/{compared} sentences")

        timings: list[Timing] = []
        hook = suppress_eos(model)
        try:
            for batch_size in batch_sizes:
                n = args.n_batch1 if batch_size == 1 else args.n_sentences
                batches = source_batches(sources, tokenizers, n, batch_size, model.cfg.max_len)
                uncached = spread_subset(batches, args.n_uncached)
                # Each group decodes the same batches, interleaved; the slow uncached reference
                # runs alone on its subset.
                groups = [
                    ([("tmt greedy, cached", tmt_engine(model, device, precision, n_tokens, beam=1, use_cache=True)),
                      ("ct2 greedy", ct2_engine(translator, n_tokens, beam=1))], batches),
                    ([("tmt greedy, uncached", tmt_engine(model, device, precision, n_tokens, beam=1,
                                                          use_cache=False))], uncached),
                    ([(f"tmt beam {BEAM}", tmt_engine(model, device, precision, n_tokens, beam=BEAM, use_cache=True)),
                      (f"ct2 beam {BEAM}", ct2_engine(translator, n_tokens, beam=BEAM))], batches),
                ]
                for runs, engine_batches in groups:
                    for timing in time_engines(runs, engine_batches, batch_size, n_tokens, args.warmup_batches,
                                               device):
                        timings.append(timing)
                        print(f"{timing.engine:<22} batch {batch_size:>3}  {timing.sentences:>5} sentences  "
                              f"{timing.tokens:>7} tokens  {timing.seconds:8.2f} s  {timing.tokens_per_s:10.1f} tokens/s"
                              f"  (CPU {timing.cpu_seconds:8.2f} s  {timing.tokens_per_cpu_s:10.1f} tokens/CPU-s)",
                              flush=True)
            if args.profile:
                print_profile(tmt_engine(model, device, precision, n_tokens, beam=1, use_cache=True),
                              source_batches(sources, tokenizers, args.profile * batch_sizes[-1], batch_sizes[-1],
                                             model.cfg.max_len))
        finally:
            hook.remove()

    print(json.dumps(summary(args, device, precision, vocab_size, model, timings, batch_sizes, agree, compared)))


def summary(args, device, precision, vocab_size, model, timings, batch_sizes, agree, compared) -> dict:
    by_batch: dict[str, dict] = {}
    for batch_size in batch_sizes:
        rate = {t.engine: t.tokens_per_s for t in timings if t.batch_size == batch_size}
        cpu_rate = {t.engine: t.tokens_per_cpu_s for t in timings if t.batch_size == batch_size}
        sentences = {t.engine: t.sentences for t in timings if t.batch_size == batch_size}
        by_batch[str(batch_size)] = {
            "cached_tokens_per_s": round(rate["tmt greedy, cached"], 1),
            "uncached_tokens_per_s": round(rate["tmt greedy, uncached"], 1),
            "beam4_tokens_per_s": round(rate[f"tmt beam {BEAM}"], 1),
            "ct2_tokens_per_s": round(rate["ct2 greedy"], 1),
            "ct2_beam4_tokens_per_s": round(rate[f"ct2 beam {BEAM}"], 1),
            "cache_speedup": round(rate["tmt greedy, cached"] / rate["tmt greedy, uncached"], 2),
            "tmt_vs_ct2": round(rate["tmt greedy, cached"] / rate["ct2 greedy"], 3),
            "tmt_beam4_vs_ct2": round(rate[f"tmt beam {BEAM}"] / rate[f"ct2 beam {BEAM}"], 3),
            "tmt_vs_ct2_cpu_time": round(cpu_rate["tmt greedy, cached"] / cpu_rate["ct2 greedy"], 3),
            "tmt_beam4_vs_ct2_cpu_time": round(cpu_rate[f"tmt beam {BEAM}"] / cpu_rate[f"ct2 beam {BEAM}"], 3),
            "sentences": sentences,
        }
    headline = by_batch[str(max(batch_sizes))]
    import ctranslate2
    return {
        "device": device.type if device.type != "cuda" else torch.cuda.get_device_name(device),
        "cpu": cpu_name(),
        "preset": args.preset,
        **{k: v for k, v in headline.items() if k != "sentences"},
        "headline_batch_size": max(batch_sizes),
        "precision": precision.name,
        "threads": args.threads,
        "gen_tokens": args.gen_tokens,
        "data": args.data.name,
        "vocab_size": vocab_size,
        "parameters": model.num_parameters(),
        "same_greedy_output": f"{agree}/{compared}",
        "torch": torch.__version__,
        "ctranslate2": ctranslate2.__version__,
        "by_batch_size": by_batch,
    }


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
