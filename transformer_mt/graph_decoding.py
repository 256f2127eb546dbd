"""Greedy and beam search on a GPU with a fixed-shape decoder step replayed as a CUDA graph.

`decoding.greedy_decode` and `decoding.beam_search` run the decoder on one new position per step
with a cache that grows, so every step has new shapes and costs a few hundred kernel launches
from the host: for a small model the host sets the pace (docs/benchmarks.md, "GPU"). Here the
keys and values live in buffers of the batch's whole length cap, attention masks the positions
not written yet, and the step (embedding, layers, output projection, then greedy's argmax or
beam search's `decoding.advance_beams`, and the cache's reordering) reads its position from a
device tensor: every step has the same shapes, so it is captured once per batch and replayed.
Each gives its eager counterpart's output (tested); chosen by `evaluation` on CUDA with
`decode.cuda_graphs`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from transformer_mt.batching import round_up
from transformer_mt.decoding import (BeamState, Hypothesis, advance_beams, finished_hypotheses, max_target_lengths,
                                     new_beam_state, strip_generated)
from transformer_mt.model import Transformer


@dataclass
class StaticCache:
    """The decoder's source-side tensors and key/value buffers; their shapes never change."""

    memory_mask: torch.Tensor  # (N, S) bool, True = real source token
    cross_k: list[torch.Tensor]  # per layer (N, H, S, Dh), from the memory once
    cross_v: list[torch.Tensor]
    # (2, L, N, H, C, Dh): every layer's self-attention keys, then values, written one position
    # per step; one tensor, so that a beam step reorders them all with one gather and one copy.
    self_kv: torch.Tensor
    written: torch.Tensor  # (1, C) bool: the positions written so far, the only ones attended to

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i of the self-attention buffers becomes row rows[i] (N,), in place: beams of one
        sentence trade places, so the source side stays."""
        self.self_kv.copy_(self.self_kv.index_select(2, rows))


def _new_cache(model: Transformer, src_ids: torch.Tensor, capacity: int, beams: int = 1) -> StaticCache:
    """Encode src_ids (B, S) once; each sentence gets `beams` neighbouring rows (N = B·beams)."""
    src_mask = src_ids != model.pad_id  # (B, S)
    memory = model.encode(src_ids, src_mask)  # (B, S, D)
    cross = [[t.repeat_interleave(beams, dim=0) for t in layer.cross_attn.project_kv(memory)]
             for layer in model.decoder_layers]  # (N, H, S, Dh) each
    N, H, _, Dh = cross[0][0].shape
    self_kv = cross[0][0].new_zeros(2, len(cross), N, H, capacity, Dh)  # the projections' dtype: bf16 under autocast
    return StaticCache(src_mask.repeat_interleave(beams, dim=0), [k for k, _ in cross], [v for _, v in cross],
                       self_kv, torch.zeros(1, capacity, dtype=torch.bool, device=src_ids.device))


def _logits(model: Transformer, c: StaticCache, tokens: torch.Tensor, position: torch.Tensor,
            bos_id: int) -> torch.Tensor:
    """fp32 logits (N, V) of the position `position` (1,) long, whose input is tokens[:, position]
    (tokens (N, C + 1) long); writes that position's keys and values. Padding and BOS are ruled out."""
    ids = tokens.gather(1, position.expand(tokens.shape[0])[:, None])  # (N, 1): the input token
    position_code = model.positions.index_select(0, position).to(model.tgt_embed.weight.dtype)  # (1, D)
    y = model.embed_dropout(model.tgt_embed(ids) * model.embed_scale + position_code)  # (N, 1, D)
    c.written.index_fill_(1, position, True)
    for i, layer in enumerate(model.decoder_layers):
        y = layer.self_block(y, lambda h: _self_attention(layer.self_attn, h, c, i, position))
        y = layer.cross_block(y, lambda h: layer.cross_attn.attend(
            *layer.cross_attn.split_heads(layer.cross_attn.q_proj(h)), c.cross_k[i], c.cross_v[i], c.memory_mask))
        y = layer.ffn_block(y, layer.ffn)
    y = model.decoder_norm(y)
    with torch.autocast(device_type=y.device.type, enabled=False):  # rank tokens on fp32 logits, as decode does
        logits = model.output_proj(y.float())[:, 0, :]  # (N, V)
    logits[:, model.pad_id] = torch.finfo(logits.dtype).min  # never padding or a second BOS
    logits[:, bos_id] = torch.finfo(logits.dtype).min
    return logits


def _self_attention(attention, h: torch.Tensor, c: StaticCache, layer: int, position: torch.Tensor) -> torch.Tensor:
    q, k, v = attention.project(h)  # (N, H, 1, Dh) each
    keys, values = c.self_kv[0, layer], c.self_kv[1, layer]  # (N, H, C, Dh) each
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)
    return attention.attend(q, keys, values, c.written)  # over the written positions


