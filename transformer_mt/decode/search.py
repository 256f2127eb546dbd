"""The search algorithms, one step on tensors with no host sync (a CUDA graph can replay it): beam
search (greedy is one beam) and sampling. Sentence b's K rows are b·K .. b·K + K - 1; C caps the
generated tokens; `tokens` holds BOS, then each row's generated ids, pad beyond. A state with `forced`
(B, C) long generates those tokens first (a target prefix; pad beyond each sentence's).
`ConstrainedBeamState` is beam search whose hypotheses contain given terms."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from transformer_mt.decode.hypotheses import Hypothesis, Sampling, length_penalty, strip_generated


class Candidates(NamedTuple):
    """A beam step's 2K best continuations of each sentence, best first: (B, 2K) each."""

    scores: torch.Tensor  # fp32: the summed log-probability with the token
    rows: torch.Tensor  # long: the live beam's row (b·K + k) each continues
    tokens: torch.Tensor  # long: the token it adds


@dataclass
class BeamState:
    """A beam search over B sentences × K beams in tensors of fixed size: the live beams, each
    sentence's M best finished hypotheses, and which sentences are done."""

    tokens: torch.Tensor  # (B·K, C + 1) long
    scores: torch.Tensor  # (B·K,) fp32: each live beam's summed log-probability
    position: torch.Tensor  # (1,) long: tokens generated so far (shared with the KV cache)
    limits: torch.Tensor  # (B,) long: each sentence's cap on generated tokens
    done: torch.Tensor  # (B,) bool: the sentence sets nothing more aside
    count: torch.Tensor  # (B,) long: hypotheses set aside so far (may pass K)
    best_tokens: torch.Tensor  # (B, M, C) long: the M best finished, with their EOS; pad beyond
    best_log_probs: torch.Tensor  # (B, M) fp32
    best_scores: torch.Tensor  # (B, M) fp64: log-prob / length penalty, best first; -inf = empty slot
    penalties: torch.Tensor  # (C + 1,) fp64: length_penalty(n, α) for n = 0..C generated tokens
    eos_id: int
    pad_id: int
    forced: torch.Tensor | None = None  # (B, C) long: each sentence's first tokens, pad beyond; None: none

    @classmethod
    def start(cls, limits: torch.Tensor, capacity: int, position: torch.Tensor, forced: torch.Tensor | None = None,
              *, beam_size: int, n_best: int, bos_id: int, eos_id: int, pad_id: int, alpha: float) -> BeamState:
        """One live beam per sentence (score 0), the other K - 1 at -inf (else all K would pick the
        same first token; a forced token keeps them there). limits (B,) long."""
        if not 1 <= n_best <= beam_size:
            raise ValueError(f"n_best must be between 1 and beam_size={beam_size}, got {n_best}")
        B, K, device = limits.shape[0], beam_size, limits.device
        # Scores in fp64, as Python's floats (MPS has no fp64).
        fp64 = torch.float32 if device.type == "mps" else torch.float64
        tokens = torch.full((B * K, capacity + 1), pad_id, dtype=torch.long, device=device)
        tokens[:, 0] = bos_id
        scores = torch.full((B, K), float("-inf"), device=device)
        scores[:, 0] = 0.0
        penalties = torch.tensor([length_penalty(n, alpha) for n in range(capacity + 1)], dtype=fp64, device=device)
        return cls(tokens, scores.flatten(), position, limits, torch.zeros(B, dtype=torch.bool, device=device),
                   torch.zeros(B, dtype=torch.long, device=device),
                   torch.full((B, n_best, capacity), pad_id, dtype=torch.long, device=device),
                   torch.zeros(B, n_best, device=device),
                   torch.full((B, n_best), float("-inf"), dtype=fp64, device=device), penalties, eos_id, pad_id,
                   forced)

    @property
    def rows_per_sentence(self) -> int:
        return self.tokens.shape[0] // self.done.shape[0]

    def advance(self, logits: torch.Tensor) -> torch.Tensor:
        """One step on the live beams' logits (B·K, V) fp32 -> the rows (B·K,) the new beams continue.
        Of each sentence's 2K best continuations by log-prob, the top K that end in EOS (all at the
        cap) go, scored log-prob / length penalty, into the M best finished; the K best that do not
        end live on. A sentence is done with K finished, or M that no live beam can beat (at best its
        log-prob over the penalty at its cap), or at its cap. A forced token is the only continuation."""
        log_probs = torch.log_softmax(logits, dim=-1)
        if self.forced is not None:
            log_probs = log_probs.masked_fill(~allowed_tokens(log_probs, self.forced, self.position, self.pad_id),
                                              float("-inf"))
        candidates = self.best_candidates(log_probs)
        if self.forced is not None:
            candidates = self.after_prefix(candidates)
        at_cap = self.position + 1 >= self.limits  # (B,)
        self.set_aside_finished(candidates, at_cap)
        return self.continue_live(candidates, at_cap)

    def best_candidates(self, log_probs: torch.Tensor) -> Candidates:
        """Each sentence's 2K best continuations of its live beams by summed log-prob, from log_probs (B·K, V)."""
        BK, V = log_probs.shape
        B = self.best_tokens.shape[0]
        K = BK // B
        W = min(2 * K, V)  # a sentence's 2K best continuations are among each beam's 2K best tokens
        row_scores, row_tokens = log_probs.topk(W, dim=1)  # (B·K, W) each
        candidates = (self.scores[:, None] + row_scores).view(B, K * W)
        cand_scores, cand_flat = candidates.topk(2 * K, dim=1)  # (B, 2K), best first
        first_row = torch.arange(0, BK, K, device=log_probs.device)[:, None]  # (B, 1)
        return Candidates(cand_scores, first_row + cand_flat // W, row_tokens.view(B, K * W).gather(1, cand_flat))

    def after_prefix(self, candidates: Candidates) -> Candidates:
        """At the first free step after a sentence's prefix, when all its candidates continue one beam,
        only the best may end (as in CTranslate2, lest the prefix alone win): the others of the top K
        that end are dropped, and the first non-ending candidate after them stays only to replace the
        best if it ends. Dropped candidates score -inf: dead beams."""
        K = self.rows_per_sentence
        prefix_lengths = (self.forced != self.pad_id).sum(dim=1)  # (B,)
        free_now = (prefix_lengths > 0) & (prefix_lengths == self.position)  # (B,)
        ends = candidates.tokens == self.eos_id  # (B, 2K)
        later = ~ends[:, K:]
        replacement = later & (later.cumsum(dim=1) == 1) & ends[:, :1]  # (B, K): the first that goes on, if needed
        drop = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, 1:K], ~replacement], dim=1) & free_now[:, None]
        return candidates._replace(scores=candidates.scores.masked_fill(drop, float("-inf")))

    def set_aside_finished(self, candidates: Candidates, at_cap: torch.Tensor) -> None:
        """Put the top K candidates that end (EOS, or any at the cap: at_cap (B,) bool) into each
        sentence's M best finished, scored log-prob / length penalty; count them."""
        B, M, C = self.best_tokens.shape
        K = self.rows_per_sentence
        top_scores, top_tokens = candidates.scores[:, :K], candidates.tokens[:, :K]  # (B, K) each
        ends = (((top_tokens == self.eos_id) | at_cap[:, None]) & (top_scores > float("-inf")) & ~self.done[:, None])
        penalty_now = self.penalties.index_select(0, self.position + 1)  # (1,): every candidate has position + 1 tokens
        new_scores = (top_scores.to(self.best_scores.dtype) / penalty_now).masked_fill(~ends, float("-inf"))
        new_tokens = self.tokens.index_select(0, candidates.rows[:, :K].flatten())[:, 1:].view(B, K, C)
        new_tokens.index_copy_(2, self.position, top_tokens[:, :, None])  # the EOS, or the last token at the cap
        pool_scores = torch.cat([self.best_scores, new_scores], dim=1)  # (B, M + K)
        keep = stable_descending_order(pool_scores)[:, :M]  # (B, M)
        self.best_scores.copy_(pool_scores.gather(1, keep))
        self.best_log_probs.copy_(torch.cat([self.best_log_probs, top_scores], dim=1).gather(1, keep))
        self.best_tokens.copy_(torch.cat([self.best_tokens, new_tokens], dim=1).gather(
            1, keep[:, :, None].expand(B, M, C)))
        self.count += ends.sum(dim=1)

    def continue_live(self, candidates: Candidates, at_cap: torch.Tensor) -> torch.Tensor:
        """Make the K best candidates that do not end the live beams, mark the sentences done, and
        return the rows (B·K,) the new beams continue. at_cap (B,) bool."""
        K = self.rows_per_sentence
        live_scores, pick = candidates.scores.masked_fill(candidates.tokens == self.eos_id, float("-inf")).topk(K, dim=1)
        rows = candidates.rows.gather(1, pick).flatten()  # (B·K,)
        beaten = (live_scores[:, 0].to(self.best_scores.dtype) / self.penalties.index_select(0, self.limits)
                  <= self.best_scores[:, -1])
        self.done |= at_cap | (self.count >= K) | ((self.count >= self.best_scores.shape[1]) & beaten)
        self.tokens.copy_(self.tokens.index_select(0, rows))
        self.tokens.index_copy_(1, self.position + 1, candidates.tokens.gather(1, pick).view(-1, 1))
        self.scores.copy_(live_scores.flatten())
        self.position += 1
        return rows

    def select(self, sentences: torch.Tensor) -> BeamState:
        """The state of the sentences `sentences` (B',) long alone, in that order."""
        K = self.rows_per_sentence
        rows = (sentences[:, None] * K + torch.arange(K, device=sentences.device)).flatten()  # (B'·K,)
        return BeamState(self.tokens[rows], self.scores[rows], self.position, self.limits[sentences],
                         self.done[sentences], self.count[sentences], self.best_tokens[sentences],
                         self.best_log_probs[sentences], self.best_scores[sentences], self.penalties, self.eos_id,
                         self.pad_id, None if self.forced is None else self.forced[sentences])

    def results(self) -> list[list[Hypothesis]]:
        """Each sentence's finished hypotheses, best first (one copy to the host)."""
        tokens, log_probs, scores = self.best_tokens.tolist(), self.best_log_probs.tolist(), self.best_scores.tolist()
        return [[Hypothesis(strip_generated(ids, self.eos_id, self.pad_id), log_prob, score)
                 for ids, log_prob, score in zip(*sentence) if score > float("-inf")]
                for sentence in zip(tokens, log_probs, scores)]


