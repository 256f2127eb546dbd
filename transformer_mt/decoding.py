"""Greedy and beam search on top of `Transformer.encode` / `Transformer.decode` and its `KVCache`.

Both decode a batch of sentences at once. Generated length is capped per sentence at
`a·S + b` tokens (S = source tokens including EOS), EOS included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transformer_mt.model import Transformer


def max_target_lengths(src_mask: torch.Tensor, max_len_a: float, max_len_b: int, model_max_len: int) -> torch.Tensor:
    """Per-sentence cap on generated tokens (EOS included): a·S + b, within the model's positions.

    src_mask (B, S) bool -> (B,) long. The decoder input holds BOS plus all but the last
    generated token, so at most `model_max_len` tokens can be generated.
    """
    src_lengths = src_mask.sum(dim=1).float()  # (B,)
    limits = (max_len_a * src_lengths + max_len_b).floor().long()
    return limits.clamp(min=1, max=model_max_len)


def _forbid_special(logits: torch.Tensor, pad_id: int, bos_id: int) -> torch.Tensor:
    """Never generate padding or a second BOS. logits (N, V), modified in place."""
    logits[:, pad_id] = torch.finfo(logits.dtype).min
    logits[:, bos_id] = torch.finfo(logits.dtype).min
    return logits


@torch.inference_mode()
def greedy_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int,
                  max_len_a: float, max_len_b: int, use_cache: bool = True,
                  drop_finished: float | None = 0.25) -> list[list[int]]:
    """Pick the most probable token at each step for a batch of sources.

    src_ids (B, S) long, padded with `model.pad_id` -> B lists of generated ids, without BOS
    and EOS. Each sentence stops at its EOS or its length cap; the batch stops when all have.
    With the cache, finished sentences leave the batch (their cache rows, memory and mask) once
    they are at least `drop_finished` of the rows still decoded (None: never): a step's work
    grows with its rows, and dropping costs a copy of the cache. `use_cache=False` re-runs the
    decoder over the whole prefix each step with every row (the slow reference).
    """
    pad_id = model.pad_id
    src_mask = src_ids != pad_id  # (B, S) True = real token
    memory = model.encode(src_ids, src_mask)  # (B, S, D)
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len)  # (B,)
    B, max_steps = src_ids.shape[0], int(limits.max())
    # The decoder is fed BOS plus all but the last generated token: at most `max_steps` positions.
    cache = model.new_cache(max_steps) if use_cache else None
    tgt_ids = torch.full((B, max_steps + 1), pad_id, dtype=torch.long, device=src_ids.device)  # BOS + generated
    tgt_ids[:, 0] = bos_id
    live, rows = tgt_ids, None  # the rows still decoded, and their rows in tgt_ids once some are dropped
    finished = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
    first_cap, done = int(limits.min()), 0  # no row reaches its cap before step first_cap - 1
    for step in range(max_steps):
        new_ids = live[:, step:step + 1] if use_cache else live[:, :step + 1]  # (N, 1) or (N, step + 1)
        next_ids = model.decode_best(new_ids, memory, src_mask, cache, (pad_id, bos_id))  # (N,)
        live[:, step + 1] = next_ids.masked_fill_(finished, pad_id) if done else next_ids
        ended = next_ids == eos_id
        if step + 1 >= first_cap:
            ended |= step + 1 >= limits
        finished |= ended
        done = int(finished.sum())
        if done == finished.shape[0]:
            break
        if cache is not None and drop_finished is not None and done and done >= drop_finished * finished.shape[0]:
            keep = (~finished).nonzero().squeeze(1)  # (N',)
            if rows is None:
                rows = torch.arange(B, device=src_ids.device)
            else:
                tgt_ids.index_copy_(0, rows, live)  # the dropped rows' last tokens
            cache.reorder(keep, cross=True)
            live, rows, memory, src_mask = live[keep], rows[keep], memory[keep], src_mask[keep]
            limits, finished = limits[keep], finished[keep]
    if rows is not None:
        tgt_ids.index_copy_(0, rows, live)
    return [strip_generated(row, eos_id, pad_id) for row in tgt_ids[:, 1:].tolist()]


def strip_generated(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Generated ids up to (not including) the first EOS or padding."""
    for i, token in enumerate(ids):
        if token in (eos_id, pad_id):
            return ids[:i]
    return ids


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6)^α (Wu et al. 2016, §7); α = 0 turns it off."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: token ids (no BOS/EOS), summed log-probability, length-normalised score."""

    ids: list[int]
    log_prob: float
    score: float


