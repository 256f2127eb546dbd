"""A training run's resumable state: its progress counters, and the checkpoint that holds them with
every other resumable piece (weights, optimizer, sampler position, RNG streams)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Protocol

import torch

from transformer_mt.config.schema import Config, config_to_dict, with_defaults
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import CheckpointError, UsageError
from transformer_mt.core.run_layout import RunDir
from transformer_mt.core.runtime import load_rng_state, rng_state
from transformer_mt.data.batching import TokenBatchSampler
from transformer_mt.runs.checkpoint import CheckpointDir, check_tokenizers, checkpoint_state, load_checkpoint
from transformer_mt.runs.run_dir import resume_config_changes
from transformer_mt.train.ema import WeightEMA

logger = logging.getLogger(__name__)

# What a checkpoint needs besides the weights to go on training (an average holds weights only).
RESUME_KEYS = ("optimizer", "scaler", "train_state", "sampler", "rng")


@dataclasses.dataclass
class TrainState:
    """Progress counters that a checkpoint must carry besides the tensors."""

    step: int = 0  # optimizer updates done; a skipped batch is not a step
    best_bleu: float = -1.0
    best_step: int = -1  # the step `best.pt` holds
    best_value: float | None = None  # best_metric's value at best_step (None: no validation yet)
    best_metric: str | None = None  # the train.best_metric best_value is of
    evals_since_best: int = 0  # validations without a new best (early stopping)
    stopped_early: bool = False
    tgt_tokens_seen: int = 0
    skipped_nonfinite: int = 0  # batches skipped for a NaN/inf loss or gradient
    skipped_oom: int = 0  # batches skipped for running out of device memory
    train_seconds: float = 0.0  # wall time spent in this run's training processes, validation included
    last_valid: dict | None = None  # the latest validation's step and metrics
    parent: dict | None = None  # the checkpoint `train.init_from` started the run from (summary.json)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for field in dataclasses.fields(self):  # a number as its field's type; `parent` may be absent
            value = state.get(field.name)
            setattr(self, field.name, value if field.default is None else type(field.default)(value))


def improves(value: float, state: TrainState, metric: str) -> bool:
    """Whether a validation's `metric` (train.best_metric) beats the best so far: a lower loss, a
    higher score. A run resumed with another `best_metric` starts its best anew; a checkpoint from
    before `best_value` was kept has its best BLEU."""
    best = state.best_value if state.best_metric == metric else None
    if state.best_metric is None and metric == "bleu" and state.best_bleu >= 0:
        best = state.best_bleu
    return best is None or (value < best if metric == "loss" else value > best)


class Stateful(Protocol):  # `TrainStep`: the optimizer and the scaler
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RunCheckpoint:
    """Writes and restores everything a checkpoint holds: the plain model's weights, the optimizer and
    scaler (`update`), the progress counters, the sampler position, every rank's RNG state, the config,
    the tokenizers' fingerprint, and the weights' EMA."""

    def __init__(self, cfg: Config, run_dir: Path, *, model: torch.nn.Module, update: Stateful, state: TrainState,
                 sampler: TokenBatchSampler, model_args: dict, tokenizer_fingerprint: str, dist: Distributed,
                 device: torch.device, ema: WeightEMA | None = None):
        self.cfg, self.run_dir, self.model, self.update, self.state = cfg, run_dir, model, update, state
        self.sampler, self.model_args, self.tokenizer_fingerprint = sampler, model_args, tokenizer_fingerprint
        self.dist, self.device, self.ema = dist, device, ema
        self.checkpoints = CheckpointDir(RunDir(run_dir).checkpoints, cfg.train.keep_last)
        # The sampler runs one update ahead of training (the loop prepares the next update's
        # batches while the device works); checkpoints record where the trained batches end.
        self.sampler_state = sampler.state_dict()

    def state_dict(self) -> dict:
        return checkpoint_state(
            self.model.state_dict(), config_to_dict(self.cfg), self.model_args, tokenizers=self.tokenizer_fingerprint,
            ema=self.ema.state_dict() if self.ema is not None else None,
            **self.update.state_dict(),  # optimizer, scaler
            train_state=self.state.state_dict(), sampler=self.sampler_state,
            # Every rank's RNG state (dropout differs per rank); a collective, so all ranks call this.
            rng=rng_state() if not self.dist.enabled else {"ranks": self.dist.gather(rng_state())})

    def save(self, *, is_best: bool) -> None:
        """Write a step checkpoint, and `best.pt` (rank 0); every rank calls this at the same step."""
        state = self.state_dict()
        if self.dist.is_main:
            self.checkpoints.save(state, self.state.step, is_best=is_best)

    def resume(self) -> None:
        """Load the newest intact step checkpoint into every stateful piece."""
        path, ckpt, skipped = self._newest_intact()
        check_tokenizers(ckpt, self.tokenizer_fingerprint, path, self.run_dir)
        # Keys added to tmt since the checkpoint was written count as their defaults, not as changes.
        changes = resume_config_changes(with_defaults(ckpt["config"]), config_to_dict(self.cfg), path)
        own_rng = self._own_rng_state(ckpt["rng"], path)  # another world size: refused before anything is loaded
        self.model.load_state_dict(ckpt["model"])
        self.state.load_state_dict(ckpt["train_state"])
        self.update.load_state_dict(ckpt)  # after the counters: it sets the next update's learning rate
        self.sampler.load_state_dict(ckpt["sampler"])
        self.sampler_state = self.sampler.state_dict()
        if self.ema is None and "ema" in ckpt:
            logger.info("train.ema_decay is 0: the EMA of the weights in %s is dropped from now on", path.name)
        elif self.ema is not None and "ema" not in ckpt:  # train.ema_decay turned on at this resume
            logger.info("%s holds no EMA of the weights: it starts from the weights of step %d", path.name,
                        self.state.step)
            self.ema.reset()
        elif self.ema is not None:
            self.ema.load_state_dict(ckpt["ema"])
        load_rng_state({k: [t.cpu() for t in v] if isinstance(v, (list, tuple)) else v.cpu()
                        for k, v in own_rng.items()})
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

    def _newest_intact(self) -> tuple[Path, dict, list[Path]]:
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

    def _set_aside(self, skipped: list[Path], resumed: Path) -> None:
        """Set aside the step checkpoints skipped on resume, and `best.pt` too when it holds a step after
        the one training resumes from: the run's best is then the one its training state names."""
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
        """This rank's RNG state from a checkpoint, which must come from a run of as many processes
        (the data position and the random streams are per process)."""
        saved_world = len(saved["ranks"]) if "ranks" in saved else 1
        if saved_world != self.dist.world_size:
            raise UsageError(f"{path} was written by a run of {saved_world} process(es); resume it with the same "
                             f"number (torchrun --nproc_per_node/--nnodes), not {self.dist.world_size}")
        return saved["ranks"][self.dist.rank] if "ranks" in saved else saved
