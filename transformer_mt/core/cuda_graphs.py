"""Capturing a CUDA graph: warm-up runs on a side stream, then the capture, as `torch.cuda.graph`
requires. The decoder's step (`decode.generator`) and the training update (`train.cuda_graphs`)
are captured through `capture_graph`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def capture_graph(step: Callable[[], object], state: Sequence[torch.Tensor] = (), *,
                  warmup: Callable[[], object] | None = None, warmup_runs: int = 1, pool=None,
                  device: torch.device | str | None = None) -> torch.cuda.CUDAGraph:
    """`step` captured as a graph (not yet replayed: replaying it runs the step). First `warmup_runs`
    runs of `warmup` (default `step`) on a side stream: cuBLAS handles, allocator pools and compiling
    happen there, never inside a capture. The tensors of `state` the warm-up changed are then put
    back, so the graph's first replay is the step's first run. `pool`: the memory pool to capture
    into (`torch.cuda.graph_pool_handle`), shared by graphs that replay one at a time."""
    saved = [tensor.clone() for tensor in state]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            (warmup or step)()
    torch.cuda.current_stream(device).wait_stream(side)
    for tensor, before in zip(state, saved):
        tensor.copy_(before)
    del saved
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph
