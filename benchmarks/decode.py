"""Decoding speed of tmt (greedy with and without the KV cache, beam 4) against CTranslate2 on the
same model and Hugging Face's MarianMTModel of the same size.

One process builds a randomly initialised tmt model of the preset's dimensions, with a BPE
vocabulary trained on the corpus's train split, exports it with `export_ctranslate2` (so both
engines run the same weights), builds a `MarianMTModel` of the same dimensions and vocabulary
(its own random weights: Marian normalises after each sublayer, tmt before, so the weights
cannot be shared; the work per token is the same), and times every engine on the same source
sentences after a warm-up. An engine whose package is not installed (`ctranslate2`, or
`transformers`), or that `--without` names, is left out with a note, and its figures are null.
tmt and Marian run attention on the kernels of `--attention-backend` (tmt's
`decode.attention_backend`, default auto: never cuDNN's on CUDA). Each sentence generates exactly `--gen-tokens` tokens in every engine (EOS is
suppressed), so all do the same work; the script checks the counts. Speed is generated target
tokens per second. Engines that decode the same batches are timed interleaved, batch by batch
in rotating order, so a change in the machine's load during the run hits them alike; CPU
time (process time, all threads) is reported beside wall time.

"tmt translate" is what `tmt translate` runs once the run is loaded: `Translator.translate` on
text (tokenization, its engine, detokenization; on a CPU the CTranslate2 engine, from the run's
cached conversion), against raw CTranslate2 on token strings: `tmt_vs_ct2` and
`tmt_beam4_vs_ct2`. "tmt torch" is tmt's own model and search (`decode.generator`), the torch engine.
On a CPU, greedy decoding is also timed with int8 weights: `tmt translate --quantize int8`
against CTranslate2's `compute_type="int8"` (`--no-int8` leaves them out).

    python benchmarks/decode.py                                   # demo corpus, cpu-small, 1 thread
    python benchmarks/decode.py --data /path/to/multi30k
    python benchmarks/decode.py --device cuda --preset base --precision bf16 --threads 4
    python benchmarks/decode.py --device cuda --preset base --precision bf16 \
        --data .gpu/data/multi30k_en_de --test-beam 5       # also: 1,000 test sentences, beam 5

`--test-beam K` also times `translate_ids` (what `tmt translate` runs after start-up: length-sorted
token-budget batches, `decode.*` defaults, EOS when the model picks it) over `--test-sentences`
test sentences with K beams, and prints it as one JSON line `{"figure": "decode_<n>_beam<K>_s", ...}`.
A random model seldom picks EOS, so its sentences run to the length cap (1.5·S + 10 tokens): more
work than a trained model's. The last line of output is one JSON object; its headline keys are
the figures at the largest batch size, with every batch size under `by_batch_size`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.config.schema import DecodeConfig
from transformer_mt.core.runtime import (
    AttentionKernels,
    pick_attention,
    pick_device,
    pick_precision,
    warn_attention_fallbacks,
)
from transformer_mt.data.batching import pad_sequences
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID, TokenizerPair
from transformer_mt.decode.torch_engine import translate_ids
from transformer_mt.decode.generator import StepGraphs, beam_search, greedy_decode
from transformer_mt.decode.translator import Translator
from transformer_mt.export import ct2_conversion
from transformer_mt.export.ct2_conversion import export_ctranslate2
from transformer_mt.model.transformer import Transformer

from common import (DECODE_PRESETS, add_setup_arguments, build_marian, build_run, cpu_name, print_profile,
                    read_corpus, synchronize)

CT2_COMPUTE_TYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
BEAM = 4
PROFILE_TOP = 15  # operators in the --profile table
# Comparison engines: the module each needs, and the name the figures use.
OPTIONAL_ENGINES = {"ct2": "ctranslate2", "hf_marian": "transformers"}
ATTENTION_CHOICES = typing.get_args(typing.get_type_hints(DecodeConfig)["attention_backend"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setup_arguments(parser, DECODE_PRESETS, "corpus directory with train.<lang>[.gz] and test.<lang>")
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
    parser.add_argument("--without", default="", metavar="ENGINES",
                        help=f"comma-separated comparison engines to leave out: {', '.join(OPTIONAL_ENGINES)} "
                        "(default: none; one whose package is not installed is left out anyway)")
    parser.add_argument("--attention-backend", choices=ATTENTION_CHOICES, default="auto",
                        help="SDPA kernels of tmt and Marian, as tmt's decode.attention_backend (default auto)")
    parser.add_argument("--test-beam", type=int, default=0, metavar="K",
                        help="also time translate_ids over --test-sentences test sentences with K beams "
                        "(default 0: not)")
    parser.add_argument("--test-sentences", type=int, default=1000, help="sentences for --test-beam (default 1000)")
    parser.add_argument("--no-int8", dest="int8", action="store_false",
                        help="leave out the int8 greedy engines (tmt decode.quantize int8, CTranslate2 int8), "
                        "timed on a CPU only")
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

def source_batches(sources: list[str], tokenizers: TokenizerPair, n: int, batch_size: int,
                   max_len: int) -> list[tuple[list[list[int]], list[list[str]], list[str]]]:
    """The first `n` sources (cycled if fewer), sorted by length and cut into batches of
    (ids + EOS for tmt torch, token strings for CTranslate2, which appends EOS itself, the text
    for tmt translate)."""
    chosen = [sources[i % len(sources)] for i in range(n)]
    encodings = tokenizers.src.encode_batch(chosen, add_special_tokens=False)
    keep = max_len - 1
    rows = sorted(((e.ids[:keep] + [EOS_ID], e.tokens[:keep], text) for e, text in zip(encodings, chosen)),
                  key=lambda row: len(row[0]))
    return [tuple(list(column) for column in zip(*rows[i:i + batch_size])) for i in range(0, len(rows), batch_size)]


def spread_subset(batches: list, n_sentences: int) -> list:
    """Evenly spaced batches holding about `n_sentences`: the batches are sorted by length, so
    the subset spans the same source lengths as the whole set."""
    batch_size = len(batches[0][0])
    full = [batch for batch in batches if len(batch[0]) == batch_size] or batches  # skip a short last batch
    k = max(1, min(len(full), round(n_sentences / batch_size)))
    return [full[round(i * (len(full) - 1) / (k - 1))] for i in range(k)] if k > 1 else full[:1]


def forbid_eos_in_conversions() -> Callable[[], None]:
    """Make EOS impossible in every CTranslate2 conversion made until the returned function is
    called (`export`'s and `tmt translate`'s cache alike), as `EosSuppression` does for torch."""
    build = ct2_conversion.build_ctranslate2_spec

    def without_eos(model):
        spec = build(model)
        spec.decoder.projection.bias[EOS_ID] = -1e4
        return spec

    ct2_conversion.build_ctranslate2_spec = without_eos
    return lambda: setattr(ct2_conversion, "build_ctranslate2_spec", build)


class EosSuppression:
    """Make EOS impossible, so every sentence runs to the length cap: its logit at the minimum in
    every step's logits. `remove()` undoes it."""

    def __init__(self, model: Transformer):
        def hook(module, inputs, logits):
            logits[..., EOS_ID] = torch.finfo(logits.dtype).min
            return logits

        self.handle = model.output_proj.register_forward_hook(hook)

    def remove(self) -> None:
        self.handle.remove()


