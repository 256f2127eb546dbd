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
                  max_len_a: float, max_len_b: int, use_cache: bool = True) -> list[list[int]]:
    """Pick the most probable token at each step for a batch of sources.

    src_ids (B, S) long, padded with `model.pad_id` -> B lists of generated ids, without BOS
    and EOS. Each sentence stops at its EOS or its length cap; the batch stops when all have.
    `use_cache=False` re-runs the decoder over the whole prefix each step (the slow reference).
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
    finished = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
    for step in range(max_steps):
        new_ids = tgt_ids[:, step:step + 1] if use_cache else tgt_ids[:, :step + 1]  # (B, 1) or (B, step + 1)
        logits = model.decode(new_ids, memory, src_mask, cache)[:, -1, :]  # (B, V) last position
        next_ids = best_tokens(_forbid_special(logits, pad_id, bos_id))  # (B,)
        tgt_ids[:, step + 1] = next_ids.masked_fill(finished, pad_id)
        finished |= (next_ids == eos_id) | (step + 1 >= limits)
        if bool(finished.all()):
            break
    return [strip_generated(row, eos_id, pad_id) for row in tgt_ids[:, 1:].tolist()]


def best_tokens(logits: torch.Tensor, block: int = 64) -> torch.Tensor:
    """logits (N, V) -> (N,) long: each row's argmax, the first index among ties.

    `max(dim).indices` (torch's CPU `argmax` is slower still) does not vectorise on a CPU, `amax`
    does: with many rows on a CPU, take the maxima of blocks of `block` logits, then search only
    each row's first best block (32 × 8,000 logits: 67 µs against 231 µs, docs/benchmarks.md).
    """
    N, V = logits.shape
    head = V - V % block
    if N < 8 or head == 0 or logits.device.type != "cpu":
        return logits.max(dim=-1).indices
    blocks = logits[:, :head].reshape(N, head // block, block)
    best = blocks.amax(dim=-1).max(dim=-1)  # the first block holding each row's maximum
    within = blocks[torch.arange(N, device=logits.device), best.indices].max(dim=-1).indices  # (N,)
    ids = best.indices * block + within
    if head < V:  # the last V % block logits; on a tie the earlier index stays
        tail = logits[:, head:].max(dim=-1)
        ids = torch.where(tail.values > best.values, tail.indices + head, ids)
    return ids


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


@torch.inference_mode()
def beam_search(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, beam_size: int,
                max_len_a: float, max_len_b: int, alpha: float = 0.6, n_best: int = 1) -> list[list[Hypothesis]]:
    """Beam search with K = `beam_size` beams per sentence, batched over sentences.

    src_ids (B, S) long -> for each sentence, its `n_best` hypotheses, best first. Beams are
    ranked by summed log-probability; a beam that emits EOS among the top K candidates is set
    aside, scored log_prob / length_penalty(tokens incl. EOS, α). A sentence is done once it
    has K finished hypotheses, or `n_best` that no live beam can still beat (log-probs only
    fall, so a live beam's best reachable score is its log-prob over the penalty at its length
    cap), or reaches its length cap. Beam size 1 gives exactly greedy decoding's output.
    Finished sentences leave the batch, and their rows leave the cache.
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be between 1 and beam_size={beam_size}, got {n_best}")
    K, pad_id, device = beam_size, model.pad_id, src_ids.device
    B = src_ids.shape[0]
    src_mask = src_ids != pad_id  # (B, S)
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len).tolist()
    memory = model.encode(src_ids, src_mask).repeat_interleave(K, dim=0)  # (B·K, S, D)
    src_mask = src_mask.repeat_interleave(K, dim=0)  # (B·K, S)
    cache = model.new_cache(max(limits))

    active = list(range(B))  # sentences still searching, in the order of the rows below
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)  # (N·K, t+1) with BOS
    # Only the first beam is live at the start, so the K beams do not all pick the same token.
    scores = torch.tensor([0.0] + [float("-inf")] * (K - 1), device=device).repeat(B)  # (N·K,)
    step = 0
    while active:
        N = len(active)
        logits = model.decode(tokens[:, -1:], memory, src_mask, cache)[:, -1, :].float()  # (N·K, V)
        log_probs = torch.log_softmax(_forbid_special(logits, pad_id, bos_id), dim=-1)
        V = log_probs.shape[-1]
        candidates = (scores[:, None] + log_probs).view(N, K * V)  # (N, K·V)
        cand_scores, cand_flat = candidates.topk(2 * K, dim=1)  # (N, 2K), best first
        cand_beam, cand_token = cand_flat // V, cand_flat % V  # (N, 2K) each

        # Set aside hypotheses ending in EOS among the top K candidates (all top K at the cap).
        at_cap = torch.tensor([step + 1 >= limits[b] for b in active], device=device)  # (N,)
        ends = ((cand_token[:, :K] == eos_id) | at_cap[:, None]).nonzero().tolist()
        if ends:  # one copy to the host each, not one per finished hypothesis
            cand_lists = cand_scores.tolist(), cand_beam.tolist(), cand_token.tolist()
            prefixes = tokens[:, 1:].tolist()  # (N·K, t) without BOS
            for row, rank in ends:
                _set_aside(finished[active[row]], prefixes[row * K + cand_lists[1][row][rank]],
                           cand_lists[2][row][rank], cand_lists[0][row][rank], eos_id, alpha)

        # The K best candidates that did not end become the live beams.
        live_scores = cand_scores.masked_fill(cand_token == eos_id, float("-inf"))  # (N, 2K)
        live_scores, pick = live_scores.topk(K, dim=1)  # (N, K) indices into the 2K candidates
        beam_rows = torch.arange(N, device=device)[:, None] * K + cand_beam.gather(1, pick)  # (N, K)
        next_tokens = cand_token.gather(1, pick)  # (N, K)

        best_live = live_scores[:, 0].tolist()  # (N,) sorted, so column 0 is each row's best
        still = [row for row, b in enumerate(active)
                 if step + 1 < limits[b] and not _sentence_done(finished[b], best_live[row], limits[b], K, alpha, n_best)]
        if not still:
            break
        keep = torch.tensor(still, device=device)
        rows = beam_rows[keep].flatten()  # (N'·K,)
        tokens = torch.cat([tokens.index_select(0, rows), next_tokens[keep].reshape(-1, 1)], dim=1)
        scores = live_scores[keep].flatten()
        # Beams move only within their sentence, and a sentence's beams share the same memory
        # and cross-attention K/V: those need gathering only when sentences leave the batch.
        pruned = len(still) < N
        cache.reorder(rows, cross=pruned)
        if pruned:
            memory, src_mask = memory.index_select(0, rows), src_mask.index_select(0, rows)
        active = [active[row] for row in still]
        step += 1
    return [sorted(hyps, key=lambda h: h.score, reverse=True)[:n_best] for hyps in finished]


