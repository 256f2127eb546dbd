"""`train(cfg, run_dir)`: prepare the data, build the model, maybe resume, then the loop (step, log,
validate, save), the final test, and the run's status in `summary.json` throughout."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from transformer_mt.config.loading import save_config
from transformer_mt.config.schema import Config, frozen_prefixes
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import (CheckpointError, ConfigError, TmtError, TrainingError, TrainingStopped,
                                        interrupted, missing_from_rank0)
from transformer_mt.core.files import os_error_reason, os_errors_named
from transformer_mt.core.run_layout import RunDir, checkpoint_steps
from transformer_mt.core.runtime import (Precision, pick_attention, pick_device, pick_precision,
                                         warn_attention_fallbacks, warn_if_bf16_emulated)
from transformer_mt.core.signals import StopRequest, sigterm_interrupts
from transformer_mt.data.tokenization import PAD_ID, TokenizerPair
from transformer_mt.evaluate.metrics import bleu_tokenizer_problem
from transformer_mt.model.transformer import Transformer, build_model
from transformer_mt.runs import summary
from transformer_mt.runs.init_from import Parent, load_parent
from transformer_mt.runs.run_dir import check_saved_config
from transformer_mt.train.batches import StepBatches, resolve_batch_tokens
from transformer_mt.train.ema import WeightEMA
from transformer_mt.train.interval import BAR_FORMAT, Interval, peak_flops_per_s
from transformer_mt.train.optional_outputs import OptionalWriter, quiet_tensorboard_thread
from transformer_mt.train.preparation import batch_padding, prepare_data
from transformer_mt.train.state import RunCheckpoint, TrainState, improves
from transformer_mt.train.step import TrainStep, choose_engine
from transformer_mt.train.validation import Evaluator

logger = logging.getLogger(__name__)


class Trainer:
    """One training run: sets up its pieces, then `run` is the loop; keeps `summary.json` and `train_seconds`."""

    def __init__(self, cfg: Config, run_dir: Path, *, progress: bool = True, config_dir: Path | None = None,
                 dist: Distributed = Distributed(), parent: Parent | None = None):
        if problem := bleu_tokenizer_problem(cfg.train.bleu_tokenize):  # before hours of training
            raise ConfigError([f"train.bleu_tokenize: {problem}"])
        if cfg.train.valid_comet and dist.is_main:  # the package and the model, as early
            from transformer_mt.evaluate.comet import comet_checkpoint

            comet_checkpoint(cfg.train.valid_comet, key="train.valid_comet")
        self.run_dir, self.dist = run_dir, dist
        self.progress = progress and dist.is_main
        self.device = dist.local_device(pick_device(cfg.train.device))
        self.precision: Precision = pick_precision(cfg.train.precision, self.device)
        cfg, budget_note = resolve_batch_tokens(cfg, self.device, self.precision, dist)  # `auto`: for this device
        self.cfg = cfg
        if dist.is_main:  # decoding picks its attention kernels from decode.attention_backend; both warn here, once
            if budget_note:
                logger.info("%s", budget_note)
            warn_if_bf16_emulated(self.precision, self.device)
            if cfg.train.valid_comet and self.device.type != "cuda":
                logger.warning("train.valid_comet: COMET runs on the %s here, where its models are slow; each "
                               "validation takes longer", self.device.type.upper())
            warn_attention_fallbacks(self.device, {"train.attention_backend": cfg.train.attention_backend,
                                                   "decode.attention_backend": cfg.decode.attention_backend})
        attention = pick_attention(cfg.train.attention_backend, self.device, "train")  # SDPA kernels of steps
        pad_to_multiple = batch_padding(cfg.train, self.device.type)
        # Packed batches and the captured update, each checked once here and kept if it passes.
        self.engine = choose_engine(cfg, self.device, self.precision, attention, dist)
        torch.manual_seed(cfg.seed)  # CPU and CUDA generators; tmt draws nothing from random or numpy
        with dist.main_first():  # rank 0 trains the tokenizers, carves the splits, fills the token cache
            self.tokenizers, self.train_data, valid_data, self.data_report = prepare_data(
                cfg, run_dir, self.progress, dist.world_size, pad_to_multiple, prepared=not dist.is_main,
                packed=self.engine.packed)
        model_args = {"src_vocab_size": self.tokenizers.src.get_vocab_size(),
                      "tgt_vocab_size": self.tokenizers.tgt.get_vocab_size(), "pad_id": PAD_ID}
        self.model = build_model(cfg.model, **model_args).to(self.device)  # the same initial weights on every rank
        if parent is not None:  # train.init_from
            self.model.load_state_dict(parent.weights)
        self.frozen = freeze(self.model, cfg.train.freeze)
        self.ema = WeightEMA(self.model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        if dist.enabled:
            torch.manual_seed(cfg.seed + dist.rank)  # different dropout masks on each rank
        self.state = TrainState(parent=parent.record if parent is not None else None)
        self.train_step = TrainStep(cfg, self.model, self.train_data, self.state, device=self.device,
                                    precision=self.precision, attention=attention, dist=dist,
                                    pad_to_multiple=pad_to_multiple, engine=self.engine)
        self.sampler = self.train_step.batches.sampler
        self.checkpoint = RunCheckpoint(cfg, run_dir, model=self.model, update=self.train_step, state=self.state,
                                        sampler=self.sampler, model_args=model_args, dist=dist, device=self.device,
                                        tokenizer_fingerprint=self.tokenizers.fingerprint(), ema=self.ema)
        self.evaluator = Evaluator(cfg, run_dir, model=self.ema.model if self.ema else self.model,
                                   tokenizers=self.tokenizers, valid_data=valid_data, ema=self.ema is not None,
                                   checkpoints=self.checkpoint.checkpoints, device=self.device,
                                   precision=self.precision, attention=attention, dist=dist,
                                   pad_to_multiple=pad_to_multiple, progress=self.progress)
        self.provenance = summary.provenance(cfg, run_dir, self.device, config_dir)
        self.test_report: dict | None = None  # the final test's, once there is one
        self._clock = time.perf_counter()  # train_seconds counts from here
        self._summary_warned = False
        t = cfg.train
        if t.eval_every_steps % t.save_every_steps:
            logger.info("train.eval_every_steps=%d is not a multiple of train.save_every_steps=%d: a new best "
                        "between saves is saved as a step checkpoint too, and counts toward train.keep_last "
                        "and train.average_last", t.eval_every_steps, t.save_every_steps)
        # The step and data position of this process's newest checkpoint (a skipped batch moves only the latter)
        self.saved_at: tuple[int, dict] | None = None

    def save(self, *, is_best: bool) -> None:
        self._tick()
        self.checkpoint.save(is_best=is_best)
        self.saved_at = (self.state.step, self.checkpoint.sampler_state)
        self.write_summary("running")

    def _tick(self) -> None:
        """Add the wall time since the last tick to `train_seconds`."""
        now = time.perf_counter()
        self.state.train_seconds += now - self._clock
        self._clock = now

    def write_summary(self, status: str) -> None:
        """Rewrite `summary.json` (rank 0). A failed write (a full disk) warns once and the run goes
        on: the next checkpoint, which a resume needs, stops it with the reason if the disk stays full."""
        self._tick()
        if not self.dist.is_main:
            return
        s, sampler_state = self.state, self.checkpoint.sampler_state
        content = {
            "name": self.cfg.name, "status": status, "step": s.step, "max_steps": self.cfg.train.max_steps,
            "epoch": sampler_state["epoch"] + 1, "best_bleu": s.best_bleu, "best_step": s.best_step,
            "last_valid": s.last_valid, "test": self.test_report, "tgt_tokens_seen": s.tgt_tokens_seen,
            "train_seconds": round(s.train_seconds, 1),
            "tgt_tokens_per_s": round(s.tgt_tokens_seen / s.train_seconds, 1) if s.train_seconds else None,
            "skipped_nonfinite": s.skipped_nonfinite, "skipped_oom": s.skipped_oom, "init_from": s.parent,
            "parameters": self.model.num_parameters(), "data": self.data_report.to_dict(),
            "provenance": {**self.provenance, "processes": self.dist.world_size},  # what --resume must start again
            "cuda_graphs": self.train_step.engine_report(), "engine_check": self.engine.report}
        try:
            summary.write_summary(self.run_dir, content)
        except OSError as err:
            if not self._summary_warned:
                logger.warning("could not update %s (%s); training goes on", err.filename or "summary.json",
                               os_error_reason(err))
            self._summary_warned = True

    def validate(self, writer: SummaryWriter) -> dict:
        """Validate at the current step; returns its scores (`last_valid`)."""
        self.state.last_valid = self.evaluator.validate(writer, self.state.step)
        return self.state.last_valid

    def final_test(self) -> None:
        self.test_report = self.evaluator.final_test(self.state.step)

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> TrainState:
        t, state = self.cfg.train, self.state
        logger.info("device %s, precision %s, %d parameters, %d training pairs", self.device,
                    self.precision.name, self.model.num_parameters(), len(self.train_data))
        if t.freeze:
            total = self.model.num_parameters()
            logger.info("train.freeze %s: %s of the %s parameters frozen, %s trained", ", ".join(t.freeze),
                        f"{self.frozen:,}", f"{total:,}", f"{total - self.frozen:,}")
        tensorboard = str(RunDir(self.run_dir).tensorboard)  # a failed write warns once, then training goes on
        writer = OptionalWriter(lambda: SummaryWriter(tensorboard, purge_step=state.step + 1)
                                if self.dist.is_main else None, tensorboard)
        self.write_summary("running")
        # No bar off a terminal (a CI log, a file: the log lines stand in for it), and none left once done.
        bar = tqdm(total=t.max_steps, initial=state.step, desc="train", unit="step", file=sys.stderr, leave=False,
                   disable=not (self.progress and sys.stderr.isatty()), dynamic_ncols=True, bar_format=BAR_FORMAT)
        batches = iter(self.sampler)
        interval = Interval(t, self.device, self.dist, peak_flops=peak_flops_per_s(self.device, self.precision.name),
                            data_report=self.data_report, step=state.step)
        nonfinite_in_a_row = 0
        stop = StopRequest(second_signal_interrupts=not self.dist.enabled)
        agreed_signal = 0  # under DDP, the stop signal the ranks agreed on in the last step
        upcoming: list[StepBatches] = []  # the next update's batches, drawn while the device works
        try:
            stop.install()
            while state.step < t.max_steps:
                if signal_number := agreed_signal if self.dist.enabled else (stop.signal_number or 0):
                    self._stop_on_signal(signal_number)
                current = upcoming.pop() if upcoming else self.train_step.batches.draw(batches)

                def draw_next() -> None:  # runs on the host while the device works on `current`
                    if state.step + 1 < t.max_steps:
                        upcoming.append(self.train_step.batches.draw(batches))

                result = self.train_step.run_or_skip(current.micro_batches, current.tgt_tokens, draw_next,
                                                     stop.signal_number or 0)
                self.checkpoint.sampler_state = current.sampler_state  # trained (or skipped): resume after them
                if result is None:  # out of memory: the batch was skipped
                    writer.add_scalar("train/skipped_oom", state.skipped_oom, state.step)
                    continue
                agreed_signal = result.stop_signal
                if not result.updated:
                    nonfinite_in_a_row += 1
                    self._skip_nonfinite(nonfinite_in_a_row, writer)
                    continue
                nonfinite_in_a_row = 0
                if self.ema is not None:
                    self.ema.update()
                state.tgt_tokens_seen += current.tgt_tokens
                flops = sum(self.model.train_flops(*self.train_data.lengths_of(i)) for i in current.indices)
                interval.add(result.loss, current.micro_batches, flops, result.capture_seconds)
                bar.update(1)
                if state.step % t.log_every_steps == 0 or state.step == t.max_steps:
                    interval.write(state.step, result.grad_norm, writer, bar)
                if self._after_step(writer, interval):
                    break
            # A signal during the last step's validation or save: stop before the final test, which a resume
            # runs. Under torchrun the ranks agree on it first (it may have reached only some).
            signal_number = stop.signal_number or 0
            if self.dist.enabled:
                signal_number = int(self.dist.max_(torch.full((), float(signal_number), device=self.device)).item())
            if signal_number:
                name = signal.Signals(signal_number).name
                logger.warning("received %s during the last step: stopping before the final test", name)
                raise TrainingStopped(f"{interrupted(signal_number)} after the last step ({state.step}); "
                                      "checkpoint saved", signal_number)
        finally:
            stop.uninstall()
            bar.close()
            writer.close()
        return state

    def _after_step(self, writer: SummaryWriter, interval: Interval) -> bool:
        """Validate and save when due. True when training is over: `max_steps`, or early stopping."""
        t, state, is_best = self.cfg.train, self.state, False
        step, finished = state.step, state.step >= t.max_steps
        validate = step % t.eval_every_steps == 0 or finished
        save_due = step % t.save_every_steps == 0 or finished
        if validate or save_due:
            interval.pause()  # validation and checkpoint writing are not training time
        if validate:
            valid = self.validate(writer)
            is_best = improves(valid[t.best_metric], state, t.best_metric)
            if is_best:
                state.best_bleu, state.best_step = valid["bleu"], step
                state.best_value, state.best_metric = valid[t.best_metric], t.best_metric
            state.evals_since_best = 0 if is_best else state.evals_since_best + 1
            if t.patience and state.evals_since_best >= t.patience:
                logger.info("stopping early at step %d: validation %s has not improved on %g (step %d) for %d "
                            "validations (train.patience)", step, t.best_metric, state.best_value, state.best_step,
                            state.evals_since_best)
                state.stopped_early = finished = True
            if finished:
                self.evaluator.log_hparams(writer, step, state.best_bleu, valid["bleu"])
        if save_due or finished or is_best:  # finished: also by early stopping; a best: a step checkpoint too
            self.save(is_best=is_best)
        interval.resume()
        return finished

    def _stop_on_signal(self, signal_number: int) -> None:
        name = signal.Signals(signal_number).name
        logger.warning("received %s: saving a checkpoint, then stopping", name)
        saved_step, saved_position = self.saved_at or (None, None)
        if saved_step != self.state.step or saved_position is not self.checkpoint.sampler_state:
            self.save(is_best=False)  # not saved already by this step being a save step
        self.dist.barrier()  # no rank leaves while rank 0 still writes: torchrun would kill it mid-write
        raise TrainingStopped(f"{interrupted(signal_number)} at step {self.state.step}; checkpoint saved",
                              signal_number)

    def _skip_nonfinite(self, in_a_row: int, writer: SummaryWriter) -> None:
        """Count a skipped NaN/inf update; `train.max_nonfinite_steps` in a row stop the run."""
        self.state.skipped_nonfinite += 1
        step, limit = self.state.step + 1, self.cfg.train.max_nonfinite_steps
        writer.add_scalar("train/skipped_nonfinite", self.state.skipped_nonfinite, self.state.step)
        logger.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in all)",
                       step, in_a_row, self.state.skipped_nonfinite)
        if in_a_row >= limit:
            again = ("resume from the last checkpoint with --resume" if self.checkpoint.checkpoints.latest() is not None
                     else "start again with --overwrite (no checkpoint was written yet)")
            raise TrainingError(
                f"stopping at step {step}: {in_a_row} updates in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={limit}); try a lower train.lr, more train.warmup_steps or "
                f"train.precision fp32/bf16, then {again}")


def train(cfg: Config, run_dir: Path, *, resume: bool = False, progress: bool = True,
          config_dir: Path | None = None, dist: Distributed = Distributed()) -> TrainState:
    """Train (or resume) the run in `run_dir`, set up by `prepare_run_dir`; `config_dir`: where `summary.json`
    looks for a git commit. Under torchrun every rank calls this; rank 0 alone writes files and tests."""
    with sigterm_interrupts(), quiet_tensorboard_thread(), os_errors_named():  # a full disk: the file, why
        if not resume and dist.is_main:
            save_config(cfg, RunDir(run_dir).config)
        if resume and not TokenizerPair.exists_in(run_dir):  # never silently train a different vocabulary
            if not dist.is_main:  # rank 0 found them (it checked the run first): this rank sees another folder
                raise missing_from_rank0(RunDir(run_dir).tokenizer_file(cfg.tokenizer.joint))
            raise CheckpointError(f"{run_dir}: the tokenizer files are missing, so its checkpoints cannot be "
                                  "resumed; restore them or start a new run")
        if resume:  # refused before the data is prepared: that costs nothing, changes nothing
            if changes := check_saved_config(cfg, run_dir):  # what the user changed, said before any work
                logger.warning("resuming with settings that differ from the run's config.yaml: %s", "; ".join(changes))
            steps = checkpoint_steps(RunDir(run_dir).checkpoints)  # the run was finished at "30/20" before
            if steps and steps[-1] > cfg.train.max_steps:
                raise ConfigError([f"train.max_steps: {cfg.train.max_steps} is below the run's step {steps[-1]}; a "
                                   "run cannot be shortened (its checkpoints are there for tmt average and evaluate); "
                                   f"resume with --set train.max_steps={steps[-1]} or more"])
        parent = None
        if cfg.train.init_from and resume:
            logger.info("train.init_from is ignored: the run resumes from its own checkpoint")
        elif cfg.train.init_from:
            parent = load_parent(cfg)  # before the data is prepared, as above
        trainer = Trainer(cfg, run_dir, progress=progress, config_dir=config_dir, dist=dist, parent=parent)
        state, trained_out = trainer.state, False
        if resume:
            trainer.checkpoint.resume()
            if dist.is_main:
                save_config(cfg, RunDir(run_dir).config)  # training-only settings may have changed
            trained_out = _trained_out(state, cfg)
            state.stopped_early = state.stopped_early and trained_out
        try:
            if not trained_out:
                state = trainer.run()
                dist.barrier()  # every rank is done training (and rank 0 done writing) before any leaves
            earlier_test = trainer.evaluator.earlier_test_report(state.step) if trained_out else None
            if earlier_test is not None:
                trainer.test_report = earlier_test
            elif cfg.train.test_at_end and dist.is_main:  # also a test the end of an earlier start never finished
                trainer.final_test()
        except (TrainingStopped, KeyboardInterrupt):
            trainer.write_summary("interrupted")  # a failure to write warns: the error that ended the run counts
            raise
        except BaseException as err:
            trainer.write_summary(f"failed: {err}" if isinstance(err, TmtError) else f"failed: {type(err).__name__}")
            raise
        trainer.write_summary("stopped early" if state.stopped_early else "finished")
        return state


def freeze(model: Transformer, names: tuple[str, ...]) -> int:
    """`train.freeze` applied to `model`: the parameters frozen; a `ConfigError` when nothing is left to train."""
    frozen = model.freeze(frozen_prefixes(names))
    if names and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError([f"train.freeze: {', '.join(names)} freezes every parameter of the model; "
                           "nothing would be trained"])
    return frozen


def check_freeze(cfg: Config) -> None:
    """Refuse a `train.freeze` that leaves nothing to train before the run directory is claimed
    (`--overwrite` would have emptied it), on a model that holds no memory."""
    if cfg.train.freeze:
        with torch.device("meta"):
            freeze(build_model(cfg.model, 8, 8, PAD_ID), cfg.train.freeze)


def _trained_out(state: TrainState, cfg: Config) -> bool:
    """True (and says why) when a resumed run is at train.max_steps, or stopped early with its patience used up."""
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