def _capacity(model: Transformer, max_steps: int) -> int:
    # The position table bounds the capacity; rounding up lets batches of similar caps share shapes.
    return min(round_up(max_steps, 8), model.cfg.max_len)


class StepGraphs:
    """The decoding step last captured during one round of decoding (one `evaluation.translate_ids`
    call), for the next batches of its padded shape to replay: each copies its inputs into the
    tensors the capture was made on. Batches are padded to a multiple of `multiple` sentences (the
    extra ones done from the start) and of source tokens, and the cache holds the length cap of
    the padded source length, so length-sorted batches of similar lengths share a capture: on
    Multi30k's 1,000 test sentences, beam 5 captures 10 times instead of 21, for 8% more rows.
    Only the last is kept (its buffers stay allocated): sorted batches seldom return to a shape.
    Off CUDA (capture=False) the same reuse runs eagerly."""

    def __init__(self, multiple: int = 8):
        self.multiple = multiple
        self.captured: dict[tuple, tuple[tuple, Callable[[], None]]] = {}  # shape -> (state, step), one at most


def _padded(model: Transformer, src_ids: torch.Tensor, graphs: StepGraphs | None, eos_id: int
            ) -> tuple[torch.Tensor, int]:
    """src_ids (B, S) padded to its `graphs` bucket (extra sentences are a lone EOS), and B."""
    B, S = src_ids.shape
    if graphs is None:
        return src_ids, B
    rows, width = round_up(B, graphs.multiple), max(S, min(round_up(S, graphs.multiple), model.cfg.max_len))
    padded = src_ids.new_full((rows, width), model.pad_id)
    padded[:B, :S] = src_ids
    padded[B:, 0] = eos_id
    return padded, B


def _bucket_capacity(model: Transformer, src_ids: torch.Tensor, graphs: StepGraphs | None, max_len_a: float,
                     max_len_b: int, max_steps: int) -> int:
    """The cache's capacity: the batch's longest cap, or in a `graphs` bucket the cap of its padded width."""
    if graphs is not None:
        full = torch.ones(1, src_ids.shape[1], dtype=torch.bool)  # a source as long as the padded width
        max_steps = int(max_target_lengths(full, max_len_a, max_len_b, model.cfg.max_len)[0])
    return _capacity(model, max_steps)


@dataclass
class _GreedyState:
    tokens: torch.Tensor  # (N, C + 1) long: BOS, then the generated ids (pad after a sentence ends)
    position: torch.Tensor  # (1,) long: the position the next step writes
    finished: torch.Tensor  # (N,) bool
    limits: torch.Tensor  # (N,) long: each sentence's cap on generated tokens


@torch.inference_mode()
def static_greedy_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, max_len_a: float,
                         max_len_b: int, capture: bool, check_every: int = 8,
                         graphs: StepGraphs | None = None) -> list[list[int]]:
    """`decoding.greedy_decode` with fixed-shape steps; `capture` replays them from a CUDA graph
    (else they run eagerly: the same computation, for a CPU test), reused from `graphs` when a
    batch of this padded shape captured one. src_ids (N, S) long -> N lists of generated ids
    without BOS and EOS. The host checks whether every sentence has finished every
    `check_every` steps (a sync); the steps in between are queued."""
    pad_id, device = model.pad_id, src_ids.device
    src_ids, n_real = _padded(model, src_ids, graphs, eos_id)
    limits = max_target_lengths(src_ids != pad_id, max_len_a, max_len_b, model.cfg.max_len)  # (N,)
    max_steps = int(limits[:n_real].max())
    capacity = _bucket_capacity(model, src_ids, graphs, max_len_a, max_len_b, max_steps)
    tokens = torch.full((src_ids.shape[0], capacity + 1), pad_id, dtype=torch.long, device=device)
    tokens[:, 0] = bos_id
    finished = torch.zeros(src_ids.shape[0], dtype=torch.bool, device=device)
    finished[n_real:] = True  # the bucket's filler sentences
    fresh = (_new_cache(model, src_ids, capacity), _GreedyState(tokens, torch.zeros_like(limits[:1]), finished, limits))

    def make_step(c: StaticCache, g: _GreedyState) -> Callable[[], None]:
        def step() -> None:
            next_ids = _logits(model, c, g.tokens, g.position, bos_id).max(dim=-1).indices  # (N,) first among ties
            next_ids = next_ids.masked_fill(g.finished, pad_id)
            g.tokens.index_copy_(1, g.position + 1, next_ids[:, None])
            g.position.add_(1)
            g.finished.logical_or_(next_ids == eos_id).logical_or_(g.position >= g.limits)
        return step

    (_, g), step, done = _prepared(graphs, ("greedy", *src_ids.shape, capacity), fresh, make_step,
                                   lambda c, g: [c.written, g.tokens, g.position, g.finished], capture)
    _run(step, done, max_steps, g.finished, check_every)
    return [strip_generated(row, eos_id, pad_id) for row in g.tokens[:n_real, 1:].tolist()]


