"""One training update: forward and backward over the update's micro-batches
(gradient accumulation, DDP), clipping, the NaN/inf and out-of-memory guards, and the AdamW step."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from transformer_mt.config.schema import Config
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import TrainingError
from transformer_mt.core.runtime import AttentionKernels, Precision
from transformer_mt.data.batching import Batch
from transformer_mt.data.token_cache import TokenizedSplit
from transformer_mt.model.transformer import Transformer
from transformer_mt.train.batches import BatchSource, packed_batches
from transformer_mt.train.cuda_graphs import GraphedStep, compiled_for_graphs, graphs_apply
from transformer_mt.train.loss import StepLoss, batch_offsets
from transformer_mt.train.schedule import lr_at
from transformer_mt.train.self_check import Engine, check_engine
from transformer_mt.train.state import TrainState

logger = logging.getLogger(__name__)


def choose_engine(cfg: Config, device: torch.device, precision: Precision, attention: AttentionKernels,
                  dist: Distributed) -> Engine:
    """The paths training takes: packed batches (`train.batching`) and the captured update
    (`train.cuda_graphs`, where it applies), each kept if the self-check passes on this device."""
    graphed = cfg.train.cuda_graphs and graphs_apply(device, distributed=dist.enabled,
                                                     grad_scaler=precision.needs_grad_scaler)
    return check_engine(cfg, device, precision, attention, packed=packed_batches(cfg, device), graphed=graphed,
                        dist=dist)


@dataclass(frozen=True)
class StepResult:
    """What one training step reports; the tensors stay on the device until a log line needs them."""

    loss: torch.Tensor  # label-smoothed loss per target token
    grad_norm: torch.Tensor  # global gradient norm before clipping
    updated: bool  # False: the loss or a gradient was not finite and the update was skipped
    stop_signal: int = 0  # the stop signal any rank had received by this step (0: none)
    capture_seconds: float = 0.0  # spent capturing CUDA graphs in this step (new batch shapes)


class TrainStep:
    """Owns what an update changes besides the weights: the batches (`BatchSource`), the optimizer, the
    fp16 grad scaler and the module a step calls. A finite update advances `state.step`; the optimizer
    always holds the learning rate of the next update, `lr_at(state.step + 1, cfg.train)`."""

    def __init__(self, cfg: Config, model: Transformer, train_data: TokenizedSplit, state: TrainState, *,
                 device: torch.device, precision: Precision, attention: AttentionKernels, dist: Distributed,
                 pad_to_multiple: int, engine: Engine):
        t = cfg.train
        self.cfg, self.model, self.state, self.device, self.dist = cfg, model, state, device, dist
        self.precision, self.attention = precision, attention  # attention: the SDPA kernels of forward and backward
        # The module a step calls is the model's loss (`StepLoss`), DDP-wrapped under torchrun and
        # compiled with train.compile; checkpoints, validation and decoding use the plain model.
        self.ddp_model: torch.nn.parallel.DistributedDataParallel | None = None
        if dist.enabled:
            # No buffer broadcast before every forward: the only buffer, the position table, is a
            # constant. torch 2.13 renamed the argument, and warns at the old name.
            ddp = torch.nn.parallel.DistributedDataParallel
            no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters
                       else "broadcast_buffers")
            self.ddp_model = ddp(StepLoss(model), device_ids=[device] if device.type == "cuda" else None,
                                 **{no_sync: False})
        self.step_model = plain_step_model = self.ddp_model or StepLoss(model)
        # The GPU engine (`train.cuda_graphs`, `choose_engine`): each batch shape's whole update replayed
        # as a CUDA graph; its AdamW is capturable and reads the rate from a device tensor.
        graphed = engine.graphed
        if t.compile:  # under the engine: static shapes, each compiled before its capture
            self.step_model = compiled_for_graphs(self.step_model) if graphed else torch.compile(self.step_model)
        self.fused_optimizer = device.type in ("cuda", "cpu")  # one kernel per group; MPS keeps foreach
        # The CUDA kernel reads the rate tensor as fp32 (6e-8 from the eager double at most), the CPU one as double.
        self.lr = torch.zeros((), dtype=torch.float32 if device.type == "cuda" else torch.float64,
                              device=device) if graphed else None
        # Parameters frozen by train.freeze have no gradient and no optimizer state (under DDP, no bucket).
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr if self.lr is None else self.lr, betas=t.betas,
                                           eps=1e-9, weight_decay=t.weight_decay, fused=self.fused_optimizer,
                                           capturable=graphed)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.needs_grad_scaler)
        self.batches = BatchSource(cfg, train_data, device=device, dist=dist, pad_to_multiple=pad_to_multiple,
                                   fixed_rows=graphed, packed=engine.packed)
        # The layers compute at the real tokens only, except where shapes must stay fixed (captured, compiled).
        self.pack = not (graphed or t.compile)
        self.graphs = GraphedStep(self.step_model, self.params, self.optimizer, precision=precision,
                                  attention=attention, label_smoothing=t.label_smoothing,
                                  max_norm=t.clip_grad_norm or float("inf"), capture=device.type == "cuda",
                                  uncaptured_loss=plain_step_model) if graphed else None
        self.apply_settings()

    def apply_settings(self) -> None:
        """Set every parameter group from train.* (which may change on resume) and the next update's
        learning rate (on the captured path into the device tensor the graphs read)."""
        t = self.cfg.train
        lr = lr_at(self.state.step + 1, t)
        if self.lr is not None:
            self.lr.fill_(lr)  # queued behind the update that has just run: no sync
        for group in self.optimizer.param_groups:
            group.update(lr=lr if self.lr is None else self.lr, betas=t.betas, weight_decay=t.weight_decay,
                         fused=self.fused_optimizer, capturable=self.lr is not None)

    def state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        for group in optimizer["param_groups"]:  # a plain number in checkpoints, whichever path saved them
            group["lr"] = float(group["lr"])
        return {"optimizer": optimizer, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])  # new state tensors: captured graphs must go
        if self.graphs is not None:
            self.graphs.captured.clear()
        if state["scaler"] and self.scaler.is_enabled():  # a run may switch between fp32 and fp16
            self.scaler.load_state_dict(state["scaler"])
        self.apply_settings()

    # --- the update ----------------------------------------------------------------------
    def run(self, batches: Batch | list[Batch], step_tgt_tokens: int | None = None, *,
            while_device_works: Callable[[], None] | None = None, stop_signal: int = 0) -> StepResult:
        """Forward and backward over one or more batches (gradient accumulation), then clip and
        update; a NaN/inf loss or gradient norm skips the update. Each batch's loss is divided by
        the target tokens of the whole update, `step_tgt_tokens` (every rank's under DDP). The
        returned loss is this rank's share of the update's per-token loss. The host reads one
        finiteness flag per update, after `while_device_works` (drawing the next batches); under
        DDP the same all-reduce agrees on `stop_signal`, this rank's pending stop signal."""
        batches = [batches] if isinstance(batches, Batch) else batches
        n_tgt_tokens = step_tgt_tokens or sum(batch.n_tgt_tokens for batch in batches)
        self.model.train()
        graphs, capture_seconds = self.graphs, 0.0
        if graphs is not None:  # the GPU engine replays the update, the skip of a non-finite one included
            captured_before = graphs.capture_seconds
            graphs.start_update()
            for i, batch in enumerate(batches):
                graphs.run(batch, n_tgt_tokens, last=i == len(batches) - 1)
            total, grad_norm = graphs.loss_sum.clone(), graphs.grad_norm.clone()  # the next update overwrites them
            capture_seconds, nonfinite = graphs.capture_seconds - captured_before, graphs.nonfinite
        else:
            total = self._forward_backward(batches, n_tgt_tokens)
            self.scaler.unscale_(self.optimizer)
            max_norm = self.cfg.train.clip_grad_norm or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            nonfinite = (~(torch.isfinite(total) & torch.isfinite(grad_norm))).float()
        if while_device_works is not None:
            while_device_works()
        # Ranks must agree: one rank's non-finite loss must skip the update on every rank, and one
        # rank's stop signal must stop every rank at the same step.
        if self.dist.enabled:
            flags = torch.stack([nonfinite, torch.full((), float(stop_signal), device=self.device)])
            nonfinite_anywhere, stop_signal = (int(v) for v in self.dist.max_(flags).tolist())
            finite = nonfinite_anywhere == 0
        else:
            finite = not bool(nonfinite)
        if graphs is None and (finite or self.scaler.is_enabled()):
            # The fp16 scaler skips a non-finite update itself, and must see it to lower its scale.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if finite:
            self.state.step += 1
            self.apply_settings()  # the next update's learning rate
        return StepResult(total, grad_norm.detach(), finite, stop_signal, capture_seconds)

    def _forward_backward(self, batches: list[Batch], n_tgt_tokens: int) -> torch.Tensor:
        """Gradients of the batches' summed loss / `n_tgt_tokens` into `.grad`; returns that loss."""
        # DDP averages gradients over the W ranks; scaling each rank's loss by W turns that into the sum.
        world = self.dist.world_size
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            # Under DDP, gradients are all-reduced only in the backward of the last micro-batch.
            last = self.ddp_model is None or i == len(batches) - 1
            with contextlib.nullcontext() if last else self.ddp_model.no_sync(), self.attention.enabled():
                with self.precision.autocast():  # the model's; the loss computes in fp32 outside it
                    loss = self.step_model(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids,
                                           self.cfg.train.label_smoothing, self.pack, batch_offsets(batch))
                loss = loss / n_tgt_tokens  # normalise per target token of the whole update, not per sentence
                self.scaler.scale(loss * world if world > 1 else loss).backward()  # frees this batch's activations
            total += loss.detach()
        return total

    def engine_report(self) -> dict | None:
        """What the GPU engine captured in this process (for summary.json); None without it."""
        if self.graphs is None:
            return None
        return {"captured_shapes": len(self.graphs.captured), "capture_seconds": round(self.graphs.capture_seconds, 2),
                "compile_seconds": round(self.graphs.compile_seconds, 2)}  # part of capture_seconds

    def run_or_skip(self, batches: list[Batch], step_tgt_tokens: int,
                    while_device_works: Callable[[], None] | None, stop_signal: int) -> StepResult | None:
        """`run`, or None when the batch ran out of device memory and was skipped (freed, its size
        logged). A second time stops the run (skipping more would bias training against long
        sentences); under DDP the first does, as one rank cannot skip alone."""
        try:
            return self.run(batches, step_tgt_tokens, while_device_works=while_device_works, stop_signal=stop_signal)
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
            # Out of memory in the optimizer step leaves the scaler mid-step; a fresh one keeps the scale.
            scaler_state = self.scaler.state_dict()
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=True)
            self.scaler.load_state_dict(scaler_state)
        self.state.skipped_oom += 1
        batch = max(batches, key=lambda b: b.src_ids.numel() + b.tgt_out_ids.numel())  # the largest
        n_sentences, width = batch.tgt_out_ids.shape
        size = (f"{n_sentences} sentences, {batch.n_src_tokens} source and {batch.n_tgt_tokens} target tokens, "
                f"padded length {max(width, batch.src_ids.shape[1])}")
        if batch.packed:
            size = (f"a pack of {batch.src_ids.shape[1]} source and {width} target tokens "
                    f"({batch.n_src_tokens} and {batch.n_tgt_tokens} of them real)")
        if self.state.skipped_oom > 1:
            raise TrainingError(
                f"out of memory again at step {self.state.step + 1} ({size}); lower train.batch_tokens "
                f"(now {self.cfg.train.batch_tokens}) or model.max_len, then resume with --resume")
        logger.warning("out of memory at step %d on a batch of %s: skipped it and freed its memory; a second "
                       "time stops the run", self.state.step + 1, size)
        return None
