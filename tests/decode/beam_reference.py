"""A beam search written plainly, the reference that `decode.generator.beam_search` must reproduce: a Python
loop over finished hypotheses and active sentences, no cache, rows leaving the batch as their
sentences finish."""

from __future__ import annotations

import torch

from transformer_mt.decode.generator import max_target_lengths
from transformer_mt.decode.hypotheses import Hypothesis, length_penalty
from transformer_mt.model.transformer import Packing, Transformer


@torch.inference_mode()
def reference_beam_search(model: Transformer, src_ids: torch.Tensor, *, bos_id: int, eos_id: int, beam_size: int,
                max_len_a: float, max_len_b: int, alpha: float = 1.0, n_best: int = 1,
                gaps: list[float] | None = None) -> list[list[Hypothesis]]:
    """Beam search with K = `beam_size` beams per sentence, batched over sentences.

    src_ids (B, S) long -> for each sentence, its `n_best` hypotheses, best first. Beams are
    ranked by summed log-probability; a beam that emits EOS among the top K candidates is set
    aside, scored log_prob / length_penalty(tokens incl. EOS, α). A sentence is done once it
    has K finished hypotheses, or `n_best` that no live beam can still beat (log-probs only
    fall, so a live beam's best reachable score is its log-prob over the penalty at its length
    cap), or reaches its length cap. Beam size 1 gives exactly greedy decoding's output.
    Finished sentences leave the batch.

    `gaps`, when given, receives the score gaps where the search chose between candidates (the K-th
    and next candidate, the K-th and next live beam, neighbours in each n-best list): near zero, a
    tie that rounding breaks, so another search may keep the other candidate.
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be between 1 and beam_size={beam_size}, got {n_best}")
    K, pad_id, device = beam_size, model.pad_id, src_ids.device
    B = src_ids.shape[0]
    src_mask = src_ids != pad_id  # (B, S)
    limits = max_target_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_len).tolist()
    src_mask = src_mask.repeat_interleave(K, dim=0)  # (B·K, S)
    memory = model.encode(src_ids.repeat_interleave(K, dim=0), Packing.dense(src_mask))  # (B·K·S, D)
    memory = memory.view(B * K, src_ids.shape[1], -1)  # (B·K, S, D)

    active = list(range(B))  # sentences still searching, in the order of the rows below
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)  # (N·K, t+1) with BOS
    # Only the first beam is live at the start, so the K beams do not all pick the same token.
    scores = torch.tensor([0.0] + [float("-inf")] * (K - 1), device=device).repeat(B)  # (N·K,)
    step = 0
    while active:
        N = len(active)
        # No cache: the decoder reads the whole prefix at every step.
        tgt = Packing.dense(torch.ones_like(tokens, dtype=torch.bool))
        states = model.decode(tokens, tgt, memory.flatten(0, 1), Packing.dense(src_mask))  # (N·K·(t+1), D)
        logits = model.logits(states.view(N * K, tokens.shape[1], -1)[:, -1])  # (N·K, V)
        logits[:, [pad_id, bos_id]] = torch.finfo(logits.dtype).min  # never padding or a second BOS
        log_probs = torch.log_softmax(logits, dim=-1)
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
        if gaps is not None:
            gaps += (cand_scores[:, K - 1] - cand_scores[:, K]).tolist()
            boundary = live_scores.topk(K + 1, dim=1).values
            gaps += (boundary[:, K - 1] - boundary[:, K]).tolist()
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
        memory, src_mask = memory.index_select(0, rows), src_mask.index_select(0, rows)
        active = [active[row] for row in still]
        step += 1
    ranked = [sorted(hyps, key=lambda h: h.score, reverse=True) for hyps in finished]
    if gaps is not None:
        gaps += [a.score - b.score for hyps in ranked for a, b in zip(hyps[:n_best], hyps[1:n_best + 1])]
    return [hyps[:n_best] for hyps in ranked]


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

