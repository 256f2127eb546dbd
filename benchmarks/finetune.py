"""Fine-tuning and decoding speed of an imported OPUS-MT (Marian) model: tmt against Hugging Face's
`Seq2SeqTrainer` and `generate` on the same model.

One process:

1. builds a Marian model of OPUS-MT's shape (d_model 512, 6+6 layers, 8 heads, FFN 2048, swish,
   58,101 vocabulary entries) with random weights, and its tokenizer: two SentencePiece unigram
   models trained on the corpus's training split (source and target), their pieces as
   `vocab.json`, padded with unused pieces up to `--vocab-size` when the corpus yields fewer (so
   the embeddings and the output layer cost what OPUS-MT's do); trains it `--fit-steps` steps
   on the training pairs (a plain loop, untimed) so that it ends its sentences as a trained model
   does; writes both with `save_pretrained` and turns the folder into a tmt run with `tmt import`;
2. fine-tunes it from the same weights with tmt (the `Trainer` that `tmt train` builds for a config
   naming only `data` and `train`, with `train.init_from` the imported run) and with transformers'
   `Seq2SeqTrainer` (the folder's `MarianMTModel`), fp32, AdamW with tmt's settings, label
   smoothing and clipping alike, on the same batches: tmt's token-budget batches drawn by its
   sampler, given to `Seq2SeqTrainer` as the same rows of token ids (Marian's ids), which its
   `DataCollatorForSeq2Seq` pads. Each runs `--warmup-steps` untimed steps, then `--steps` timed
   ones: tmt's update as its training loop runs it (the next batch built while the step runs), and
   `Seq2SeqTrainer.train()` timed from the end of its last warm-up step to the end of its last
   step (its step callback), so both clocks hold only the training steps and what the loop does
   between them. Speed is real target tokens (with EOS) per second;
3. decodes the corpus's test sources in batches of `--batch-size` with beam `--beam` and at most
   `--max-tokens` generated tokens, on tmt's CTranslate2 engine (fp32, and on a CPU int8 as
   `tmt translate --quantize int8`), tmt's torch engine and `MarianMTModel.generate`, after one
   untimed batch each; the engines take each batch in turn, in rotating order. All start from token ids (tokenization is left out of the clocks); speed is
   generated tokens (without EOS) per second and sentences per second. A random model
   (`--fit-steps 0`) seldom ends a sentence, so most run to the cap in every engine.

Prints one JSON line per figure, `{"figure": "<label>-train", ...}` and `{"figure": "<label>-decode", ...}`,
with the commit, the CPU, the threads and the versions of torch, transformers and CTranslate2.

    python benchmarks/finetune.py --threads $(nproc)               # demo corpus, OPUS-MT's size, CPU
    python benchmarks/finetune.py --d-model 64 --layers 1 --heads 2 --ffn 128 --vocab-size 1000  # tiny
    python benchmarks/finetune.py --device cuda --batch-tokens 8192 --steps 30 --threads 4
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from transformer_mt.config.loading import load_config
from transformer_mt.core.errors import TmtError
from transformer_mt.pretrained.marian_vocab import MarianVocab
from transformer_mt.runs.init_from import inherited_settings, load_parent
from transformer_mt.train.trainer import Trainer

from common import (DEMO_CORPUS, checkout_env, commit, cpu_name, print_profile, read_corpus, synchronize,
                    tmt_update_steps)

OPUS_VOCAB = 58_101  # the vocabulary of OPUS-MT's en-de and many others
LR = 5e-5  # a fine-tuning rate, for both (it does not change the speed)
PROFILE_TOP = 15
GOALS = {"train": 1.2, "decode": 3.0}  # tmt ÷ Hugging Face: fine-tuning target tokens/s; CTranslate2 ÷ generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEMO_CORPUS,
                        help="corpus folder: train.<lang>, test.<lang>, valid.<lang> or carved (default: the demo "
                             "corpus)")
    parser.add_argument("--src-lang", default="en", help="source language suffix (default en; the other is the target)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads and CTranslate2's threads (tmt's engine: int8 one batch per thread), "
                             "for every engine (default 1)")
    parser.add_argument("--seed", type=int, default=1)
    size = parser.add_argument_group("the model (default: OPUS-MT's)")
    size.add_argument("--d-model", type=int, default=512)
    size.add_argument("--layers", type=int, default=6, help="encoder and decoder layers each (default 6)")
    size.add_argument("--heads", type=int, default=8)
    size.add_argument("--ffn", type=int, default=2048, help="feed-forward width (default 2048)")
    size.add_argument("--vocab-size", type=int, default=OPUS_VOCAB,
                      help=f"vocab.json entries, padded with unused pieces (default {OPUS_VOCAB:,}, OPUS-MT's)")
    size.add_argument("--spm-vocab", type=int, default=8000,
                      help="each SentencePiece model's size, at most (a small corpus gives fewer; default 8000)")
    train = parser.add_argument_group("fine-tuning")
    train.add_argument("--batch-tokens", type=int, default=1024,
                       help="tmt's train.batch_tokens: its batches, which both train on (default 1024)")
    train.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default 2)")
    train.add_argument("--steps", type=int, default=6, help="timed steps (default 6)")
    decode = parser.add_argument_group("decoding")
    decode.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    decode.add_argument("--beam", type=int, default=4, help="beam size (default 4)")
    decode.add_argument("--max-tokens", type=int, default=64,
                        help="generated tokens per sentence, at most (default 64)")
    decode.add_argument("--sentences", type=int, default=0, help="test sources decoded (default 0: all)")
    decode.add_argument("--fit-steps", type=int, default=60,
                        help="train the random model this many steps (batches of 32 training pairs) before it "
                             "is saved, so that it ends its sentences as a trained model does; 0: decode the "
                             "random model, which seldom ends one (default 60)")
    decode.add_argument("--fit-lr", type=float, default=5e-4, help="the fitting's peak learning rate (default 5e-4)")
    parser.add_argument("--label", default="finetune", help="the figures' name: <label>-train, <label>-decode")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile tmt's and the Hugging Face steps again over the timed batches "
                             "and print their N costliest operators side by side (self CPU ms)")
    args = parser.parse_args(argv)
    if min(args.threads, args.steps, args.warmup_steps, args.batch_size, args.beam, args.max_tokens) < 1:
        parser.error("--threads, --steps, --warmup-steps, --batch-size, --beam and --max-tokens must be at least 1")
    if args.fit_steps < 0:
        parser.error("--fit-steps must be at least 0")
    return args


# --- the model: an OPUS-MT folder, as save_pretrained writes it ---------------------------------

def train_spm(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    """A SentencePiece unigram model of `lines` as OPUS-MT's (nmt_nfkc, full character coverage), of
    at most `vocab_size` pieces; its path."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def padded_vocab(spm_paths: list[Path], size: int) -> tuple[dict[str, int], int]:
    """Marian's vocab.json for these models: `</s>` 0, `<unk>` 1, their pieces in order, each once,
    unused pieces up to `size`, `<pad>` last; and how many pieces the models have."""
    import sentencepiece

    pieces = ["</s>", "<unk>"]
    for path in spm_paths:
        model = sentencepiece.SentencePieceProcessor(model_file=str(path))
        pieces += [model.id_to_piece(i) for i in range(model.get_piece_size())
                   if not (model.is_control(i) or model.is_unknown(i) or model.is_unused(i))]
    pieces = list(dict.fromkeys(pieces))
    real = len(pieces) - 2
    if len(pieces) + 1 > size:
        raise SystemExit(f"--vocab-size {size}: the SentencePiece models have {real} pieces; give at least "
                         f"{len(pieces) + 1}")
    pieces += [f"<unused{i}>" for i in range(size - 1 - len(pieces))]
    return {piece: i for i, piece in enumerate(pieces + ["<pad>"])}, real


