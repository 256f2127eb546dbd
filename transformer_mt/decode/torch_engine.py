"""`TorchEngine`: tmt's own model and search on any torch device, over id lists in length-sorted,
token-budget batches."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import torch

from transformer_mt.config.schema import DecodeConfig
from transformer_mt.core.runtime import Precision, pick_attention
from transformer_mt.data.batching import pad_sequences, round_up, sorted_batches
from transformer_mt.data.tokenization import BOS_ID, EOS_ID, model_source, token_room
from transformer_mt.decode.generator import StepGraphs, beam_search, sample_decode
from transformer_mt.decode.hypotheses import Hypothesis, Sampling
from transformer_mt.model.transformer import Transformer


class TorchEngine:
    """The `Engine` of a `Transformer` on `device`, under the run's `precision` (autocast)."""

    name = "torch"

    def __init__(self, model: Transformer, device: torch.device, precision: Precision):
        self.model = model.eval()
        self.device = device.type
        self.common = {"bos_id": BOS_ID, "eos_id": EOS_ID, "device": device}
        self.precision = precision

    def translate(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, progress: bool,
                  prefixes: list[list[int]] | None = None,
                  terms: list[list[list[int]]] | None = None) -> list[list[int]]:
        return translate_ids(self.model, src_ids, decode, precision=self.precision, beam_size=beam_size,
                             progress=progress, prefixes=prefixes, terms=terms, **self.common)

    def hypotheses(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, n_best: int,
                   sampling: Sampling | None, progress: bool, prefixes: list[list[int]] | None = None,
                   terms: list[list[list[int]]] | None = None) -> list[list[Hypothesis]]:
        return translate_hypotheses(self.model, src_ids, decode, precision=self.precision, beam_size=beam_size,
                                    n_best=n_best, sampling=sampling, progress=progress, prefixes=prefixes,
                                    terms=terms, **self.common)

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]], decode: DecodeConfig,
              progress: bool) -> list[list[float]]:
        return score_ids(self.model, src_ids, tgt_ids, decode, precision=self.precision, progress=progress,
                         **self.common)

    def cross_attention(self, src_ids: list[int], hyp_ids: list[int], layer: int) -> torch.Tensor:
        return cross_attention_maps(self.model, [src_ids], [hyp_ids], layer, **self.common)[0]

    def cross_attentions(self, src_ids: list[list[int]], tgt_ids: list[list[int]], layer: int,
                         decode: DecodeConfig) -> list[torch.Tensor]:
        """`cross_attention_maps` of these pairs, in batches of `decode.batch_tokens`."""
        return cross_attention_maps(self.model, src_ids, tgt_ids, layer, batch_tokens=decode.batch_tokens,
                                    **self.common)


def translate_ids(model: Transformer, src_seqs: list[list[int]], decode_cfg: DecodeConfig, *,
                  bos_id: int, eos_id: int, device: torch.device, precision: Precision,
                  beam_size: int | None = None, progress: bool = False,
                  prefixes: list[list[int]] | None = None,
                  terms: list[list[list[int]]] | None = None) -> list[list[int]]:
    """The best translation of each source id list (no special tokens): greedy when the beam size
    (`beam_size`, else `decode_cfg.beam_size`) is 1, else beam search."""
    return [hyps[0].ids for hyps in translate_hypotheses(
        model, src_seqs, decode_cfg, bos_id=bos_id, eos_id=eos_id, device=device, precision=precision,
        beam_size=beam_size, progress=progress, prefixes=prefixes, terms=terms)]