def _set_aside(hyps: list[Hypothesis], prefix: list[int], token: int, log_prob: float, eos_id: int,
               alpha: float) -> None:
    """Record a finished hypothesis: `prefix` (no BOS) plus `token`, which is EOS unless at the cap."""
    if log_prob == float("-inf"):
        return  # an unused beam (only one beam is live on the first step)
    ids = prefix if token == eos_id else prefix + [token]
    length = len(ids) + (token == eos_id)  # generated tokens, EOS included
    hyps.append(Hypothesis(ids, log_prob, log_prob / length_penalty(length, alpha)))


def _sentence_done(hyps: list[Hypothesis], best_live_log_prob: float, limit: int, beam_size: int, alpha: float,
                   n_best: int) -> bool:
    """True when the sentence has `beam_size` finished hypotheses (fairseq's rule, which makes
    beam 1 equal greedy), or `n_best` that no live beam can still beat."""
    if len(hyps) >= beam_size:
        return True
    if len(hyps) < n_best:
        return False
    nth_best = sorted((h.score for h in hyps), reverse=True)[n_best - 1]
    # Log-probs only decrease and the penalty grows with length, so the best a live beam can
    # reach is its current log-prob divided by the penalty at the longest allowed length.
    return best_live_log_prob / length_penalty(limit, alpha) <= nth_best


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
