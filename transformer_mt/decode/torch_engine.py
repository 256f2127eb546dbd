"""`TorchEngine`: tmt's own model and search (`evaluation.translate_ids`), on any torch device."""

from __future__ import annotations

import torch

from transformer_mt.config.schema import DecodeConfig
from transformer_mt.core.runtime import Precision
from transformer_mt.data.tokenization import BOS_ID, EOS_ID
from transformer_mt.decode.engine import Scored
from transformer_mt.decode.evaluation import cross_attention_map, translate_hypotheses, translate_ids
from transformer_mt.decode.hypotheses import Sampling
from transformer_mt.model.transformer import Transformer


class TorchEngine:
    """The `Engine` of a `Transformer` on `device`, under the run's `precision` (autocast)."""

    name = "torch"

    def __init__(self, model: Transformer, device: torch.device, precision: Precision):
        self.model = model.eval()
        self.torch_device = device
        self.device = device.type
        self.precision = precision

    def translate(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int,
                  progress: bool) -> list[list[int]]:
        return translate_ids(self.model, src_ids, decode, bos_id=BOS_ID, eos_id=EOS_ID, device=self.torch_device,
                             precision=self.precision, beam_size=beam_size, progress=progress)

    def hypotheses(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, n_best: int,
                   sampling: Sampling | None, progress: bool) -> list[list[Scored]]:
        found = translate_hypotheses(self.model, src_ids, decode, bos_id=BOS_ID, eos_id=EOS_ID,
                                     device=self.torch_device, precision=self.precision, beam_size=beam_size,
                                     n_best=n_best, sampling=sampling, progress=progress)
        return [[Scored(hyp.ids, hyp.score) for hyp in hyps] for hyps in found]

    def cross_attention(self, src_ids: list[int], hyp_ids: list[int], layer: int) -> torch.Tensor:
        return cross_attention_map(self.model, src_ids, hyp_ids, bos_id=BOS_ID, eos_id=EOS_ID,
                                   device=self.torch_device, layer=layer)
