"""`serve.batcher.Batcher` on a translator that records its calls: which requests share a call
(same options, the token budget, the wait), and failures that stay in their batch."""

from __future__ import annotations

import threading

import pytest

from transformer_mt.serve.batcher import Batcher, Options
from transformer_mt.decode.translator import Translation

WAIT = 30  # seconds a future may take: far more than any batch here needs


class RecordingTranslator:
    """Translates "x" as "x/beam", after its prefix; the first call holds until `release` is set, so
    that requests queue up behind it; a line "boom" fails its call."""

    def __init__(self):
        self.calls: list[tuple[list[str], Options]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def _record(self, lines, options):
        self.calls.append((list(lines), options))
        self.entered.set()
        assert self.release.wait(WAIT)
        if "boom" in lines:
            raise RuntimeError("the engine failed")

    def translate(self, lines, beam_size, prefixes, target_lang=None, constraints=None):
        self._record(lines, Options(beam_size, target_lang=target_lang))
        return [f"{prefix}{line}/{beam_size}" for line, prefix in zip(lines, prefixes)]

    def translate_n_best(self, lines, n_best, beam_size, prefixes, target_lang=None, alignments=False,
                         constraints=None):
        self._record(lines, Options(beam_size, n_best, True, target_lang, alignments))
        return [[Translation(f"{prefix}{line}/{beam_size}#{k}", -float(k), []) for k in range(n_best)]
                for line, prefix in zip(lines, prefixes)]


def busy_batcher(batch_tokens: int = 100, max_wait: float = 0.0) -> tuple[Batcher, RecordingTranslator]:
    """A batcher whose worker is inside its first call (request "first"), holding until released."""
    translator = RecordingTranslator()
    batcher = Batcher(translator, batch_tokens=batch_tokens, max_wait=max_wait)
    batcher.submit(["first"], 2, Options(1))
    assert translator.entered.wait(WAIT)
    return batcher, translator


def test_requests_queued_meanwhile_share_a_call_with_their_own_options():
    batcher, translator = busy_batcher()
    greedy, beam = Options(1), Options(4, 2, True)
    futures = [batcher.submit(["a", "b"], 5, greedy), batcher.submit(["c"], 3, beam),
               batcher.submit(["d"], 3, greedy, ["D:"]), batcher.submit(["e"], 3, beam, ["E:"])]
    translator.release.set()
    results = [future.result(WAIT) for future in futures]
    batcher.close()
    assert translator.calls == [(["first"], greedy), (["a", "b", "d"], greedy), (["c", "e"], beam)]
    assert [[t.text for t in sentence] for sentence in results[0]] == [["a/1"], ["b/1"]]
    assert [[t.text for t in sentence] for sentence in results[2]] == [["D:d/1"]]  # its prefix, not a neighbour's
    assert [[t.text for t in sentence] for sentence in results[3]] == [["E:e/4#0", "E:e/4#1"]]
    stats = batcher.stats()
    assert (stats.requests, stats.sentences, stats.batches, stats.largest_batch_requests) == (5, 6, 3, 2)


def test_requests_for_another_target_language_go_in_their_own_call():
    batcher, translator = busy_batcher()
    ita, fra = Options(1, target_lang="ita"), Options(1, target_lang="fra")
    futures = [batcher.submit(["a"], 2, ita), batcher.submit(["b"], 2, fra), batcher.submit(["c"], 2, ita)]
    translator.release.set()
    for future in futures:
        future.result(WAIT)
    batcher.close()
    assert translator.calls[1:] == [(["a", "c"], ita), (["b"], fra)]


def test_the_token_budget_splits_batches_and_a_large_request_goes_alone():
    batcher, translator = busy_batcher(batch_tokens=6)
    futures = [batcher.submit([name], tokens, Options(1)) for name, tokens in
               (("a", 3), ("b", 4), ("c", 2), ("huge", 9), ("d", 1))]
    translator.release.set()
    for future in futures:
        future.result(WAIT)
    batcher.close()
    assert [lines for lines, _ in translator.calls] == [["first"], ["a"], ["b", "c"], ["huge"], ["d"]]


def test_a_full_budget_sends_the_batch_before_the_wait_ends():
    translator = RecordingTranslator()
    translator.release.set()
    batcher = Batcher(translator, batch_tokens=4, max_wait=3600.0)
    first = batcher.submit(["a"], 2, Options(1))
    second = batcher.submit(["b"], 2, Options(1))
    assert [t.text for t in first.result(WAIT)[0]] == ["a/1"]  # an hour's wait would time this out
    assert [t.text for t in second.result(WAIT)[0]] == ["b/1"]
    batcher.close()
    assert translator.calls == [(["a", "b"], Options(1))]


def test_close_answers_what_is_queued_without_waiting():
    translator = RecordingTranslator()
    translator.release.set()
    batcher = Batcher(translator, batch_tokens=1000, max_wait=3600.0)
    future = batcher.submit(["a"], 2, Options(1))
    batcher.close()
    assert future.done() and [t.text for t in future.result()[0]] == ["a/1"]
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(["b"], 2, Options(1))


def test_a_failing_batch_fails_its_requests_only_and_a_cancelled_one_is_skipped():
    batcher, translator = busy_batcher()
    failing = batcher.submit(["boom"], 2, Options(2))
    cancelled = batcher.submit(["gone"], 2, Options(3))
    assert cancelled.cancel()  # its client left before the worker reached it
    later = batcher.submit(["fine"], 2, Options(1))
    translator.release.set()
    with pytest.raises(RuntimeError, match="the engine failed"):
        failing.result(WAIT)
    assert [t.text for t in later.result(WAIT)[0]] == ["fine/1"]
    batcher.close()
    assert [lines for lines, _ in translator.calls] == [["first"], ["boom"], ["fine"]]
