"""Capture and replay of a decoding step as a CUDA graph. The step itself is `decode.generator`'s, on the
model's own `decode_step` and static KV cache; here live only the capture, the reuse of a capture
by later batches of the same padded shape, and the loading of a new batch into its buffers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import fields

import torch


class StepGraphs:
    """The decoding step last captured during one round of decoding (one `evaluation.translate_ids`
    call), for the next batches of its padded shape to replay: each copies its inputs into the
    tensors the capture was made on. Batches are padded to a multiple of `multiple` sentences and
    source tokens, so length-sorted batches of similar lengths share a capture; only the last is
    kept. Off CUDA (capture=False) the same reuse runs eagerly."""

    def __init__(self, multiple: int = 8):
        self.multiple = multiple
        self.captured: dict[tuple, tuple[tuple, Callable[[], None]]] = {}  # shape -> (state, step), one at most


def prepared(graphs: StepGraphs | None, key: tuple, fresh: tuple, make_step: Callable[..., Callable[[], None]],
             capture: bool) -> tuple[tuple, Callable[[], None], int]:
    """(the objects to decode on, their step, the steps already run). With a step of this key in
    `graphs`, the objects it runs on, loaded with `fresh`'s values; else `fresh` and a step made for
    it, captured with `capture` (which runs the first step) and kept in `graphs`."""
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
            step, done = _captured(step, [t for obj in fresh for t in _tensors(obj)]), 1
    if graphs is not None:
        graphs.captured = {key: (fresh, step)}
    return fresh, step, done


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors among a dataclass's fields, lists of tensors flattened."""
    found = []
    for field in fields(obj):
        value = getattr(obj, field.name)
        found.extend(t for t in (value if isinstance(value, list) else [value]) if isinstance(t, torch.Tensor))
    return found


def _load(into, values) -> None:
    """Copy every tensor of dataclass `values` into the same tensor of `into` (same shapes)."""
    for target, source in zip(_tensors(into), _tensors(values)):
        if target is not source:
            target.copy_(source)


def _captured(step: Callable[[], None], state: list[torch.Tensor]) -> Callable[[], None]:
    """Run `step` once eagerly on a side stream (cuBLAS and allocator warm-up, which a capture may
    not do), put `state` back as it was, capture the step, then replay the capture for the real
    first step."""
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