@dataclass
class BeamState:
    """A beam search over B sentences × K beams (row b·K + k is beam k of sentence b) in tensors of
    fixed size: the live beams, each sentence's M best finished hypotheses, and which sentences
    are done. `advance_beams` updates it in place, with no Python loop over sentences or
    hypotheses and nothing read back to the host, so a step can be replayed from a CUDA graph
    (`graph_decoding.py`); `select` keeps some sentences, for the eager search."""

    tokens: torch.Tensor  # (B·K, C + 1) long: BOS, then each live beam's tokens; pad beyond
    scores: torch.Tensor  # (B·K,) fp32: each live beam's summed log-probability
    position: torch.Tensor  # (1,) long: tokens generated so far, i.e. the step
    limits: torch.Tensor  # (B,) long: each sentence's cap on generated tokens
    done: torch.Tensor  # (B,) bool: the sentence sets nothing more aside
    count: torch.Tensor  # (B,) long: hypotheses set aside so far (may pass K)
    best_tokens: torch.Tensor  # (B, M, C) long: the M best finished, generated ids with their EOS; pad beyond
    best_log_probs: torch.Tensor  # (B, M) fp32
    best_scores: torch.Tensor  # (B, M) fp64: log-prob / length penalty, best first; -inf = empty slot
    penalties: torch.Tensor  # (C + 1,) fp64: length_penalty(n, α) for n = 0..C generated tokens

    def select(self, sentences: torch.Tensor) -> BeamState:
        """The state of the sentences `sentences` (B',) long alone, in that order."""
        K = self.tokens.shape[0] // self.done.shape[0]
        rows = (sentences[:, None] * K + torch.arange(K, device=sentences.device)).flatten()  # (B'·K,)
        return BeamState(self.tokens[rows], self.scores[rows], self.position, self.limits[sentences],
                         self.done[sentences], self.count[sentences], self.best_tokens[sentences],
                         self.best_log_probs[sentences], self.best_scores[sentences], self.penalties)


def new_beam_state(limits: torch.Tensor, beam_size: int, n_best: int, capacity: int, *, bos_id: int, pad_id: int,
                   alpha: float) -> BeamState:
    """The state before the first step: one live beam per sentence (score 0), the other K - 1 at
    -inf so that the K beams do not all pick the same first token. limits (B,) long."""
    B, K, device = limits.shape[0], beam_size, limits.device
    # Scores in fp64, as Python's floats: a hypothesis's score is then the very number the plain
    # search computed. MPS has no fp64.
    fp64 = torch.float32 if device.type == "mps" else torch.float64
    tokens = torch.full((B * K, capacity + 1), pad_id, dtype=torch.long, device=device)
    tokens[:, 0] = bos_id
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    penalties = torch.tensor([length_penalty(n, alpha) for n in range(capacity + 1)], dtype=fp64, device=device)
    return BeamState(tokens, scores.flatten(), torch.zeros(1, dtype=torch.long, device=device), limits,
                     torch.zeros(B, dtype=torch.bool, device=device), torch.zeros(B, dtype=torch.long, device=device),
                     torch.full((B, n_best, capacity), pad_id, dtype=torch.long, device=device),
                     torch.zeros(B, n_best, device=device),
                     torch.full((B, n_best), float("-inf"), dtype=fp64, device=device), penalties)


