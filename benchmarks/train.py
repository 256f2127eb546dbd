"""Training speed of tmt against a from-scratch tutorial baseline and Hugging Face's MarianMTModel.

One process, the same training sentences for all engines, each timed after warm-up:

- **tmt_padded**: a `Trainer` built from the preset with `train.batching: padded` (token-budget,
  length-bucketed batches from its own sampler, its own `train.step`: autocast, GradScaler, fused
  AdamW; every layer at the real tokens only, except where a captured or compiled step needs
  fixed shapes).
- **tmt_packed**: the same with `train.batching: packed`: the same sentences laid end to end into
  packs of `batch_tokens` target tokens (one shape: one captured graph on a GPU); the round's last
  pack, filled only partly because the round's sentences end there, is left out when there are others. `tmt_*` figures
  of the JSON line are those of the engine `train.batching: auto` picks on the device; the
  `engines` entry holds both, each with its real-token share (real target tokens ÷ target
  positions computed).
- **tutorial**: the approach of the common from-scratch tutorials, written here so nothing else
  depends on it: every pair padded to a fixed length (default 350), fp32, a fixed number of
  sentences per batch, masks built as dense float tensors, attention as plain matmul/softmax.
- **hf_marian**: `transformers.MarianMTModel` built locally from a `MarianConfig` with the same
  dimensions (no download), trained with its own loss on tmt's batches.

Speed is real (non-pad) target tokens per second; MFU counts the real tokens' FLOPs. On CUDA, `peak_memory_mb` is tmt's peak
allocated memory over its warm-up and rounds (its own weights, gradients and optimizer state, plus
the largest step's activations; under CUDA graphs their memory pool, taken when a shape is captured), and `peak_memory_mb_per_1k_tgt_tokens` divides it by the mean real
target tokens per step, in thousands. The engines run interleaved, `--repeats`
rounds of each, and the reported figure is each engine's median round: on a shared machine a
neighbour's burst then hits one round, not one engine.

    python benchmarks/train.py                                   # demo corpus, cpu-small, 1 thread
    python benchmarks/train.py --data path/to/multi30k_en_de
    python benchmarks/train.py --data path/to/multi30k_en_de --profile 25   # where the time goes
    python benchmarks/train.py --device cuda --preset base --data path/to/multi30k_en_de

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from transformer_mt.config.schema import Config, DataConfig, ModelConfig, TokenizerConfig, TrainConfig
from transformer_mt.data.batching import Batch, greedy_packs
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.train.batches import packed_batches
from transformer_mt.train.interval import peak_flops_per_s
from transformer_mt.train.trainer import Trainer

from common import (add_setup_arguments, build_marian, commit, cpu_name, print_profile, synchronize, target_lang,
                    tmt_update_steps)

PRESETS = {
    "cpu-small": {"model": ModelConfig(d_model=256, n_heads=4, n_layers=3, d_ff=1024, dropout=0.1, max_len=256),
                  "vocab_size": 8000, "batch_tokens": 2048, "steps": 6, "warmup": 2},
    "base": {"model": ModelConfig(d_model=512, n_heads=8, n_layers=6, d_ff=2048, dropout=0.1, max_len=256),
             "vocab_size": 8000, "batch_tokens": 16384, "steps": 60, "warmup": 10},
}  # batch_tokens: on a CPU; on a GPU tmt's `auto` budget unless --batch-tokens says otherwise


TUTORIAL_ROUNDS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setup_arguments(parser, PRESETS, "corpus directory: train.<lang>, valid.<lang>, test.<lang>")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed tmt/Marian steps per round (default: the preset's)")
    parser.add_argument("--repeats", type=int, default=5,
                        help=f"interleaved timing rounds (default 5; the tutorial runs in the first {TUTORIAL_ROUNDS})")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tmt's train.batch_tokens (default: the preset's on a CPU, auto on a GPU: sized for its memory)")
    parser.add_argument("--attention-dropout", type=float, default=None, metavar="P",
                        help="the model's attention dropout, for tmt and Marian alike (default: the preset's "
                             "dropout); 0 lets packed batches on CUDA take FlashAttention's variable-length kernel")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="train.KEY=VALUE",
                        help="extra train.* settings for tmt, e.g. --set train.compile=true")
    parser.add_argument("--tutorial-pad-len", type=int, default=350, help="tutorial: fixed padded length")
    parser.add_argument("--tutorial-batch-sentences", type=int, default=8, help="tutorial: sentences per batch")
    parser.add_argument("--tutorial-steps", type=int, default=None,
                        help="tutorial steps timed per round (default 2 on a CPU, where each takes seconds; "
                             "20 on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--label", default="bench",
                        help="the JSON line's `figure` name, e.g. bench-multi30k (benchmarks/gpu_runbook.sh sets it)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile one more round of tmt and of Marian with torch.profiler "
                             "and print their N costliest operators side by side (self CPU ms)")
    return parser.parse_args(argv)


def build_trainer(args: argparse.Namespace, run_dir: Path, batching: str = "auto") -> Trainer:
    preset = PRESETS[args.preset]
    tgt_lang = target_lang(args.data, args.src_lang)
    # On a GPU tmt's own choice for the device (`train.batch_tokens: auto`), as a user's run would.
    default_tokens = preset["batch_tokens"] if args.device == "cpu" else "auto"
    train = TrainConfig(max_steps=10**9, batch_tokens=args.batch_tokens or default_tokens,
                        device=args.device, log_every_steps=10**9, eval_every_steps=10**9, test_at_end=False)
    for item in args.overrides:
        key, _, value = item.partition("=")
        if not key.startswith("train."):
            raise SystemExit(f"--set {item}: only train.* keys may be set here")
        import yaml
        train = replace(train, **{key[len("train."):]: yaml.safe_load(value)})
    train = replace(train, batching=batching)
    cfg = Config(name="bench", seed=args.seed,
                 data=DataConfig(format="text", path=str(args.data), src_lang=args.src_lang, tgt_lang=tgt_lang,
                                 valid_size=100, test_size=100),  # used only when the corpus lacks them
                 tokenizer=TokenizerConfig(vocab_size=preset["vocab_size"], joint=True, min_frequency=2),
                 model=replace(preset["model"], attention_dropout=args.attention_dropout), train=train)
    return Trainer(cfg, run_dir, progress=False)


# --- the tutorial baseline --------------------------------------------------------------------
# Written the way the popular from-scratch tutorials write it (fixed-length padding, dense float
# masks, -1e9 fills, explicit softmax attention); deliberately not using any of tmt's code.

class TutorialAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask):
        B = q.shape[0]
        q = self.w_q(q).view(B, -1, self.h, self.d_k).transpose(1, 2)  # (B, H, L, Dh)
        k = self.w_k(k).view(B, -1, self.h, self.d_k).transpose(1, 2)
        v = self.w_v(v).view(B, -1, self.h, self.d_k).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, H, Lq, Lk)
        scores = scores.masked_fill(mask == 0, -1e9)
        attn = self.dropout(scores.softmax(dim=-1))
        return self.w_o((attn @ v).transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k))


class TutorialBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, cross: bool):
        super().__init__()
        self.self_attn = TutorialAttention(d_model, n_heads, dropout)
        self.cross_attn = TutorialAttention(d_model, n_heads, dropout) if cross else None
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3 if cross else 2))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask, memory=None, memory_mask=None):
        h = self.norms[0](x)
        x = x + self.dropout(self.self_attn(h, h, h, mask))
        if self.cross_attn is not None:
            h = self.norms[1](x)
            x = x + self.dropout(self.cross_attn(h, memory, memory, memory_mask))
        return x + self.dropout(self.ff(self.norms[-1](x)))


class TutorialTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_len: int):
        super().__init__()
        self.d_model = cfg.d_model
        self.src_embed = nn.Embedding(vocab_size, cfg.d_model)
        self.tgt_embed = nn.Embedding(vocab_size, cfg.d_model)
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, cfg.d_model, 2) * (-math.log(10000.0) / cfg.d_model))
        pe = torch.zeros(max_len, cfg.d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(cfg.dropout)
        args = (cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout)
        self.encoder = nn.ModuleList(TutorialBlock(*args, cross=False) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(TutorialBlock(*args, cross=True) for _ in range(cfg.n_decoder_layers))
        self.enc_norm, self.dec_norm = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, vocab_size)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def embed(self, embedding, ids):
        return self.dropout(embedding(ids) * math.sqrt(self.d_model) + self.pe[: ids.shape[1]])

    def forward(self, src, tgt, src_mask, tgt_mask):
        x = self.embed(self.src_embed, src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        memory = self.enc_norm(x)
        y = self.embed(self.tgt_embed, tgt)
        for layer in self.decoder:
            y = layer(y, tgt_mask, memory, src_mask)
        return self.proj(self.dec_norm(y))  # (B, L, V)


def tutorial_batches(pairs: list[tuple[list[int], list[int]]], n_sentences: int, pad_len: int,
                     device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Fixed-length, fixed-count batches with dense float masks, as the tutorials build them."""
    batches = []
    for start in range(0, len(pairs), n_sentences):
        chunk = pairs[start:start + n_sentences]
        src = torch.full((len(chunk), pad_len), PAD_ID, dtype=torch.long)
        tgt_in, tgt_out = src.clone(), src.clone()
        for row, (s, t) in enumerate(chunk):
            s, t = s[: pad_len - 1], t[: pad_len - 1]
            src[row, : len(s) + 1] = torch.tensor(s + [EOS_ID])
            tgt_in[row, : len(t) + 1] = torch.tensor([BOS_ID] + t)
            tgt_out[row, : len(t) + 1] = torch.tensor(t + [EOS_ID])
        src_mask = (src != PAD_ID).float()[:, None, None, :]  # (B, 1, 1, L) float
        causal = torch.tril(torch.ones(pad_len, pad_len))  # (L, L) float
        tgt_mask = (tgt_in != PAD_ID).float()[:, None, None, :] * causal  # (B, 1, L, L) float
        n_tgt = int((tgt_out != PAD_ID).sum())
        batches.append((src.to(device), tgt_in.to(device), tgt_out.to(device), src_mask.to(device),
                        tgt_mask.to(device), n_tgt))
    return batches


