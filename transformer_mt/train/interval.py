"""The metrics of a log interval, the updates between two log lines: loss, token rates, padding
efficiency, MFU and peak memory, written as the log line, the progress bar's figures and TensorBoard points."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from transformer_mt.config.schema import TrainConfig
from transformer_mt.core.distributed import Distributed
from transformer_mt.data.batching import Batch
from transformer_mt.data.report import DataReport, estimated_time, format_duration
from transformer_mt.train.schedule import lr_at

logger = logging.getLogger("transformer_mt.train.trainer")  # the loop's lines, as scripts reading train.log expect

# Dense peaks from NVIDIA's datasheets, FLOP/s: tensor cores for bf16, fp16 and tf32, CUDA cores for
# fp32 (an fp32 run counts the tf32 peak only when torch lets matmuls use TF32).
PEAK_FLOPS = {
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def peak_flops_per_s(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for `precision` ('bf16', 'fp16', 'fp32'); None when unknown or not a GPU."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), precision, torch.backends.cuda.matmul.allow_tf32)


def peak_flops_of(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The dense peak of the GPU called `device_name` for `precision`; fp32 counts as tf32 when `tf32`."""
    if "MIG" in device_name:  # a slice of the GPU: a share of its peak that the name does not give
        return None
    if precision == "fp32" and tf32:
        precision = "tf32"
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "H200 NVL" before a bare "H200"
        if all(part in device_name for part in key.split()):
            return PEAK_FLOPS[key][precision]
    if "H100" in device_name:  # e.g. "NVIDIA H100 80GB HBM3" is the SXM part
        return PEAK_FLOPS["H100 SXM"][precision]
    return None


@dataclasses.dataclass(frozen=True)
class IntervalStats:
    """What one log line reports about the updates since the previous one."""

    mean_loss: float  # per target token, averaged over the updates
    src_tokens_per_s: float  # real (non-pad) tokens
    tgt_tokens_per_s: float
    src_padding_efficiency: float  # real tokens ÷ padded slots in the batches
    tgt_padding_efficiency: float
    mfu: float | None  # model FLOPs (the model's `train_flops`) ÷ (seconds × device peak); None off-GPU
    peak_memory_mb: float | None  # most GPU memory allocated at once in the interval; None off-GPU
    capture_seconds: float = 0.0  # spent capturing CUDA graphs in the interval: not in the rates above

    def perf(self) -> dict[str, float]:
        """The TensorBoard `train/perf/` scalars: every figure but the loss that there is (capture time if any)."""
        values = {**dataclasses.asdict(self), "capture_seconds": self.capture_seconds or None}
        return {name: value for name, value in values.items() if name != "mean_loss" and value is not None}


# The training bar: its figures before the bar itself, which takes the columns left (tqdm trims the line
# to the terminal's width); no rate-based time left of tqdm's own, the figures carry the log line's.
BAR_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt}{postfix} |{bar}|"
MIN_BAR_COLUMNS = 10  # optional figures are left out before the bar gets narrower than this


def bar_figures(figures: list[tuple[str, bool]], room: int | None) -> str:
    """The bar's postfix: `figures` (text, always shown) in their order, the optional ones in turn
    while the text stays within `room` columns (None: no limit)."""
    length, full = len(", ".join(text for text, always in figures if always)), False
    shown = []
    for text, always in figures:
        if not (always or full):  # the first optional one that does not fit leaves the rest out too
            full = room is not None and length + len(", ") + len(text) > room
            length += 0 if full else len(", ") + len(text)
        if always or not full:
            shown.append(text)
    return ", ".join(shown)


def bar_room(bar: tqdm) -> int | None:
    """The columns `bar` leaves its postfix in `BAR_FORMAT` at its widest, with the bar at `MIN_BAR_COLUMNS`;
    None when it has no width (no terminal)."""
    columns = bar.format_dict["ncols"]  # asks the terminal again: it may have been resized
    if not columns:
        return None
    counts = f"{bar.desc}: 100% {bar.total}/{bar.total}, "
    return columns - len(counts) - len(" ||") - MIN_BAR_COLUMNS


class TimeLeft:
    """Time left to `max_steps` at the recent pace: wall time over the last `window` steps or more (since
    `step`, where this process started, until there are that many), so that the validations and saves
    among them count and the start (compiling, warming up) is soon forgotten."""

    def __init__(self, max_steps: int, window: int, step: int):
        self.max_steps, self.window = max_steps, window
        self.marks = collections.deque([(time.monotonic(), step)])

    def at(self, step: int) -> float:
        """Seconds left after `step`; marks it for later estimates."""
        now = time.monotonic()
        while len(self.marks) > 1 and step - self.marks[1][1] >= self.window:
            self.marks.popleft()
        then, first = self.marks[0]
        self.marks.append((now, step))
        return (now - then) / max(step - first, 1) * (self.max_steps - step)