def write_marian_folder(folder: Path, args: argparse.Namespace, tgt_lang: str,
                        train_pairs: list[tuple[str, str]]) -> dict:
    """A random MarianMTModel of the chosen size and its MarianTokenizer, saved into `folder`; what was built."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    work = folder.parent / "spm"
    work.mkdir()
    src = train_spm([s for s, _ in train_pairs], work / "source", args.spm_vocab)
    tgt = train_spm([t for _, t in train_pairs], work / "target", args.spm_vocab)
    vocab, pieces = padded_vocab([src, tgt], args.vocab_size)
    (work / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = MarianTokenizer(source_spm=str(src), target_spm=str(tgt), vocab=str(work / "vocab.json"),
                                source_lang=args.src_lang, target_lang=tgt_lang)
    tokenizer.save_pretrained(str(folder))
    pad = tokenizer.pad_token_id
    config = MarianConfig(  # OPUS-MT's settings, at the chosen size
        vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=args.d_model, encoder_layers=args.layers,
        decoder_layers=args.layers, encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn, decoder_ffn_dim=args.ffn, activation_function="swish", max_position_embeddings=512,
        scale_embedding=True, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=pad, forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    model = MarianMTModel(config)
    fitted = fit(model, tokenizer, train_pairs, args)
    model.generation_config.num_beams = args.beam
    model.generation_config.max_length = 512
    # No EOS forced at the length cap (OPUS-MT forces one): every engine generates the tokens of its choice.
    model.generation_config.bad_words_ids = [[pad]]  # as OPUS-MT's: padding is never generated
    model.save_pretrained(folder)
    return {"vocab_size": len(vocab), "spm_pieces": pieces, "parameters": model.num_parameters(), "pad": pad,
            "eos": tokenizer.eos_token_id, **fitted}


FIT_BATCH = 32  # training pairs a fitting step


def fit(model, tokenizer, pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    """Train the random model `--fit-steps` steps on random batches of the training pairs (teacher
    forcing, AdamW, 10 % linear warm-up): decoding's speed depends on where sentences end, and a
    random model runs every one to the cap. The first and last steps' losses (a plain loop, untimed)."""
    if not args.fit_steps:
        return {"fit_steps": 0}
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.fit_lr, betas=(0.9, 0.98), eps=1e-9)
    warmup = max(1, args.fit_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    model.to(args.device).train()
    losses = []
    for _ in range(args.fit_steps):
        rows = torch.randint(len(pairs), (FIT_BATCH,), generator=generator).tolist()
        batch = tokenizer([pairs[i][0] for i in rows], text_target=[pairs[i][1] for i in rows], padding=True,
                          return_tensors="pt").to(args.device)
        batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.to("cpu").eval()
    return {"fit_steps": args.fit_steps, "fit_loss_first": round(losses[0], 3), "fit_loss_last": round(losses[-1], 3)}


def tmt_import(folder: Path, run_dir: Path) -> None:
    """`tmt import FOLDER --run-dir RUN_DIR`, this checkout's."""
    result = subprocess.run([sys.executable, "-m", "transformer_mt", "import", str(folder), "--run-dir", str(run_dir)],
                            capture_output=True, text=True, env=checkout_env())
    if result.returncode != 0:
        raise SystemExit(f"finetune: tmt import failed:\n{result.stderr}")


# --- fine-tuning ------------------------------------------------------------------------------

def tmt_trainer(args: argparse.Namespace, work: Path, parent: Path, tgt_lang: str) -> Trainer:
    """The Trainer `tmt train` builds for a fine-tuning config naming only data and train (model
    and tokenizer: the parent's), with the parent's weights loaded."""
    import yaml

    config = work / "finetune.yaml"
    train = {"init_from": str(parent), "max_steps": args.warmup_steps + args.steps, "batch_tokens": args.batch_tokens,
             "lr": LR, "warmup_steps": 0, "precision": "fp32", "device": args.device, "log_every_steps": 10**9,
             "eval_every_steps": 10**9, "save_every_steps": 10**9, "test_at_end": False}
    config.write_text(yaml.safe_dump({"name": "finetune", "seed": args.seed, "train": train, "data": {
        "format": "text", "path": str(args.data.resolve()), "src_lang": args.src_lang, "tgt_lang": tgt_lang}}),
        encoding="utf-8")
    cfg = load_config(config, (), inherited_settings)
    return Trainer(cfg, work / "tmt-run", progress=False, parent=load_parent(cfg))


def hf_rows(trainer: Trainer, vocab: MarianVocab, eos: int) -> list[dict]:
    """Every training row of tmt's split as Marian's ids (tmt's tokenizers give MarianTokenizer's
    pieces), with the EOS `MarianTokenizer` appends: what a `Seq2SeqTrainer` dataset holds."""
    src_ids, tgt_ids = trainer.train_data.ids(range(len(trainer.train_data)))
    to_marian = vocab.rows

    def marian(ids: list[int]) -> list[int]:
        return [to_marian[t] for t in ids] + [eos]
    return [{"input_ids": marian(s), "attention_mask": [1] * (len(s) + 1), "labels": marian(t)}
            for s, t in zip(src_ids, tgt_ids)]


def hf_seq2seq_trainer(folder: Path, work: Path, trainer: Trainer, rows: list[dict], batches: list[list[int]],
                       args: argparse.Namespace):
    """A `Seq2SeqTrainer` of the folder's model with tmt's optimizer settings, training on `batches`
    (lists of rows) in order; its `step_ends` callback holds the clock after each step."""
    from torch.utils.data import DataLoader
    from transformers import (DataCollatorForSeq2Seq, MarianMTModel, MarianTokenizer, Seq2SeqTrainer,
                              Seq2SeqTrainingArguments, TrainerCallback)
    from transformers.trainer_callback import PrinterCallback

    t = trainer.cfg.train
    device = trainer.device

    class StepClock(TrainerCallback):
        """(wall, process CPU) clocks at the end of the last warm-up step and of the last step."""

        def __init__(self):
            self.ends: list[tuple[float, float]] = []

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step in (args.warmup_steps, args.warmup_steps + args.steps):
                synchronize(device)
                self.ends.append(clocks())

    class TmtBatches(Seq2SeqTrainer):
        """The same batches as tmt, in its order (a trainer's own sampler would draw others)."""

        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_sampler=batches, collate_fn=self.data_collator)

    torch.manual_seed(args.seed)
    model = MarianMTModel.from_pretrained(folder)
    tokenizer = MarianTokenizer.from_pretrained(folder)
    training = Seq2SeqTrainingArguments(
        output_dir=str(work / "hf-out"), max_steps=len(batches), learning_rate=LR, lr_scheduler_type="constant",
        optim="adamw_torch_fused" if trainer.train_step.fused_optimizer else "adamw_torch",
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], adam_epsilon=1e-9, weight_decay=t.weight_decay,
        max_grad_norm=t.clip_grad_norm, label_smoothing_factor=t.label_smoothing, seed=args.seed,
        use_cpu=device.type == "cpu", save_strategy="no", eval_strategy="no", logging_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=device.type == "cuda")
    clock = StepClock()
    hf = TmtBatches(model=model, args=training, train_dataset=rows, processing_class=tokenizer,
                    data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), callbacks=[clock])
    hf.remove_callback(PrinterCallback)  # its metrics line at the end
    return hf, clock


