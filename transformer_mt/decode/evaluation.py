"""Translate token-id sequences in batches and score hypotheses with sacreBLEU."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from transformer_mt.config.schema import DecodeConfig
from transformer_mt.core.runtime import Precision, pick_attention
from transformer_mt.data.batching import pad_sequences, sorted_batches
from transformer_mt.decode.generator import beam_search, greedy_decode, sample_decode
from transformer_mt.decode.graphs import StepGraphs
from transformer_mt.decode.hypotheses import Hypothesis, Sampling
from transformer_mt.model.transformer import Transformer

T = TypeVar("T")  # what a batch's decoding gives per sentence: token ids, or a list of hypotheses


@dataclass(frozen=True)
class Scores:
    """Corpus-level sacreBLEU scores with the signatures needed to report them."""

    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str


def bleu_tokenizer_problem(tokenize: str) -> str | None:
    """Why sacreBLEU cannot build its `tokenize` tokenizer here, or None when it can.

    Some (ja-mecab, ko-mecab, spm, flores*) need optional packages; without this check the
    first validation would fail after `train.eval_every_steps` of training.
    """
    import sacrebleu  # here, not at the top: translating needs no scorer (start-up time)

    try:
        sacrebleu.metrics.BLEU(tokenize=tokenize)
    except (ImportError, RuntimeError, OSError) as err:
        # sacreBLEU's message spreads an install hint over several lines: keep it on one.
        return f"sacreBLEU cannot use the {tokenize!r} tokenizer here ({' '.join(str(err).split())})"
    return None


def score(hypotheses: list[str], references: list[str], tokenize: str = "13a") -> Scores:
    """BLEU and chrF of detokenised hypotheses against one reference each (sacreBLEU defaults).

    `tokenize="none"` scores pre-tokenized text on purpose (tokenized BLEU, e.g. Multi30k's
    `tok/`), so sacreBLEU's "you forgot to detokenize" warning is switched off (`force`); the
    score and the signature are unchanged.
    """
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU(tokenize=tokenize, force=tokenize == "none")
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return Scores(bleu_score.score, chrf_score.score, str(bleu.get_signature()), str(chrf.get_signature()))


def translate_ids(model: Transformer, src_seqs: list[list[int]], decode_cfg: DecodeConfig, *,
                  bos_id: int, eos_id: int, device: torch.device, precision: Precision,
                  beam_size: int | None = None, progress: bool = False) -> list[list[int]]:
    """Translate source id lists (no special tokens) in length-sorted, token-budget batches.

    Greedy when the beam size (`beam_size`, else `decode_cfg.beam_size`) is 1, else beam
    search, on the attention kernels of `decode_cfg.attention_backend` (one this device cannot
    run falls back quietly: whoever loads the run warns once). Sources longer than the model
    allows are truncated; results come back in input order. `progress` shows a bar on stderr.
    """
    beam_size = decode_cfg.beam_size if beam_size is None else beam_size
    graphs = StepGraphs()  # batches of one padded shape replay one capture

    def decode(decoder: Transformer, src_ids: torch.Tensor) -> list[list[int]]:
        return _decode_batch(decoder, src_ids, decode_cfg, beam_size, bos_id, eos_id, graphs)

    # Beam search decodes K rows per sentence, so each sentence costs K times its length.
    return _translate_batches(model, src_seqs, decode_cfg, decode, rows_per_sentence=beam_size, eos_id=eos_id,
                              device=device, precision=precision, progress=progress)


def translate_hypotheses(model: Transformer, src_seqs: list[list[int]], decode_cfg: DecodeConfig, *,
                         bos_id: int, eos_id: int, device: torch.device, precision: Precision,
                         beam_size: int | None = None, n_best: int = 1, sampling: Sampling | None = None,
                         progress: bool = False) -> list[list[Hypothesis]]:
    """As `translate_ids`, but each source gets a list of hypotheses with their log-probabilities
    and length-normalised scores (α = `decode_cfg.length_penalty`): the `n_best` best of beam
    search, best first (beam 1 is greedy decoding, scored), or with `sampling`, `n_best` samples
    in the order drawn, from one generator seeded with `sampling.seed` for the whole call.
    """
    alpha = decode_cfg.length_penalty
    if sampling is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)

        def decode(decoder: Transformer, src_ids: torch.Tensor) -> list[list[Hypothesis]]:
            return sample_decode(decoder, src_ids, bos_id=bos_id, eos_id=eos_id, max_len_a=decode_cfg.max_len_a,
                                 max_len_b=decode_cfg.max_len_b, sampling=sampling, generator=generator,
                                 n_samples=n_best, alpha=alpha)
        rows_per_sentence = n_best
    else:
        beam_size = decode_cfg.beam_size if beam_size is None else beam_size
        graphs = StepGraphs()

        def decode(decoder: Transformer, src_ids: torch.Tensor) -> list[list[Hypothesis]]:
            return _beam_search(decoder, src_ids, decode_cfg, beam_size, bos_id, eos_id, graphs, n_best)
        rows_per_sentence = beam_size
    return _translate_batches(model, src_seqs, decode_cfg, decode, rows_per_sentence=rows_per_sentence,
                              eos_id=eos_id, device=device, precision=precision, progress=progress)


def _translate_batches(model: Transformer, src_seqs: list[list[int]], decode_cfg: DecodeConfig,
                       decode: Callable[[Transformer, torch.Tensor], list[T]], *, rows_per_sentence: int,
                       eos_id: int, device: torch.device, precision: Precision, progress: bool) -> list[T]:
    """Run `decode(model, src_ids (B, S))` over length-sorted batches of at most
    `decode_cfg.batch_tokens` tokens, each sentence counted `rows_per_sentence` times; its
    results come back in input order."""
    attention = pick_attention(decode_cfg.attention_backend, device, "decode")
    keep = model.cfg.max_len - 1  # room for the EOS appended to every source
    sources = [list(s[:keep]) + [eos_id] for s in src_seqs]
    batches = sorted_batches([len(s) * rows_per_sentence for s in sources], decode_cfg.batch_tokens)
    results: list = [None] * len(sources)
    was_training = model.training
    model.eval()
    try:
        # leave=False: the bar goes once done, so nothing of it is left beside the next log line.
        for chunk in tqdm(batches, desc="translate", unit="batch", disable=not (progress and sys.stderr.isatty()),
                          file=sys.stderr, leave=False):
            src_ids = pad_sequences([sources[i] for i in chunk], model.pad_id).to(device)
            with precision.autocast(), attention.enabled():
                outputs = decode(model, src_ids)
            for i, output in zip(chunk, outputs):
                results[i] = output
    finally:
        model.train(was_training)
    return results


def _decode_batch(model: Transformer, src_ids: torch.Tensor, decode_cfg: DecodeConfig, beam_size: int,
                  bos_id: int, eos_id: int, graphs: StepGraphs) -> list[list[int]]:
    if beam_size == 1:
        return greedy_decode(model, src_ids, bos_id=bos_id, eos_id=eos_id, max_len_a=decode_cfg.max_len_a,
                             max_len_b=decode_cfg.max_len_b, **_captured(decode_cfg, src_ids, graphs))
    return [hyps[0].ids for hyps in _beam_search(model, src_ids, decode_cfg, beam_size, bos_id, eos_id, graphs)]


def _beam_search(model: Transformer, src_ids: torch.Tensor, decode_cfg: DecodeConfig, beam_size: int, bos_id: int,
                 eos_id: int, graphs: StepGraphs, n_best: int = 1) -> list[list[Hypothesis]]:
    return beam_search(model, src_ids, bos_id=bos_id, eos_id=eos_id, beam_size=beam_size,
                       max_len_a=decode_cfg.max_len_a, max_len_b=decode_cfg.max_len_b,
                       alpha=decode_cfg.length_penalty, n_best=n_best, **_captured(decode_cfg, src_ids, graphs))


def _captured(decode_cfg: DecodeConfig, src_ids: torch.Tensor, graphs: StepGraphs) -> dict:
    """On CUDA with `decode.cuda_graphs`, fixed-shape steps replayed from a CUDA graph; else eager."""
    if decode_cfg.cuda_graphs and src_ids.device.type == "cuda":
        return {"graphs": graphs, "capture": True}
    return {}


def cross_attention_map(model: Transformer, src_ids: list[int], hyp_ids: list[int], *, bos_id: int, eos_id: int,
                        device: torch.device, layer: int = -1) -> torch.Tensor:
    """Head-averaged cross-attention of decoder `layer` while producing `hyp_ids` + EOS from
    `src_ids` + EOS (teacher-forced on the hypothesis): (T + 1, S + 1), fp32 on the CPU."""
    keep = model.cfg.max_len - 1
    src = torch.tensor([list(src_ids[:keep]) + [eos_id]], device=device)  # (1, S+1)
    tgt_in = torch.tensor([[bos_id] + list(hyp_ids[:keep])], device=device)  # (1, T+1)
    was_training = model.training
    model.eval()
    try:
        return model.cross_attention(src, tgt_in, layer)[0].mean(dim=0).cpu()  # (H, T+1, S+1) -> (T+1, S+1)
    finally:
        model.train(was_training)


def cross_attention_labels(src_pieces: list[str], hyp_pieces: list[str], eos: str, max_len: int
                           ) -> tuple[list[str], list[str]]:
    """Axis labels of `cross_attention_map`: its columns are the source pieces and EOS, its rows
    the pieces each decoder position produced, then EOS; both cut as the map cuts them to
    `max_len` positions (a hypothesis that fills them all has no EOS row)."""
    keep = max_len - 1
    return src_pieces[:keep] + [eos], (hyp_pieces + [eos])[: min(len(hyp_pieces), keep) + 1]
