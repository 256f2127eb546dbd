"""The search driver: encode a batch, then step a search (`search.py`) on the model's static KV cache
until every sentence is done: eagerly, done sentences leave the batch; with fixed shapes, the step
may be captured as a CUDA graph and replayed by later batches of its padded shape."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from transformer_mt.core.cuda_graphs import capture_graph
from transformer_mt.data.batching import round_up
from transformer_mt.decode.hypotheses import Hypothesis, Sampling
from transformer_mt.decode.search import BeamState, ConstrainedBeamState, SampleState
from transformer_mt.model.transformer import KVCache, Transformer

State = BeamState | SampleState  # ConstrainedBeamState is a BeamState
CHECK_EVERY = 8  # fixed-shape steps between the host's checks whether every sentence is done
# (limits, capacity, position, forced) -> the search's first state
StartState = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor | None], State]


def max_target_lengths(src_mask: torch.Tensor, max_len_a: float, max_len_b: int, model_max_len: int) -> torch.Tensor:
    """Each sentence's cap on generated tokens, EOS included: a·S + b (S: source tokens with EOS),
    at most `model_max_len`. src_mask (B, S) bool -> (B,) long."""
    src_lengths = src_mask.sum(dim=1).float()  # (B,)
    limits = (max_len_a * src_lengths + max_len_b).floor().long()
    return limits.clamp(min=1, max=model_max_len)


def greedy_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, max_len_a: float,
                  max_len_b: int, prefixes: torch.Tensor | None = None, graphs: StepGraphs | None = None,
                  capture: bool = False, drop_finished: float = 0.25) -> list[list[int]]:
    """The most probable token at each step (beam search with one beam): src_ids (B, S) long,
    padded with `model.pad_id` -> B lists of generated ids, without BOS and EOS."""
    hypotheses = beam_search(model, src_ids, bos_id=bos_id, eos_id=eos_id, beam_size=1, max_len_a=max_len_a,
                             max_len_b=max_len_b, alpha=0.0, prefixes=prefixes, graphs=graphs, capture=capture,
                             drop_finished=drop_finished)
    return [hyps[0].ids for hyps in hypotheses]


def beam_search(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, beam_size: int,
                max_len_a: float, max_len_b: int, alpha: float = 1.0, n_best: int = 1,
                prefixes: torch.Tensor | None = None, graphs: StepGraphs | None = None, capture: bool = False,
                drop_finished: float | None = None, terms: torch.Tensor | None = None) -> list[list[Hypothesis]]:
    """Beam search with K = `beam_size` beams per sentence (`BeamState.advance`): src_ids (B, S)
    long -> for each sentence its `n_best` hypotheses, best first. Beam size 1 is greedy decoding.
    With `terms` (B, N, T) long, each sentence's terms' ids padded with `model.pad_id`, every hypothesis
    contains all of its sentence's (`ConstrainedBeamState`). (`search` says what `graphs`, `capture`
    and `drop_finished` do; default 0.25 greedy, else 0.)"""
    start = functools.partial(BeamState.start if terms is None else functools.partial(ConstrainedBeamState.start,
                                                                                      terms=terms),
                              beam_size=beam_size, n_best=n_best, bos_id=bos_id, eos_id=eos_id, pad_id=model.pad_id,
                              alpha=alpha)
    return search(model, src_ids, start, rows_per_sentence=beam_size, bos_id=bos_id, eos_id=eos_id,
                  max_len_a=max_len_a, max_len_b=max_len_b, prefixes=prefixes, graphs=graphs, capture=capture,
                  key=("beam", beam_size, n_best, alpha, None if terms is None else tuple(terms.shape[1:])),
                  drop_finished=(0.25 if beam_size == 1 else 0.0) if drop_finished is None else drop_finished)


def sample_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, max_len_a: float,
                  max_len_b: int, sampling: Sampling, generator: torch.Generator, n_samples: int = 1,
                  alpha: float = 1.0, prefixes: torch.Tensor | None = None) -> list[list[Hypothesis]]:
    """Draw `n_samples` translations per source (`Sampling` says how): src_ids (B, S) long -> for
    each sentence its samples in the order drawn, scored as beam search scores its hypotheses."""
    start = functools.partial(SampleState.start, sampling=sampling, generator=generator, bos_id=bos_id,
                              eos_id=eos_id, pad_id=model.pad_id, alpha=alpha)
    # A sentence's samples are neighbours, with its prefix each.
    repeated = None if prefixes is None else prefixes.repeat_interleave(n_samples, dim=0)
    rows = search(model, src_ids.repeat_interleave(n_samples, dim=0), start, rows_per_sentence=1, bos_id=bos_id,
                  eos_id=eos_id, max_len_a=max_len_a, max_len_b=max_len_b, prefixes=repeated)
    return [[hyps[0] for hyps in rows[i:i + n_samples]] for i in range(0, len(rows), n_samples)]


@torch.inference_mode()
def search(model: Transformer, src_ids: torch.Tensor, start: StartState, *, rows_per_sentence: int, bos_id: int,
           eos_id: int, max_len_a: float, max_len_b: int, prefixes: torch.Tensor | None = None,
           graphs: StepGraphs | None = None, capture: bool = False, key: tuple = (),
           drop_finished: float = 0.25) -> list[list[Hypothesis]]:
    """Run the search that `start` begins over src_ids (B, S) -> each sentence's hypotheses, each
    beginning with its row of `prefixes` (B, P) long, padded with `model.pad_id` (None: none). Eagerly
    (no `graphs`, no `capture`), done sentences leave the batch once they are at least `drop_finished`
    of those still decoded (0: at once). With `graphs` or `capture`, every row runs in steps of one
    shape (`capture`: replayed from a CUDA graph); the host checks every `CHECK_EVERY` steps."""
    forbidden = (model.pad_id, bos_id)  # never padding or a second BOS
    if graphs is None and not capture:
        limits = max_target_lengths(src_ids != model.pad_id, max_len_a, max_len_b, model.cfg.max_len)  # (B,)
        capacity = int(limits.max())
        cache = model.new_cache(src_ids, capacity, rows_per_sentence)
        state = start(limits, capacity, cache.position, _forced(prefixes, src_ids.shape[0], capacity, model.pad_id))
        return _eager(model, state, cache, forbidden, capacity, drop_finished)
    B, S = src_ids.shape
    if graphs is not None:  # padded to its bucket, which shares a capture; extra sentences are a lone EOS
        rows, width = round_up(B, graphs.multiple), max(S, min(round_up(S, graphs.multiple), model.cfg.max_len))
        padded = src_ids.new_full((rows, width), model.pad_id)
        padded[:B, :S] = src_ids
        padded[B:, 0] = eos_id
        src_ids = padded
    limits = max_target_lengths(src_ids != model.pad_id, max_len_a, max_len_b, model.cfg.max_len)  # (B,)
    max_steps = bucket = int(limits[:B].max())
    if graphs is not None:  # the cap of the padded width, so that batches of one bucket share a capacity
        full = torch.ones(1, src_ids.shape[1], dtype=torch.bool)
        bucket = int(max_target_lengths(full, max_len_a, max_len_b, model.cfg.max_len)[0])
    capacity = min(round_up(bucket, 8), model.cfg.max_len)
    cache = model.new_cache(src_ids, capacity, rows_per_sentence)
    state = start(limits, capacity, cache.position, _forced(prefixes, src_ids.shape[0], capacity, model.pad_id))
    state.done[B:] = True  # the bucket's filler sentences
    (cache, state), step, done = prepared(
        graphs, (*key, *src_ids.shape, capacity, prefixes is not None), (cache, state),
        lambda c, s: lambda: _step(model, s, c, forbidden), capture)
    while done < max_steps:
        step()
        done += 1
        if done % CHECK_EVERY == 0 and bool(state.done.all()):
            break
    return state.results()[:B]


def _forced(prefixes: torch.Tensor | None, rows: int, capacity: int, pad_id: int) -> torch.Tensor | None:
    """prefixes (B, P) long as a search state's `forced` (rows, capacity): padded, or cut at the capacity."""
    if prefixes is None:
        return None
    forced = prefixes.new_full((rows, capacity), pad_id)
    width = min(prefixes.shape[1], capacity)
    forced[:prefixes.shape[0], :width] = prefixes[:, :width]
    return forced


