"""`train(cfg, run_dir)`: build data, tokenizers and model, maybe resume, loop, validate, save."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from transformer_mt import data as data_module
from transformer_mt.batching import Batch, TokenBatchSampler, sorted_batches
from transformer_mt.checkpoint import (FORMAT_VERSION, CheckpointDir, average_checkpoints, check_tokenizers,
                                       load_checkpoint, save_atomic)
from transformer_mt.config import Config, TrainConfig, config_to_dict, save_config
from transformer_mt.distributed import Distributed, interleave
from transformer_mt.errors import (CheckpointError, ConfigError, Terminated, TmtError, TrainingError,
                                  TrainingStopped, UsageError, missing_from_rank0)
from transformer_mt.evaluation import (Scores, bleu_tokenizer_problem, cross_attention_labels, cross_attention_map,
                                       score, translate_ids)
from transformer_mt.files import lines_to_text, write_text_atomic
from transformer_mt.loss import label_smoothed_loss
from transformer_mt.model import Transformer
from transformer_mt.runtime import (Precision, cpu_bf16_emulated, load_rng_state, pick_device, pick_precision, rng_state,
                                   seed_everything)
from transformer_mt.plotting import attention_figure
from transformer_mt.report import DataReport, build_report, estimated_time
from transformer_mt.run_dir import check_saved_config, resume_config_changes
from transformer_mt.summary import provenance, write_summary
from transformer_mt.throughput import IntervalMeter, peak_flops_per_s, train_flops
from transformer_mt.token_cache import CACHE_DIR, TokenizedSplit, processes_for, tokenize_split
from transformer_mt.tokenization import (BOS_ID, EOS, EOS_ID, JOINT_FILE, PAD_ID, SRC_FILE, TokenizerPair,
                                        train_tokenizers)

logger = logging.getLogger(__name__)

TEST_SCORES_FILE = "test_scores.json"  # in <run>/evaluation/: the final test's scores
RESUME_KEYS = ("optimizer", "scheduler", "scaler", "train_state", "sampler", "rng")  # of `Trainer.checkpoint_state`


@dataclass
class TrainState:
    """Progress counters that a checkpoint must carry besides the tensors."""

    step: int = 0  # optimizer updates done; a skipped batch is not a step
    best_bleu: float = -1.0
    best_step: int = -1  # the step `best.pt` holds
    evals_since_best: int = 0  # validations without a new best BLEU (early stopping)
    stopped_early: bool = False
    tgt_tokens_seen: int = 0
    skipped_nonfinite: int = 0  # batches skipped for a NaN/inf loss or gradient
    skipped_oom: int = 0  # batches skipped for running out of device memory
    train_seconds: float = 0.0  # wall time spent in this run's training processes, validation included
    last_valid: dict | None = None  # the latest validation's step and metrics

    def state_dict(self) -> dict:
        return {"step": self.step, "best_bleu": self.best_bleu, "best_step": self.best_step,
                "evals_since_best": self.evals_since_best, "stopped_early": self.stopped_early,
                "tgt_tokens_seen": self.tgt_tokens_seen,
                "skipped_nonfinite": self.skipped_nonfinite, "skipped_oom": self.skipped_oom,
                "train_seconds": self.train_seconds, "last_valid": self.last_valid}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.best_bleu = float(state["best_bleu"])
        self.tgt_tokens_seen = int(state["tgt_tokens_seen"])
        self.best_step = int(state.get("best_step", -1))  # absent in checkpoints older than these counters
        self.evals_since_best = int(state.get("evals_since_best", 0))
        self.stopped_early = bool(state.get("stopped_early", False))
        self.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))
        self.skipped_oom = int(state.get("skipped_oom", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.last_valid = state.get("last_valid")


@dataclass(frozen=True)
class StepResult:
    """What one training step reports; the tensors stay on the device until a log line needs them."""

    loss: torch.Tensor  # label-smoothed loss per target token
    grad_norm: torch.Tensor  # global gradient norm before clipping
    updated: bool  # False: the loss or a gradient was not finite and the update was skipped
    stop_signal: int = 0  # the stop signal any rank had received by this step (0: none)


@dataclass
class _StepBatches:
    """One update's micro-batches, drawn from the sampler and already on the device."""

    micro_batches: list[Batch]  # this rank's
    indices: list[np.ndarray]  # their example indices
    tgt_tokens: int  # target tokens of every rank's micro-batches: the loss's denominator
    sampler_state: dict  # the sampler's position once these batches are drawn


