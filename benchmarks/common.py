"""What the benchmarks share: the demo corpus and a random model's run of decode.py's presets, a
Hugging Face Marian of tmt's dimensions, the device sync, the machine's and the commit's names, and
the profile table. Each benchmark runs as `python benchmarks/NAME.py`, which puts this folder on
the import path: they import this module as `common`, never each other."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from transformer_mt.config.schema import ModelConfig

if TYPE_CHECKING:  # torch and the model load where used: serve.py's client process stays light
    import torch

    from transformer_mt.data.tokenization import TokenizerPair
    from transformer_mt.model.transformer import Transformer
    from transformer_mt.train.step import TrainStep

REPO = Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO / "transformer_mt" / "corpora" / "demo_en_it"
# The random models decode.py times (and serve.py serves with --bench-model).
DECODE_PRESETS = {
    "cpu-small": {"model": ModelConfig(d_model=256, n_heads=4, n_layers=3, d_ff=1024, dropout=0.0), "vocab_size": 8000},
    "base": {"model": ModelConfig(d_model=512, n_heads=8, n_layers=6, d_ff=2048, dropout=0.0), "vocab_size": 8000},
    # Deep encoder, shallow decoder (Kasai et al. 2021): base's width with the decoder's work cut to a sixth.
    "base-12-1": {"model": ModelConfig(d_model=512, n_heads=8, encoder_layers=12, decoder_layers=1, d_ff=2048,
                                       dropout=0.0), "vocab_size": 8000},
}


# --- corpora and runs ----------------------------------------------------------------------------

def add_setup_arguments(parser: argparse.ArgumentParser, presets: dict, data_help: str) -> None:
    """The options every timing benchmark takes: its corpus, the model preset, the device, the seed."""
    parser.add_argument("--data", type=Path, default=DEMO_CORPUS, help=f"{data_help} (default: the demo corpus)")
    parser.add_argument("--src-lang", default="en", help="source language suffix (default en; the other is the target)")
    parser.add_argument("--preset", choices=sorted(presets), default="cpu-small", help="model dimensions")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--seed", type=int, default=1)


def target_lang(data: Path, src_lang: str) -> str:
    """The other language of a corpus folder holding train.<src_lang> and one other train.<lang>."""
    langs = sorted({p.name.split(".")[1] for p in data.iterdir()
                    if p.name.startswith("train.") and len(p.name.split(".")) >= 2})
    others = [lang for lang in langs if lang != src_lang]
    if src_lang not in langs or len(others) != 1:
        raise SystemExit(f"{data}: expected train.{src_lang} and one other train.<lang> file, found {langs}")
    return others[0]


def read_corpus(directory: Path, src_lang: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(target language, train pairs, test sources) from a corpus folder (train.<lang>, test.<lang>)."""
    from transformer_mt.data.sources import read_aligned_files

    tgt_lang = target_lang(directory, src_lang)
    train = read_aligned_files(_existing(directory / f"train.{src_lang}"), _existing(directory / f"train.{tgt_lang}"))
    test = read_aligned_files(_existing(directory / f"test.{src_lang}"), _existing(directory / f"test.{tgt_lang}"))
    return tgt_lang, train, [src for src, _ in test if src]


def synthetic_corpus(work: Path, pairs: int) -> Path:
    """The folder of `make_synthetic_corpus.py`'s corpus of `pairs` pairs in `work`, made the first time."""
    import subprocess
    import sys

    corpus = work / f"synthetic-{pairs}"
    if not (corpus / "train.it").is_file():
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "make_synthetic_corpus.py"), "--pairs",
                        str(pairs), "--out", str(corpus)], check=True)
    return corpus


def _existing(path: Path) -> Path:
    gz = path.with_name(path.name + ".gz")
    return path if path.is_file() else gz