def translate_hypotheses(model: Transformer, src_seqs: list[list[int]], decode_cfg: DecodeConfig, *,
                         bos_id: int, eos_id: int, device: torch.device, precision: Precision,
                         beam_size: int | None = None, n_best: int = 1, sampling: Sampling | None = None,
                         progress: bool = False, prefixes: list[list[int]] | None = None,
                         terms: list[list[list[int]]] | None = None) -> list[list[Hypothesis]]:
    """Each source's `n_best` best hypotheses of beam search, best first (beam 1: greedy), or with
    `sampling`, `n_best` samples drawn from one generator seeded with `sampling.seed`; decoded in
    length-sorted batches of `decode_cfg.batch_tokens` (counting each beam or sample), in input order.
    Each hypothesis begins with its source's `prefixes` ids (none where empty or None) and, in beam
    search, contains each of its source's `terms` (id lists; the caller checks they fit)."""
    alpha = decode_cfg.length_penalty
    beam_size = decode_cfg.beam_size if beam_size is None else beam_size
    capture = decode_cfg.cuda_graphs and device.type == "cuda"
    graphs = StepGraphs() if capture else None  # batches of one padded shape replay one capture
    generator = None if sampling is None else torch.Generator(device=device).manual_seed(sampling.seed)
    common = {"bos_id": bos_id, "eos_id": eos_id, "max_len_a": decode_cfg.max_len_a,
              "max_len_b": decode_cfg.max_len_b}

    def decode(src_ids: torch.Tensor, forced: torch.Tensor | None,
               batch_terms: torch.Tensor | None) -> list[list[Hypothesis]]:
        if sampling is not None:
            return sample_decode(model, src_ids, sampling=sampling, generator=generator, n_samples=n_best,
                                 alpha=alpha, prefixes=forced, **common)
        return beam_search(model, src_ids, beam_size=beam_size, alpha=alpha, n_best=n_best, prefixes=forced,
                           graphs=graphs, capture=capture, terms=batch_terms, **common)

    attention = pick_attention(decode_cfg.attention_backend, device, "decode")
    sources = [model_source(s, model.cfg.max_len, eos_id) for s in src_seqs]
    rows = n_best if sampling is not None else beam_size
    batches = sorted_batches([len(s) * rows for s in sources], decode_cfg.batch_tokens)
    if progress and sys.stderr.isatty():
        from tqdm import tqdm  # leave=False: no bar left beside the next log line

        batches = tqdm(batches, desc="translate", unit="batch", file=sys.stderr, leave=False)
    results: list = [None] * len(sources)
    was_training = model.training
    model.eval()
    try:
        for chunk in batches:
            src_ids = pad_sequences([sources[i] for i in chunk], model.pad_id).to(device)
            forced = None  # a batch without prefixes searches as before
            if prefixes is not None and any(prefixes[i] for i in chunk):
                forced = pad_sequences([prefixes[i] for i in chunk], model.pad_id).to(device)
            batch_terms = None  # a batch without terms searches as before
            if terms is not None and any(terms[i] for i in chunk):
                batch_terms = pad_terms([terms[i] for i in chunk], model.pad_id).to(device)
            with precision.autocast(), attention.enabled():
                for i, output in zip(chunk, decode(src_ids, forced, batch_terms)):
                    results[i] = output
    finally:
        model.train(was_training)
    return results


def pad_terms(terms: list[list[list[int]]], pad_id: int) -> torch.Tensor:
    """Each sentence's terms (id lists) as one tensor (B, N, T) long padded with `pad_id`, N and T
    rounded up (to 2 and 4) so that more batches share a captured step's shape."""
    n = round_up(max(max(len(sentence) for sentence in terms), 1), 2)
    t = round_up(max((len(term) for sentence in terms for term in sentence), default=1), 4)
    padded = torch.full((len(terms), n, t), pad_id, dtype=torch.long)
    for b, sentence in enumerate(terms):
        for i, term in enumerate(sentence):
            padded[b, i, :len(term)] = torch.tensor(term)
    return padded