def uncached_greedy(model: Transformer, src_ids: torch.Tensor, n_tokens: int) -> list[list[int]]:
    """Greedy decoding without a cache: the whole prefix through the teacher-forced forward at every
    step (the reference the cache is measured against)."""
    tokens = torch.full((src_ids.shape[0], 1), BOS_ID, dtype=torch.long, device=src_ids.device)
    with torch.inference_mode():
        for _ in range(n_tokens):
            logits = model(src_ids, tokens, pack=False).view(*tokens.shape, -1)[:, -1].float()  # (B, V)
            logits[:, [PAD_ID, BOS_ID]] = torch.finfo(logits.dtype).min
            tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return tokens[:, 1:].tolist()


# --- engines: each decodes one batch and returns the generated lengths ------------------------

def tmt_engine(model: Transformer, device: torch.device, precision, attention: AttentionKernels, n_tokens: int, *,
               beam: int, use_cache: bool) -> Callable:
    graphs = StepGraphs()  # on CUDA, batches of one padded shape replay one capture, as in `translate_ids`

    def run(ids: list[list[int]], tokens: list[list[str]], texts: list[str]) -> list[int]:
        src_ids = pad_sequences(ids, PAD_ID).to(device)  # (B, S)
        with precision.autocast(), attention.enabled():
            captured = {"capture": True, "graphs": graphs} if device.type == "cuda" else {}  # as `translate_ids`
            if not use_cache:
                out = uncached_greedy(model, src_ids, n_tokens)
            elif beam == 1:
                out = greedy_decode(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, max_len_a=0, max_len_b=n_tokens,
                                    **captured)
            else:
                out = [hyps[0].ids for hyps in beam_search(model, src_ids, bos_id=BOS_ID, eos_id=EOS_ID, beam_size=beam,
                                                           max_len_a=0, max_len_b=n_tokens, **captured)]
        return [len(ids) for ids in out]
    return run


