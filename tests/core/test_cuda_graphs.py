"""The one CUDA graph capture (`core.cuda_graphs`): warm-up on a side stream, the state put back,
then the capture, as torch's `torch.cuda.graph` documentation prescribes. No GPU here: torch's CUDA
stream and graph calls are replaced by recorders of what was done, in order."""

import contextlib

import torch

from transformer_mt.core import cuda_graphs


class FakeCuda:
    """Stands in for torch.cuda's streams and graphs, recording the calls and the stream each step ran on."""

    def __init__(self):
        self.events, self.stream_now = [], "main"
        outer = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"
                outer.events.append(("new stream", device))

            def wait_stream(self, other):
                outer.events.append((f"{self.name} waits", other.name))

        class Current:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                outer.events.append((f"{self.name} waits", other.name))

        class Graph:
            pass

        @contextlib.contextmanager
        def stream(side):
            before, self.stream_now = self.stream_now, side.name
            yield
            self.stream_now = before

        @contextlib.contextmanager
        def graph(graph, pool=None):
            before, self.stream_now = self.stream_now, "capturing"
            self.events.append(("capture", pool))
            yield
            self.stream_now = before

        self.Stream, self.CUDAGraph, self.stream, self.graph = Stream, Graph, stream, graph
        self.current_stream = lambda device=None: Current(self.stream_now)


def test_a_capture_warms_up_on_a_side_stream_puts_the_state_back_then_captures(monkeypatch):
    fake = FakeCuda()
    for name in ("Stream", "CUDAGraph", "stream", "graph", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    state = torch.zeros(3)

    def step():  # what a captured step does: changes its state in place
        state.add_(1)
        fake.events.append(("step on", fake.stream_now, state.tolist()))

    graph = cuda_graphs.capture_graph(step, [state], warmup_runs=2, pool="pool", device="cuda:0")
    assert isinstance(graph, fake.CUDAGraph)
    assert fake.events == [("new stream", "cuda:0"), ("side waits", "main"),
                           ("step on", "side", [1, 1, 1]), ("step on", "side", [2, 2, 2]),
                           ("main waits", "side"),
                           ("capture", "pool"), ("step on", "capturing", [1, 1, 1])]  # the state as before warm-up

    fake.events.clear()
    warmed = []
    cuda_graphs.capture_graph(step, [], warmup=lambda: warmed.append(fake.stream_now))  # one warm-up of its own
    assert warmed == ["side"] and [e for e in fake.events if e[0] == "step on"] == [("step on", "capturing", [2, 2, 2])]