def build_run(run_dir: Path, preset: str, data: Path = DEMO_CORPUS, src_lang: str = "en",
              seed: int = 1) -> tuple[Transformer, TokenizerPair]:
    """A run directory (tokenizer + checkpoint) with a random model of a DECODE_PRESETS entry, as
    `tmt train` would leave one; the model in eval mode and the tokenizers."""
    import torch

    from transformer_mt.config.schema import Config, DataConfig, TokenizerConfig, config_to_dict
    from transformer_mt.core.run_layout import RunDir
    from transformer_mt.data.tokenization import PAD_ID, train_tokenizers
    from transformer_mt.model.transformer import build_model
    from transformer_mt.runs.checkpoint import checkpoint_state, save_atomic

    tgt_lang, train_pairs, _ = read_corpus(data, src_lang)
    chosen = DECODE_PRESETS[preset]
    cfg = Config(name="bench", seed=seed,
                 data=DataConfig(format="text", path=str(data), src_lang=src_lang, tgt_lang=tgt_lang),
                 tokenizer=TokenizerConfig(vocab_size=chosen["vocab_size"], joint=True, min_frequency=2),
                 model=chosen["model"])
    tokenizers = train_tokenizers(cfg.tokenizer, [s for s, _ in train_pairs], [t for _, t in train_pairs])
    tokenizers.save(run_dir)
    torch.manual_seed(seed)
    vocab_size = tokenizers.src.get_vocab_size()
    model = build_model(cfg.model, vocab_size, vocab_size, PAD_ID)
    RunDir(run_dir).checkpoints.mkdir()
    model_args = {"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, "pad_id": PAD_ID}
    save_atomic(checkpoint_state(model.state_dict(), config_to_dict(cfg), model_args,
                                 tokenizers=tokenizers.fingerprint()), RunDir(run_dir).checkpoints / "best.pt")
    return model.eval(), tokenizers


# --- the Hugging Face baseline -------------------------------------------------------------------

def build_marian(cfg: ModelConfig, vocab_size: int):
    """A randomly initialised `MarianMTModel` of tmt's dimensions, vocabulary and dropouts (no
    download), in training mode. Its generation forces no EOS at the length cap: every engine
    generates the tokens of its choice."""
    from transformers import MarianConfig, MarianMTModel

    from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
    config = MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.n_encoder_layers, decoder_layers=cfg.n_decoder_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function="relu",
        dropout=cfg.dropout, activation_dropout=cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout,
        attention_dropout=cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout,  # as tmt applies it
        max_position_embeddings=cfg.max_len, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID, forced_eos_token_id=None)
    return MarianMTModel(config)


# --- timing and what was timed -------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it counts that work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tmt_update_steps(train_step: TrainStep, index_batches: list,
                     on_batch: Callable[[object], None] | None = None) -> list[Callable[[], int]]:
    """tmt's update as its training loop runs it, one callable per batch of `index_batches` (each
    returns the batch's real target tokens): the batch built as the loop builds it (padding, pinned
    memory), the next one while the device works on this step (`while_device_works`).
    `on_batch(batch)` sees each batch once it is trained."""
    prefetched: dict[int, object] = {}

    def step(k: int) -> Callable[[], int]:
        def load_next() -> None:
            if k + 1 < len(index_batches):
                prefetched[k + 1] = train_step.batches.load(index_batches[k + 1])

        def run() -> int:
            batch = prefetched.pop(k, None) or train_step.batches.load(index_batches[k])
            train_step.run(batch, while_device_works=load_next)
            if on_batch is not None:
                on_batch(batch)
            return batch.n_tgt_tokens
        return run
    return [step(k) for k in range(len(index_batches))]


def print_profile(rounds: dict[str, list[Callable[[], object]]], top: int) -> None:
    """One round of each engine under torch.profiler: self CPU milliseconds and calls of its `top`
    costliest operators, the engines side by side."""
    from torch.profiler import ProfilerActivity, profile
    costs: dict[str, dict[str, tuple[float, int]]] = {}
    for name, steps in rounds.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in steps:
                step()
        costs[name] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    names = list(costs)
    ops = sorted(set().union(*costs.values()), key=lambda op: -max(costs[n].get(op, (0.0, 0))[0] for n in names))
    print("# profile of one round (self CPU ms, calls)")
    print(f"{'operator':<48}" + "".join(f" {n + ' ms':>12} {'calls':>6}" for n in names))
    for op in ops[:top]:
        print(f"{op[:48]:<48}" + "".join(f" {costs[n].get(op, (0.0, 0))[0]:>12.1f} {costs[n].get(op, (0.0, 0))[1]:>6}"
                                        for n in names))
    print(f"{'total':<48}" + "".join(f" {sum(c for c, _ in costs[n].values()):>12.1f} {'':>6}" for n in names))


def cpu_name() -> str:
    """The processor's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment for a `tmt` subprocess that imports this checkout first, then the
    caller's PYTHONPATH (e.g. wheels carried to a GPU machine)."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def commit() -> str | None:
    """The commit measured: $COMMIT (a copy of the tree without .git, as a GPU machine may get), else git's."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None
