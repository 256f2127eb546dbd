"""Training throughput accounting: device peak FLOP/s, MFU (from the model's own FLOP count), padding
efficiency, and the meter that turns the steps between two log lines into those figures."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from transformer_mt.core.distributed import Distributed
from transformer_mt.data.batching import Batch

# Dense (no sparsity) peaks from NVIDIA's datasheets, FLOP/s: tensor cores for bf16, fp16 and
# tf32 (equal on these parts for bf16 and fp16), the plain CUDA cores for fp32. An fp32 run counts
# the tf32 peak only when torch lets matmuls use TF32 (`torch.set_float32_matmul_precision("high")`);
# by default it does not, and fp32 matmuls run on the CUDA cores.
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


def padding_efficiency(real_tokens: int, padded_slots: int) -> float:
    """Real tokens ÷ padded slots (1.0 = no padding)."""
    return real_tokens / padded_slots if padded_slots else 1.0


@dataclass(frozen=True)
class IntervalStats:
    """What one log line reports about the steps since the previous one."""

    mean_loss: float  # per target token, averaged over the steps
    src_tokens_per_s: float  # real (non-pad) tokens
    tgt_tokens_per_s: float
    src_padding_efficiency: float  # real tokens ÷ padded slots in the batches
    tgt_padding_efficiency: float
    mfu: float | None  # model FLOPs (the model's `train_flops`) ÷ (seconds × device peak); None off-GPU
    peak_memory_mb: float | None  # most GPU memory allocated at once in the interval; None off-GPU
    capture_seconds: float = 0.0  # spent capturing CUDA graphs in the interval: not in the rates above

    def perf(self) -> dict[str, float]:
        """The TensorBoard `perf/` scalars."""
        values = {"src_tokens_per_s": self.src_tokens_per_s, "tgt_tokens_per_s": self.tgt_tokens_per_s,
                  "src_padding_efficiency": self.src_padding_efficiency,
                  "tgt_padding_efficiency": self.tgt_padding_efficiency,
                  "mfu": self.mfu, "peak_memory_mb": self.peak_memory_mb,
                  "capture_seconds": self.capture_seconds or None}
        return {name: value for name, value in values.items() if value is not None}


class IntervalMeter:
    """Loss, throughput and padding since the last log line; the loss is summed on the device (no sync per step).
    Time spent capturing CUDA graphs (`add`'s `capture_seconds`) is counted apart: the rates are
    the steady state's, and the capture time is reported on its own."""

    def __init__(self, device: torch.device, dist: Distributed, peak_flops: float | None = None):
        self.device = device
        self.dist = dist
        self.peak_flops = peak_flops
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
        """Count one update: its loss (a device scalar), its batches, their model FLOPs, and the
        seconds it spent capturing CUDA graphs (taken out of the interval's time)."""
        self.loss_sum += loss
        self.steps += 1
        self.capture_seconds += capture_seconds
        for batch in batches:
            self.src_tokens += batch.n_src_tokens
            self.tgt_tokens += batch.n_tgt_tokens
            self.src_slots += batch.padded_src_slots
            self.tgt_slots += batch.padded_tgt_slots
        self.flops += flops

    def restart_clock(self) -> None:
        self.started = time.perf_counter()

    def pause(self) -> None:
        """Stop the clock (for validation, a checkpoint) once the device has done the steps counted so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.paused = time.perf_counter()

    def resume(self) -> None:
        """Restart a paused clock: the pause does not count towards the interval's time."""
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
            src_padding_efficiency=padding_efficiency(self.src_tokens, self.src_slots),
            tgt_padding_efficiency=padding_efficiency(self.tgt_tokens, self.tgt_slots),
            mfu=self.flops / elapsed / (self.peak_flops * self.dist.world_size) if self.peak_flops else None,
            peak_memory_mb=peak_memory_mb, capture_seconds=self.capture_seconds)
        self.loss_sum.zero_()
        self._zero_counts()
        self.restart_clock()
        return stats
