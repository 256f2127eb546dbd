"""tmt's decoding inside transformers' `generate`, shipped as custom_generate/generate.py of a
`tmt export --format hf` folder (loaded with `trust_remote_code=True`): each source's cap of
a·S + b generated tokens, sources cut to max_len tokens, and beam search ranked by GNMT's length
penalty. It imports torch and transformers alone: the folder is used without tmt."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, GenerationMixin, StoppingCriteria, StoppingCriteriaList


class SentenceCaps(StoppingCriteria):
    """Stops each sentence's rows once they hold its cap of generated tokens."""

    def __init__(self, caps: torch.Tensor, prompt_length: int):
        super().__init__()
        self.caps, self.prompt_length = caps, prompt_length  # (B,) long

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        """input_ids (B·r, L), a sentence's r rows together -> (B·r,) bool."""
        rows_per_sentence = input_ids.shape[0] // self.caps.shape[0]
        done = input_ids.shape[1] - self.prompt_length >= self.caps  # (B,)
        return done.repeat_interleave(rows_per_sentence)


def gnmt_penalty(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's length penalty ((5 + n) / 6)^α of n generated tokens (EOS included), fp64."""
    return ((5.0 + lengths.double()) / 6.0) ** alpha


def generate(inputs: torch.Tensor | None = None, *, model, generation_config: GenerationConfig | None = None,
             **kwargs) -> torch.Tensor:
    """transformers' `generate` with tmt's rules; returns the generated ids (B·n, L) as it does.
    The generation config's `length_penalty` (a greedy run's `gnmt_length_penalty`) is GNMT's α,
    `max_len_a` and `max_len_b` the cap;
    an explicit `max_new_tokens` or `max_length` replaces the cap."""
    config = copy.deepcopy(generation_config or model.generation_config)
    explicit_cap = "max_new_tokens" in kwargs or "max_length" in kwargs
    model_kwargs = config.update(**kwargs)
    if config.num_beams > 1 and "length_penalty" not in kwargs and hasattr(config, "gnmt_length_penalty"):
        config.length_penalty = config.gnmt_length_penalty  # a greedy run's α, for the beams asked
    input_ids = model_kwargs.pop("input_ids", inputs)
    pad_id, eos_id = model.config.pad_token_id, model.config.eos_token_id
    mask = model_kwargs.pop("attention_mask", None)
    mask = (input_ids != pad_id).long() if mask is None else mask  # (B, S), right padding
    max_len = model.config.max_position_embeddings
    if input_ids.shape[1] > max_len:  # as tmt: max_len - 1 tokens, then EOS
        long_rows = mask.sum(dim=1) > max_len
        input_ids, mask = input_ids[:, :max_len].clone(), mask[:, :max_len]
        input_ids[long_rows, -1] = eos_id
    criteria = StoppingCriteriaList(model_kwargs.pop("stopping_criteria", None) or [])
    if not explicit_cap:
        a, b = getattr(config, "max_len_a", 0.0), getattr(config, "max_len_b", max_len)
        caps = (a * mask.sum(dim=1).double() + b).floor().long().clamp(1, max_len)  # (B,)
        criteria.append(SentenceCaps(caps, prompt_length=1))  # after the decoder start token
        config.max_new_tokens, config.max_length = None, int(caps.max()) + 1  # the start token, then the tokens
    if config.num_beams == 1 or config.do_sample:
        return GenerationMixin.generate(model, input_ids, attention_mask=mask, generation_config=config,
                                        stopping_criteria=criteria, **model_kwargs)
    # Live beams go by summed log-probability in both searches, which stop once K hypotheses have
    # finished. With no length penalty, the K finished kept (the best by log-probability) always
    # hold GNMT's best: one dropped has a longer or equal one with a higher log-probability.
    n_return, alpha, K = config.num_return_sequences or 1, config.length_penalty, config.num_beams
    if n_return > K:
        raise ValueError(f"num_return_sequences={n_return} is more than num_beams={K}")
    config.length_penalty, config.early_stopping, config.num_return_sequences = 0.0, True, K
    config.output_scores, config.return_dict_in_generate = True, True
    out = GenerationMixin.generate(model, input_ids, attention_mask=mask, generation_config=config,
                                   stopping_criteria=criteria, **model_kwargs)
    sequences = out.sequences.view(-1, K, out.sequences.shape[1])  # (B, K, L), the start token first
    lengths = (out.beam_indices >= 0).sum(dim=1).view(-1, K)  # (B, K): generated tokens, EOS included
    scores = out.sequences_scores.view(-1, K).double() / gnmt_penalty(lengths, alpha)  # (B, K)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n_return]  # (B, n)
    best = sequences.gather(1, order[:, :, None].expand(-1, -1, sequences.shape[2]))
    return best.flatten(0, 1)