@dataclass
class ConstrainedBeamState(BeamState):
    """Beam search whose finished hypotheses contain every term of their sentence (hard lexical
    constraints), by dynamic beam allocation (Post & Vilar 2018) in fixed shapes (Hu et al. 2019). A
    beam's bank is the number of term tokens it has met (`bank`). Each step's candidates are each beam's
    2K best tokens and the next token of each of its terms not yet met; the live beams are taken from
    the banks in turn, highest first (each bank's best, then each bank's second, ...), so the beam that
    has met the most always goes on and meets one token more per step. A beam may end (EOS, or any
    candidate at the cap) only once it has met every term."""

    terms: torch.Tensor | None = None  # (B, N, T) long: each sentence's terms' ids, pad beyond (a row of pad: none)
    term_lengths: torch.Tensor | None = None  # (B, N) long
    matched: torch.Tensor | None = None  # (B·K, N) long: tokens of each term the beam's last tokens spell; its
    # length once the term occurred

    @classmethod
    def start(cls, limits: torch.Tensor, capacity: int, position: torch.Tensor, forced: torch.Tensor | None = None,
              *, terms: torch.Tensor, beam_size: int, **settings) -> ConstrainedBeamState:
        """`BeamState.start` with each sentence's terms (B', N, T) long, pad beyond (B' <= B: the
        batch's filler sentences have none)."""
        state = super().start(limits, capacity, position, forced, beam_size=beam_size, **settings)
        padded = terms.new_full((limits.shape[0], *terms.shape[1:]), state.pad_id)
        padded[:terms.shape[0]] = terms
        state.terms, state.term_lengths = padded, (padded != state.pad_id).sum(dim=2)
        state.matched = torch.zeros(limits.shape[0] * beam_size, terms.shape[1], dtype=torch.long,
                                    device=terms.device)
        return state

    def best_candidates(self, log_probs: torch.Tensor) -> Candidates:
        """Each sentence's candidates (B, P), P = K·(2K + N), in the order of dynamic beam allocation:
        rank r in its bank (by summed log-prob) before rank r + 1, and within a rank the higher bank
        first; dead candidates (-inf) last. EOS is no candidate before every term is met; at the cap,
        no candidate that has not met them all."""
        BK, V = log_probs.shape
        B, N = self.terms.shape[:2]
        K = BK // B
        lengths = self.term_lengths.repeat_interleave(K, dim=0)  # (B·K, N)
        terms = self.terms.repeat_interleave(K, dim=0)  # (B·K, N, T)
        met = self.matched >= lengths  # (B·K, N)
        eos = torch.arange(V, device=log_probs.device) == self.eos_id  # (V,)
        log_probs = log_probs.masked_fill(eos[None, :] & ~met.all(dim=1, keepdim=True), float("-inf"))
        W = min(2 * K, V)
        top_scores, top_tokens = log_probs.topk(W, dim=1)  # (B·K, W) each
        wanted = next_term_tokens(terms, self.matched)  # (B·K, N)
        # Each unmet term's next token once, unless it is among the row's best already.
        earlier = torch.ones(N, N, dtype=torch.bool, device=wanted.device).tril(-1)  # [n, m]: m before n
        repeated = ((wanted[:, :, None] == wanted[:, None, :]) & earlier & ~met[:, None, :]).any(dim=2)
        fresh = ~met & ~repeated & ~(wanted[:, :, None] == top_tokens[:, None, :]).any(dim=2)
        term_scores = log_probs.gather(1, wanted).masked_fill(~fresh, float("-inf"))
        tokens = torch.cat([top_tokens, wanted], dim=1)  # (B·K, W + N)
        scores = self.scores[:, None] + torch.cat([top_scores, term_scores], dim=1)
        banks = bank(matched_after(self.matched, lengths, terms, tokens), lengths[:, None, :])  # (B·K, W + N)
        all_met = banks == self.term_lengths.sum(dim=1).repeat_interleave(K)[:, None]
        at_cap = (self.position + 1 >= self.limits).repeat_interleave(K)[:, None]  # (B·K, 1)
        scores = scores.masked_fill(at_cap & ~all_met, float("-inf"))
        P = K * (W + N)
        scores, banks, tokens = scores.view(B, P), banks.view(B, P), tokens.view(B, P)
        order = allocation_order(scores, banks, top_bank=self.terms.shape[1] * self.terms.shape[2])
        first_row = torch.arange(0, BK, K, device=log_probs.device)[:, None]  # (B, 1)
        return Candidates(scores.gather(1, order), first_row + order // (W + N), tokens.gather(1, order))

    def continue_live(self, candidates: Candidates, at_cap: torch.Tensor) -> torch.Tensor:
        """The first K candidates that do not end, in allocation order, go on (`BeamState.continue_live`,
        which puts them best first), each with what it has matched of its terms."""
        K, P = self.rows_per_sentence, candidates.scores.shape[1]
        places = torch.arange(P, device=candidates.scores.device).expand_as(candidates.scores)
        ending = (candidates.tokens == self.eos_id).long()
        pick = (places + P * ending).topk(K, dim=1, largest=False)[1]  # (B, K)
        rows = super().continue_live(Candidates(*(field.gather(1, pick) for field in candidates)), at_cap)
        new_tokens = self.tokens.index_select(1, self.position).squeeze(1)  # (B·K,)
        lengths = self.term_lengths.repeat_interleave(K, dim=0)
        self.matched.copy_(matched_after(self.matched.index_select(0, rows), lengths,
                                         self.terms.repeat_interleave(K, dim=0), new_tokens[:, None])[:, 0])
        return rows

    def select(self, sentences: torch.Tensor) -> ConstrainedBeamState:
        K = self.rows_per_sentence
        rows = (sentences[:, None] * K + torch.arange(K, device=sentences.device)).flatten()  # (B'·K,)
        base = super().select(sentences)
        return ConstrainedBeamState(**{f.name: getattr(base, f.name) for f in fields(BeamState)},
                                    terms=self.terms[sentences], term_lengths=self.term_lengths[sentences],
                                    matched=self.matched[rows])


def next_term_tokens(terms: torch.Tensor, matched: torch.Tensor) -> torch.Tensor:
    """Each term's next token (R, N) long after `matched` (R, N) of its tokens, terms (R, N, T) (a met
    term's is its last token's neighbour or padding: ignored)."""
    return terms.gather(2, matched.clamp(max=terms.shape[2] - 1)[:, :, None]).squeeze(2)


def matched_after(matched: torch.Tensor, lengths: torch.Tensor, terms: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor:
    """What each row has matched of its terms (R, C, N) after adding each of `tokens` (R, C), from
    `matched` (R, N) of terms (R, N, T) of `lengths` (R, N): one more where the token is the term's next,
    else 1 where it is its first, else 0; a met term stays met. (A restart finds no overlap of a term with
    itself: that only undercounts, so a term counted met is always in the output.)"""
    met = (matched >= lengths)[:, None, :]  # (R, 1, N)
    added = tokens[:, :, None]  # (R, C, 1)
    going_on = next_term_tokens(terms, matched)[:, None, :] == added  # (R, C, N)
    restart = (terms[:, None, :, 0] == added).long()
    return torch.where(met, matched[:, None, :], torch.where(going_on, matched[:, None, :] + 1, restart))


def bank(matched: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The term tokens met (..., N) -> (...): every token of the met terms, and the most of one unmet
    term (several terms under way at once overlap in the output, so only the longest counts)."""
    met = matched >= lengths
    return torch.where(met, lengths, 0).sum(dim=-1) + torch.where(met, 0, matched).max(dim=-1).values


def allocation_order(scores: torch.Tensor, banks: torch.Tensor, top_bank: int) -> torch.Tensor:
    """The order (B, P) long of dynamic beam allocation over candidates scores (B, P) fp32 in banks
    (B, P) long (at most `top_bank`): by rank in the bank, best first, then by bank, highest first;
    -inf last."""
    P = scores.shape[1]
    earlier = torch.ones(P, P, dtype=torch.bool, device=scores.device).tril(-1)  # [i, j]: j comes before i
    ahead = (scores[:, None, :] > scores[:, :, None]) | ((scores[:, None, :] == scores[:, :, None]) & earlier)
    rank = (ahead & (banks[:, None, :] == banks[:, :, None])).sum(dim=2)  # (B, P)
    places = torch.arange(P, device=scores.device)
    key = (rank * (top_bank + 1) + top_bank - banks).masked_fill(scores == float("-inf"), P * (top_bank + 1))
    return (key * P + places).topk(P, dim=1, largest=False)[1]


def allowed_tokens(log_probs: torch.Tensor, forced: torch.Tensor, position: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Which tokens (R, V) bool each row of log_probs (R, V) may generate now: the forced one of its
    sentence at `position` (forced (B, C) long, R = B·K), or any where that is padding."""
    B, K = forced.shape[0], log_probs.shape[0] // forced.shape[0]
    wanted = forced.index_select(1, position).expand(B, K).reshape(-1, 1)  # (R, 1)
    return torch.zeros_like(log_probs, dtype=torch.bool).scatter_(1, wanted, True) | (wanted == pad_id)


def stable_descending_order(scores: torch.Tensor) -> torch.Tensor:
    """The indices (B, P) long that sort each row of scores (B, P) best first, stably, by comparing
    all pairs: `torch.sort`'s stable CUDA kernels may not be captured in a graph."""
    P = scores.shape[1]
    earlier = torch.ones(P, P, dtype=torch.bool, device=scores.device).tril(-1)  # [i, j]: j comes before i
    ahead = (scores[:, None, :] > scores[:, :, None]) | ((scores[:, None, :] == scores[:, :, None]) & earlier)
    rank = ahead.sum(dim=2)  # (B, P): how many go before each; a permutation of 0..P-1
    return torch.empty_like(rank).scatter_(1, rank, torch.arange(P, device=scores.device).expand_as(rank))


@dataclass
class SampleState:
    """N independent samples drawn a token at a time (one row each)."""

    tokens: torch.Tensor  # (N, C + 1) long
    position: torch.Tensor  # (1,) long (shared with the KV cache)
    limits: torch.Tensor  # (N,) long
    done: torch.Tensor  # (N,) bool: EOS drawn or the cap reached
    log_probs: torch.Tensor  # (N,) fp32: log-probability under the model (temperature 1, no cuts), EOS included
    lengths: torch.Tensor  # (N,) long: tokens drawn, EOS included
    sampling: Sampling
    generator: torch.Generator
    alpha: float
    eos_id: int
    pad_id: int
    forced: torch.Tensor | None = None  # (N, C) long: each row's first tokens, pad beyond; None: none

    rows_per_sentence = 1

    @classmethod
    def start(cls, limits: torch.Tensor, capacity: int, position: torch.Tensor, forced: torch.Tensor | None = None,
              *, sampling: Sampling, generator: torch.Generator, bos_id: int, eos_id: int, pad_id: int,
              alpha: float) -> SampleState:
        N, device = limits.shape[0], limits.device
        tokens = torch.full((N, capacity + 1), pad_id, dtype=torch.long, device=device)
        tokens[:, 0] = bos_id
        return cls(tokens, position, limits, torch.zeros(N, dtype=torch.bool, device=device),
                   torch.zeros(N, device=device), torch.zeros(N, dtype=torch.long, device=device), sampling,
                   generator, alpha, eos_id, pad_id, forced)

    def advance(self, logits: torch.Tensor) -> None:
        """Draw each row's next token from logits (N, V) fp32 (a forced token replaces the draw)."""
        next_ids = torch.multinomial(self.sampling.probabilities(logits), 1, generator=self.generator).squeeze(1)
        if self.forced is not None:
            wanted = self.forced.index_select(1, self.position).squeeze(1)  # (N,)
            next_ids = torch.where(wanted == self.pad_id, next_ids, wanted)
        token_log_probs = torch.log_softmax(logits, dim=-1).gather(1, next_ids[:, None]).squeeze(1)  # (N,)
        self.log_probs += token_log_probs.masked_fill(self.done, 0.0)
        self.lengths += (~self.done).long()
        self.tokens.index_copy_(1, self.position + 1, next_ids.masked_fill(self.done, self.pad_id)[:, None])
        self.position += 1
        self.done |= (next_ids == self.eos_id) | (self.position >= self.limits)

    def select(self, rows: torch.Tensor) -> SampleState:
        return SampleState(self.tokens[rows], self.position, self.limits[rows], self.done[rows], self.log_probs[rows],
                           self.lengths[rows], self.sampling, self.generator, self.alpha, self.eos_id, self.pad_id,
                           None if self.forced is None else self.forced[rows])

    def results(self) -> list[list[Hypothesis]]:
        """Each row's sample, scored as beam search scores its hypotheses."""
        return [[Hypothesis(strip_generated(ids, self.eos_id, self.pad_id), log_prob,
                            log_prob / length_penalty(length, self.alpha))]
                for ids, log_prob, length in zip(self.tokens[:, 1:].tolist(), self.log_probs.tolist(),
                                                 self.lengths.tolist())]
