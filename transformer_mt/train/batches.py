"""An update's batches: the token budget of a batch (`train.batch_tokens: auto` sized for the GPU),
padded or packed (`train.batching`), the seeded sampler over the training split, and each update's
micro-batches on the device."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from transformer_mt.config.schema import Config, ModelConfig
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import ConfigError
from transformer_mt.core.runtime import Precision
from transformer_mt.data.batching import Batch, TokenBatchSampler, pack_shape, pad_rows, static_rows
from transformer_mt.data.token_cache import TokenizedSplit
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, PAD_ID
from transformer_mt.model.transformer import varlen_available

WITHOUT_GPU_TOKENS = 4096  # CPU and MPS
MAX_TOKENS = 65_536  # the largest budget measured on an H100 (docs/benchmarks/training.md); more is for a run to set
MEMORY_SHARE = 0.5  # of the device's memory, for the weights, optimizer state and activations together


def parameter_count(model: ModelConfig, vocab_size: int) -> int:
    """About the model's parameters: the layers' matrices and the embeddings (biases and norms
    are a fraction of a per cent). Unshared embeddings and an untied output count apart."""
    d, ff = model.d_model, model.d_ff
    layers = model.n_encoder_layers * (4 * d * d + 2 * d * ff) + model.n_decoder_layers * (8 * d * d + 2 * d * ff)
    embeddings = vocab_size * d * ((1 if model.share_embeddings else 2) + (0 if model.tie_output else 1))
    return layers + embeddings


def check_model_fits(model: ModelConfig, vocab_size: int, memory_bytes: int) -> None:
    """Refuse, in one line naming the sizes, a model whose fp32 weights alone exceed `memory_bytes`
    (the memory of the machine that builds it)."""
    n = parameter_count(model, vocab_size)
    if 4 * n > memory_bytes:
        sizes = ", ".join(f"model.{key}={getattr(model, key):.6g}" for key in ("d_model", "d_ff", "n_heads"))
        layers = f"{model.n_encoder_layers} + {model.n_decoder_layers} layers"
        raise ConfigError([f"model.d_model: a model of {sizes}, {layers} and {vocab_size:,} words has about "
                           f"{n:.3g} parameters, {4 * n / 2**30:.3g} GiB in fp32, more than this machine's "
                           f"{memory_bytes / 2**30:.3g} GiB of memory"])


def activation_bytes_per_token(model: ModelConfig, vocab_size: int, element_bytes: int) -> int:
    """What backward keeps per token of a batch, in bytes, with activations of `element_bytes`: per
    layer, at 2 bytes, about 30·d_model + 5·d_ff (encoder) or 42·d_model + 5·d_ff (decoder); and 10
    bytes per vocabulary entry of each target position (the logits, their fp32 copy, their gradient)."""
    d, ff = model.d_model, model.d_ff
    layers = model.n_encoder_layers * (30 * d + 5 * ff) + model.n_decoder_layers * (42 * d + 5 * ff)
    return layers * element_bytes // 2 + 10 * vocab_size


def device_batch_tokens(total_memory: int, model: ModelConfig, vocab_size: int, element_bytes: int) -> int:
    """The `auto` budget of a GPU with `total_memory` bytes: the largest power of two whose
    activations fit in `MEMORY_SHARE` of it beside the weights, gradients and AdamW moments (16
    bytes a parameter), at most `MAX_TOKENS`, at least one sequence of `model.max_len`."""
    free = MEMORY_SHARE * total_memory - 16 * parameter_count(model, vocab_size)
    fits = int(max(free, 0) // activation_bytes_per_token(model, vocab_size, element_bytes))
    smallest = 1 << max(model.max_len - 1, 0).bit_length()  # one sequence of max_len, as a power of two
    largest_power = 1 << (fits.bit_length() - 1) if fits else 0
    return max(smallest, min(largest_power, MAX_TOKENS))


def resolve_batch_tokens(cfg: Config, device: torch.device, precision: Precision | None = None,
                         dist: Distributed = Distributed()) -> tuple[Config, str | None]:
    """`cfg` with `train.batch_tokens` a number, and the line that says how an `auto` budget was
    chosen on a GPU (None otherwise). `precision` None: what `auto` picks (bf16 or fp16 on a GPU).
    Under torchrun every rank takes the smallest of the ranks' budgets (the same batches)."""
    if cfg.train.batch_tokens != "auto":
        return cfg, None
    note = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        tokens = device_batch_tokens(props.total_memory, cfg.model, cfg.tokenizer.vocab_size,
                                     4 if precision is not None and precision.dtype is None else 2)
        if dist.enabled:
            tokens = -int(dist.max_(torch.tensor(-float(tokens), device=device)).item())
        note = (f"train.batch_tokens {tokens:,} chosen for the {props.total_memory / 2**30:.0f} GiB of the "
                f"{props.name} and this model (set train.batch_tokens to override)")
    else:
        tokens = WITHOUT_GPU_TOKENS
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_tokens=tokens)), note


