"""The GPU engine's self-check: before training, each engine path a run chose (packed batches through
the variable-length attention, the captured update) runs once on a tiny synthetic model beside its
reference (the same sentences padded; the eager update). An exception, or a loss or gradients
outside the precision's tolerance, falls back to the reference with one warning. The run's model,
optimizer and random streams are not touched: the check builds its own, and puts the RNG states back."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time

import numpy as np
import torch

from transformer_mt.config.schema import Config, ModelConfig
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.runtime import AttentionKernels, Precision, device_description, load_rng_state, rng_state
from transformer_mt.data.batching import Batch, PackShape, make_batch_from_flat, make_pack_from_flat
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.model import transformer
from transformer_mt.model.transformer import Transformer
from transformer_mt.train.cuda_graphs import GraphedStep
from transformer_mt.train.loss import StepLoss, batch_offsets

logger = logging.getLogger(__name__)

# The relative error allowed in the loss and in the gradients (the norm of their difference over the
# reference's): the precision's rounding, far below what a wrong kernel gives (about 1).
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 1e-1}
VOCAB = 32
# Two updates' sentences, (source, target) tokens without EOS/BOS; in a pack of `PACK` each leaves
# filler and empty segments, as a static pack's unused slots.
LENGTHS = ([(5, 4), (3, 6), (7, 2)], [(2, 3), (6, 6), (4, 5)])
PACK = PackShape(src_tokens=24, tgt_tokens=24, longest=8, max_sentences=4)
LR, EPS = 1e-2, 1e-3  # the check's AdamW: steps of about lr · g / (|g| + eps), comparable across paths
FALLBACK = {"packed": "padded batches", "captured": "eager update"}  # what each path falls back to


@dataclasses.dataclass(frozen=True)
class Engine:
    """The training paths a run takes, and what the self-check found (summary.json's `engine_check`;
    None where nothing was checked: padded batches and the eager update)."""

    packed: bool  # packed batches (else padded)
    graphed: bool  # the captured update (`GraphedStep`; else the eager one)
    report: dict | None = None


class Mismatch(Exception):
    """A path computed another loss or other gradients than its reference."""


def check_engine(cfg: Config, device: torch.device, precision: Precision, attention: AttentionKernels, *,
                 packed: bool, graphed: bool, dist: Distributed = Distributed()) -> Engine:
    """The engine a run takes: `packed` and `graphed` as chosen, each kept only if its check passes
    (on every rank of a torchrun run). Warns once (rank 0) when anything falls back."""
    if not (packed or graphed):
        return Engine(False, False)
    # torch's optimizers import dynamo when the first one is made (seconds, once per process, which
    # the run's optimizer pays otherwise): not part of the check's cost.
    import torch._dynamo  # noqa: F401

    started = time.perf_counter()
    results = run_checks(Engine(packed, graphed), cfg, device, precision, attention)
    failed = torch.tensor([not results.get(part, {}).get("passed", True) for part in FALLBACK],
                          dtype=torch.float32, device=device)
    for part, failed_somewhere in zip(FALLBACK, dist.max_(failed).tolist()):  # the ranks take the same paths
        if failed_somewhere and results.get(part, {}).get("passed", False):
            results[part] = {**results[part], "passed": False, "fallback": FALLBACK[part],
                             "error": "failed in another process of this run"}
    fell_back = {part: result for part, result in results.items() if not result["passed"]}
    report = {**results, "seconds": round(time.perf_counter() - started, 3), "torch": torch.__version__,
              "device": device_description(device)}
    if dist.is_main and fell_back:
        logger.warning("%s", fallback_warning(fell_back, report))
    elif dist.is_main and results:
        logger.info("GPU engine self-check passed (%s) in %.2fs", ", ".join(results), report["seconds"])
    return Engine(packed and "packed" not in fell_back, graphed and "captured" not in fell_back, report)


def fallback_warning(fell_back: dict, report: dict) -> str:
    """One line: what failed, what training does instead, what a bug report needs."""
    failures = "; ".join(f"{result['engine']} failed: {result['error'].splitlines()[0]}"
                         for result in fell_back.values())
    instead = " and ".join({"packed": "padded batches", "captured": "the eager update"}[part] for part in fell_back)
    return (f"GPU engine self-check: {failures}; training goes on with {instead}. Please report this as a bug "
            f"with torch {report['torch']}, the device ({report['device']}) and this message (summary.json's "
            "engine_check has the details)")


def run_checks(engine: Engine, cfg: Config, device: torch.device, precision: Precision,
               attention: AttentionKernels) -> dict:
    """{"packed": ..., "captured": ...} for the paths `engine` takes, each: `engine` (what ran), `passed`,
    and the relative `loss_error` and `grad_error` with their `tolerance`, or `fallback` and `error`."""
    tolerance = TOLERANCE[precision.name]
    model_cfg = check_model_config(cfg.model)
    results = {}
    saved = rng_state()  # every device's generator: the check seeds its own model
    try:
        if engine.packed:
            backend = transformer.varlen_backend(device, 0.0, precision.dtype or torch.float32)
            kernel = {transformer._flash_varlen: "FlashAttention's variable-length kernel",
                      transformer._reference_varlen: "the SDPA reference"}.get(
                          backend, getattr(backend, "__name__", str(backend)))
            results["packed"] = attempt(f"packed batches ({kernel})", "packed", tolerance, lambda: check_packed(
                model_cfg, device, precision, attention, cfg.train.label_smoothing))
        if engine.graphed:
            packs = engine.packed and results["packed"]["passed"]
            capture = device.type == "cuda"
            results["captured"] = attempt(
                "captured update" + (" (CUDA graph)" if capture else " (run eagerly)"), "captured", tolerance,
                lambda: check_captured(model_cfg, cfg, device, precision, attention, packs=packs, capture=capture))
    finally:
        load_rng_state(saved)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the check's graphs and tensors
    return results


def attempt(name: str, part: str, tolerance: float, check) -> dict:
    """Run `check` (-> its relative errors by name) and say whether it passed."""
    result = {"engine": name}
    try:
        errors = check()
        result.update({key: figure(value) for key, value in errors.items()}, tolerance=tolerance)
        if not all(value <= tolerance for value in errors.values()):  # NaN fails too
            found = ", ".join(f"{key.removesuffix('_error')} by {value:.2g}" for key, value in errors.items())
            raise Mismatch(f"its results differ from the reference's: {found} (relative; tolerance {tolerance:g})")
    except Exception as err:  # noqa: BLE001 (any failure of a kernel or a capture falls back)
        return {**result, "passed": False, "fallback": FALLBACK[part], "error": f"{type(err).__name__}: {err}"}
    return {**result, "passed": True}


def figure(value: float) -> float | None:
    return float(f"{value:.3g}") if math.isfinite(value) else None


def check_model_config(model: ModelConfig) -> ModelConfig:
    """A one-layer model with the run's head size and norm (what the kernels see), no dropout."""
    heads = min(model.n_heads, 2)
    d_model = heads * (model.d_model // model.n_heads)
    return ModelConfig(d_model=d_model, n_heads=heads, n_layers=1, d_ff=2 * d_model, dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, norm=model.norm, max_len=2 * PACK.longest)


def synthetic_batches(update: int, device: torch.device) -> tuple[Batch, Batch]:
    """One update's sentences as a static pack (`PACK`) and padded to a multiple of 8, on `device`."""
    rng = np.random.default_rng(update)  # its own generator: the run's streams stay as they are
    src_lengths, tgt_lengths = (np.array(side) for side in zip(*LENGTHS[update]))
    src = rng.integers(EOS_ID + 1, VOCAB, int(src_lengths.sum()))
    tgt = rng.integers(EOS_ID + 1, VOCAB, int(tgt_lengths.sum()))
    pack = make_pack_from_flat(src, src_lengths, tgt, tgt_lengths, PACK, PAD_ID, BOS_ID, EOS_ID, static=True)
    padded = make_batch_from_flat(src, src_lengths, tgt, tgt_lengths, PAD_ID, BOS_ID, EOS_ID, pad_to_multiple=8)
    return pack.to(device), padded.to(device)


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """‖got - want‖ / ‖want‖ over all the tensors together (L2 norms, fp32)."""
    flat = lambda tensors: torch.cat([t.detach().float().flatten() for t in tensors])  # noqa: E731
    got, want = flat(got), flat(want)
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def check_packed(model_cfg: ModelConfig, device: torch.device, precision: Precision, attention: AttentionKernels,
                 label_smoothing: float) -> dict[str, float]:
    """A pack's loss and gradients against those of its sentences padded (SDPA)."""
    torch.manual_seed(0)
    model = Transformer(model_cfg, VOCAB, VOCAB, PAD_ID).to(device).train()
    step_loss, params = StepLoss(model), list(model.parameters())
    pack, padded = synthetic_batches(0, device)

    def loss_and_grads(batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with precision.autocast(), attention.enabled():
            loss = step_loss(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, label_smoothing, True,
                             batch_offsets(batch))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(pack), loss_and_grads(padded)
    return {"loss_error": relative_error([loss], [ref_loss]), "grad_error": relative_error(grads, ref_grads)}


def check_captured(model_cfg: ModelConfig, cfg: Config, device: torch.device, precision: Precision,
                   attention: AttentionKernels, *, packs: bool, capture: bool) -> dict[str, float]:
    """Two updates (a capture, then a replay with other sentences) through `GraphedStep` against the
    eager update of a copy of the model: the worst loss and (clipped) gradient errors, and the error
    of the weights' change."""
    t = cfg.train
    torch.manual_seed(0)
    eager_model = Transformer(model_cfg, VOCAB, VOCAB, PAD_ID).to(device).train()
    graphed_model = copy.deepcopy(eager_model)
    graphed_params, eager_params = list(graphed_model.parameters()), list(eager_model.parameters())
    initial = [p.detach().clone() for p in eager_params]
    fused = device.type in ("cuda", "cpu")
    lr = torch.full((), LR, dtype=torch.float32 if device.type == "cuda" else torch.float64, device=device)
    optimizer = torch.optim.AdamW(graphed_params, lr=lr, betas=t.betas, eps=EPS, weight_decay=0.0, fused=fused,
                                  capturable=True)
    eager_optimizer = torch.optim.AdamW(eager_params, lr=LR, betas=t.betas, eps=EPS, weight_decay=0.0, fused=fused)
    max_norm = t.clip_grad_norm or float("inf")
    graphs = GraphedStep(StepLoss(graphed_model), graphed_params, optimizer, precision=precision,
                         attention=attention, label_smoothing=t.label_smoothing, max_norm=max_norm, capture=capture)
    eager_loss = StepLoss(eager_model)
    loss_errors, grad_errors = [], []
    for update in range(len(LENGTHS)):
        pack, padded = synthetic_batches(update, device)
        batch = pack if packs else padded
        graphs.start_update()
        graphs.run(batch, batch.n_tgt_tokens, last=True)
        eager_optimizer.zero_grad(set_to_none=True)
        with precision.autocast(), attention.enabled():
            loss = eager_loss(batch.src_ids, batch.tgt_in_ids, batch.tgt_out_ids, t.label_smoothing, False,
                              batch_offsets(batch))
        loss = loss / batch.n_tgt_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(eager_params, max_norm)
        eager_optimizer.step()
        loss_errors.append(relative_error([graphs.loss_sum], [loss]))
        grad_errors.append(relative_error(graphs.grads, [torch.zeros_like(p) if p.grad is None else p.grad
                                                         for p in eager_params]))
    update_error = relative_error([p.detach() - p0 for p, p0 in zip(graphed_params, initial)],
                                  [p.detach() - p0 for p, p0 in zip(eager_params, initial)])
    del graphs  # its graphs and their memory pool
    return {"loss_error": worst(loss_errors), "grad_error": worst(grad_errors), "update_error": update_error}


def worst(errors: list[float]) -> float:
    """The largest error; NaN if any is (`max` may skip it)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)