def lr_at(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Inverse-square-root schedule: linear warmup to `peak_lr`, then ∝ 1/sqrt(step).

    Equal to Vaswani et al. §5.3 with the peak set directly; `step` counts from 1.
    """
    warmup = max(warmup_steps, 1)
    return peak_lr * min(step / warmup, math.sqrt(warmup / step))


def batch_padding(train_cfg: TrainConfig, device_type: str) -> int:
    """The multiple that batch lengths are padded to: `train.pad_to_multiple` on CUDA or under
    compile, else 1. On a CPU, padding to a multiple of 8 cost 25% of the demo's throughput and
    bought nothing (docs/benchmarks.md); tensor cores and compile's shape bound are what it is for."""
    return train_cfg.pad_to_multiple if device_type == "cuda" or train_cfg.compile else 1


def prepare_data(cfg: Config, run_dir: Path, progress: bool = False, world_size: int = 1, pad_to_multiple: int = 1,
                 prepared: bool = False) -> tuple[TokenizerPair, TokenizedSplit, TokenizedSplit, DataReport | None]:
    """Load the corpus, train (or reuse) the tokenizers, tokenize the train and valid splits once
    (cached in the run directory, see `token_cache`), and log the data report (batches counted
    with lengths padded to `pad_to_multiple`, see `batch_padding`).

    `prepared`: rank 0 of a torchrun run has just done all this in `run_dir`; only read what it
    wrote (the other ranks), so that every rank trains on the same data and none writes there.
    The data report is then None: rank 0 made it."""
    corpus = data_module.load_corpus(cfg.data, cfg.seed, run_dir, prepared=prepared)
    if TokenizerPair.exists_in(run_dir):
        tokenizers = TokenizerPair.load(run_dir)
        logger.info("reusing the tokenizers in %s", run_dir)
    elif prepared:
        raise missing_from_rank0(_tokenizer_file(cfg, run_dir))
    else:
        started = time.perf_counter()
        rows = data_module.sample_rows(len(corpus.train), cfg.tokenizer.max_train_pairs, cfg.seed)
        if rows is not None:
            logger.info("training the tokenizers on %d of the %d training pairs (tokenizer.max_train_pairs)",
                        len(rows), len(corpus.train))
        tokenizers = train_tokenizers(cfg.tokenizer, data_module.iter_text(corpus.train, "src", rows),
                                      data_module.iter_text(corpus.train, "tgt", rows), progress,
                                      n_lines=len(corpus.train) if rows is None else len(rows))
        tokenizers.save(run_dir)
        logger.info("trained BPE tokenizers (vocabulary %d%s) in %.1fs", tokenizers.src.get_vocab_size(),
                    ", joint" if tokenizers.joint else "", time.perf_counter() - started)
    cache = run_dir / CACHE_DIR
    train = tokenize_split(corpus.train, corpus.digests["train"], tokenizers, cfg.model.max_len, cache, "train",
                           drop_long=True, num_proc=processes_for(len(corpus.train), cfg.data.num_proc),
                           progress=progress, prepared=prepared)
    # Evaluation sets are never filtered; their over-long sentences are truncated instead.
    valid = tokenize_split(corpus.valid, corpus.digests["valid"], tokenizers, cfg.model.max_len, cache, "valid",
                           drop_long=False, keep_text=True, num_proc=processes_for(len(corpus.valid), cfg.data.num_proc),
                           progress=progress, prepared=prepared)
    if prepared:
        return tokenizers, train, valid, None  # rank 0 reports the data (a pass over all of train)
    report = build_report(cfg, corpus, tokenizers, train, world_size, pad_to_multiple)
    logger.info("data report:\n%s", report.render())
    return tokenizers, train, valid, report


def _tokenizer_file(cfg: Config, run_dir: Path) -> Path:
    """The tokenizer file a run of `cfg` writes first (its joint one, else the source one)."""
    return run_dir / (JOINT_FILE if cfg.tokenizer.joint else SRC_FILE)


def build_model(cfg: Config, tokenizers: TokenizerPair) -> Transformer:
    return Transformer(cfg.model, tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size(), PAD_ID)


class Trainer:
    """Holds everything one training run mutates, so each phase is a short named method."""

    def __init__(self, cfg: Config, run_dir: Path, *, progress: bool = True, config_dir: Path | None = None,
                 dist: Distributed = Distributed()):
        if problem := bleu_tokenizer_problem(cfg.train.bleu_tokenize):  # before hours of training
            raise ConfigError([f"train.bleu_tokenize: {problem}"])
        self.cfg = cfg
        self.run_dir = run_dir
        self.dist = dist
        self.progress = progress and dist.is_main
        self.device = dist.local_device(pick_device(cfg.train.device))
        self.precision: Precision = pick_precision(cfg.train.precision, self.device)
        if self.precision.name == "bf16" and self.device.type == "cpu" and cpu_bf16_emulated() and dist.is_main:
            logger.warning("train.precision bf16 on an x86 CPU without bf16 instructions (AVX512-BF16 or AMX): its "
                           "matrix products are emulated and may well be slower than fp32; compare the tokens/s")
        self.pad_to_multiple = batch_padding(cfg.train, self.device.type)
        seed_everything(cfg.seed)
        with dist.main_first():  # rank 0 trains the tokenizers, carves the splits, fills the token cache
            self.tokenizers, self.train_data, self.valid_data, self.data_report = prepare_data(
                cfg, run_dir, self.progress, dist.world_size, self.pad_to_multiple, prepared=not dist.is_main)
        self.tokenizer_fingerprint = self.tokenizers.fingerprint()  # saved in checkpoints
        self.model = build_model(cfg, self.tokenizers).to(self.device)  # the same initial weights on every rank
        t = cfg.train
        # The module train steps call. Under torchrun, DDP wraps the model and averages the
        # gradients in backward. torch.compile wraps the same parameters, so checkpoints,
        # validation and decoding keep using the plain `self.model`. Batch sizes vary per batch;
        # Dynamo's automatic dynamic shapes compile a shape-generic graph after the first change,
        # and train.pad_to_multiple keeps the lengths on a coarse grid, so it does not recompile
        # for every batch.
        self.ddp_model: torch.nn.parallel.DistributedDataParallel | None = None
        if dist.enabled:
            seed_everything(cfg.seed + dist.rank)  # different dropout masks on each rank
            # No buffer broadcast before every forward: the model's only buffer, the sinusoidal
            # position table, is the same constant on every rank.
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        self.step_model = self.ddp_model or self.model
        if t.compile:
            self.step_model = torch.compile(self.step_model)
        # One fused kernel per parameter group instead of a chain of foreach ops: CUDA, and CPU
        # (supported there since torch 2.4); MPS keeps the foreach path.
        self.fused_optimizer = self.device.type in ("cuda", "cpu")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas, eps=1e-9,
                                           weight_decay=t.weight_decay, fused=self.fused_optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: lr_at(done + 1, t.lr, t.warmup_steps) / t.lr)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.needs_grad_scaler)
        self.sampler = TokenBatchSampler(self.train_data.lengths(), t.batch_tokens, cfg.seed,
                                         tie_break=self.train_data.tgt_len, world_size=dist.world_size,
                                         pad_to_multiple=self.pad_to_multiple, max_length=cfg.model.max_len)
        # The sampler runs one update ahead of training (the loop prepares the next update's
        # batches while the device works); checkpoints record where the trained batches end.
        self.sampler_state = self.sampler.state_dict()
        self.state = TrainState()
        self.checkpoints = CheckpointDir(run_dir / "checkpoints", t.keep_last)
        self.valid_subset = self._pick_valid_subset()
        self.provenance = provenance(cfg, run_dir, self.device, config_dir)
        self.peak_flops = peak_flops_per_s(self.device, self.precision.name)  # None: no MFU (CPU, unknown GPU)
        # On a CPU the step runs every layer at the real tokens only (`Transformer.forward`'s
        # `real_states`), and the loss projects them to the vocabulary block by block: the
        # same loss and gradients without the padding's share of the work or whole (N, V)
        # logits (docs/benchmarks.md, "Training"). Elsewhere the padded path stays: picking the real
        # rows reads their count from the device (a host sync per step), and on a GPU that
        # trade is unmeasured; under torch.compile the row count would be one more dynamic shape.
        self.real_positions_only = self.device.type == "cpu" and not t.compile
        if t.eval_every_steps % t.save_every_steps:
            logger.info("train.eval_every_steps=%d is not a multiple of train.save_every_steps=%d: a new best "
                        "between saves is saved as a step checkpoint too, and counts toward train.keep_last "
                        "and train.average_last", t.eval_every_steps, t.save_every_steps)
        self.test_report: dict | None = None
        self._intervals_logged = 0
        self._clock = time.perf_counter()  # train_seconds counts from here

    # --- checkpoints -------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "train_state": self.state.state_dict(),
            "sampler": self.sampler_state,
            # Every rank's RNG state (dropout differs per rank); a collective, so all ranks call this.
            "rng": rng_state() if not self.dist.enabled else {"ranks": self.dist.gather(rng_state())},
            "config": config_to_dict(self.cfg),
            "model_args": {"src_vocab_size": self.tokenizers.src.get_vocab_size(),
                           "tgt_vocab_size": self.tokenizers.tgt.get_vocab_size(), "pad_id": PAD_ID},
            "tokenizers": self.tokenizer_fingerprint,
            "format_version": FORMAT_VERSION,
        }

    def resume(self) -> None:
        """Load the newest intact step checkpoint into every stateful piece."""
        path, ckpt, skipped = self._newest_intact_checkpoint()
        check_tokenizers(ckpt, self.tokenizer_fingerprint, path, self.run_dir)
        changes = resume_config_changes(ckpt["config"], config_to_dict(self.cfg), path)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self._apply_optimizer_settings()
        if ckpt["scaler"] and self.scaler.is_enabled():  # a run may switch between fp32 and fp16
            self.scaler.load_state_dict(ckpt["scaler"])
        self.state.load_state_dict(ckpt["train_state"])
        self.sampler.load_state_dict(self._sampler_state_of(ckpt))
        self.sampler_state = self.sampler.state_dict()
        load_rng_state({k: _to_cpu(v) for k, v in self._own_rng_state(ckpt["rng"], path).items()})
        logger.info("resuming from %s: step %d, epoch %d, batch %d of that epoch", path, self.state.step,
                    self.sampler.epoch + 1, ckpt["sampler"]["position"])
        logger.info("settings changed since that checkpoint: %s", "; ".join(changes) if changes else "none")
        if self.dist.is_main:
            self.checkpoints.remove_temp_files()  # left by a crash during a save
            if skipped:
                self._set_aside(skipped, path)
            best_file = self.checkpoints.step_path(self.state.best_step)
            if self.state.best_step == self.state.step:  # a crash may have come between this file and best.pt
                self.checkpoints.copy_to_best(path)
            elif not self.checkpoints.best_path.is_file() and best_file.is_file():
                self.checkpoints.copy_to_best(best_file)

    def _set_aside(self, skipped: list[Path], resumed: Path) -> None:
        """Move the step checkpoints that were skipped on resume out of the way (`CheckpointDir.set_aside`),
        and `best.pt` too when it came from after the step training resumes from (a best written
        with, or after, a skipped file): the run's best is then the one its training state names."""
        for unusable in skipped:
            self.checkpoints.set_aside(unusable, f"unusable; training goes on from step {self.state.step}")
        best = self.checkpoints.best_path
        if best.is_file() and not os.path.samefile(best, resumed):
            try:
                best_step = int(load_checkpoint(best)["train_state"]["step"])
            except (CheckpointError, KeyError):
                best_step = None
            if best_step is None or best_step > self.state.step:
                self.checkpoints.set_aside(best, "unreadable" if best_step is None else
                                           f"it holds step {best_step}, after step {self.state.step}")

    def _own_rng_state(self, saved: dict, path: Path) -> dict:
        """This rank's RNG state from a checkpoint, which must come from a run of as many processes.

        The data position and the random streams are per process, so a different world size
        could not continue the run exactly; it is refused rather than silently changed.
        """
        saved_world = len(saved["ranks"]) if "ranks" in saved else 1
        if saved_world != self.dist.world_size:
            raise UsageError(f"{path} was written by a run of {saved_world} process(es); resume it with the same "
                             f"number (torchrun --nproc_per_node/--nnodes), not {self.dist.world_size}")
        return saved["ranks"][self.dist.rank] if "ranks" in saved else saved

    def _sampler_state_of(self, ckpt: dict) -> dict:
        """The checkpoint's sampler state. Checkpoints from before the state held the cut were cut
        with the unpadded lengths, their run's batch_tokens, and this world size (resume keeps it)."""
        state = ckpt["sampler"]
        if "cut" in state:
            return state
        cut = {"batch_tokens": ckpt["config"]["train"]["batch_tokens"], "world_size": self.dist.world_size,
               "pad_to_multiple": 1}
        return {**state, "cut": cut}

    def _newest_intact_checkpoint(self) -> tuple[Path, dict, list[Path]]:
        """The newest step checkpoint that loads, and the newer ones that do not (reported and skipped)."""
        problems, skipped = [], []
        for step in reversed(self.checkpoints.steps()):
            path = self.checkpoints.step_path(step)
            try:
                ckpt = load_checkpoint(path, map_location=self.device)
                missing = [key for key in RESUME_KEYS if key not in ckpt]
                if missing:  # e.g. an average written over a step file: weights only
                    raise CheckpointError(f"{path}: holds no training state ({', '.join(missing)}); it cannot be "
                                          "resumed from")
                return path, ckpt, skipped
            except CheckpointError as err:
                logger.warning("skipping checkpoint: %s", err)
                problems.append(str(err))
                skipped.append(path)
        detail = ("; ".join(problems)) if problems else "none found"
        raise CheckpointError(f"{self.run_dir}: no intact checkpoint to resume from ({detail})")

    def _apply_optimizer_settings(self) -> None:
        """Make the current config's train.* values win over those stored in a checkpoint.

        Loading optimizer and scheduler state restores the old lr, betas and weight decay; a
        resumed run may change them (README: train.* may change on resume). With unchanged
        settings this recomputes exactly the values that were loaded.
        """
        t = self.cfg.train
        for group in self.optimizer.param_groups:
            group.update(initial_lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=self.fused_optimizer)
        self.scheduler.base_lrs = [t.lr for _ in self.optimizer.param_groups]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * factor  # what LambdaLR computes: base_lr * lambda(last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def save(self, *, is_best: bool) -> None:
        """Write a step checkpoint, and `best.pt` (rank 0); every rank calls this at the same step."""
        self._tick()
        state = self.checkpoint_state()
        if self.dist.is_main:
            self.checkpoints.save(state, self.state.step, is_best=is_best)
        self.write_summary("running")

    def _tick(self) -> None:
        now = time.perf_counter()
        self.state.train_seconds += now - self._clock
        self._clock = now

    def write_summary(self, status: str) -> None:
        """Rewrite `summary.json` (rank 0): provenance, the data report, progress, metrics and throughput so far."""
        self._tick()
        if not self.dist.is_main:
            return
        s = self.state
        write_summary(self.run_dir, {
            "name": self.cfg.name, "status": status, "step": s.step, "max_steps": self.cfg.train.max_steps,
            "epoch": self.sampler_state["epoch"] + 1, "best_bleu": s.best_bleu, "best_step": s.best_step,
            "last_valid": s.last_valid, "test": self.test_report, "tgt_tokens_seen": s.tgt_tokens_seen,
            "train_seconds": round(s.train_seconds, 1),
            "tgt_tokens_per_s": round(s.tgt_tokens_seen / s.train_seconds, 1) if s.train_seconds else None,
            "skipped_nonfinite": s.skipped_nonfinite, "skipped_oom": s.skipped_oom,
            "parameters": self.model.num_parameters(), "data": self.data_report.to_dict(),
            "provenance": self.provenance})

    # --- one optimisation step ---------------------------------------------------------
    def train_step(self, batches: Batch | list[Batch], step_tgt_tokens: int | None = None, *,
                   while_device_works: Callable[[], None] | None = None, stop_signal: int = 0) -> StepResult:
        """Forward and backward over one or more batches (gradient accumulation), then clip and
        update; a NaN/inf loss or gradient norm skips the update.

        The loss of every batch is divided by the target tokens of all of them, so accumulating
        the halves of a batch gives the gradient of the whole batch (not a mean of means).
        Under DDP, `step_tgt_tokens` counts the target tokens of every rank's batches: a DDP step
        then computes the update one process would on all of them. The returned loss is this
        rank's share of the step's per-token loss.

        The finiteness check reads one boolean from the device per update: the price of never
        letting a NaN reach the weights or the optimizer's moments. It comes after the backward
        passes are queued, and after `while_device_works` (the loop's preparation of the next
        batches), so the GPU has a whole step of work in hand while the host works and waits; only
        the optimizer's few fused kernels then wait on the host. Under DDP the same all-reduce
        agrees on `stop_signal` (this rank's pending stop signal): one sync per step for both
        questions. Reading the check one step later instead would let the next batch's dropout
        and sampler position into the checkpoint written for this step, and exact resume would be
        lost; the fp16 scaler's device-side `found_inf` skip would not tell the step counter or
        the LR schedule that no update happened.
        """
        batches = [batches] if isinstance(batches, Batch) else batches
        n_tgt_tokens = step_tgt_tokens or sum(batch.n_tgt_tokens for batch in batches)
        # DDP averages gradients over the W ranks; scaling each rank's loss by W turns that into the sum.
        world = self.dist.world_size
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            with self._gradient_sync(last=i == len(batches) - 1):
                with self.precision.autocast():  # logits (B, T, V), or the real positions' states (N, D)
                    out = self.step_model(batch.src_ids, batch.tgt_in_ids, self.real_positions_only)  # real_states
                targets, output_weight = batch.tgt_out_ids, None  # (B, T)
                if self.real_positions_only:  # the loss projects the states itself, block by block
                    targets, output_weight = targets[targets != PAD_ID], self.model.output_proj.weight  # (N,)
                loss = label_smoothed_loss(out, targets, PAD_ID, self.cfg.train.label_smoothing, output_weight,
                                           product_dtype=self.precision.dtype)
                loss = loss / n_tgt_tokens  # normalise per target token of the whole update, not per sentence
                self.scaler.scale(loss * world if world > 1 else loss).backward()  # frees this batch's activations
            total += loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.clip_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if while_device_works is not None:
            while_device_works()
        # Ranks must agree: one rank's non-finite loss must skip the update on every rank, and one
        # rank's stop signal must stop every rank at the same step.
        nonfinite = (~(torch.isfinite(total) & torch.isfinite(grad_norm))).float()
        if self.dist.enabled:
            flags = torch.stack([nonfinite, torch.full((), float(stop_signal), device=self.device)])
            nonfinite_anywhere, stop_signal = (int(v) for v in self.dist.max_(flags).tolist())
            finite = nonfinite_anywhere == 0
        else:
            finite = not bool(nonfinite)
        if finite or self.scaler.is_enabled():
            # The fp16 scaler skips a non-finite update itself, and must see it to lower its scale.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if finite:
            self.scheduler.step()
        return StepResult(total, grad_norm.detach(), finite, stop_signal)

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Under DDP, gradients are all-reduced only in the backward of a step's last micro-batch."""
        if self.ddp_model is None or last:
            return contextlib.nullcontext()
        return self.ddp_model.no_sync()

    def load_batch(self, indices: list[int]) -> Batch:
        """Training examples -> a padded batch on the device; on CUDA through pinned memory, so the
        copy is asynchronous (`non_blocking`) and overlaps with queued GPU work."""
        batch = self.train_data.batch(indices, self.pad_to_multiple)
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.device)

    # --- validation --------------------------------------------------------------------
    def _pick_valid_subset(self) -> list[int]:
        n = len(self.valid_data)
        limit = self.cfg.train.eval_max_sentences
        if limit == 0 or limit >= n:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.cfg.seed)
        return sorted(torch.randperm(n, generator=gen)[:limit].tolist())

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean per-token negative log-likelihood (no smoothing) over the whole validation split."""
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), 0
        batches = sorted_batches(self.valid_data.lengths(self.pad_to_multiple), self.cfg.train.batch_tokens)
        for indices in batches[self.dist.rank::self.dist.world_size]:  # each rank its share
            batch = self.valid_data.batch(indices, self.pad_to_multiple).to(self.device)
            with self.precision.autocast():
                logits = self.model(batch.src_ids, batch.tgt_in_ids)
            total += label_smoothed_loss(logits, batch.tgt_out_ids, PAD_ID, 0.0)
            tokens += batch.n_tgt_tokens
        loss_sum, tokens = self.dist.sum_(torch.stack([total, total.new_tensor(tokens)])).tolist()
        return loss_sum / tokens

    def validate(self, writer: SummaryWriter) -> float:
        """Loss, perplexity, greedy BLEU/chrF on the fixed subset; logs examples. Returns BLEU."""
        started = time.perf_counter()
        loss = self.validation_loss()
        sources = [self.valid_data.src_ids[i] for i in self.valid_subset]
        mine = sources[self.dist.rank::self.dist.world_size]  # each rank translates its share
        mine_ids = translate_ids(self.model, mine, self.cfg.decode, bos_id=BOS_ID, eos_id=EOS_ID, device=self.device,
                                 precision=self.precision, beam_size=1, progress=self.progress) if mine else []
        hyp_ids = interleave(self.dist.gather(mine_ids))  # every rank scores all: they agree on the best step
        hypotheses = self.tokenizers.decode_tgt(hyp_ids)
        references = [self.valid_data.tgt_text[i] for i in self.valid_subset]
        scores = score(hypotheses, references, tokenize=self.cfg.train.bleu_tokenize)
        step = self.state.step
        if self.dist.is_main:
            self._log_attention(writer, sources[0], hyp_ids[0])
            hyp_dir = self.run_dir / "validation"
            hyp_dir.mkdir(exist_ok=True)
            write_text_atomic(hyp_dir / f"step_{step:08d}.txt", lines_to_text(hypotheses))
        ppl = math.exp(min(loss, 100.0))
        writer.add_scalar("valid/loss", loss, step)
        writer.add_scalar("valid/perplexity", ppl, step)
        writer.add_scalar("valid/bleu", scores.bleu, step)
        writer.add_scalar("valid/chrf", scores.chrf, step)
        examples = []
        for i in range(min(self.cfg.train.n_examples, len(hypotheses))):
            src = self.valid_data.src_text[self.valid_subset[i]]
            examples.append(f"source: {src}\nreference: {references[i]}\nhypothesis: {hypotheses[i]}")
            logger.info("example %d\n  source:     %s\n  reference:  %s\n  hypothesis: %s",
                        i + 1, src, references[i], hypotheses[i])
        if examples:
            writer.add_text("valid/examples", "\n\n".join(f"    {e}".replace("\n", "\n    ") for e in examples), step)
        self.state.last_valid = {"step": step, "loss": round(loss, 4), "perplexity": round(ppl, 2),
                                 "bleu": round(scores.bleu, 2), "chrf": round(scores.chrf, 2)}
        logger.info("validation at step %d: loss %.3f, ppl %.2f, BLEU %.2f, chrF %.2f (%d sentences, %.1fs) [%s]",
                    step, loss, ppl, scores.bleu, scores.chrf, len(hypotheses), time.perf_counter() - started,
                    scores.bleu_signature)
        return scores.bleu

    def _log_attention(self, writer: SummaryWriter, src_ids: list[int], hyp_ids: list[int]) -> None:
        """Cross-attention images of the first validation sentence's translation: the last decoder
        layer and `train.attention_layer`, mean over heads, pieces on the axes."""
        n_layers = self.cfg.model.n_layers
        src_pieces, tgt_pieces = cross_attention_labels(
            self.tokenizers.src_pieces(src_ids), self.tokenizers.tgt_pieces(hyp_ids), EOS, self.cfg.model.max_len)
        for layer in sorted({n_layers - 1, self.cfg.train.attention_layer % n_layers}):
            weights = cross_attention_map(self.model, src_ids, hyp_ids, bos_id=BOS_ID, eos_id=EOS_ID,
                                          device=self.device, layer=layer)
            title = f"step {self.state.step}, decoder layer {layer + 1} of {n_layers}, mean over heads"
            writer.add_figure(f"valid/attention_layer_{layer + 1}",
                              attention_figure(weights, src_pieces, tgt_pieces, title), self.state.step)

    def _log_hparams(self, writer: SummaryWriter, last_bleu: float) -> None:
        """The config beside the final validation BLEU, for TensorBoard's HParams tab."""
        hparams = {}
        for section, values in config_to_dict(self.cfg).items():
            for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
                name = f"{section}.{key}" if key else section
                hparams[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
        writer.add_hparams(hparams, {"hparam/best_bleu": self.state.best_bleu, "hparam/last_bleu": last_bleu},
                           run_name="hparams", global_step=self.state.step)

    # --- the final test ----------------------------------------------------------------
    def test_weights(self) -> tuple[Path, list[int]]:
        """The checkpoint the final test uses, and the step checkpoints it averages: the average
        of the newest `train.average_last` (a file written by `final_test`), else `best.pt`, else
        the newest step checkpoint, averaging none."""
        checkpoints, average_last = self.checkpoints, self.cfg.train.average_last
        if average_last:
            steps = checkpoints.steps()[-average_last:]
            return checkpoints.directory / f"average_steps_{steps[0]:08d}-{steps[-1]:08d}.pt", steps
        return (checkpoints.best_path if checkpoints.best_path.is_file() else checkpoints.latest()), []

    def earlier_test_report(self) -> dict | None:
        """The final test an earlier start wrote for this very step, `test_weights` file, decoding
        and BLEU tokenizer, if there is one (one of an earlier, shorter training, of another
        average or beam does not count)."""
        try:
            report = json.loads((self.run_dir / "evaluation" / TEST_SCORES_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        cfg = self.cfg
        same = {"step": self.state.step, "checkpoint": self.test_weights()[0].name,
                "beam_size": cfg.decode.beam_size, "length_penalty": cfg.decode.length_penalty}
        if not isinstance(report, dict) or any(report.get(k) != v for k, v in same.items()):
            return None
        return report if f"|tok:{cfg.train.bleu_tokenize}|" in str(report.get("bleu_signature")) else None

    def final_test(self) -> Scores:
        """Translate the test split with the best (or averaged) weights; write hypotheses and scores."""
        cfg, checkpoints = self.cfg, self.checkpoints
        path, steps = self.test_weights()
        if steps:
            if len(steps) < cfg.train.average_last:  # a run stopped early, or cut short by max_steps
                logger.warning("train.average_last=%d, but the run has only %d step checkpoint(s): averaging those",
                               cfg.train.average_last, len(steps))
            save_atomic(average_checkpoints([checkpoints.step_path(step) for step in steps]), path)
        weights = load_checkpoint(path, map_location=self.device)
        self.model.load_state_dict(weights["model"])
        weights_steps = steps or [weights.get("train_state", {}).get("step")]
        test = data_module.load_corpus(cfg.data, cfg.seed, self.run_dir).test
        beam = cfg.decode.beam_size
        started = time.perf_counter()
        hyp_ids = translate_ids(self.model, self.tokenizers.encode_src(test["src"]), cfg.decode, bos_id=BOS_ID,
                                eos_id=EOS_ID, device=self.device, precision=self.precision, beam_size=beam,
                                progress=self.progress)
        hypotheses = self.tokenizers.decode_tgt(hyp_ids)
        scores = score(hypotheses, test["tgt"], tokenize=cfg.train.bleu_tokenize)
        out_dir = self.run_dir / "evaluation"
        out_dir.mkdir(exist_ok=True)
        hypotheses_file = f"test.{path.stem}.beam{beam}.txt"
        write_text_atomic(out_dir / hypotheses_file, lines_to_text(hypotheses))
        # step: the run's, when it was tested; checkpoint_steps: the steps whose weights were.
        report = {"checkpoint": path.name, "checkpoint_steps": weights_steps, "hypotheses": hypotheses_file,
                  "step": self.state.step,
                  "sentences": len(hypotheses), "beam_size": beam,
                  "length_penalty": cfg.decode.length_penalty, "bleu": round(scores.bleu, 2),
                  "chrf": round(scores.chrf, 2), "bleu_signature": scores.bleu_signature,
                  "chrf_signature": scores.chrf_signature, "seconds": round(time.perf_counter() - started, 1)}
        write_text_atomic(out_dir / TEST_SCORES_FILE, json.dumps(report, indent=2) + "\n")
        self.test_report = report
        logger.info("test (%s, beam %d, %d sentences): BLEU %.2f [%s], chrF %.2f [%s]", path.name, beam,
                    len(hypotheses), scores.bleu, scores.bleu_signature, scores.chrf, scores.chrf_signature)
        return scores

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> TrainState:
        t = self.cfg.train
        logger.info("device %s, precision %s, %d parameters, %d training pairs", self.device,
                    self.precision.name, self.model.num_parameters(), len(self.train_data))
        writer = (SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self.state.step + 1)
                  if self.dist.is_main else _NoWriter())
        self.write_summary("running")
        bar = tqdm(total=t.max_steps, initial=self.state.step, desc="train", unit="step",
                   # Not a terminal (a CI log, a file): the periodic log lines stand in for the bar.
                   disable=not (self.progress and sys.stderr.isatty()), file=sys.stderr, dynamic_ncols=True)
        batches = iter(self.sampler)
        interval = IntervalMeter(self.device, self.dist, self.peak_flops)
        nonfinite_in_a_row = 0
        stop = StopRequest(second_signal_interrupts=not self.dist.enabled)
        agreed_signal = 0  # under DDP, the stop signal the ranks agreed on in the last step
        upcoming: _StepBatches | None = None
        try:
            stop.install()
            while self.state.step < t.max_steps:
                signal_number = agreed_signal if self.dist.enabled else (stop.signal_number or 0)
                if signal_number:
                    self._stop_on_signal(signal_number)
                current, upcoming = upcoming or self._draw_step_batches(batches), None

                def prepare_next_step() -> None:  # runs on the host while the device works on `current`
                    nonlocal upcoming
                    if self.state.step + 1 < t.max_steps:
                        upcoming = self._draw_step_batches(batches)

                result = self._step_or_none(current.micro_batches, current.tgt_tokens, prepare_next_step,
                                            stop.signal_number or 0)
                self.sampler_state = current.sampler_state  # trained (or skipped): checkpoints resume after them
                if result is None:  # out of memory: the batch was skipped
                    writer.add_scalar("train/skipped_oom", self.state.skipped_oom, self.state.step)
                    continue
                agreed_signal = result.stop_signal
                if not result.updated:
                    nonfinite_in_a_row += 1
                    self._skip_nonfinite(nonfinite_in_a_row, writer)
                    continue
                nonfinite_in_a_row = 0
                self.state.step += 1
                self.state.tgt_tokens_seen += current.tgt_tokens
                flops = sum(train_flops(self.cfg.model, self.tokenizers.tgt.get_vocab_size(),
                                        *self.train_data.lengths_of(i)) for i in current.indices)
                interval.add(result.loss, current.micro_batches, flops)
                bar.update(1)
                step = self.state.step
                if step % t.log_every_steps == 0 or step == t.max_steps:
                    self._log_interval(interval, result.grad_norm, writer, bar)
                if self._after_step(writer, interval):
                    break
            # A signal during the last step's validation or save, both done by now: stop before
            # the final test, which a resume runs. Under torchrun the ranks agree on it first (it
            # may have reached only some), which also waits for rank 0 to finish writing.
            signal_number = stop.signal_number or 0
            if self.dist.enabled:
                signal_number = int(self.dist.max_(torch.full((), float(signal_number), device=self.device)).item())
            if signal_number:
                name = signal.Signals(signal_number).name
                logger.warning("received %s during the last step: stopping before the final test", name)
                raise TrainingStopped(f"stopped by {name} after the last step ({self.state.step}); checkpoint "
                                      "saved", signal_number)
        finally:
            stop.uninstall()
            bar.close()
            writer.close()
        return self.state

    def _after_step(self, writer: SummaryWriter, interval: IntervalMeter) -> bool:
        """Validate and save when due. True when training is over: `max_steps`, or early stopping."""
        t, step = self.cfg.train, self.state.step
        finished = step >= t.max_steps
        is_best = False
        validate = step % t.eval_every_steps == 0 or finished
        save_due = step % t.save_every_steps == 0 or finished
        if validate or save_due:
            interval.pause()  # validation and checkpoint writing are not training time
        if validate:
            bleu = self.validate(writer)
            is_best = bleu > self.state.best_bleu
            if is_best:
                self.state.best_bleu, self.state.best_step = bleu, step
            self.state.evals_since_best = 0 if is_best else self.state.evals_since_best + 1
            if t.patience and self.state.evals_since_best >= t.patience:
                logger.info("stopping early at step %d: validation BLEU has not improved on %.2f (step %d) for %d "
                            "validations (train.patience)", step, self.state.best_bleu, self.state.best_step,
                            self.state.evals_since_best)
                self.state.stopped_early = finished = True
            if finished:
                self._log_hparams(writer, bleu)
        # A new best is always a step checkpoint too: a resume after a crash then never starts
        # before the step `best.pt` holds, whose weights a replay that differs (changed train.*
        # settings, a GPU's non-deterministic kernels) would otherwise leave in place.
        if save_due or finished or is_best:  # finished: also by early stopping
            self.save(is_best=is_best)
        interval.resume()
        return finished

    def _draw_step_batches(self, batches: Iterator[np.ndarray]) -> _StepBatches:
        """The next update's batches from the sampler: every rank's, in groups of W; this rank's on the device."""
        W = self.dist.world_size
        step_batches = [next(batches) for _ in range(self.cfg.train.accum_steps * W)]
        indices = step_batches[self.dist.rank::W]  # this rank's micro-batches
        tgt_tokens = int(self.train_data.lengths_of(np.concatenate(step_batches))[1].sum())
        return _StepBatches([self.load_batch(i) for i in indices], indices, tgt_tokens, self.sampler.state_dict())

    def _stop_on_signal(self, signal_number: int) -> None:
        name = signal.Signals(signal_number).name
        logger.warning("received %s: saving a checkpoint, then stopping", name)
        self.save(is_best=False)
        self.dist.barrier()  # no rank leaves while rank 0 still writes: torchrun would kill it mid-write
        raise TrainingStopped(f"stopped by {name} at step {self.state.step}; checkpoint saved", signal_number)

    def _step_or_none(self, batches: list[Batch], step_tgt_tokens: int, while_device_works: Callable[[], None] | None,
                      stop_signal: int) -> StepResult | None:
        """`train_step`, or None when the batch ran out of device memory and was skipped.

        The first out-of-memory batch is skipped (its memory freed, its size logged); a second
        one stops the run: the budget is too large for this device, and skipping would bias
        training against long sentences. Under DDP the other ranks are already waiting in the
        gradient all-reduce, so one rank cannot skip alone: the run stops at once.
        """
        try:
            return self.train_step(batches, step_tgt_tokens, while_device_works=while_device_works,
                                   stop_signal=stop_signal)
        except torch.OutOfMemoryError:
            if self.dist.enabled:
                raise TrainingError(f"rank {self.dist.rank} ran out of memory at step {self.state.step + 1}; lower "
                                    f"train.batch_tokens (now {self.cfg.train.batch_tokens}) or raise "
                                    "train.accum_steps, then resume with --resume") from None
            # One process: free the memory below, outside the handler, where the traceback no longer pins it.
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.scaler.is_enabled():
            # Out of memory in the optimizer step leaves the fp16 scaler mid-step (`unscale_` done,
            # no `update`), and its next `unscale_` would refuse. A fresh scaler keeps the scale.
            scaler_state = self.scaler.state_dict()
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=True)
            self.scaler.load_state_dict(scaler_state)
        self.state.skipped_oom += 1
        batch = max(batches, key=lambda b: b.src_ids.numel() + b.tgt_out_ids.numel())  # the largest
        n_sentences, width = batch.tgt_out_ids.shape
        size = (f"{n_sentences} sentences, {batch.n_src_tokens} source and {batch.n_tgt_tokens} target tokens, "
                f"padded length {max(width, batch.src_ids.shape[1])}")
        if self.state.skipped_oom > 1:
            raise TrainingError(
                f"out of memory again at step {self.state.step + 1} ({size}); lower train.batch_tokens "
                f"(now {self.cfg.train.batch_tokens}) or model.max_len, then resume with --resume")
        logger.warning("out of memory at step %d on a batch of %s: skipped it and freed its memory; a second "
                       "time stops the run", self.state.step + 1, size)
        return None

    def _skip_nonfinite(self, in_a_row: int, writer: SummaryWriter) -> None:
        """Count a skipped NaN/inf update; too many in a row stop the run."""
        self.state.skipped_nonfinite += 1
        step, limit = self.state.step + 1, self.cfg.train.max_nonfinite_steps
        writer.add_scalar("train/skipped_nonfinite", self.state.skipped_nonfinite, self.state.step)
        logger.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in all)",
                       step, in_a_row, self.state.skipped_nonfinite)
        if in_a_row >= limit:
            raise TrainingError(
                f"stopping at step {step}: {in_a_row} updates in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={limit}); try a lower train.lr, more train.warmup_steps or "
                f"train.precision fp32/bf16, then resume from the last checkpoint with --resume")

    def _log_interval(self, interval: IntervalMeter, grad_norm: torch.Tensor, writer: SummaryWriter, bar: tqdm) -> None:
        """Log line and TensorBoard points for the steps since the last log; one host sync."""
        t, step = self.cfg.train, self.state.step
        stats = interval.read_and_reset()
        lr = lr_at(step, t.lr, t.warmup_steps)  # the rate this step used
        grad_norm_value = grad_norm.item()
        writer.add_scalar("train/loss", stats.mean_loss, step)
        writer.add_scalar("train/grad_norm", grad_norm_value, step)
        writer.add_scalar("lr", lr, step)
        for name, value in stats.perf().items():
            writer.add_scalar(f"perf/{name}", value, step)
        postfix = {"loss": f"{stats.mean_loss:.3f}", "lr": f"{lr:.2e}", "tgt_tok_s": f"{stats.tgt_tokens_per_s:,.0f}",
                   "src_tok_s": f"{stats.src_tokens_per_s:,.0f}"}
        if stats.mfu is not None:
            postfix["mfu"] = f"{stats.mfu:.1%}"
        if stats.peak_memory_mb is not None:
            postfix["mem"] = f"{stats.peak_memory_mb / 1024:.1f}G"
        bar.set_postfix(postfix)
        extra = "".join([f", MFU {stats.mfu:.1%}" if stats.mfu is not None else "",
                         f", peak memory {stats.peak_memory_mb:,.0f} MB" if stats.peak_memory_mb is not None else ""])
        logger.info("step %d: loss %.4f, lr %.3e, grad norm %.3f, %.0f source and %.0f target tokens/s, padding "
                    "efficiency %.3f source, %.3f target%s", step, stats.mean_loss, lr, grad_norm_value,
                    stats.src_tokens_per_s, stats.tgt_tokens_per_s, stats.src_padding_efficiency,
                    stats.tgt_padding_efficiency, extra)
        self._intervals_logged += 1
        # From the first interval of this process; under train.compile from the second, as the
        # first includes compiling.
        if self._intervals_logged == (2 if t.compile else 1) and self.data_report is not None:
            logger.info("%s", estimated_time(self.data_report, stats.tgt_tokens_per_s, step))