@torch.inference_mode()
def static_beam_search(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, beam_size: int,
                       max_len_a: float, max_len_b: int, alpha: float = 0.6, n_best: int = 1, capture: bool,
                       check_every: int = 8, graphs: StepGraphs | None = None) -> list[list[Hypothesis]]:
    """`decoding.beam_search` with fixed-shape steps over all B·K rows; `capture` replays them from
    a CUDA graph (else they run eagerly, for a CPU test), reused from `graphs` when a batch of
    this padded shape captured one. src_ids (B, S) long -> for each sentence its `n_best`
    hypotheses, best first. The host checks whether every sentence is done every `check_every`
    steps; a done sentence's rows are computed and ignored until then."""
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be between 1 and beam_size={beam_size}, got {n_best}")
    pad_id = model.pad_id
    src_ids, n_real = _padded(model, src_ids, graphs, eos_id)
    limits = max_target_lengths(src_ids != pad_id, max_len_a, max_len_b, model.cfg.max_len)  # (B,)
    max_steps = int(limits[:n_real].max())
    capacity = _bucket_capacity(model, src_ids, graphs, max_len_a, max_len_b, max_steps)
    beams = new_beam_state(limits, beam_size, n_best, capacity, bos_id=bos_id, pad_id=pad_id, alpha=alpha)
    beams.done[n_real:] = True  # the bucket's filler sentences
    fresh = (_new_cache(model, src_ids, capacity, beams=beam_size), beams)

    def make_step(c: StaticCache, s: BeamState) -> Callable[[], None]:
        def step() -> None:
            logits = _logits(model, c, s.tokens, s.position, bos_id)  # (B·K, V)
            c.reorder(advance_beams(s, torch.log_softmax(logits, dim=-1), eos_id))
        return step

    def changed(c: StaticCache, s: BeamState) -> list[torch.Tensor]:
        return [c.written, s.tokens, s.scores, s.position, s.done, s.count, s.best_tokens, s.best_log_probs,
                s.best_scores]

    key = ("beam", *src_ids.shape, capacity, beam_size, n_best, alpha)
    (_, s), step, done = _prepared(graphs, key, fresh, make_step, changed, capture)
    _run(step, done, max_steps, s.done, check_every)
    return finished_hypotheses(s, eos_id, pad_id)[:n_real]


def _prepared(graphs: StepGraphs | None, key: tuple, fresh: tuple, make_step: Callable[..., Callable[[], None]],
              changed: Callable[..., list[torch.Tensor]], capture: bool) -> tuple[tuple, Callable[[], None], int]:
    """(the state to decode on, its step, the steps already run). With a step of this shape in
    `graphs`, the state it runs on, loaded with `fresh`'s values; else `fresh` and a step made for
    it, captured with `capture` (which runs the first step) and kept in `graphs`. `changed(*state)`
    lists the tensors a step changes other than the caches' keys and values."""
    if graphs is not None and key in graphs.captured:
        state, step = graphs.captured[key]
        for into, values in zip(state, fresh):
            _load(into, values)
        return state, step, 0
    step, done = make_step(*fresh), 0
    if capture:
        device_type = "cuda"
        # Autocast's cache of cast weights must not be filled while a graph is captured.
        no_cast_cache = (torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
                         if torch.is_autocast_enabled(device_type) else contextlib.nullcontext())
        with no_cast_cache:
            step, done = _captured(step, changed(*fresh)), 1  # capturing ran the first step once, for real
    if graphs is not None:
        graphs.captured = {key: (fresh, step)}
    return fresh, step, done


def _load(into, values) -> None:
    """Copy every tensor field of dataclass `values` into the same field of `into` (same shapes)."""
    for field in fields(values):
        targets, sources = getattr(into, field.name), getattr(values, field.name)
        for target, source in zip(targets, sources) if isinstance(targets, list) else [(targets, sources)]:
            target.copy_(source)


def _run(step: Callable[[], None], done: int, max_steps: int, finished: torch.Tensor, check_every: int) -> None:
    """Run `step` until `max_steps` steps have run (`done` already), stopping early once `finished`
    (bool) is all true, read every `check_every` steps."""
    while done < max_steps:
        step()
        done += 1
        if done % check_every == 0 and bool(finished.all()):
            break


def _captured(step: Callable[[], None], state: list[torch.Tensor]) -> Callable[[], None]:
    """Run `step` once eagerly on a side stream (cuBLAS and allocator warm-up, which a capture may
    not do), undo what it wrote to `state`, capture it, then replay the capture for the real first
    step. The first step's keys and values it leaves in the caches are rewritten by the replay; a
    beam search's reordering of them moves rows among identical beams (all start from BOS)."""
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for tensor, before in zip(state, saved):
        tensor.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    return graph.replay