def finetune(args: argparse.Namespace, work: Path, folder: Path, run_dir: Path, tgt_lang: str, built: dict) -> dict:
    """Both fine-tunings on the same batches; the train figure."""
    trainer = tmt_trainer(args, work, run_dir, tgt_lang)
    sampler = iter(trainer.sampler)
    index_batches = [next(sampler) for _ in range(args.warmup_steps + args.steps)]
    timed = index_batches[args.warmup_steps:]
    tokens = {"tmt": 0}

    # tmt: warm-up steps, then the timed ones.
    steps = tmt_update_steps(trainer.train_step, index_batches)
    for step in steps[:args.warmup_steps]:
        step()
    synchronize(trainer.device)
    started = clocks()
    tokens["tmt"] = sum(step() for step in steps[args.warmup_steps:])
    synchronize(trainer.device)
    tmt_seconds, tmt_cpu = (end - start for end, start in zip(clocks(), started))

    # Hugging Face on the same rows, in the same batches.
    vocab = MarianVocab.of(built["vocab_size"], pad=built["pad"], unk=1, eos=built["eos"], decoder_start=built["pad"])
    rows = hf_rows(trainer, vocab, built["eos"])
    batches = [[int(i) for i in b] for b in index_batches]
    hf, clock = hf_seq2seq_trainer(folder, work, trainer, rows, batches, args)
    hf.train()
    if len(clock.ends) != 2:
        raise SystemExit(f"finetune: Seq2SeqTrainer ran {hf.state.global_step} steps, not {len(batches)}")
    hf_seconds, hf_cpu = (end - start for start, end in zip(*clock.ends))
    tokens["hf"] = sum(len(rows[i]["labels"]) for b in batches[args.warmup_steps:] for i in b)
    if tokens["hf"] != tokens["tmt"]:
        raise SystemExit(f"finetune: the engines' batches differ: {tokens['tmt']} target tokens in tmt's, "
                         f"{tokens['hf']} in Seq2SeqTrainer's")

    rates = {"tmt": tokens["tmt"] / tmt_seconds, "hf": tokens["hf"] / hf_seconds}
    sentences = sum(len(b) for b in timed)
    print(f"# fine-tuning: {args.steps} timed steps after {args.warmup_steps}, {sentences} sentences, "
          f"{tokens['tmt']} target tokens (tmt's batches of train.batch_tokens {args.batch_tokens}, engine "
          f"{'packed' if trainer.engine.packed else 'padded'})")
    cpu_rates = {"tmt": tokens["tmt"] / tmt_cpu, "hf": tokens["hf"] / hf_cpu}
    for name, label, seconds in (("tmt", "tmt", tmt_seconds), ("hf", "Seq2SeqTrainer", hf_seconds)):
        print(f"{label:<16} {seconds:8.2f} s  {rates[name]:10.1f} target tokens/s  ({cpu_rates[name]:10.1f} per CPU-s)")
    if args.profile:
        profile_training(trainer, timed, hf, batches[args.warmup_steps:], args.profile)
    return {"tmt_tokens_per_s": round(rates["tmt"], 1), "hf_seq2seq_tokens_per_s": round(rates["hf"], 1),
            "tmt_vs_hf": round(rates["tmt"] / rates["hf"], 3), "goal": GOALS["train"],
            "met": rates["tmt"] / rates["hf"] >= GOALS["train"], "tmt_seconds": round(tmt_seconds, 6),
            "hf_seconds": round(hf_seconds, 6),
            "tmt_vs_hf_cpu_time": round(cpu_rates["tmt"] / cpu_rates["hf"], 3), "timed_steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "sentences": sentences, "tgt_tokens": tokens["tmt"], "batch_tokens": args.batch_tokens,
            "tmt_engine": "packed" if trainer.engine.packed else "padded", "precision": trainer.precision.name}


