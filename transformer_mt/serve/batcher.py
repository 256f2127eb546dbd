"""`Batcher`: requests from many threads translated together by one worker thread that owns the
`Translator`, in batches of the same decoding options gathered for a short wait or up to a token budget."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from transformer_mt.decode.translator import Translation, Translator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    """A request's decoding options: only requests with equal options share a batch."""

    beam_size: int
    n_best: int = 1
    scores: bool = False  # n-best lists with scores (`Translator.translate_n_best`), else best translations only
    target_lang: str | None = None  # a multilingual model's target language; None: the server's
    alignments: bool = False  # each translation with its word alignment


@dataclass(eq=False)  # a job is itself: two equal requests are two jobs
class _Job:
    sentences: list[str]
    prefixes: list[str]  # the text each translation begins with ("": none)
    constraints: list[list[str]]  # the terms each translation contains
    tokens: int  # source tokens with their EOS: what the budget counts
    options: Options
    future: Future
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class BatcherStats:
    """What the worker did so far: requests and sentences answered, batched calls made, the most
    requests one call served, and requests waiting now."""

    requests: int = 0
    sentences: int = 0
    batches: int = 0
    largest_batch_requests: int = 0
    queued: int = 0


class Batcher:
    """Translates submitted requests on one worker thread. A batch starts with the oldest waiting
    request and takes the later ones with its options, in order, while their source tokens fit in
    `batch_tokens` (the first always goes, whatever its size); it leaves once the budget is reached or
    `max_wait` seconds after the oldest arrived (at once if the worker was busy that long)."""

    def __init__(self, translator: Translator, batch_tokens: int, max_wait: float):
        self.translator = translator
        self.batch_tokens = batch_tokens
        self.max_wait = max_wait
        self._pending: list[_Job] = []
        self._closed = False
        self._draining = False  # stopping: batches leave without waiting
        self._stats = BatcherStats()
        self._lock = threading.Condition()
        self._worker = threading.Thread(target=self._work, name="tmt-translator", daemon=True)
        self._worker.start()

    def submit(self, sentences: list[str], tokens: int, options: Options, prefixes: list[str] | None = None,
               constraints: list[list[str]] | None = None) -> Future:
        """Queue one request of `tokens` source tokens (its translations beginning with `prefixes`,
        "" or None: none, and containing the terms of `constraints`, None: none); the future gives a
        `Translation` list per sentence (one, the best, unless `options.scores`), or the error its batch
        raised."""
        job = _Job(sentences, prefixes or [""] * len(sentences), constraints or [[] for _ in sentences], tokens,
                   options, Future())
        with self._lock:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending.append(job)
            self._lock.notify()
        return job.future

    def stats(self) -> BatcherStats:
        with self._lock:
            return BatcherStats(**{**vars(self._stats), "queued": len(self._pending)})

    def drain(self) -> None:
        """From now on send batches without waiting for more requests (the server is stopping)."""
        with self._lock:
            self._draining = True
            self._lock.notify()

    def close(self) -> None:
        """Translate what is queued, then stop the worker."""
        with self._lock:
            self._closed = self._draining = True
            self._lock.notify()
        self._worker.join()

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            jobs = [job for job in batch if job.future.set_running_or_notify_cancel()]  # a client that left: skip
            if jobs:
                self._translate(jobs)

    def _next_batch(self) -> list[_Job] | None:
        """The next batch to translate (None once closed and empty), waiting as the class says."""
        with self._lock:
            while not self._pending:
                if self._closed:
                    return None
                self._lock.wait()
            first = self._pending[0]
            while not self._draining:
                queued = sum(job.tokens for job in self._pending if job.options == first.options)
                left = first.arrived + self.max_wait - time.monotonic()
                if queued >= self.batch_tokens or left <= 0:
                    break
                self._lock.wait(left)
            batch, tokens = [], 0
            for job in self._pending:
                if job.options != first.options:
                    continue
                if batch and tokens + job.tokens > self.batch_tokens:
                    break
                batch.append(job)
                tokens += job.tokens
            self._pending = [job for job in self._pending if job not in batch]
            return batch

    def _translate(self, jobs: list[_Job]) -> None:
        """One batched call for every sentence of `jobs`, each job's share of the results to its future."""
        options = jobs[0].options
        lines = [sentence for job in jobs for sentence in job.sentences]
        prefixes = [prefix for job in jobs for prefix in job.prefixes]
        constraints = [terms for job in jobs for terms in job.constraints]
        asked = {"beam_size": options.beam_size, "target_lang": options.target_lang, "prefixes": prefixes,
                 "constraints": constraints if any(constraints) else None}
        try:
            if options.scores or options.alignments:
                results = self.translator.translate_n_best(lines, n_best=options.n_best, alignments=options.alignments,
                                                           **asked)
            else:
                results = [[Translation(text, 0.0, [])] for text in self.translator.translate(lines, **asked)]
        except Exception as err:  # the batch's requests fail with it; the worker goes on with the next
            logger.error("translating a batch of %d request(s) failed: %s", len(jobs), err)
            for job in jobs:
                job.future.set_exception(err)
            return
        with self._lock:
            self._stats.requests += len(jobs)
            self._stats.sentences += len(lines)
            self._stats.batches += 1
            self._stats.largest_batch_requests = max(self._stats.largest_batch_requests, len(jobs))
        start = 0
        for job in jobs:
            job.future.set_result(results[start:start + len(job.sentences)])
            start += len(job.sentences)
