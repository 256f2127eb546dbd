"""The GPU engine: a whole training update (forward, loss, backward, clipping, the AdamW step)
captured once per batch shape as a CUDA graph, then replayed (packs: one shape, one graph, the
segment offsets written into its static buffers); with `capture=False` the same code runs eagerly."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch
from torch import nn

from transformer_mt.core.cuda_graphs import capture_graph
from transformer_mt.core.runtime import AttentionKernels, Precision
from transformer_mt.data.batching import Batch

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before a capture: cuBLAS/cuDNN handles, allocator pools, compiling
MAX_GRAPHS = 64  # batch shapes captured at most (one memory pool; under compile, one compiled entry each)


def graphs_apply(device: torch.device, *, distributed: bool, grad_scaler: bool) -> bool:
    """Whether the captured step can run: CUDA, one process (DDP's all-reduce hooks fire inside
    backward), no fp16 GradScaler (its scale changes between steps)."""
    return device.type == "cuda" and not distributed and not grad_scaler


def compiled_for_graphs(step_loss: nn.Module, max_graphs: int = MAX_GRAPHS) -> nn.Module:
    """`step_loss` through `torch.compile` for the captured step: static shapes, each compiled in
    the warm-up runs before its capture, inductor's own CUDA graphs off (`GraphedStep` captures
    the whole update), and dynamo's recompile limit raised to the shapes a run may capture."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, limit, max(getattr(config, limit), max_graphs))
    return torch.compile(step_loss, dynamic=False, options={"triton.cudagraphs": False})