def _step(model: Transformer, state: State, cache: KVCache, forbidden: tuple[int, ...],
          written: int | None = None) -> None:
    """One decoding step of every row: the model's logits, the search's choice, and the cache's first
    `written` positions (None: all) following beams that trade places."""
    tokens = state.tokens.gather(1, state.position.expand(state.tokens.shape[0])[:, None]).squeeze(1)  # (R,)
    logits = model.decode_step(tokens, cache)  # (R, V) fp32
    for token in forbidden:
        logits[:, token] = torch.finfo(logits.dtype).min
    rows = state.advance(logits)
    if state.rows_per_sentence > 1:  # beams trade places
        cache.reorder(rows, written)


def _eager(model: Transformer, state: State, cache: KVCache, forbidden: tuple[int, ...], max_steps: int,
           drop_finished: float) -> list[list[Hypothesis]]:
    K = state.rows_per_sentence
    sentences = torch.arange(state.done.shape[0], device=state.done.device)  # each row block's sentence
    results: list[list[Hypothesis]] = [[] for _ in range(state.done.shape[0])]
    for written in range(1, max_steps + 1):
        _step(model, state, cache, forbidden, written)
        n_done = int(state.done.sum())  # the step's one copy to the host
        if n_done == state.done.shape[0]:
            break
        if n_done and n_done >= drop_finished * state.done.shape[0]:
            done, keep = state.done.nonzero().squeeze(1), (~state.done).nonzero().squeeze(1)
            for sentence, hyps in zip(sentences[done].tolist(), state.select(done).results()):
                results[sentence] = hyps
            rows = (keep[:, None] * K + torch.arange(K, device=keep.device)).flatten()  # (B'·K,)
            state, cache, sentences = state.select(keep), cache.select(rows, written), sentences[keep]
    for sentence, hyps in zip(sentences.tolist(), state.results()):
        results[sentence] = hyps
    return results


