"""COMET scores with Unbabel's `unbabel-comet` package (the optional `comet` extra), from a model
name on the Hugging Face Hub or a local folder; what is missing is said in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformer_mt.core.errors import UsageError

INSTALL = "pip install 'transformer-mt[comet]'"


@dataclass(frozen=True)
class CometScore:
    """A COMET model's corpus score (the mean of its sentence scores) and each sentence's."""

    model: str
    score: float
    sentences: list[float]


def comet_checkpoint(model: str) -> Path:
    """The checkpoint file of `model`: a `.ckpt` file, a folder as COMET downloads them
    (`checkpoints/model.ckpt` inside), or a Hub name (e.g. Unbabel/wmt22-comet-da), downloaded
    once into COMET's cache."""
    try:
        from comet import download_model
    except ImportError:
        raise UsageError(f"--comet needs the unbabel-comet package, which is not installed: {INSTALL}") from None
    path = Path(model).expanduser()
    if path.exists():
        checkpoint = path / "checkpoints" / "model.ckpt" if path.is_dir() else path
        if not checkpoint.is_file():
            raise UsageError(f"--comet {model}: no COMET checkpoint at {checkpoint} (a downloaded model folder holds "
                             "checkpoints/model.ckpt)")
        return checkpoint
    if "/" not in model:
        raise UsageError(f"--comet {model}: no such folder, and not a Hub model name such as Unbabel/wmt22-comet-da")
    try:
        return Path(download_model(model))
    except Exception as err:  # the Hub unreachable, a gated or unknown model: whatever the Hub client raises
        reason = " ".join(str(err).split())[:200]
        raise UsageError(f"--comet {model}: cannot get the model from the Hugging Face Hub ({type(err).__name__}: "
                         f"{reason}); download it where the Hub is reachable and give its folder") from None


def comet_score(model: str, sources: list[str], hypotheses: list[str], references: list[str], *,
                gpus: int = 0, batch_size: int = 16) -> CometScore:
    """Score translations with the COMET `model` (`comet_checkpoint`) on `gpus` GPUs (0: the CPU)."""
    from comet import load_from_checkpoint

    checkpoint = comet_checkpoint(model)
    try:
        scorer = load_from_checkpoint(str(checkpoint))
    except (OSError, KeyError, RuntimeError, ValueError) as err:  # a damaged or foreign checkpoint
        raise UsageError(f"--comet {model}: cannot load {checkpoint} ({type(err).__name__}: {err})") from None
    data = [{"src": src, "mt": hyp, "ref": ref} for src, hyp, ref in zip(sources, hypotheses, references)]
    output = scorer.predict(data, batch_size=batch_size, gpus=gpus, progress_bar=False)
    return CometScore(model, float(output.system_score), [float(s) for s in output.scores])
