"""COMET scores with Unbabel's `unbabel-comet` package (the optional `comet` extra), from a model
name on the Hugging Face Hub or a local folder; what is missing is said in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.core.errors import UsageError

INSTALL = "pip install 'transformer-mt[comet]'"


@dataclass(frozen=True)
class CometScore:
    """A COMET model's corpus score (the mean of its sentence scores) and each sentence's."""

    model: str
    score: float
    sentences: list[float]


def comet_checkpoint(model: str, key: str = "--comet") -> Path:
    """The checkpoint file of `model`: a `.ckpt` file, a folder as COMET downloads them
    (`checkpoints/model.ckpt` inside), or a Hub name (e.g. Unbabel/wmt22-comet-da), downloaded
    once into COMET's cache. `key`: the option or config key that named it, for the error."""
    try:
        from comet import download_model
    except ImportError:
        raise UsageError(f"{key} needs the unbabel-comet package, which is not installed: {INSTALL}") from None
    path = Path(model).expanduser()
    if path.exists():
        checkpoint = path / "checkpoints" / "model.ckpt" if path.is_dir() else path
        if not checkpoint.is_file():
            raise UsageError(f"{key} {model}: no COMET checkpoint at {checkpoint} (a downloaded model folder holds "
                             "checkpoints/model.ckpt)")
        return checkpoint
    if "/" not in model:
        raise UsageError(f"{key} {model}: no such folder, and not a Hub model name such as Unbabel/wmt22-comet-da")
    try:
        return Path(download_model(model))
    except Exception as err:  # the Hub unreachable, a gated or unknown model: whatever the Hub client raises
        reason = " ".join(str(err).split())[:200]
        raise UsageError(f"{key} {model}: cannot get the model from the Hugging Face Hub ({type(err).__name__}: "
                         f"{reason}); download it where the Hub is reachable and give its folder") from None


class Comet:
    """A COMET model loaded once (`Comet.load`), then `score`d with as often as needed."""

    def __init__(self, model: str, scorer):
        self.model, self.scorer = model, scorer

    @classmethod
    def load(cls, model: str, key: str = "--comet") -> Comet:
        """Find (`comet_checkpoint`) and load `model`; a checkpoint that does not load is named in one line."""
        checkpoint = comet_checkpoint(model, key)
        from comet import load_from_checkpoint

        try:
            return cls(model, load_from_checkpoint(str(checkpoint)))
        except (OSError, KeyError, RuntimeError, ValueError) as err:  # a damaged or foreign checkpoint
            raise UsageError(f"{key} {model}: cannot load {checkpoint} ({type(err).__name__}: {err})") from None

    def score(self, sources: list[str], hypotheses: list[str], references: list[str], *,
              device: torch.device | str = "cpu", batch_size: int = 16) -> CometScore:
        """Score translations on `device` (a CUDA device: that GPU, by its index; else the CPU)."""
        device = torch.device(device)
        gpus = int(device.type == "cuda")
        devices = [device.index if device.index is not None else torch.cuda.current_device()] if gpus else None
        data = [{"src": src, "mt": hyp, "ref": ref} for src, hyp, ref in zip(sources, hypotheses, references)]
        output = self.scorer.predict(data, batch_size=batch_size, gpus=gpus, devices=devices, progress_bar=False)
        return CometScore(self.model, float(output.system_score), [float(s) for s in output.scores])

    def offload(self) -> None:
        """Move the model back to the CPU and give its GPU memory back (between validations, to training)."""
        self.scorer.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
