"""Greedy decoding on a GPU with a fixed-shape decoder step replayed as a CUDA graph.

`decoding.greedy_decode` runs the decoder on one new position per step with a cache that grows,
so every step has new shapes and costs a few hundred kernel launches from the host: for a small
model the host sets the pace (docs/benchmarks.md, "GPU"). Here the keys and values live in
buffers of the batch's whole length cap, attention masks the positions not written yet, and the
step (embedding, layers, output projection, the argmax and the bookkeeping of finished
sentences) reads its position from a device tensor: every step has the same shapes, so it is
captured once per batch and replayed. It gives `greedy_decode`'s output (tested); chosen by
`evaluation.translate_ids` on CUDA with `decode.cuda_graphs`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from transformer_mt.batching import round_up
from transformer_mt.decoding import max_target_lengths, strip_generated
from transformer_mt.model import Transformer


@dataclass
class _State:
    """Every tensor a step reads or writes; their shapes never change during a batch."""

    memory_mask: torch.Tensor  # (N, S) bool, True = real source token
    cross_k: list[torch.Tensor]  # per layer (N, H, S, Dh), from the memory once
    cross_v: list[torch.Tensor]
    self_k: list[torch.Tensor]  # per layer (N, H, C, Dh), written one position per step
    self_v: list[torch.Tensor]
    written: torch.Tensor  # (1, C) bool: the positions written so far, the only ones attended to
    position: torch.Tensor  # (1,) long: the position this step writes
    tokens: torch.Tensor  # (N, C + 1) long: BOS, then the generated ids (pad after a sentence ends)
    finished: torch.Tensor  # (N,) bool
    limits: torch.Tensor  # (N,) long: each sentence's cap on generated tokens


def _new_state(model: Transformer, src_ids: torch.Tensor, capacity: int, limits: torch.Tensor,
               bos_id: int) -> _State:
    pad_id, device = model.pad_id, src_ids.device
    src_mask = src_ids != pad_id  # (N, S)
    memory = model.encode(src_ids, src_mask)  # (N, S, D)
    cross = [layer.cross_attn.project_kv(memory) for layer in model.decoder_layers]  # (N, H, S, Dh) each
    N, H, _, Dh = cross[0][0].shape
    empty = lambda: cross[0][0].new_zeros(N, H, capacity, Dh)  # noqa: E731  (the projections' dtype: bf16 under autocast)
    tokens = torch.full((N, capacity + 1), pad_id, dtype=torch.long, device=device)
    tokens[:, 0] = bos_id
    return _State(src_mask, [k for k, _ in cross], [v for _, v in cross], [empty() for _ in cross],
                  [empty() for _ in cross], torch.zeros(1, capacity, dtype=torch.bool, device=device),
                  torch.zeros(1, dtype=torch.long, device=device), tokens,
                  torch.zeros(N, dtype=torch.bool, device=device), limits)


def _step(model: Transformer, s: _State, bos_id: int, eos_id: int) -> None:
    """Decode the position `s.position` of every row and write its token; all shapes fixed."""
    pad_id = model.pad_id
    ids = s.tokens.gather(1, s.position.expand(s.tokens.shape[0])[:, None])  # (N, 1): the input token
    position_code = model.positions.index_select(0, s.position).to(model.tgt_embed.weight.dtype)  # (1, D)
    y = model.embed_dropout(model.tgt_embed(ids) * model.embed_scale + position_code)  # (N, 1, D)
    s.written.index_fill_(1, s.position, True)
    for i, layer in enumerate(model.decoder_layers):
        y = layer.self_block(y, lambda h: _self_attention(layer.self_attn, h, s, i))
        y = layer.cross_block(y, lambda h: layer.cross_attn.attend(
            *layer.cross_attn.split_heads(layer.cross_attn.q_proj(h)), s.cross_k[i], s.cross_v[i], s.memory_mask))
        y = layer.ffn_block(y, layer.ffn)
    y = model.decoder_norm(y)
    with torch.autocast(device_type=y.device.type, enabled=False):  # rank tokens on fp32 logits, as decode does
        logits = model.output_proj(y.float())[:, 0, :]  # (N, V)
    logits[:, pad_id] = torch.finfo(logits.dtype).min  # never padding or a second BOS
    logits[:, bos_id] = torch.finfo(logits.dtype).min
    next_ids = logits.max(dim=-1).indices.masked_fill(s.finished, pad_id)  # (N,) first index among ties
    s.tokens.index_copy_(1, s.position + 1, next_ids[:, None])
    s.position += 1
    s.finished |= (next_ids == eos_id) | (s.position >= s.limits)


def _self_attention(attention, h: torch.Tensor, s: _State, layer: int) -> torch.Tensor:
    q, k, v = attention.project(h)  # (N, H, 1, Dh) each
    s.self_k[layer].index_copy_(2, s.position, k)
    s.self_v[layer].index_copy_(2, s.position, v)
    return attention.attend(q, s.self_k[layer], s.self_v[layer], s.written)  # over the written positions


@torch.inference_mode()
def static_greedy_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, max_len_a: float,
                         max_len_b: int, capture: bool, check_every: int = 8) -> list[list[int]]:
    """`decoding.greedy_decode` with fixed-shape steps; `capture` replays them from a CUDA graph
    (else they run eagerly: the same computation, for a CPU test). src_ids (N, S) long -> N
    lists of generated ids without BOS and EOS. The host checks whether every sentence has
    finished every `check_every` steps (a sync); the steps in between are queued."""
    src_mask = src_ids != model.pad_id
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len)  # (N,)
    max_steps = int(limits.max())
    # The position table bounds the capacity; rounding up lets batches of similar caps share shapes.
    capacity = min(round_up(max_steps, 8), model.cfg.max_len)
    s = _new_state(model, src_ids, capacity, limits, bos_id)
    step = lambda: _step(model, s, bos_id, eos_id)  # noqa: E731
    done = 0
    # Autocast's cache of cast weights must not be filled while a graph is captured.
    device_type = src_ids.device.type
    no_cast_cache = (torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
                     if capture and torch.is_autocast_enabled(device_type) else contextlib.nullcontext())
    with no_cast_cache:
        if capture:
            step, done = _captured(step, s), 1  # capturing ran the first step once, for real
        while done < max_steps:
            step()
            done += 1
            if done % check_every == 0 and bool(s.finished.all()):
                break
    return [strip_generated(row, eos_id, model.pad_id) for row in s.tokens[:, 1:].tolist()]


def _captured(step, s: _State):
    """Run `step` once eagerly on a side stream (cuBLAS and allocator warm-up, which a capture may
    not do), undo what it wrote, capture it, then replay the capture for the real first step."""
    saved = [t.clone() for t in (s.written, s.position, s.tokens, s.finished)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for tensor, before in zip((s.written, s.position, s.tokens, s.finished), saved):
        tensor.copy_(before)  # the caches hold that step's keys and values: the replay rewrites the same
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    return graph.replay