def advance_beams(s: BeamState, log_probs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """One step of beam search on the live beams' next-token log-probs (B·K, V) fp32.

    Each sentence's 2K best continuations are ranked by summed log-prob; those among the top K
    that end in EOS (all top K at the length cap) are set aside, scored log-prob / length
    penalty (tokens incl. EOS, α), into the M best finished; the K best that do not end become
    the live beams. A sentence is done once it has K finished hypotheses, or M that no live beam
    can still beat (log-probs only fall, so a live beam's best reachable score is its log-prob
    over the penalty at its length cap), or reaches its cap; a done sentence sets nothing more
    aside, whether its rows are dropped or computed and ignored. Returns the rows (B·K,) long the
    new beams continue, for the caller to reorder its key/value cache with: beams move only
    within their sentence.
    """
    BK, V = log_probs.shape
    B, M, C = s.best_tokens.shape
    K = BK // B
    # A sentence's 2K best continuations are among each of its beams' 2K best tokens.
    W = min(2 * K, V)
    row_scores, row_tokens = row_top(log_probs, W)  # (B·K, W) each
    candidates = (s.scores[:, None] + row_scores).view(B, K * W)
    cand_scores, cand_flat = candidates.topk(2 * K, dim=1)  # (B, 2K), best first
    cand_beam, cand_token = cand_flat // W, row_tokens.view(B, K * W).gather(1, cand_flat)  # (B, 2K) each
    first_row = torch.arange(0, BK, K, device=log_probs.device)[:, None]  # (B, 1)

    # Set aside the top K candidates that end, into the M best finished.
    at_cap = s.position + 1 >= s.limits  # (B,)
    top_scores = cand_scores[:, :K]
    ends = ((cand_token[:, :K] == eos_id) | at_cap[:, None]) & (top_scores > float("-inf")) & ~s.done[:, None]
    length_penalty_now = s.penalties.index_select(0, s.position + 1)  # (1,) every candidate has position + 1 tokens
    new_scores = (top_scores.to(s.best_scores.dtype) / length_penalty_now).masked_fill(~ends, float("-inf"))
    new_tokens = s.tokens.index_select(0, (first_row + cand_beam[:, :K]).flatten())[:, 1:].view(B, K, C)
    new_tokens.index_copy_(2, s.position, cand_token[:, :K, None])  # the EOS, or the last token at the cap
    pool_scores = torch.cat([s.best_scores, new_scores], dim=1)  # (B, M + K)
    keep = stable_descending_order(pool_scores)[:, :M]  # (B, M)
    s.best_scores.copy_(pool_scores.gather(1, keep))
    s.best_log_probs.copy_(torch.cat([s.best_log_probs, top_scores], dim=1).gather(1, keep))
    s.best_tokens.copy_(torch.cat([s.best_tokens, new_tokens], dim=1).gather(1, keep[:, :, None].expand(B, M, C)))
    s.count += ends.sum(dim=1)

    # The K best candidates that did not end become the live beams.
    live_scores, pick = cand_scores.masked_fill(cand_token == eos_id, float("-inf")).topk(K, dim=1)  # (B, K)
    rows = (first_row + cand_beam.gather(1, pick)).flatten()  # (B·K,)
    beaten = live_scores[:, 0].to(s.best_scores.dtype) / s.penalties.index_select(0, s.limits) <= s.best_scores[:, -1]
    s.done |= at_cap | (s.count >= K) | ((s.count >= M) & beaten)
    s.tokens.copy_(s.tokens.index_select(0, rows))
    s.tokens.index_copy_(1, s.position + 1, cand_token.gather(1, pick).view(BK, 1))
    s.scores.copy_(live_scores.flatten())
    s.position += 1
    return rows


def row_top(values: torch.Tensor, k: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """values (N, V) -> each row's k largest values and their indices (N, k), best first: the
    values of `topk`; among equal values the indices may differ. On a CPU with a large V, the
    k largest lie in the k blocks of `block` values with the largest maxima: `amax` over blocks
    vectorises, then `topk` searches only those (128 × 8,000 log-probs, k = 8: µs in docs/benchmarks.md)."""
    N, V = values.shape
    n_blocks = V // block
    if values.device.type != "cpu" or n_blocks < 4 * k:
        return values.topk(k, dim=1)
    head = n_blocks * block
    blocks = values[:, :head].view(N, n_blocks, block)
    chosen = blocks.amax(dim=2).topk(k, dim=1).indices  # (N, k)
    pool = blocks[torch.arange(N, device=values.device)[:, None], chosen].view(N, k * block)  # (N, k·block)
    where = (chosen[:, :, None] * block + torch.arange(block, device=values.device)).view(N, k * block)
    if head < V:  # the last V % block values: always searched
        pool = torch.cat([pool, values[:, head:]], dim=1)
        where = torch.cat([where, torch.arange(head, V, device=values.device).expand(N, V - head)], dim=1)
    top, at = pool.topk(k, dim=1)
    return top, where.gather(1, at)


def stable_descending_order(scores: torch.Tensor) -> torch.Tensor:
    """The indices that sort each row of scores (B, P) best first, the earlier of equal scores first
    (as Python's `sorted` keeps them) -> (B, P) long. Counted by comparing all pairs, for the few
    hypotheses of a beam: no `torch.sort`, whose stable CUDA kernels may not be captured in a graph."""
    P = scores.shape[1]
    earlier = torch.ones(P, P, dtype=torch.bool, device=scores.device).tril(-1)  # [i, j]: j comes before i
    ahead = (scores[:, None, :] > scores[:, :, None]) | ((scores[:, None, :] == scores[:, :, None]) & earlier)
    rank = ahead.sum(dim=2)  # (B, P): how many go before each; a permutation of 0..P-1
    return torch.empty_like(rank).scatter_(1, rank, torch.arange(P, device=scores.device).expand_as(rank))


def finished_hypotheses(s: BeamState, eos_id: int, pad_id: int) -> list[list[Hypothesis]]:
    """Each sentence's finished hypotheses, best first (one copy to the host)."""
    tokens, log_probs, scores = s.best_tokens.tolist(), s.best_log_probs.tolist(), s.best_scores.tolist()
    return [[Hypothesis(strip_generated(ids, eos_id, pad_id), log_prob, score)
             for ids, log_prob, score in zip(*sentence) if score > float("-inf")]
            for sentence in zip(tokens, log_probs, scores)]


@torch.inference_mode()
def beam_search(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, beam_size: int,
                max_len_a: float, max_len_b: int, alpha: float = 0.6, n_best: int = 1) -> list[list[Hypothesis]]:
    """Beam search with K = `beam_size` beams per sentence, batched over sentences (`advance_beams`
    says how candidates are ranked, set aside and when a sentence is done).

    src_ids (B, S) long -> for each sentence, its `n_best` hypotheses, best first. A step where
    sentences are done takes their rows out of the batch and the cache: the work of a step
    grows with its rows, and a trained model's sentences end at different steps (on the demo
    model, keeping them all in made beam 5 take 1.55x the CPU time). `graph_decoding.
    static_beam_search` keeps every row instead, for a CUDA graph. Beam size 1 gives exactly
    greedy decoding's output.
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be between 1 and beam_size={beam_size}, got {n_best}")
    K, pad_id = beam_size, model.pad_id
    src_mask = src_ids != pad_id  # (B, S)
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len)  # (B,)
    max_steps = int(limits.max())
    memory = model.encode(src_ids, src_mask)  # (B, S, D)
    # A sentence's K beams share its memory: one row for all where the model's steps take that.
    shared = getattr(model, "shares_source_rows", lambda device_type: False)(src_ids.device.type)
    if not shared:
        memory, src_mask = memory.repeat_interleave(K, dim=0), src_mask.repeat_interleave(K, dim=0)  # (B·K, S, D)
    cache = model.new_cache(max_steps)
    s = new_beam_state(limits, K, n_best, max_steps, bos_id=bos_id, pad_id=pad_id, alpha=alpha)
    sentences = torch.arange(src_ids.shape[0], device=src_ids.device)  # (N,) each row block's sentence
    results: list[list[Hypothesis]] = [[] for _ in range(src_ids.shape[0])]
    for step in range(max_steps):
        logits = model.decode(s.tokens[:, step:step + 1], memory, src_mask, cache)[:, -1, :].float()  # (N·K, V)
        rows = advance_beams(s, torch.log_softmax(_forbid_special(logits, pad_id, bos_id), dim=-1), eos_id)
        if not bool(s.done.any()):
            # A sentence's beams share its memory and cross-attention K/V: only self-attention's move.
            cache.reorder(rows, cross=False)
            continue
        done = s.done.nonzero().squeeze(1)  # (n,) the one copy to the host of a step where some are done
        for sentence, hyps in zip(sentences[done].tolist(), finished_hypotheses(s.select(done), eos_id, pad_id)):
            results[sentence] = hyps
        keep = (~s.done).nonzero().squeeze(1)  # (N',)
        if keep.numel() == 0:
            break
        rows = rows.view(-1, K)[keep].flatten()  # (N'·K,)
        source_rows = keep if shared else rows
        cache.reorder(rows, cross=not shared)
        if shared:
            cache.select_cross(keep)
        memory, src_mask = memory.index_select(0, source_rows), src_mask.index_select(0, source_rows)
        s, sentences = s.select(keep), sentences[keep]
    return results


@dataclass(frozen=True)
class Sampling:
    """Draw each next token instead of taking the best: from the model's distribution at
    `temperature`, cut to the `top_k` most probable tokens (0: no cut) and then to the smallest
    set whose probability reaches `top_p` (nucleus sampling, Holtzman et al. 2020; 1: no cut).
    Draws come from a generator seeded with `seed`: the same sources, settings and seed give the
    same samples on the same device."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature > 0, top_k >= 0 and 0 < top_p <= 1, got {self}")

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (N, V) float -> the distribution to draw from (N, V), zero outside the cuts."""
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth_best = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (N, 1)
            logits = logits.masked_fill(logits < kth_best, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (N, V)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # (N, V) each
            # Drop a token once the more probable ones before it already reach top_p; the most
            # probable token always stays.
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # (N, V)
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        return probs


@torch.inference_mode()
def sample_decode(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, max_len_a: float,
                  max_len_b: int, sampling: Sampling, generator: torch.Generator, n_samples: int = 1,
                  alpha: float = 0.6) -> list[list[Hypothesis]]:
    """Draw `n_samples` translations per source, one token at a time (`sampling` says how).

    src_ids (B, S) long -> for each sentence, its samples in the order drawn. A sample's
    `log_prob` is its log-probability under the model itself (temperature 1, no cuts), EOS
    included, and `score` that over the GNMT length penalty, as beam search scores its
    hypotheses: so samples and beam outputs can be ranked together.
    """
    pad_id = model.pad_id
    src_ids = src_ids.repeat_interleave(n_samples, dim=0)  # (B·n, S): the samples of a sentence are neighbours
    src_mask = src_ids != pad_id  # (B·n, S)
    memory = model.encode(src_ids, src_mask)  # (B·n, S, D)
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len)  # (B·n,)
    N, max_steps = src_ids.shape[0], int(limits.max())
    cache = model.new_cache(max_steps)
    tgt_ids = torch.full((N, max_steps + 1), pad_id, dtype=torch.long, device=src_ids.device)  # BOS + drawn
    tgt_ids[:, 0] = bos_id
    log_probs_sum = torch.zeros(N, device=src_ids.device)  # (N,)
    lengths = torch.zeros(N, dtype=torch.long, device=src_ids.device)  # drawn tokens, EOS included
    finished = torch.zeros(N, dtype=torch.bool, device=src_ids.device)
    for step in range(max_steps):
        logits = _forbid_special(model.decode(tgt_ids[:, step:step + 1], memory, src_mask, cache)[:, -1, :].float(),
                                 pad_id, bos_id)  # (N, V)
        next_ids = torch.multinomial(sampling.probabilities(logits), 1, generator=generator).squeeze(1)  # (N,)
        token_log_probs = torch.log_softmax(logits, dim=-1).gather(1, next_ids[:, None]).squeeze(1)  # (N,)
        log_probs_sum += token_log_probs.masked_fill(finished, 0.0)
        lengths += (~finished).long()
        tgt_ids[:, step + 1] = next_ids.masked_fill(finished, pad_id)
        finished |= (next_ids == eos_id) | (step + 1 >= limits)
        if bool(finished.all()):
            break
    samples = [Hypothesis(strip_generated(ids, eos_id, pad_id), log_prob, log_prob / length_penalty(length, alpha))
               for ids, log_prob, length in zip(tgt_ids[:, 1:].tolist(), log_probs_sum.tolist(), lengths.tolist())]
    return [samples[i:i + n_samples] for i in range(0, N, n_samples)]