def translate_engine(translator: Translator, *, beam: int) -> Callable:
    """`Translator.translate` on the batch's text; the generated lengths are the engine's own."""
    lengths: list[int] = []
    decode = translator.engine.translate

    def counted(*args):
        out = decode(*args)
        lengths.extend(len(ids) for ids in out)
        return out

    translator.engine.translate = counted

    def run(ids: list[list[int]], tokens: list[list[str]], texts: list[str]) -> list[int]:
        lengths.clear()
        translator.translate(texts, beam_size=beam)
        return list(lengths)
    return run


def ct2_engine(translator, n_tokens: int, *, beam: int) -> Callable:
    def run(ids: list[list[int]], tokens: list[list[str]], texts: list[str]) -> list[int]:
        results = translator.translate_batch(tokens, beam_size=beam, max_decoding_length=n_tokens,
                                             min_decoding_length=n_tokens)  # no EOS before the cap
        return [len(r.hypotheses[0]) for r in results]
    return run


def hf_engine(marian, device: torch.device, precision, attention: AttentionKernels, n_tokens: int, *,
              beam: int) -> Callable:
    """`MarianMTModel.generate` with exactly `n_tokens` new tokens (min = max: EOS is held back until then)."""
    def run(ids: list[list[int]], tokens: list[list[str]], texts: list[str]) -> list[int]:
        src_ids = pad_sequences(ids, PAD_ID).to(device)  # (B, S), the same ids as tmt's, EOS included
        with torch.inference_mode(), precision.autocast(), attention.enabled():
            out = marian.generate(input_ids=src_ids, attention_mask=(src_ids != PAD_ID).long(), num_beams=beam,
                                  do_sample=False, max_new_tokens=n_tokens, min_new_tokens=n_tokens)
        return [out.shape[1] - 1] * out.shape[0]  # (B, 1 + new): the decoder start token, then the new ones
    return run


def time_engines(runs: list[tuple[str, Callable]], batches: list, batch_size: int, n_tokens: int, warmup: int,
                 device: torch.device) -> list[Timing]:
    """Time engines on the same batches, interleaved: each batch is decoded by every engine in
    turn, the order rotating from batch to batch."""
    for _, run in runs:
        for batch in batches[:warmup]:
            run(*batch)
    wall = dict.fromkeys((name for name, _ in runs), 0.0)
    cpu = dict(wall)
    lengths: dict[str, list[int]] = {name: [] for name, _ in runs}
    for i, batch in enumerate(batches):
        for name, run in runs[i % len(runs):] + runs[:i % len(runs)]:
            synchronize(device)
            started, cpu_started = time.perf_counter(), time.process_time()
            lengths[name] += run(*batch)
            synchronize(device)
            wall[name] += time.perf_counter() - started
            cpu[name] += time.process_time() - cpu_started
    for name, got in lengths.items():
        if any(n != n_tokens for n in got):
            sys.exit(f"{name}: expected {n_tokens} tokens per sentence, got lengths {sorted(set(got))}")
    return [Timing(name, batch_size, len(lengths[name]), sum(lengths[name]), wall[name], cpu[name])
            for name, _ in runs]