@dataclass
class StepGraphs:
    """The step last captured in one round of decoding (one `translate_hypotheses` call), which later
    batches of its padded shape (`multiple` sentences and source tokens) replay on their inputs,
    copied into its tensors. Without capture the same reuse runs eagerly."""

    multiple: int = 8
    captured: dict[tuple, tuple[tuple, Callable[[], None]]] = field(default_factory=dict)  # key: state, step


def prepared(graphs: StepGraphs | None, key: tuple, fresh: tuple, make_step: Callable[..., Callable[[], None]],
             capture: bool) -> tuple[tuple, Callable[[], None], int]:
    """(the objects to decode on, their step, the steps already run): `graphs`' step of this key and
    its objects, loaded with `fresh`'s values; else `fresh` with a new step, captured with `capture`
    (which runs the first step) and kept in `graphs`."""
    if graphs is not None and key in graphs.captured:
        state, step = graphs.captured[key]
        for into, values in zip(state, fresh):
            for target, source in zip(_tensors(into), _tensors(values)):
                if target is not source:
                    target.copy_(source)
        return state, step, 0
    step, done = make_step(*fresh), 0
    if capture:
        # Autocast's cache of cast weights must not be filled while a graph is captured.
        no_cast_cache = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                         if torch.is_autocast_enabled("cuda") else contextlib.nullcontext())
        with no_cast_cache:
            step, done = _captured(step, [t for obj in fresh for t in _tensors(obj)]), 1
    if graphs is not None:
        graphs.captured = {key: (fresh, step)}
    return fresh, step, done


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors among a dataclass's fields, lists of tensors flattened."""
    values = [getattr(obj, f.name) for f in fields(obj)]
    flat = [t for value in values for t in (value if isinstance(value, list) else [value])]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _captured(step: Callable[[], None], state: list[torch.Tensor]) -> Callable[[], None]:
    """`step` captured (warmed up once, `state` then put back), replayed for the real first step."""
    graph = capture_graph(step, state)
    graph.replay()
    return graph.replay