# --- Hugging Face Marian ------------------------------------------------------------------------

def marian_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    labels = batch.tgt_out_ids.masked_fill(batch.tgt_out_ids == PAD_ID, -100)  # HF's ignore index
    return {"input_ids": batch.src_ids, "attention_mask": (batch.src_ids != PAD_ID).long(),
            "decoder_input_ids": batch.tgt_in_ids, "labels": labels}


# --- timing -------------------------------------------------------------------------------------

def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a model keeps between steps: parameters, their gradients, the optimizer's state tensors."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(device: torch.device, steps: list[Callable[[], int]]) -> tuple[float, float, int]:
    """Run each step (which returns its real target tokens); (wall seconds, process CPU seconds, tokens)."""
    synchronize(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = sum(step() for step in steps)
    synchronize(device)
    return time.perf_counter() - started, time.process_time() - cpu_started, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("transformers") is None:  # the baseline, before minutes of setup
        raise SystemExit("bench_train: the HF Marian baseline needs transformers: pip install -e '.[bench]'")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    preset = PRESETS[args.preset]
    steps = args.steps or preset["steps"]
    if steps < 1 or args.repeats < 1:
        raise SystemExit("--steps and --repeats must be at least 1")
    warmup = preset["warmup"]
    tutorial_steps = args.tutorial_steps or (20 if args.device.startswith("cuda") else 2)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build_trainer(args, Path(tmp) / name, name) for name in ("padded", "packed")}
    trainer = trainers["padded"]  # its sampler draws the sentences every engine trains on
    if trainer.tokenizers.src.to_str() != trainers["packed"].tokenizers.src.to_str():
        raise SystemExit("bench_train: the two tmt engines trained different tokenizers on the same corpus")
    if not trainers["packed"].engine.packed:  # its self-check failed here (the warning above says why)
        raise SystemExit("bench_train: packed batches fell back to padded ones in the engine's self-check on this "
                         "device: no packed engine to measure")
    device, cfg = trainer.device, trainer.cfg
    auto_engine = "tmt_packed" if packed_batches(replace(cfg, train=replace(cfg.train, batching="auto")),
                                                 device) else "tmt_padded"
    data = trainer.train_data
    vocab_size = trainer.tokenizers.src.get_vocab_size()
    sampler = iter(trainer.sampler)
    # The same index batches for tmt and Marian: warm-up batches, then `steps` per round.
    index_batches = [next(sampler) for _ in range(warmup + steps)]
    timed_indices = index_batches[warmup:]
    sentence_order = [i for batch in timed_indices for i in batch]
    src_ids, tgt_ids = data.ids(sentence_order)
    # The packed engine: the same sentences, in the same order, laid into its packs (its rate counts its own tokens).
    pack = trainers["packed"].train_step.batches.pack

    def packs_of(batches: list[np.ndarray]) -> list[np.ndarray]:
        """The sentences of `batches` in packs; the last pack, partly filled only because a round's
        sentences end there, is left out when there are others (training's packs run on)."""
        order = np.concatenate(batches)
        packs = greedy_packs(order, data.src_len + 1, data.tgt_len + 1, pack.src_tokens, pack.tgt_tokens)
        return packs[:-1] if len(packs) > 1 else packs

    computed: dict[str, list[int]] = {"tmt_padded": [0, 0], "tmt_packed": [0, 0]}  # real, computed target positions

    # tmt, as its training loop runs (`tmt_update_steps`). Marian's step never waits for its device
    # at the end, so its next batch overlaps the same way.
    def tmt_steps(name: str, index_list: list[np.ndarray], count: bool = False) -> list[Callable[[], int]]:
        def counted(batch: Batch) -> None:
            computed[name][0] += batch.n_tgt_tokens
            computed[name][1] += batch.padded_tgt_slots
        return tmt_update_steps(trainers[name.removeprefix("tmt_")].train_step, index_list,
                                counted if count else None)

    # tutorial (its own model, fp32, fixed-length batches of the same sentences)
    torch.manual_seed(args.seed)
    tutorial = TutorialTransformer(cfg.model, vocab_size, args.tutorial_pad_len).to(device)
    tutorial_opt = torch.optim.Adam(tutorial.parameters(), lr=1e-4, eps=1e-9)
    # Only the batches it times: each carries a dense (B, 1, L, L) float mask (3.9 MB at 8 x 350),
    # and a base-preset round's sentences would fill tens of GB of a GPU with unused masks.
    # Its real tokens per second grow with the sentences' length (every pair is padded to the
    # same length): its sentences are spread evenly over the round's, not the first few
    # batches' (one length bucket), so their lengths are the round's.
    tut_pairs = list(zip(src_ids, tgt_ids))
    tut_total_batches = math.ceil(len(tut_pairs) / args.tutorial_batch_sentences)
    n_tut = min(tutorial_steps * args.tutorial_batch_sentences, len(tut_pairs))
    tut_sample = [tut_pairs[i] for i in np.linspace(0, len(tut_pairs) - 1, n_tut).round().astype(int)]
    tut_batches = tutorial_batches(tut_sample, args.tutorial_batch_sentences, args.tutorial_pad_len, device)
    mean_tgt = {"round": statistics.fmean(len(t) + 1 for _, t in tut_pairs),
                "tutorial": statistics.fmean(len(t) + 1 for _, t in tut_sample)}

    def tutorial_step(b) -> Callable[[], int]:
        def run() -> int:
            src, tgt_in, tgt_out, src_mask, tgt_mask, n_tgt = b
            tutorial.train()
            logits = tutorial(src, tgt_in, src_mask, tgt_mask)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt_out.view(-1), ignore_index=PAD_ID,
                                   label_smoothing=cfg.train.label_smoothing)
            tutorial_opt.zero_grad()
            loss.backward()
            tutorial_opt.step()
            return n_tgt
        return run

    # Hugging Face Marian on tmt's batches, with its own loss; same optimizer settings and precision.
    torch.manual_seed(args.seed)
    marian = build_marian(cfg.model, vocab_size).to(device)
    marian_opt = torch.optim.AdamW(marian.parameters(), lr=cfg.train.lr, betas=cfg.train.betas, eps=1e-9,
                                   fused=trainer.train_step.fused_optimizer)  # the same optimizer as tmt

    def marian_step(indices) -> Callable[[], int]:
        def run() -> int:
            batch = trainer.train_step.batches.load(indices)
            marian.train()
            with trainer.precision.autocast():
                loss = marian(**marian_inputs(batch)).loss
            marian_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(marian.parameters(), cfg.train.clip_grad_norm)
            marian_opt.step()
            return batch.n_tgt_tokens
        return run

    # What each engine keeps on the device between steps (weights, gradients, optimizer moments):
    # the peak of one engine's round counts the other engines' resident state too, so each
    # peak below is taken over the memory allocated when its round starts, plus its own state.
    resident = {"tmt_padded": (trainer.model, trainer.train_step.optimizer),
                "tmt_packed": (trainers["packed"].model, trainers["packed"].train_step.optimizer),
                "tutorial": (tutorial, tutorial_opt), "hf_marian": (marian, marian_opt)}

    engines = {
        "tmt_padded": (tmt_steps("tmt_padded", index_batches[:warmup]),
                       tmt_steps("tmt_padded", timed_indices, count=True)),
        "tmt_packed": (tmt_steps("tmt_packed", packs_of(index_batches[:warmup])),
                       tmt_steps("tmt_packed", packs_of(timed_indices), count=True)),
        "tutorial": ([tutorial_step(tut_batches[0])], [tutorial_step(b) for b in tut_batches[:tutorial_steps]]),
        "hf_marian": ([marian_step(b) for b in index_batches[:warmup]], [marian_step(b) for b in timed_indices]),
    }
    peak_mb: dict[str, float | None] = {name: None for name in engines}
    for name, (warm, _) in engines.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start_bytes, start_resident = torch.cuda.memory_allocated(device), resident_bytes(*resident[name])
        timed(device, warm)
        if device.type == "cuda":  # the warm-up's peak counts too: CUDA graphs take their memory when captured
            peak_mb[name] = (torch.cuda.max_memory_allocated(device) - start_bytes + start_resident) / 2**20
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu_rates: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for round_number in range(args.repeats):
        # Rotate the order each round, so no engine always runs after the memory-hungry tutorial.
        turn = round_number % len(names)
        for name in names[turn:] + names[:turn]:
            if name == "tutorial" and round_number >= TUTORIAL_ROUNDS:
                continue  # tens of times slower: a few rounds pin its figure down well enough
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                start_bytes = torch.cuda.memory_allocated(device)
            elapsed, cpu_elapsed, n = timed(device, engines[name][1])
            rates[name].append(n / elapsed)
            cpu_rates[name].append(n / cpu_elapsed)
            if device.type == "cuda":
                own_peak = torch.cuda.max_memory_allocated(device) - start_bytes + resident_bytes(*resident[name])
                peak_mb[name] = max(peak_mb[name] or 0.0, own_peak / 2**20)
    speed = {name: statistics.median(r) for name, r in rates.items()}
    # On a CPU shared with other jobs, wall time swings with their load; with one torch thread the
    # process's CPU time counts only this engine's work, so its ratios are the steadier figure.
    cpu_speed = {name: statistics.median(r) for name, r in cpu_rates.items()}

    # MFU of tmt: useful FLOPs of the timed batches (real tokens only) over the device's peak.
    lengths = data.lengths_of
    flops_per_round = sum(trainer.model.train_flops(*lengths(b)) for b in timed_indices)
    tokens_per_round = sum(int(lengths(b)[1].sum()) for b in timed_indices)  # target tokens, as the rates count
    peak = peak_flops_per_s(device, trainer.precision.name)

    def mfu_of(name: str) -> float | None:  # at the engine's median round
        return flops_per_round * speed[name] / tokens_per_round / peak if peak else None

    def share_of(name: str) -> float:  # real target tokens ÷ target positions computed, over its timed rounds
        real, slots = computed[name]
        return real / slots if slots else 1.0
    tgt_tokens_per_step = sum(len(tgt_ids[i]) + 1 for i in range(len(tgt_ids))) / max(len(timed_indices), 1)

    print(f"# {args.preset}: d_model={cfg.model.d_model} "
          f"layers={cfg.model.n_encoder_layers}+{cfg.model.n_decoder_layers} "
          f"heads={cfg.model.n_heads} d_ff={cfg.model.d_ff} vocab={vocab_size}; device {device}, "
          f"tmt precision {trainer.precision.name}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"{cpu_name()}")
    print(f"# corpus {args.data}: {len(sentence_order)} sentences per round in {len(timed_indices)} tmt/Marian "
          f"batches (batch_tokens {cfg.train.batch_tokens}, {tgt_tokens_per_step:.0f} target tokens per step), "
          f"packed: {len(engines['tmt_packed'][1])} packs of {pack.src_tokens} source and {pack.tgt_tokens} target "
          f"tokens; "
          f"tutorial: {tutorial_steps} of its {tut_total_batches} batches of {args.tutorial_batch_sentences} "
          f"sentences padded to {args.tutorial_pad_len}, spread over the round (mean target length "
          f"{mean_tgt['tutorial']:.1f}, the round's {mean_tgt['round']:.1f}); {args.repeats} interleaved rounds (tutorial: "
          f"{min(args.repeats, TUTORIAL_ROUNDS)}), median shown")
    print(f"{'engine':<12} {'tgt tokens/s':>13} {'per CPU-s':>10} {'rounds (tokens/s, wall)':<44} {'peak MB':>8} "
          f"{'real share':>10}")
    for name in engines:
        rounds = ", ".join(f"{r:.0f}" for r in rates[name])
        mem = f"{peak_mb[name]:.0f}" if peak_mb[name] is not None else "n/a"
        share = f"{share_of(name):.3f}" if name in computed else ""
        print(f"{name:<12} {speed[name]:>13.1f} {cpu_speed[name]:>10.1f} {rounds:<44} {mem:>8} {share:>10}")
    tmt = auto_engine  # the `tmt_*` figures: the engine a run on this device takes
    result = {
        "figure": args.label,
        "commit": commit(),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "preset": args.preset,
        "data": str(args.data),
        "precision": trainer.precision.name,
        "threads": torch.get_num_threads(),
        "tmt_engine": tmt.removeprefix("tmt_"),
        "tmt_tokens_per_s": round(speed[tmt], 1),
        "tutorial_tokens_per_s": round(speed["tutorial"], 1),
        "hf_marian_tokens_per_s": round(speed["hf_marian"], 1),
        "tmt_vs_tutorial": round(speed[tmt] / speed["tutorial"], 3),
        "tmt_vs_hf_marian": round(speed[tmt] / speed["hf_marian"], 3),
        "mfu": round(mfu_of(tmt), 4) if peak else None,
        "real_token_share": round(share_of(tmt), 4),
        "peak_memory_mb": round(peak_mb[tmt], 1) if peak_mb[tmt] is not None else None,
        "peak_memory_mb_per_1k_tgt_tokens": (round(peak_mb[tmt] / tgt_tokens_per_step * 1000, 2)
                                             if peak_mb[tmt] is not None else None),
        "engines": {name.removeprefix("tmt_"): {
            "tokens_per_s": round(speed[name], 1), "vs_hf_marian": round(speed[name] / speed["hf_marian"], 3),
            "vs_hf_marian_cpu_time": round(cpu_speed[name] / cpu_speed["hf_marian"], 3),
            "mfu": round(mfu_of(name), 4) if peak else None, "real_token_share": round(share_of(name), 4),
            "peak_memory_mb": round(peak_mb[name], 1) if peak_mb[name] is not None else None,
            "cuda_graphs": trainers[name.removeprefix("tmt_")].train_step.engine_report()}
            for name in computed},
        "packed_vs_padded": round(speed["tmt_packed"] / speed["tmt_padded"], 3),
        "packed_vs_padded_cpu_time": round(cpu_speed["tmt_packed"] / cpu_speed["tmt_padded"], 3),
        "hf_marian_peak_memory_mb": peak_mb["hf_marian"],
        "tokens_per_cpu_s": {name: round(v, 1) for name, v in cpu_speed.items()},
        "tmt_vs_tutorial_cpu_time": round(cpu_speed[tmt] / cpu_speed["tutorial"], 3),
        "tmt_vs_hf_marian_cpu_time": round(cpu_speed[tmt] / cpu_speed["hf_marian"], 3),
        "rounds": {name: [round(r, 1) for r in values] for name, values in rates.items()},
        "steps": steps, "repeats": args.repeats, "batch_tokens": cfg.train.batch_tokens,
        "batch_tokens_auto": args.batch_tokens is None and args.device != "cpu",  # tmt's choice for the device
        "overrides": args.overrides, "attention_dropout": args.attention_dropout,
        "cuda_graphs": trainers[tmt.removeprefix("tmt_")].train_step.engine_report(),  # shapes, seconds (not in the rates)
    }
    if args.profile:
        print_profile({name: engines[name][1] for name in ("tmt_padded", "tmt_packed", "hf_marian")}, args.profile)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