def greedy_outputs(model: Transformer, batch: tuple, device: torch.device, precision, n_tokens: int) -> list[list[int]]:
    """tmt's natural greedy output (EOS when the model picks it) for one batch."""
    with precision.autocast():
        return greedy_decode(model, pad_sequences(batch[0], PAD_ID).to(device), bos_id=BOS_ID, eos_id=EOS_ID,
                             max_len_a=0, max_len_b=n_tokens)


def same_greedy_output(expected: list[list[int]], translator, tokenizers: TokenizerPair, batch: tuple,
                       n_tokens: int) -> int:
    """Sentences of `batch` where CTranslate2's natural greedy output is tmt's `expected`."""
    results = translator.translate_batch(batch[1], beam_size=1, max_decoding_length=n_tokens, min_decoding_length=0)
    got = [[tokenizers.tgt.token_to_id(token) for token in r.hypotheses[0]] for r in results]
    return sum(a == b for a, b in zip(expected, got))


def output_checks(decoder: Transformer, translator, tokenizers: TokenizerPair, sources: list[str],
                  device: torch.device, precision, n_tokens: int) -> dict[str, str | None]:
    """Natural greedy outputs (EOS when the model picks it) of 32 sentences: CTranslate2's against
    tmt torch's, "agreeing/compared" (None: not run)."""
    checks = {"same_greedy_output": None}
    if translator is None:
        return checks
    batch = source_batches(sources, tokenizers, 32, 32, decoder.cfg.max_len)[0]
    expected = greedy_outputs(decoder, batch, device, precision, n_tokens)
    agree = same_greedy_output(expected, translator, tokenizers, batch, n_tokens)
    checks["same_greedy_output"] = f"{agree}/{len(expected)}"
    print(f"# same greedy output as ct2 (natural EOS, no suppression): {checks['same_greedy_output']} sentences")
    return checks


def tmt_translator(run_dir: Path, args: argparse.Namespace, device: torch.device, n_tokens: int) -> Translator:
    """The run as `tmt translate --device <device>` loads it (CTranslate2 on a CPU, from the run's
    cache, on `--threads` threads), decoding exactly `n_tokens` tokens in one batch of each batch."""
    translator = Translator.from_run(run_dir, device=device.type)
    if translator.engine.name == "ctranslate2":
        translator.engine.threads = args.threads
    translator.set_decoding(max_len_a=0, max_len_b=n_tokens, batch_tokens=1 << 20)
    return translator


# --- main --------------------------------------------------------------------------------------

