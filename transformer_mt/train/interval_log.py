"""What training says every `train.log_every_steps` updates: the log line (progress, time left,
loss, learning rate, gradient norm, token rates, padding, MFU, memory), the progress bar's figures
and the TensorBoard points, from the `IntervalMeter` of the updates since the last line."""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from transformer_mt.config.schema import TrainConfig
from transformer_mt.data.report import DataReport, estimated_time, format_duration
from transformer_mt.train.schedule import lr_at
from transformer_mt.train.throughput import IntervalMeter

# The loop's own lines: train.log names them `transformer_mt.train.trainer`, as before this module
# was cut out of training.py, so scripts that read the log keep finding them.
logger = logging.getLogger("transformer_mt.train.trainer")


class IntervalLog:
    """Writes each log interval; `start` marks where this process began training, the origin of the
    pace behind each line's time left."""

    def __init__(self, cfg: TrainConfig, data_report: DataReport | None):
        self.cfg = cfg
        self.data_report = data_report  # for the one-time estimate of the whole run's duration
        self.lines = 0
        self.pace_from = (time.monotonic(), 0)  # (clock, step) where training started in this process

    def start(self, step: int) -> None:
        self.pace_from = (time.monotonic(), step)

    def write(self, step: int, interval: IntervalMeter, grad_norm: torch.Tensor, writer: SummaryWriter,
              bar: tqdm) -> None:
        """Log line and TensorBoard points for the steps since the last log; one host sync."""
        t = self.cfg
        stats = interval.read_and_reset()
        lr = lr_at(step, t)  # the rate this step used
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
                         f", peak memory {stats.peak_memory_mb:,.0f} MB" if stats.peak_memory_mb is not None else "",
                         f"; {stats.capture_seconds:.1f}s {'compiling and ' if t.compile else ''}capturing CUDA "
                         "graphs, not counted in these rates"
                         if stats.capture_seconds else ""])
        # Progress and time left on every line, for a log read under nohup or in CI (no bar there): at
        # the pace since this process started training, validations and checkpoints included.
        started, first_step = self.pace_from
        left = (time.monotonic() - started) / max(step - first_step, 1) * (t.max_steps - step)
        logger.info("step %d/%d (%.0f%%, %s left): loss %.4f, lr %.3e, grad norm %.3f, %.0f source and %.0f target "
                    "tokens/s, padding efficiency %.3f source, %.3f target%s", step, t.max_steps,
                    100 * step / t.max_steps, format_duration(left), stats.mean_loss, lr, grad_norm_value,
                    stats.src_tokens_per_s, stats.tgt_tokens_per_s, stats.src_padding_efficiency,
                    stats.tgt_padding_efficiency, extra)
        self.lines += 1
        # From the first interval of this process; under train.compile from the second, as the
        # first includes compiling.
        if self.lines == (2 if t.compile else 1) and self.data_report is not None:
            logger.info("%s", estimated_time(self.data_report, stats.tgt_tokens_per_s, step))