class Interval:
    """Counts the updates since the last log line (`add`, no host sync) and `write`s them out; `pause`
    and `resume` leave validation and checkpoints out of its time. Each line's time left, and the
    bar's, is `TimeLeft`'s, from `step`, where this process started training."""

    def __init__(self, cfg: TrainConfig, device: torch.device, dist: Distributed, *, peak_flops: float | None = None,
                 data_report: DataReport | None = None, step: int = 0):
        self.cfg, self.device, self.dist, self.peak_flops = cfg, device, dist, peak_flops
        self.data_report = data_report  # for the one-time estimate of the whole run's duration
        self.lines = 0
        self.time_left = TimeLeft(cfg.max_steps, max(cfg.eval_every_steps, cfg.save_every_steps), step)
        self.loss_sum = torch.zeros((), device=device)
        self._zero_counts()
        self.started = time.perf_counter()
        self.paused: float | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _zero_counts(self) -> None:
        self.steps = self.src_tokens = self.tgt_tokens = self.src_slots = self.tgt_slots = 0
        self.flops = self.capture_seconds = 0.0

    def add(self, loss: torch.Tensor, batches: list[Batch], flops: float = 0.0, capture_seconds: float = 0.0) -> None:
        """Count one update: its loss (a device scalar), batches, model FLOPs and CUDA-graph capture time."""
        self.loss_sum += loss
        self.steps += 1
        self.capture_seconds += capture_seconds
        for batch in batches:
            self.src_tokens += batch.n_src_tokens
            self.tgt_tokens += batch.n_tgt_tokens
            self.src_slots += batch.padded_src_slots
            self.tgt_slots += batch.padded_tgt_slots
        self.flops += flops

    def pause(self) -> None:
        """Stop the clock once the device has done the updates counted so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.paused = time.perf_counter()

    def resume(self) -> None:
        if self.paused is not None:
            self.started += time.perf_counter() - self.paused
            self.paused = None

    def read_and_reset(self) -> IntervalStats:
        """The interval's figures; under DDP summed over the ranks (a collective: every rank calls it)."""
        if self.dist.enabled:
            values = [self.loss_sum.item(), self.src_tokens, self.tgt_tokens, self.src_slots, self.tgt_slots, self.flops]
            summed = self.dist.sum_(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()
            self.loss_sum.fill_(summed[0])  # each rank held its share of every step's per-token loss
            self.src_tokens, self.tgt_tokens, self.src_slots, self.tgt_slots = map(int, summed[1:5])
            self.flops = summed[5]
        mean_loss = self.loss_sum.item() / max(self.steps, 1)  # waits for the device: the clock then counts its work
        elapsed = max(time.perf_counter() - self.started - self.capture_seconds, 1e-9)
        peak_memory_mb = None
        if self.device.type == "cuda":
            peak_memory_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
            torch.cuda.reset_peak_memory_stats(self.device)
        stats = IntervalStats(
            mean_loss=mean_loss, src_tokens_per_s=self.src_tokens / elapsed, tgt_tokens_per_s=self.tgt_tokens / elapsed,
            src_padding_efficiency=self.src_tokens / self.src_slots if self.src_slots else 1.0,
            tgt_padding_efficiency=self.tgt_tokens / self.tgt_slots if self.tgt_slots else 1.0,
            mfu=self.flops / elapsed / (self.peak_flops * self.dist.world_size) if self.peak_flops else None,
            peak_memory_mb=peak_memory_mb, capture_seconds=self.capture_seconds)
        self.loss_sum.zero_()
        self._zero_counts()
        self.started = time.perf_counter()
        return stats

    def write(self, step: int, grad_norm: torch.Tensor, writer: SummaryWriter, bar: tqdm) -> None:
        """The log line, the bar's figures and the TensorBoard points of the interval, then a new one."""
        t = self.cfg
        stats = self.read_and_reset()
        lr = lr_at(step, t)  # the rate this step used
        grad_norm_value = grad_norm.item()
        writer.add_scalar("train/loss", stats.mean_loss, step)
        writer.add_scalar("train/grad_norm", grad_norm_value, step)
        writer.add_scalar("train/lr", lr, step)
        for name, value in stats.perf().items():
            writer.add_scalar(f"train/perf/{name}", value, step)
        left = format_duration(self.time_left.at(step))  # validations and checkpoints included
        if not bar.disable:  # what a terminal's width has room for: loss, tokens/s and time left first
            figures = [(f"loss {stats.mean_loss:.3f}", True), (f"lr {lr:.2e}", False),
                       (f"{stats.tgt_tokens_per_s:,.0f} tgt tok/s", True),
                       (f"{stats.src_tokens_per_s:,.0f} src tok/s", False)]
            if stats.mfu is not None:
                figures.append((f"MFU {stats.mfu:.1%}", False))
            if stats.peak_memory_mb is not None:
                figures.append((f"{stats.peak_memory_mb / 1024:.1f}G peak", False))
            bar.set_postfix_str(bar_figures([*figures, (f"{left} left", True)], bar_room(bar)))
        extra = "".join([f", MFU {stats.mfu:.1%}" if stats.mfu is not None else "",
                         f", peak memory {stats.peak_memory_mb:,.0f} MB" if stats.peak_memory_mb is not None else "",
                         f"; {stats.capture_seconds:.1f}s {'compiling and ' if t.compile else ''}capturing CUDA "
                         "graphs, not counted in these rates"
                         if stats.capture_seconds else ""])
        logger.info("step %d/%d (%.0f%%, %s left): loss %.4f, lr %.3e, grad norm %.3f, %.0f source and %.0f target "
                    "tokens/s, padding efficiency %.3f source, %.3f target%s", step, t.max_steps,
                    100 * step / t.max_steps, left, stats.mean_loss, lr, grad_norm_value,
                    stats.src_tokens_per_s, stats.tgt_tokens_per_s, stats.src_padding_efficiency,
                    stats.tgt_padding_efficiency, extra)
        self.lines += 1
        if self.lines == (2 if t.compile else 1) and self.data_report is not None:  # under compile: past compiling
            logger.info("%s", estimated_time(self.data_report, stats.tgt_tokens_per_s, step))