def profile_training(trainer: Trainer, timed: list, hf, hf_batches: list[list[int]], top: int) -> None:
    """One more pass over the timed batches under torch.profiler: tmt's update and Seq2SeqTrainer's
    (its `training_step`, then clipping and its optimizer's step, as its loop does)."""
    collate = hf.get_train_dataloader().collate_fn
    model = hf.model

    def hf_step(rows_of_batch: list[int]):
        def run() -> None:
            inputs = collate([hf.train_dataset[i] for i in rows_of_batch])
            hf.training_step(model, inputs)
            torch.nn.utils.clip_grad_norm_(model.parameters(), hf.args.max_grad_norm)
            hf.optimizer.step()
            model.zero_grad()
        return run
    print_profile({"tmt": tmt_update_steps(trainer.train_step, timed),
                   "hf": [hf_step(b) for b in hf_batches]}, top)


# --- decoding ---------------------------------------------------------------------------------

def decode(args: argparse.Namespace, folder: Path, run_dir: Path, sources: list[str]) -> dict:
    """tmt's two engines and `generate` over the test sources; the decode figure."""
    from transformers import MarianMTModel, MarianTokenizer

    from transformer_mt.decode.translator import Translator

    device = torch.device(args.device)
    tmt = {"torch": Translator.from_run(run_dir, device=device.type, engine="torch")}
    if importlib.util.find_spec("ctranslate2"):
        try:
            tmt["ctranslate2"] = Translator.from_run(run_dir, device=device.type, engine="ctranslate2")
            tmt["ctranslate2"].engine.threads = args.threads
        except TmtError as err:  # e.g. a CTranslate2 build without CUDA
            print(f"# tmt's CTranslate2 engine: left out on {device.type} ({err}); its figures are null")
    # One engine batch of each batch, capped at --max-tokens.
    # No length penalty in any engine: transformers' and tmt's conventions differ, and the engines must
    # choose the same translations (counted below) for their speeds to compare.
    settings = dataclasses.replace(tmt["torch"].cfg.decode, max_len_a=0.0, max_len_b=args.max_tokens,
                                   batch_tokens=1 << 20, length_penalty=0.0)
    src_ids = tmt["torch"].tokenizers.encode_src(sources)
    tokenizer = MarianTokenizer.from_pretrained(folder)
    marian = MarianMTModel.from_pretrained(folder).eval().to(device)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    vocab_rows = MarianVocab.of(len(tokenizer), pad=pad, unk=tokenizer.unk_token_id, eos=eos, decoder_start=pad).rows

    def tmt_engine(translator, quantize: str = "none"):
        decoding = dataclasses.replace(settings, quantize=quantize)

        def run(lo: int, hi: int) -> list[list[int]]:
            return [[vocab_rows[t] for t in h] for h in translator.engine.translate(src_ids[lo:hi], decoding,
                                                                                     args.beam, False)]
        return run

    marian_inputs = tokenizer(sources, return_tensors=None)["input_ids"]

    def hf_generate(lo: int, hi: int) -> list[list[int]]:
        batch = tokenizer.pad({"input_ids": marian_inputs[lo:hi]}, return_tensors="pt").to(device)
        with torch.inference_mode():
            out = marian.generate(**batch, num_beams=args.beam, max_new_tokens=args.max_tokens, do_sample=False,
                                  length_penalty=0.0)
        return [[t for t in row[1:] if t not in (pad, eos)] for row in out.tolist()]  # after the start token

    engines = {"tmt_torch": tmt_engine(tmt["torch"]), "hf_generate": hf_generate}
    if "ctranslate2" in tmt:
        engines["tmt_ct2"] = tmt_engine(tmt["ctranslate2"])
        if device.type == "cpu":  # `tmt translate --quantize int8`: CTranslate2's int8 weights
            engines["tmt_ct2_int8"] = tmt_engine(tmt["ctranslate2"], "int8")
    spans = [(lo, min(lo + args.batch_size, len(sources))) for lo in range(0, len(sources), args.batch_size)]
    for run in engines.values():  # warm-up
        run(*spans[0])
    seconds = dict.fromkeys(engines, 0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    names = list(engines)
    for k, span in enumerate(spans):  # batch by batch, in rotating order
        for name in names[k % len(names):] + names[:k % len(names)]:
            synchronize(device)
            started = time.perf_counter()
            found = engines[name](*span)
            synchronize(device)
            seconds[name] += time.perf_counter() - started
            outputs[name] += found
    tokens = {name: sum(len(h) for h in hyps) for name, hyps in outputs.items()}  # generated, without EOS
    # Translations identical to generate's (int8 weights may choose others).
    same = {name: sum(a == b for a, b in zip(hyps, outputs["hf_generate"])) for name, hyps in outputs.items()}
    rate = {name: tokens[name] / seconds[name] for name in engines}
    per_sentence = {name: len(sources) / seconds[name] for name in engines}
    for name in ("tmt_ct2", "tmt_ct2_int8"):  # null where left out
        rate[name], per_sentence[name] = rate.get(name), per_sentence.get(name)
    print(f"# decoding: {len(sources)} test sources in batches of {args.batch_size}, beam {args.beam}, at most "
          f"{args.max_tokens} tokens each, after one untimed batch each; the model was fitted {args.fit_steps} steps")
    for name in engines:
        print(f"{name:<14} {seconds[name]:8.2f} s  {tokens[name]:>7} tokens  {rate[name]:10.1f} tokens/s  "
              f"{per_sentence[name]:8.2f} sentences/s  {same[name]:>4} of {len(sources)} as generate's")
    ratio = per_sentence["tmt_ct2"] and per_sentence["tmt_ct2"] / per_sentence["hf_generate"]
    return {"ct2_tokens_per_s": rate["tmt_ct2"] and round(rate["tmt_ct2"], 1),
            "torch_tokens_per_s": round(rate["tmt_torch"], 1),
            "hf_generate_tokens_per_s": round(rate["hf_generate"], 1),
            "ct2_sentences_per_s": per_sentence["tmt_ct2"] and round(per_sentence["tmt_ct2"], 2),
            "torch_sentences_per_s": round(per_sentence["tmt_torch"], 2),
            "hf_generate_sentences_per_s": round(per_sentence["hf_generate"], 2),
            "ct2_vs_hf": ratio and round(ratio, 3),
            "torch_vs_hf": round(per_sentence["tmt_torch"] / per_sentence["hf_generate"], 3),
            "ct2_int8_tokens_per_s": rate["tmt_ct2_int8"] and round(rate["tmt_ct2_int8"], 1),
            "ct2_int8_vs_hf": per_sentence["tmt_ct2_int8"] and round(per_sentence["tmt_ct2_int8"]
                                                                     / per_sentence["hf_generate"], 3),
            "goal": GOALS["decode"], "met": ratio and ratio >= GOALS["decode"],
            "generated_tokens": tokens, "same_as_generate": same, "sentences": len(sources),
            "batch_size": args.batch_size, "beam": args.beam,
            "max_tokens": args.max_tokens}


# --- main -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [m for m in ("transformers", "sentencepiece", "accelerate") if not importlib.util.find_spec(m)]
    if missing:
        raise SystemExit(f"finetune: needs {', '.join(missing)}: pip install -e '.[bench,marian]'")
    if not importlib.util.find_spec("ctranslate2"):
        print("# tmt's CTranslate2 engine: left out, ctranslate2 is not installed; its figures are null")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformer_mt").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # e.g. max_new_tokens beside the generation config's max_length
    hf_logging.disable_progress_bar()
    tgt_lang, train_pairs, sources = read_corpus(args.data, args.src_lang)
    if args.sentences:
        sources = [sources[i % len(sources)] for i in range(args.sentences)]
    with tempfile.TemporaryDirectory(prefix="tmt-finetune-") as tmp:
        work = Path(tmp)
        folder, run_dir = work / f"opus-mt-{args.src_lang}-{tgt_lang}", work / "imported"
        started = time.perf_counter()
        built = write_marian_folder(folder, args, tgt_lang, train_pairs)
        tmt_import(folder, run_dir)
        print(f"# Marian d_model={args.d_model} layers={args.layers}+{args.layers} heads={args.heads} ffn={args.ffn} "
              f"swish, vocab.json {built['vocab_size']:,} entries ({built['spm_pieces']:,} SentencePiece pieces of "
              f"{args.data.name}'s train split, the rest unused), {built['parameters'] / 1e6:.1f}M parameters; "
              f"{fitting(built)}built and imported in {time.perf_counter() - started:.1f}s; {args.device}, "
              f"{args.threads} thread(s)")
        context = {"commit": commit(), "device": device_name(args.device), "cpu": cpu_name(), "threads": args.threads,
                   "data": args.data.name, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
                   "ffn": args.ffn, "vocab_size": built["vocab_size"], "spm_pieces": built["spm_pieces"],
                   "parameters": built["parameters"], "fit_steps": built["fit_steps"],
                   "fit_loss_last": built.get("fit_loss_last"), **versions()}
        figure = {"figure": f"{args.label}-train", **finetune(args, work, folder, run_dir, tgt_lang, built), **context}
        print(json.dumps(figure), flush=True)
        figure = {"figure": f"{args.label}-decode", **decode(args, folder, run_dir, sources), **context}
        print(json.dumps(figure), flush=True)
    return 0


def fitting(built: dict) -> str:
    if not built["fit_steps"]:
        return "random weights; "
    return f"fitted {built['fit_steps']} steps (loss {built['fit_loss_first']} -> {built['fit_loss_last']}); "


def clocks() -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all its threads): on a machine shared with other
    work, the second counts this process's work only."""
    return time.perf_counter(), time.process_time()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


def versions() -> dict:
    import transformers

    import transformer_mt
    ct2 = importlib.import_module("ctranslate2") if importlib.util.find_spec("ctranslate2") else None
    return {"tmt": transformer_mt.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "ctranslate2": ct2 and ct2.__version__}


if __name__ == "__main__":
    sys.exit(main())