def packed_batches(cfg: Config, device: torch.device) -> bool:
    """Whether training takes packs (`train.batching`; `auto`: on CUDA where FlashAttention's
    variable-length kernel runs: not in fp32, not with attention dropout)."""
    if cfg.train.batching != "auto":
        return cfg.train.batching == "packed"
    model = cfg.model
    attention_dropout = model.dropout if model.attention_dropout is None else model.attention_dropout
    return (device.type == "cuda" and cfg.train.precision != "fp32" and attention_dropout == 0.0
            and varlen_available())


@dataclasses.dataclass
class StepBatches:
    """One update's micro-batches, drawn from the sampler and already on the device."""

    micro_batches: list[Batch]  # this rank's
    indices: list[np.ndarray]  # their example indices
    tgt_tokens: int  # target tokens of every rank's micro-batches: the loss's denominator
    sampler_state: dict  # the sampler's position once these batches are drawn


class BatchSource:
    """The training split's batches for `TrainStep`: `sampler` cuts them (resumable, its state in
    every checkpoint), `draw` takes one update's worth, `load` puts one on the device."""

    def __init__(self, cfg: Config, train_data: TokenizedSplit, *, device: torch.device, dist: Distributed,
                 pad_to_multiple: int, fixed_rows: bool, packed: bool):
        self.cfg, self.train_data, self.device, self.dist = cfg, train_data, device, dist
        self.pad_to_multiple = pad_to_multiple
        self.fixed_rows = fixed_rows  # the GPU engine: a fixed row count per padded length; packs of fixed offsets
        pair_lengths = (train_data.src_len + 1, train_data.tgt_len + 1)  # with EOS, BOS
        # Packed: the pack's shape, a pair too long for it refused now, before any step.
        self.pack = pack_shape(*pair_lengths, cfg.train.batch_tokens, pad_to_multiple) if packed else None
        self.sampler = TokenBatchSampler(train_data.lengths(), cfg.train.batch_tokens, cfg.seed,
                                         tie_break=train_data.tgt_len, world_size=dist.world_size,
                                         pad_to_multiple=pad_to_multiple, max_length=cfg.model.max_len,
                                         epoch_rows=train_data.epoch_rows, pack=self.pack, pair_lengths=pair_lengths)

    def load(self, indices: list[int] | np.ndarray) -> Batch:
        """Training examples -> a padded batch or a pack on the device (on CUDA an asynchronous copy
        from pinned memory)."""
        if self.pack is not None:  # fixed rows: offsets of the pack's slots, every pack one shape
            batch = self.train_data.pack(indices, self.pack, static=self.fixed_rows)
        else:
            batch = self.train_data.batch(indices, self.pad_to_multiple)
        if self.fixed_rows and self.pack is None:  # shapes repeat, so captured graphs replay
            batch = pad_rows(batch, static_rows(batch, self.cfg.train.batch_tokens), PAD_ID, BOS_ID, EOS_ID)
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.device)

    def draw(self, batches: Iterator[np.ndarray]) -> StepBatches:
        """The next update's batches from `iter(self.sampler)`: every rank's, this rank's on the device."""
        W = self.dist.world_size
        step_batches = [next(batches) for _ in range(self.cfg.train.accum_steps * W)]
        indices = step_batches[self.dist.rank::W]  # this rank's micro-batches
        tgt_tokens = int(self.train_data.lengths_of(np.concatenate(step_batches))[1].sum())
        return StepBatches([self.load(i) for i in indices], indices, tgt_tokens, self.sampler.state_dict())
