"""`train.batch_tokens: auto`: the token budget of a training batch, sized for the GPU's memory and
the model, or today's 4,096 on a CPU or MPS.

The rule (`device_batch_tokens`): the largest power of two whose activations, by the estimate of
`activation_bytes_per_token`, fit in half the device's memory once the weights, gradients and
AdamW moments (16 bytes per parameter) are counted, at most `MAX_TOKENS` and at least one
sequence of `model.max_len`. The other half is headroom: the estimate's error, the allocator's
fragmentation, the captured steps' memory pool, cuBLAS workspaces and validation's decoding.
The estimate was checked against the base model on an H100 (eccf7fe, eager bf16): its peak rose
from 7,355 to 27,477 MB between 16,384 and 65,536 tokens per batch, 429 kB per token; the
estimate gives 424 kB. A budget set in the config is always kept, so a recipe's tokens per update
do not depend on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from transformer_mt.config.schema import Config, ModelConfig
from transformer_mt.core.distributed import Distributed
from transformer_mt.core.errors import ConfigError
from transformer_mt.core.runtime import Precision

WITHOUT_GPU_TOKENS = 4096  # CPU and MPS: tmt's budget before `auto` existed
MAX_TOKENS = 65_536  # the largest budget measured on an H100 (docs/benchmarks.md); more is for a run to set
MEMORY_SHARE = 0.5  # of the device's memory, for the weights, optimizer state and activations together


def parameter_count(model: ModelConfig, vocab_size: int) -> int:
    """About the model's parameters: the layers' matrices and the embeddings (biases and norms
    are a fraction of a per cent). Unshared embeddings and an untied output count apart."""
    d, ff = model.d_model, model.d_ff
    layers = model.n_encoder_layers * (4 * d * d + 2 * d * ff) + model.n_decoder_layers * (8 * d * d + 2 * d * ff)
    embeddings = vocab_size * d * ((1 if model.share_embeddings else 2) + (0 if model.tie_output else 1))
    return layers + embeddings


def check_model_fits(model: ModelConfig, vocab_size: int, memory_bytes: int) -> None:
    """Refuse, in one line naming the sizes, a model whose fp32 weights alone (4 bytes a parameter)
    exceed `memory_bytes` (the machine's memory, where the model is built): torch would fail to
    allocate it, or take the machine's memory down with it."""
    n = parameter_count(model, vocab_size)
    if 4 * n > memory_bytes:
        sizes = ", ".join(f"model.{key}={getattr(model, key):.6g}" for key in ("d_model", "d_ff", "n_heads"))
        layers = f"{model.n_encoder_layers} + {model.n_decoder_layers} layers"
        raise ConfigError([f"model.d_model: a model of {sizes}, {layers} and {vocab_size:,} words has about "
                           f"{n:.3g} parameters, {4 * n / 2**30:.3g} GiB in fp32, more than this machine's "
                           f"{memory_bytes / 2**30:.3g} GiB of memory"])


def activation_bytes_per_token(model: ModelConfig, vocab_size: int, element_bytes: int) -> int:
    """What backward keeps per token of a batch, in bytes, with activations of `element_bytes`
    (2 under bf16/fp16 autocast, 4 in fp32). Per layer and token, at 2 bytes: about 30·d_model
    + 5·d_ff for an encoder layer (the fp32 residual and its norm, Q/K/V, the attention output,
    the feed-forward's hidden layer, dropout masks) and 42·d_model + 5·d_ff for a decoder layer
    (cross-attention besides); and 10 bytes per vocabulary entry of each target position (the
    logits, the loss's fp32 copy of them and their gradient)."""
    d, ff = model.d_model, model.d_ff
    layers = model.n_encoder_layers * (30 * d + 5 * ff) + model.n_decoder_layers * (42 * d + 5 * ff)
    return layers * element_bytes // 2 + 10 * vocab_size


def device_batch_tokens(total_memory: int, model: ModelConfig, vocab_size: int, element_bytes: int) -> int:
    """The `auto` budget of a GPU with `total_memory` bytes (the rule in the module's docstring)."""
    free = MEMORY_SHARE * total_memory - 16 * parameter_count(model, vocab_size)
    fits = int(max(free, 0) // activation_bytes_per_token(model, vocab_size, element_bytes))
    smallest = 1 << max(model.max_len - 1, 0).bit_length()  # one sequence of max_len, as a power of two
    largest_power = 1 << (fits.bit_length() - 1) if fits else 0
    return max(smallest, min(largest_power, MAX_TOKENS))


def resolve_batch_tokens(cfg: Config, device: torch.device, precision: Precision | None = None,
                         dist: Distributed = Distributed()) -> tuple[Config, str | None]:
    """`cfg` with `train.batch_tokens` a number, and the line that says how an `auto` budget was
    chosen on a GPU (None otherwise). `precision` None: what `auto` picks (bf16 or fp16 on a GPU).
    Under torchrun every rank takes the smallest of the ranks' budgets: the sampler cuts the same
    batches on every rank."""
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