class _NoWriter:
    """Stands in for the SummaryWriter on ranks other than 0, which write no files."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class StopRequest:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step.

    The loop then saves a checkpoint and stops; a second signal interrupts at once, unsaved.
    Under torchrun a second signal is expected (Ctrl-C reaches every process, then torchrun
    sends SIGTERM while it waits for them), so it is ignored: torchrun's own SIGKILL after
    its grace period is the hard stop there.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, second_signal_interrupts: bool = True):
        self.signal_number: int | None = None
        self.second_signal_interrupts = second_signal_interrupts
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signal_number: int, frame) -> None:
        if self.signal_number is not None:
            if self.second_signal_interrupts:
                raise KeyboardInterrupt  # asked twice: stop now, without a checkpoint
            return
        self.signal_number = signal_number  # no logging here: a handler may interrupt a log write


@contextlib.contextmanager
def sigterm_interrupts():
    """While inside, SIGTERM raises `Terminated` where the program is, as SIGINT raises
    KeyboardInterrupt, instead of killing the process on the spot: the CLI then says how to go
    on, and, once the trainer exists, the run's summary says it was interrupted. The training
    loop's `StopRequest` overrides this for its steps."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handle(signal_number: int, frame) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train(cfg: Config, run_dir: Path, *, resume: bool = False, progress: bool = True,
          config_dir: Path | None = None, dist: Distributed = Distributed()) -> TrainState:
    """Train (or resume) the run in `run_dir`, which `prepare_run_dir` has set up.

    `config_dir`, the config file's folder, is where `summary.json` looks for a git commit.
    Under torchrun every rank calls this with its `dist` (process group started); rank 0
    alone writes files, and alone scores the test split at the end.
    """
    with sigterm_interrupts():
        return _train(cfg, run_dir, resume=resume, progress=progress, config_dir=config_dir, dist=dist)