class GraphedStep:
    """One update over one or more micro-batches: `start_update`, then `run` for each (the last with
    `last=True` clips and steps `optimizer`, a fused capturable AdamW). Gradients accumulate in buffers
    linked as the parameters' `.grad`. Outputs, valid until the next update: `loss_sum` (per target
    token), `grad_norm` (before clipping) and `nonfinite` (1.0: skipped). A shape beyond `max_graphs`
    runs eagerly through `uncaptured_loss` (under compile the plain module)."""

    def __init__(self, step_loss: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, *,
                 precision: Precision, attention: AttentionKernels, label_smoothing: float, max_norm: float,
                 capture: bool, max_graphs: int = MAX_GRAPHS, uncaptured_loss: nn.Module | None = None):
        self.step_loss = step_loss  # a `loss.StepLoss`, or it compiled (`compiled_for_graphs`)
        self.uncaptured_loss = step_loss if uncaptured_loss is None else uncaptured_loss
        self.compiled = self.uncaptured_loss is not step_loss  # a compiled step_loss comes with its plain module
        self.params, self.optimizer, self.precision, self.attention = params, optimizer, precision, attention
        self.label_smoothing = label_smoothing
        self.max_norm = max_norm  # inf: no clipping (the norm is still computed, for the log)
        self.capture, self.max_graphs = capture, max_graphs
        device = params[0].device
        self.grads = [torch.zeros_like(p) for p in params]  # every graph adds into these: never replaced
        self.loss_sum, self.grad_norm, self.nonfinite = (torch.zeros((), device=device) for _ in range(3))
        self._skip = torch.ones((), device=device)  # found_inf while warming up: no update
        self._warming_up = False
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # graphs replay one at a time
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # shape -> graph, its static inputs
        self.capture_seconds = 0.0  # spent capturing (warm-up runs included), reported apart from speed
        self.compile_seconds = 0.0  # of which compiling: a compiled shape's first warm-up run beyond its second
        self._said_eager = False
        for param in params:  # AdamW's state as its first step would create it: a capture must find it in place
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def start_update(self) -> None:
        """Zero the gradient buffers and the loss; relink the buffers (an out-of-memory skip unlinks them)."""
        torch._foreach_zero_(self.grads)
        self.loss_sum.zero_()
        if self.params[0].grad is not self.grads[0]:
            for param, grad in zip(self.params, self.grads):
                param.grad = grad

    def run(self, batch: Batch, n_tgt_tokens: int, last: bool) -> None:
        """Add the batch's gradient of (loss sum / `n_tgt_tokens`) and its loss; with `last`, clip and update."""
        key = (tuple(batch.src_ids.shape), tuple(batch.tgt_in_ids.shape), batch.packed and len(batch.src_offsets),
               batch.longest, last)
        captured = self.captured.get(key)
        if captured is None and self.capture and len(self.captured) < self.max_graphs:
            captured = self.captured[key] = self._capture(batch, last)
        if captured is None:
            if self.capture and not self._said_eager:
                logger.info("more than %d batch shapes: the others run without a CUDA graph", self.max_graphs)
                self._said_eager = True
            denominator = torch.full((), float(n_tgt_tokens), device=batch.src_ids.device)
            with _uncaptured_capturable_step():
                # Without capture (the CPU tests) the captured path's module; past max_graphs the plain one.
                self._micro_step(_inputs(batch), denominator, last,
                                 self.uncaptured_loss if self.capture else self.step_loss)
            return
        graph, (inputs, denominator, _) = captured
        for static, new in zip(inputs[:5], _inputs(batch)):  # ids; a pack's offsets too
            if static is not None:
                static.copy_(new)
        denominator.fill_(float(n_tgt_tokens))
        graph.replay()

    def _micro_step(self, inputs: tuple, denominator: torch.Tensor, last: bool,
                    step_loss: nn.Module | None = None) -> None:
        """What a graph holds: forward, loss / denominator (as the eager step divides it), backward
        into the buffers; with `last`, `clip_and_update`. `inputs`: `_inputs` of a batch."""
        step_loss = self.step_loss if step_loss is None else step_loss
        src_ids, tgt_in_ids, tgt_out_ids, src_offsets, tgt_offsets, longest = inputs
        offsets = None if src_offsets is None else (src_offsets, tgt_offsets, longest)
        # Autocast's cache of cast weights would be captured once and then hold stale casts.
        with self.precision.autocast(cache_enabled=False), self.attention.enabled():
            loss = step_loss(src_ids, tgt_in_ids, tgt_out_ids, self.label_smoothing, False, offsets) / denominator
        torch._foreach_add_(self.grads, torch.autograd.grad(loss, self.params))
        self.loss_sum += loss.detach()
        if last:
            self.clip_and_update()

    def clip_and_update(self) -> None:
        """Clip the gradients (as the eager step) and step AdamW, skipped on the device (the fused
        AdamW's `found_inf`) when the loss or the norm is not finite. No host sync: capturable."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.grad_norm.copy_(norm)
        self.nonfinite.copy_(~(torch.isfinite(self.loss_sum) & torch.isfinite(norm)))
        self.optimizer.found_inf = self._skip if self._warming_up else self.nonfinite
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # a later eager `step()` must not read a stale flag

    def _capture(self, batch: Batch, last: bool) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """Warm up (on a side stream, the update forced off), then capture this shape's micro-step.
        The gradient buffers, the loss and the CUDA random state are put back: capturing draws no
        dropout mask that training would not have drawn. The first replay runs the step."""
        started = time.perf_counter()
        device = batch.src_ids.device
        # The graph's inputs, copied in before each replay: (B, S), (B, T), (B, T) long, a pack's
        # offsets (P+1,) int32 each; the () fp32 denominator.
        inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in _inputs(batch))
        args = (inputs, torch.ones((), device=device), last)
        rng = torch.cuda.get_rng_state(device)
        run_seconds = []  # the first run of a compiled module compiles this shape (forward and backward)

        def warm_up() -> None:  # on the capture's side stream, the update forced off
            self._warming_up = True
            try:
                run_started = time.perf_counter()
                with _uncaptured_capturable_step():
                    self._micro_step(*args)
                torch.cuda.current_stream(device).synchronize()
                run_seconds.append(time.perf_counter() - run_started)
            finally:
                self._warming_up = False

        try:
            graph = capture_graph(lambda: self._micro_step(*args), [*self.grads, self.loss_sum], warmup=warm_up,
                                  warmup_runs=WARMUP_RUNS, pool=self.pool, device=device)
        except RuntimeError as err:
            # Out of memory inside a capture can surface as the error of ending the capture.
            if isinstance(err.__context__, torch.OutOfMemoryError):
                raise err.__context__ from None
            raise
        compiling = max(run_seconds[0] - run_seconds[-1], 0.0) if self.compiled else 0.0
        self.compile_seconds += compiling
        torch.cuda.set_rng_state(rng, device)
        torch.cuda.synchronize(device)  # the warm-up runs' GPU time belongs to the capture, not the steps after it
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        logger.debug("captured a CUDA graph for batch shape %s in %.2fs (compiling: %.2fs)", tuple(batch.src_ids.shape),
                     seconds, compiling)
        return graph, args


def _inputs(batch: Batch) -> tuple:
    """What `_micro_step` takes of a batch: its ids, a pack's offsets (None when padded) and longest segment."""
    return batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, batch.src_offsets, batch.tgt_offsets, batch.longest


@contextlib.contextmanager
def _uncaptured_capturable_step():
    """Silence torch's warning about a capturable optimizer stepping outside a capture (on purpose here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        yield
