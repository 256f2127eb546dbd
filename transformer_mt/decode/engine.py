"""What a decoding engine offers `Translator` (`TorchEngine`, `CT2Engine`), and which engine a
setting of `decode.engine` picks. Torch-free: `tmt translate` imports no torch on CTranslate2."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from transformer_mt.core.errors import UsageError

if TYPE_CHECKING:
    from transformer_mt.config.schema import DecodeConfig
    from transformer_mt.decode.hypotheses import Sampling

ENGINES = ("auto", "torch", "ctranslate2")


@dataclass(frozen=True)
class Scored:
    """One translation as target ids (no BOS or EOS) with tmt's score."""

    ids: list[int]
    score: float  # log-probability (EOS included) / GNMT length penalty ((5 + length) / 6)^α


class Engine(Protocol):
    """Decodes source ids (no special tokens; cut to `model.max_len - 1` and given an EOS inside)
    in length-sorted batches of `decode.batch_tokens`, results in input order."""

    name: str  # "torch" or "ctranslate2"
    device: str  # "cpu", "cuda" or "mps"

    def translate(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int,
                  progress: bool) -> list[list[int]]:
        """The best translation of each source: greedy when `beam_size` is 1, else beam search."""

    def hypotheses(self, src_ids: list[list[int]], decode: DecodeConfig, beam_size: int, n_best: int,
                   sampling: Sampling | None, progress: bool) -> list[list[Scored]]:
        """Each source's `n_best` best translations (beam 1: greedy), best first, or with
        `sampling`, `n_best` samples in the order drawn; scored as `Scored.score` says."""

    def cross_attention(self, src_ids: list[int], hyp_ids: list[int], layer: int):
        """Head-averaged cross-attention of decoder `layer` producing `hyp_ids` + EOS: (T + 1, S + 1)."""


def has_ctranslate2() -> bool:
    """Whether the `ctranslate2` package is installed (without importing it)."""
    return importlib.util.find_spec("ctranslate2") is not None


def pick_engine(setting: str, device: str) -> str:
    """The engine `decode.engine: setting` runs on `--device device`: "torch" or "ctranslate2".

    auto: CTranslate2 on a CPU (`device` cpu, or auto on a machine without a CUDA GPU) when it is
    installed; torch otherwise, whose CUDA-graph decoding serves GPUs.
    """
    if setting == "torch":
        return "torch"
    if setting == "ctranslate2":
        if not has_ctranslate2():
            raise UsageError("decode.engine: ctranslate2 needs the ctranslate2 package (pip install ctranslate2); "
                             "or translate with --engine torch")
        if device == "mps":
            raise UsageError("--device mps: CTranslate2 runs on a CPU or CUDA; use --engine torch on mps")
        return "ctranslate2"
    if device not in ("auto", "cpu") or not has_ctranslate2():
        return "torch"
    if device == "auto" and _cuda_devices() > 0:
        return "torch"
    return "ctranslate2"


def ctranslate2_device(device: str) -> str:
    """The device CTranslate2 runs on for `--device device`: CUDA when asked or when auto finds one."""
    return "cuda" if device == "cuda" or (device == "auto" and _cuda_devices() > 0) else "cpu"


def _cuda_devices() -> int:
    import ctranslate2  # asks the CUDA driver without importing torch

    return ctranslate2.get_cuda_device_count()