@torch.no_grad()
def score_ids(model: Transformer, src_seqs: list[list[int]], tgt_seqs: list[list[int]], decode_cfg: DecodeConfig, *,
              bos_id: int, eos_id: int, device: torch.device, precision: Precision,
              progress: bool = False) -> list[list[float]]:
    """Each target's per-token log-probabilities given its source (teacher-forced, the target's
    tokens then EOS) under the distribution the search draws from (padding and BOS excluded), in length-sorted batches of `decode_cfg.batch_tokens`, in input order.
    Sources are cut as `model_source` cuts them; targets must fit (`token_room(max_len)`)."""
    attention = pick_attention(decode_cfg.attention_backend, device, "decode")
    results: list = [None] * len(src_seqs)
    for chunk, src_ids, tgt_in in teacher_forced_batches(model, src_seqs, tgt_seqs, decode_cfg.batch_tokens, bos_id,
                                                         eos_id, device, "score" if progress else None):
        tgt_out = pad_sequences([[*tgt_seqs[i], eos_id] for i in chunk], model.pad_id).to(device)  # (B, T)
        with precision.autocast(), attention.enabled():
            logits = model(src_ids, tgt_in, pack=False).float()  # (B·T, V)
        logits[:, [model.pad_id, bos_id]] = torch.finfo(logits.dtype).min  # as the search: never emitted
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, tgt_out.view(-1, 1))
        log_probs = log_probs.view(tgt_out.shape).cpu()  # (B, T)
        for row, i in enumerate(chunk):
            results[i] = log_probs[row, : len(tgt_seqs[i]) + 1].tolist()
    return results


@torch.no_grad()
def cross_attention_maps(model: Transformer, src_seqs: list[list[int]], tgt_seqs: list[list[int]], layer: int, *,
                         bos_id: int, eos_id: int, device: torch.device, batch_tokens: int = 4096
                         ) -> list[torch.Tensor]:
    """Each pair's head-averaged cross-attention of decoder `layer` while producing the target + EOS
    from the source + EOS (teacher-forced, fp32): (T + 1, S + 1) on the CPU, row t where the decoder
    looked to produce target token t. Both sides are cut as `model_source` cuts a source."""
    room = token_room(model.cfg.max_len)
    tgt_seqs = [ids[:room] for ids in tgt_seqs]
    results: list = [None] * len(src_seqs)
    for chunk, src_ids, tgt_in in teacher_forced_batches(model, src_seqs, tgt_seqs, batch_tokens, bos_id, eos_id,
                                                         device):
        weights = model.cross_attention(src_ids, tgt_in, layer).mean(dim=1).cpu()  # (B, H, T, S) -> (B, T, S)
        for row, i in enumerate(chunk):
            results[i] = weights[row, : len(tgt_seqs[i]) + 1, : min(len(src_seqs[i]), room) + 1]
    return results


def teacher_forced_batches(model: Transformer, src_seqs: list[list[int]], tgt_seqs: list[list[int]],
                           batch_tokens: int, bos_id: int, eos_id: int, device: torch.device,
                           progress: str | None = None) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    """The pairs in length-sorted batches of `batch_tokens`, the model in eval mode: each batch's
    indices, padded sources (cut as `model_source` cuts them, then EOS) and BOS + targets; with
    `progress`, a bar of that name at a terminal."""
    sources = [model_source(s, model.cfg.max_len, eos_id) for s in src_seqs]
    batches = sorted_batches([max(len(s), len(t) + 1) for s, t in zip(sources, tgt_seqs)], batch_tokens)
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        batches = tqdm(batches, desc=progress, unit="batch", file=sys.stderr, leave=False)
    was_training = model.training
    model.eval()
    try:
        for chunk in batches:
            src_ids = pad_sequences([sources[i] for i in chunk], model.pad_id).to(device)  # (B, S)
            tgt_in = pad_sequences([[bos_id, *tgt_seqs[i]] for i in chunk], model.pad_id).to(device)  # (B, T)
            yield chunk, src_ids, tgt_in
    finally:
        model.train(was_training)