def comparison_engines(without: str) -> dict[str, object]:
    """The comparison engines to run: name -> imported module; a note on stdout for each left out."""
    skipped = {name.strip() for name in without.split(",") if name.strip()}
    if unknown := skipped - set(OPTIONAL_ENGINES):
        sys.exit(f"--without: unknown engine(s) {', '.join(sorted(unknown))} (choose from {', '.join(OPTIONAL_ENGINES)})")
    engines = {}
    for name, module in OPTIONAL_ENGINES.items():
        if name in skipped:
            print(f"# {name}: left out (--without); its figures are null")
            continue
        try:
            engines[name] = importlib.import_module(module)
        except ImportError:
            print(f"# {name}: left out, {module} is not installed (pip install {module}); its figures are null")
    return engines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engines = comparison_engines(args.without)
    ct2, with_hf = engines.get("ct2"), "hf_marian" in engines

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    precision = pick_precision(args.precision, device)
    warn_attention_fallbacks(device, {"--attention-backend": args.attention_backend})
    attention = pick_attention(args.attention_backend, device, "decode")
    batch_sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    n_tokens = args.gen_tokens

    with tempfile.TemporaryDirectory(prefix="tmt-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        setup_started = time.perf_counter()
        model, tokenizers = build_run(run_dir, args.preset, args.data, args.src_lang, args.seed)
        model.to(device)
        decoder = model  # tmt torch: what the torch engine decodes with (`torch_engine.translate_ids`)
        int8 = args.int8 and device.type == "cpu"  # decode.quantize applies to CPUs only
        translator = translator_int8 = natural = tmt = tmt_int8 = None
        if ct2 is not None:
            export_ctranslate2(run_dir, Path(tmp) / "ct2-natural")  # for the output check
            natural = ct2.Translator(str(Path(tmp) / "ct2-natural"), device=device.type, intra_threads=args.threads,
                                     inter_threads=1, compute_type=CT2_COMPUTE_TYPE[args.precision])
            allow_eos = forbid_eos_in_conversions()
            try:
                export_ctranslate2(run_dir, Path(tmp) / "ct2")
                tmt = tmt_translator(run_dir, args, device, n_tokens)  # converts into the run's cache
            finally:
                allow_eos()
            translator = ct2.Translator(str(Path(tmp) / "ct2"), device=device.type, intra_threads=args.threads,
                                        inter_threads=1, compute_type=CT2_COMPUTE_TYPE[args.precision])
            if int8 and tmt.engine.name == "ctranslate2":
                translator_int8 = ct2.Translator(str(Path(tmp) / "ct2"), device=device.type,
                                                 intra_threads=args.threads, inter_threads=1, compute_type="int8")
                tmt_int8 = tmt_translator(run_dir, args, device, n_tokens)
                tmt_int8.set_decoding(quantize="int8")
        vocab_size = tokenizers.src.get_vocab_size()
        marian = build_marian(model.cfg, vocab_size).eval().to(device) if with_hf else None
        _, _, sources = read_corpus(args.data, args.src_lang)
        setup_s = time.perf_counter() - setup_started
        print(f"# {args.preset}: d_model={model.cfg.d_model} "
              f"layers={model.cfg.n_encoder_layers}+{model.cfg.n_decoder_layers} "
              f"heads={model.cfg.n_heads} d_ff={model.cfg.d_ff} vocab={vocab_size} (BPE on {args.data.name} train), "
              f"{model.num_parameters() / 1e6:.1f}M parameters"
              + (f" (Marian {marian.num_parameters() / 1e6:.1f}M)" if marian is not None else "")
              + f"; {len(sources)} test sources; attention {attention.names or 'PyTorch chooses'}; setup {setup_s:.1f}s")

        checks = output_checks(decoder, natural, tokenizers, sources, device, precision, n_tokens)

        test_figure = None
        if args.test_beam:
            test_figure = time_test_split(model, tokenizers, sources, args, device, precision)
            print(json.dumps(test_figure), flush=True)

        timings: list[Timing] = []
        hooks = [EosSuppression(m) for m in [decoder] + ([tmt.engine.model] if tmt and tmt.engine.name == "torch"
                                                           else [])]
        try:
            for batch_size in batch_sizes:
                n = args.n_batch1 if batch_size == 1 else args.n_sentences
                batches = source_batches(sources, tokenizers, n, batch_size, model.cfg.max_len)
                uncached = spread_subset(batches, args.n_uncached)
                # Each group decodes the same batches, interleaved; the slow uncached reference
                # runs alone on its subset.
                def torch_engine(beam: int, use_cache: bool = True) -> Callable:
                    return tmt_engine(decoder, device, precision, attention, n_tokens, beam=beam, use_cache=use_cache)
                greedy = [("tmt torch greedy, cached", torch_engine(1))]
                beams = [(f"tmt torch beam {BEAM}", torch_engine(BEAM))]
                if tmt is not None:
                    greedy.append(("tmt translate greedy", translate_engine(tmt, beam=1)))
                    beams.append((f"tmt translate beam {BEAM}", translate_engine(tmt, beam=BEAM)))
                if translator is not None:
                    greedy.append(("ct2 greedy", ct2_engine(translator, n_tokens, beam=1)))
                    beams.append((f"ct2 beam {BEAM}", ct2_engine(translator, n_tokens, beam=BEAM)))
                if tmt_int8 is not None:
                    greedy.append(("tmt translate greedy, int8", translate_engine(tmt_int8, beam=1)))
                if translator_int8 is not None:
                    greedy.append(("ct2 greedy, int8", ct2_engine(translator_int8, n_tokens, beam=1)))
                if marian is not None:
                    greedy.append(("hf_marian greedy", hf_engine(marian, device, precision, attention, n_tokens, beam=1)))
                    beams.append((f"hf_marian beam {BEAM}", hf_engine(marian, device, precision, attention, n_tokens,
                                                                     beam=BEAM)))
                groups = [(greedy, batches), ([("tmt torch greedy, uncached", torch_engine(1, use_cache=False))],
                                              uncached),
                          (beams, batches)]
                for runs, engine_batches in groups:
                    for timing in time_engines(runs, engine_batches, batch_size, n_tokens, args.warmup_batches,
                                               device):
                        timings.append(timing)
                        print(f"{timing.engine:<26} batch {batch_size:>3}  {timing.sentences:>5} sentences  "
                              f"{timing.tokens:>7} tokens  {timing.seconds:8.2f} s  {timing.tokens_per_s:10.1f} tokens/s"
                              f"  (CPU {timing.cpu_seconds:8.2f} s  {timing.tokens_per_cpu_s:10.1f} tokens/CPU-s)",
                              flush=True)
            if args.profile:
                run = tmt_engine(decoder, device, precision, attention, n_tokens, beam=1, use_cache=True)
                profiled = source_batches(sources, tokenizers, args.profile * batch_sizes[-1], batch_sizes[-1],
                                          model.cfg.max_len)
                print_profile({"tmt greedy": [functools.partial(run, *batch) for batch in profiled]}, PROFILE_TOP)
        finally:
            for hook in hooks:
                hook.remove()

    print(json.dumps(summary(args, device, precision, attention, vocab_size, model, timings, batch_sizes, checks,
                             engines, test_figure)))


def time_test_split(model: Transformer, tokenizers: TokenizerPair, sources: list[str], args: argparse.Namespace,
                    device: torch.device, precision) -> dict:
    """Seconds `translate_ids` takes over the first `--test-sentences` test sources (cycled if fewer)
    with `--test-beam` beams, after one untimed warm-up batch: `tmt translate`'s decoding, without
    the process start-up."""
    n, beam = args.test_sentences, args.test_beam
    src_ids = tokenizers.encode_src([sources[i % len(sources)] for i in range(n)])
    decode_cfg = DecodeConfig(beam_size=beam, attention_backend=args.attention_backend)
    run = lambda seqs: translate_ids(model, seqs, decode_cfg, bos_id=BOS_ID, eos_id=EOS_ID, device=device,  # noqa: E731
                                     precision=precision)
    run(src_ids[:32])  # warm-up: CUDA context, kernels, allocator
    synchronize(device)
    started = time.perf_counter()
    hyps = run(src_ids)
    synchronize(device)
    seconds = time.perf_counter() - started
    return {"figure": f"decode_{n}_beam{beam}_s", "seconds": round(seconds, 2), "sentences": n, "beam_size": beam,
            "generated_tokens": sum(len(h) for h in hyps), "source_tokens": sum(len(s) for s in src_ids),
            "batch_tokens": decode_cfg.batch_tokens, "max_len": f"{decode_cfg.max_len_a}·S + {decode_cfg.max_len_b}",
            "preset": args.preset, "precision": precision.name, "data": args.data.name,
            "attention_backend": args.attention_backend,
            "device": device.type if device.type != "cuda" else torch.cuda.get_device_name(device),
            "model": "random init: EOS seldom picked, so sentences run near the length cap"}


def _ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return round(a / b, digits) if a is not None and b is not None else None


def summary(args, device, precision, attention, vocab_size, model, timings, batch_sizes, checks, engines,
            test_figure) -> dict:
    by_batch: dict[str, dict] = {}
    for batch_size in batch_sizes:
        rate = {t.engine: t.tokens_per_s for t in timings if t.batch_size == batch_size}
        cpu_rate = {t.engine: t.tokens_per_cpu_s for t in timings if t.batch_size == batch_size}
        sentences = {t.engine: t.sentences for t in timings if t.batch_size == batch_size}
        greedy, beam = rate["tmt torch greedy, cached"], rate[f"tmt torch beam {BEAM}"]
        translate, translate_beam = rate.get("tmt translate greedy"), rate.get(f"tmt translate beam {BEAM}")
        ct2, ct2_beam = rate.get("ct2 greedy"), rate.get(f"ct2 beam {BEAM}")
        hf, hf_beam = rate.get("hf_marian greedy"), rate.get(f"hf_marian beam {BEAM}")
        int8, ct2_int8 = rate.get("tmt translate greedy, int8"), rate.get("ct2 greedy, int8")
        by_batch[str(batch_size)] = {
            "translate_tokens_per_s": translate and round(translate, 1),
            "translate_beam4_tokens_per_s": translate_beam and round(translate_beam, 1),
            "cached_tokens_per_s": round(greedy, 1),
            "uncached_tokens_per_s": round(rate["tmt torch greedy, uncached"], 1),
            "beam4_tokens_per_s": round(beam, 1),
            "ct2_tokens_per_s": ct2 and round(ct2, 1),
            "ct2_beam4_tokens_per_s": ct2_beam and round(ct2_beam, 1),
            "hf_marian_tokens_per_s": hf and round(hf, 1),
            "hf_marian_beam4_tokens_per_s": hf_beam and round(hf_beam, 1),
            "int8_tokens_per_s": int8 and round(int8, 1),
            "ct2_int8_tokens_per_s": ct2_int8 and round(ct2_int8, 1),
            "cache_speedup": round(greedy / rate["tmt torch greedy, uncached"], 2),
            "tmt_vs_ct2": _ratio(translate, ct2),
            "tmt_beam4_vs_ct2": _ratio(translate_beam, ct2_beam),
            "tmt_vs_ct2_cpu_time": _ratio(cpu_rate.get("tmt translate greedy"), cpu_rate.get("ct2 greedy")),
            "tmt_beam4_vs_ct2_cpu_time": _ratio(cpu_rate.get(f"tmt translate beam {BEAM}"),
                                                cpu_rate.get(f"ct2 beam {BEAM}")),
            "torch_vs_ct2": _ratio(greedy, ct2),
            "torch_beam4_vs_ct2": _ratio(beam, ct2_beam),
            "tmt_int8_vs_ct2_int8": _ratio(int8, ct2_int8),
            "tmt_int8_vs_tmt_fp32": _ratio(int8, translate),
            "tmt_int8_vs_ct2_int8_cpu_time": _ratio(cpu_rate.get("tmt translate greedy, int8"),
                                                    cpu_rate.get("ct2 greedy, int8")),
            "tmt_vs_hf_marian_greedy": _ratio(greedy, hf),
            "tmt_vs_hf_marian_beam4": _ratio(beam, hf_beam),
            "sentences": sentences,
        }
    headline = by_batch[str(max(batch_sizes))]
    return {
        "device": device.type if device.type != "cuda" else torch.cuda.get_device_name(device),
        "cpu": cpu_name(),
        "preset": args.preset,
        **{k: v for k, v in headline.items() if k != "sentences"},
        "headline_batch_size": max(batch_sizes),
        "precision": precision.name,
        "attention_backend": args.attention_backend,
        "attention_kernels": attention.names or "PyTorch chooses",
        "threads": args.threads,
        "gen_tokens": args.gen_tokens,
        "data": args.data.name,
        "vocab_size": vocab_size,
        "parameters": model.num_parameters(),
        **checks,
        "torch": torch.__version__,
        "ctranslate2": engines["ct2"].__version__ if "ct2" in engines else None,
        "transformers": engines["hf_marian"].__version__ if "hf_marian" in engines else None,
        **({test_figure["figure"]: test_figure["seconds"]} if test_figure else {}),
        "by_batch_size": by_batch,
    }


if __name__ == "__main__":
    main()