def _train(cfg: Config, run_dir: Path, *, resume: bool, progress: bool, config_dir: Path | None,
           dist: Distributed) -> TrainState:
    if not resume and dist.is_main:
        save_config(cfg, run_dir / "config.yaml")
    if resume and not TokenizerPair.exists_in(run_dir):  # never silently train a different vocabulary
        if not dist.is_main:  # rank 0 found them (it checked the run first): this rank sees another folder
            raise missing_from_rank0(_tokenizer_file(cfg, run_dir))
        raise CheckpointError(f"{run_dir}: the tokenizer files are missing, so its checkpoints cannot be "
                              "resumed; restore them or start a new run")
    if resume:
        check_saved_config(cfg, run_dir)  # before the data is prepared: refusing then costs nothing, changes nothing
    trainer = Trainer(cfg, run_dir, progress=progress, config_dir=config_dir, dist=dist)
    state, trained_out = trainer.state, False
    if resume:
        trainer.resume()
        if dist.is_main:
            save_config(cfg, run_dir / "config.yaml")  # training-only settings may have changed
        trained_out = _trained_out(state, cfg)
        state.stopped_early = state.stopped_early and trained_out
    try:
        if not trained_out:
            state = trainer.run()
            dist.barrier()  # every rank is done training (and rank 0 done writing) before any leaves
        earlier_test = trainer.earlier_test_report() if trained_out else None
        if earlier_test is not None:
            trainer.test_report = earlier_test
        elif cfg.train.test_at_end and dist.is_main:  # also a test the end of an earlier start never finished
            trainer.final_test()
    except (TrainingStopped, KeyboardInterrupt):
        _write_summary_keeping_the_error(trainer, "interrupted")
        raise
    except BaseException as err:
        _write_summary_keeping_the_error(
            trainer, f"failed: {err}" if isinstance(err, TmtError) else f"failed: {type(err).__name__}")
        raise
    trainer.write_summary("stopped early" if state.stopped_early else "finished")
    return state


def _trained_out(state: TrainState, cfg: Config) -> bool:
    """True (and says why) when a resumed run has nothing left to train: at train.max_steps, or
    stopped early with its patience still used up."""
    patience = cfg.train.patience
    if state.step >= cfg.train.max_steps:
        logger.info("the run is already at step %d of train.max_steps=%d; raise it to train further",
                    state.step, cfg.train.max_steps)
        return True
    if state.stopped_early and patience and state.evals_since_best >= patience:
        logger.info("the run stopped early at step %d (no better validation BLEU for %d validations); raise "
                    "train.patience, or set it to 0, to train further", state.step, state.evals_since_best)
        return True
    return False


def _write_summary_keeping_the_error(trainer: Trainer, status: str) -> None:
    """Record how the run ended. If that write fails too (say, on the full disk that stopped the
    run), warn: the error that ended the run is the one to report."""
    try:
        trainer.write_summary(status)
    except OSError as err:
        logger.warning("could not update summary.json (%s)", err.strerror or err)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return [v.cpu() for v in value]
    return value
