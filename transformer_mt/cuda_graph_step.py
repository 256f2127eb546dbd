"""The GPU engine: a training micro-batch's forward, loss and backward captured once per batch
shape as a CUDA graph, then replayed, so a step is a few launches instead of ~900 (the host,
not the GPU, set the pace of the eager step: ../shared/gpu/README.md, docs/benchmarks.md).

Batches reach it with fixed shapes (`batching.static_rows` / `pad_rows` in `TrainStep.load_batch`),
so a run meets a handful of shapes and captures each once. Chosen by `TrainStep` on CUDA with one
process, no `train.compile` and no fp16 loss scaling (`graphs_apply`); tested against the eager
step in tests/test_gpu.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from transformer_mt.batching import Batch
from transformer_mt.runtime import AttentionKernels, Precision

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before a capture: cuBLAS/cuDNN handles, allocator pools


@dataclass
class _Captured:
    """One batch shape's graph and the static tensors it reads and writes."""

    src_ids: torch.Tensor  # (B, S) long, copied in before each replay
    tgt_in_ids: torch.Tensor  # (B, T) long
    tgt_out_ids: torch.Tensor  # (B, T) long
    scale: torch.Tensor  # () fp32: what the loss sum is multiplied by (1 / the update's target tokens)
    loss: torch.Tensor | None = None  # () fp32: the scaled loss, written by each replay
    graph: torch.cuda.CUDAGraph | None = None


def graphs_apply(device: torch.device, *, distributed: bool, compiled: bool, grad_scaler: bool) -> bool:
    """Whether the captured step can run: CUDA, one process (DDP's all-reduce hooks fire inside
    backward), no torch.compile (it is the other way to cut launches), no fp16 GradScaler (its
    scale changes between steps)."""
    return device.type == "cuda" and not distributed and not compiled and not grad_scaler


class GraphedStep:
    """Adds a micro-batch's gradient of (label-smoothed loss sum × scale) into the parameters'
    `.grad`, which are buffers of its own that every graph writes into, and returns the scaled loss.

    `max_graphs` bounds the shapes captured (each holds its inputs and outputs in a shared memory
    pool); a shape beyond it runs eagerly, with the same result."""

    def __init__(self, step_loss: nn.Module, params: list[nn.Parameter], *, precision: Precision,
                 attention: AttentionKernels, label_smoothing: float, max_graphs: int = 64):
        self.step_loss = step_loss  # a `loss.StepLoss`
        self.params = params
        self.precision = precision
        self.attention = attention
        self.label_smoothing = label_smoothing
        self.max_graphs = max_graphs
        self.grads = [torch.zeros_like(p) for p in params]  # every graph adds into these: never replaced
        self.pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time, so they share memory
        self.captured: dict[tuple, _Captured] = {}
        self.capture_seconds = 0.0
        self._said_eager = False

    def zero_grad(self) -> None:
        """Zero the gradient buffers and make them the parameters' `.grad` again (an out-of-memory
        skip sets them to None)."""
        torch._foreach_zero_(self.grads)
        for param, grad in zip(self.params, self.grads):
            param.grad = grad

    def run(self, batch: Batch, scale: float) -> torch.Tensor:
        """batch on the device -> the scaled loss (a 0-dim tensor that the next `run` overwrites:
        add it to a running total before then); the gradients are added to `.grad`."""
        key = (tuple(batch.src_ids.shape), tuple(batch.tgt_in_ids.shape))
        captured = self.captured.get(key)
        if captured is None and len(self.captured) < self.max_graphs:
            captured = self.captured[key] = self._capture(batch)
        if captured is None:
            if not self._said_eager:
                logger.info("more than %d batch shapes: the others run without a CUDA graph", self.max_graphs)
                self._said_eager = True
            scale_tensor = torch.full((), scale, device=batch.src_ids.device)
            return self._forward_backward(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, scale_tensor)
        captured.src_ids.copy_(batch.src_ids)
        captured.tgt_in_ids.copy_(batch.tgt_in_ids)
        captured.tgt_out_ids.copy_(batch.tgt_out_ids)
        captured.scale.fill_(scale)
        captured.graph.replay()
        return captured.loss

    def _forward_backward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, tgt_out_ids: torch.Tensor,
                          scale: torch.Tensor, accumulate: bool = True) -> torch.Tensor:
        # Autocast's cache of cast weights would be captured once and then hold stale casts.
        with self.precision.autocast(cache_enabled=False), self.attention.enabled():
            loss = self.step_loss(src_ids, tgt_in_ids, tgt_out_ids, False, self.label_smoothing,
                                  self.precision.dtype) * scale
        grads = torch.autograd.grad(loss, self.params)
        if accumulate:
            torch._foreach_add_(self.grads, grads)
        return loss.detach()

    def _capture(self, batch: Batch) -> _Captured:
        """Warm up, then capture this shape's forward and backward. The CUDA random state is put
        back afterwards, so capturing draws no dropout mask that training would not have drawn."""
        started = time.perf_counter()
        device = batch.src_ids.device
        captured = _Captured(batch.src_ids.clone(), batch.tgt_in_ids.clone(), batch.tgt_out_ids.clone(),
                             torch.ones((), device=device))
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward_backward(captured.src_ids, captured.tgt_in_ids, captured.tgt_out_ids, captured.scale,
                                       accumulate=False)
        torch.cuda.current_stream(device).wait_stream(side)
        captured.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured.graph, pool=self.pool):
            captured.loss = self._forward_backward(captured.src_ids, captured.tgt_in_ids, captured.tgt_out_ids,
                                                   captured.scale)
        torch.cuda.set_rng_state(rng, device)
        self.capture_seconds += time.perf_counter() - started
        logger.debug("captured a CUDA graph for batch shape %s in %.2fs", tuple(batch.src_ids.shape),
                     time.perf_counter() - started)
        return captured
