"""Checkpoints on disk: atomic save, keep-last-k step files, `best.pt`, loading (a run's, to
translate with), averaging.

A checkpoint is one dict of tensors and plain containers (loadable with `weights_only=True`):
model, optimizer, scheduler, scaler, train_state, sampler, rng, config, model_args, tokenizers
(a fingerprint), format_version, and `ema` when the run keeps an EMA of its weights; built by
`checkpoint_state` alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.config.loading import config_from_dict
from transformer_mt.config.schema import Config, config_changes
from transformer_mt.core.errors import CheckpointError, ConfigError
from transformer_mt.core.files import describe_os_error, write_atomic
from transformer_mt.core.run_layout import BEST_NAME, checkpoint_steps, find_checkpoint, step_file_name
from transformer_mt.data.tokenization import TokenizerPair
from transformer_mt.model.transformer import Transformer, build_model

logger = logging.getLogger(__name__)

# 2: `nn.Linear` weights (out, in) named `weight`. 1: the same matrices stored (in, out) as `kernel`.
FORMAT_VERSION = 2
REQUIRED_KEYS = ("model", "config", "model_args", "format_version")


def checkpoint_state(model: dict, config: dict, model_args: dict, *, tokenizers: str | None = None,
                     ema: dict | None = None, **more) -> dict:
    """A checkpoint of this tmt's format: `model` weights, `config` (`config_to_dict`), `model_args`
    (`build_model`'s), the `tokenizers` fingerprint and an `ema` when given, and `more`: what a
    training run resumes from (optimizer, scheduler, scaler, train_state, sampler, rng), or an
    average's `train_state` and `averaged_from`."""
    return {"model": model, **more, "config": config, "model_args": model_args,
            **({"tokenizers": tokenizers} if tokenizers is not None else {}), "format_version": FORMAT_VERSION,
            **({"ema": ema} if ema is not None else {})}


def translation_weights(state: dict) -> tuple[dict, str]:
    """The weights to translate with, and which: the EMA's (`"ema"`) if any, else the trained ones (`"model"`)."""
    return (state["ema"]["model"], "ema") if state.get("ema") else (state["model"], "model")


def check_tokenizers(state: dict, fingerprint: str, path: Path, run_dir: Path) -> None:
    """Refuse a checkpoint trained with other tokenizers than the run's (`TokenizerPair.fingerprint`):
    its ids would mean other pieces. Checkpoints without a fingerprint pass."""
    saved = state.get("tokenizers")
    if saved is not None and saved != fingerprint:
        raise CheckpointError(f"{path} was trained with other tokenizers than those of {run_dir} (a checkpoint of "
                              "another run?); use it with its own run directory")


def save_atomic(state: dict, path: Path) -> None:
    """`torch.save` through `files.write_atomic`: a crash leaves the old file or the new one."""
    sink: _KeepWriteError | None = None

    def write(handle) -> None:
        nonlocal sink
        sink = _KeepWriteError(handle)
        torch.save(state, sink)

    try:
        write_atomic(path, write)
    except (OSError, RuntimeError) as err:
        err = sink.error if sink is not None and sink.error is not None else err
        if not isinstance(err, OSError):
            raise
        earlier = [step_file_name(step) for step in checkpoint_steps(path.parent)] + [BEST_NAME]
        intact = any((path.parent / name).is_file() for name in earlier if name != path.name)
        raise CheckpointError(f"could not write checkpoint {describe_os_error(err, path)}"
                              + ("; earlier checkpoints are intact" if intact else "")) from None


class _KeepWriteError:
    """torch.save's file, keeping the OSError a write raised: torch reports it as a RuntimeError
    that names neither the file nor the cause (a full disk, say)."""

    def __init__(self, handle):
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str):
        return getattr(self.handle, name)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict:
    """Load and sanity-check a checkpoint written by `save_atomic`; `mmap`: its tensors read from the
    file only when used (for a look at its config)."""
    if not path.is_file():
        others = sorted(entry.name for entry in path.parent.glob("*.pt")) if path.parent.is_dir() else []
        raise CheckpointError(f"{path}: checkpoint not found" +
                              (f"; {path.parent} holds {', '.join(others)}" if others else ""))
    if path.stat().st_size == 0:  # torch would only say EOFError
        raise CheckpointError(f"{path}: not a readable checkpoint: the file is empty")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises many types for truncated or foreign files
        # Never torch's advice of weights_only=False (it would run code from the file); else its first sentence.
        text = str(err).strip()
        if "Weights only load failed" in text:
            detail = ("it holds objects other than tensors and plain containers" if _is_torch_save_file(path)
                      else "it is not a PyTorch file: neither a zip archive nor torch's legacy format")
        else:
            detail = (re.split(r"\.\s+(?=[A-Z])", text.splitlines()[0], maxsplit=1)[0][:200] if text
                      else type(err).__name__)
        raise CheckpointError(f"{path}: not a readable checkpoint, perhaps truncated, corrupt or not a tmt "
                              f"checkpoint ({detail})") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a tmt checkpoint (missing keys)")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {state['format_version']!r} is not supported "
                              f"by this tmt (expects {FORMAT_VERSION})")
    return state


# torch.save's legacy format opens with torch.serialization.MAGIC_NUMBER as a LONG1 opcode.
_LEGACY_TORCH_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _is_torch_save_file(path: Path) -> bool:
    """True when `path` is in one of torch.save's formats (a zip archive, or the legacy pickle)."""
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as handle:
        return _LEGACY_TORCH_MAGIC in handle.read(32)  # after the PROTO (and, from protocol 4, FRAME) opcode


class CheckpointDir:
    """The `checkpoints/` folder of a run: `step_00001000.pt` files plus `best.pt`."""

    def __init__(self, directory: Path, keep_last: int):
        self.directory = directory
        self.keep_last = keep_last

    def step_path(self, step: int) -> Path:
        return self.directory / step_file_name(step)

    @property
    def best_path(self) -> Path:
        return self.directory / BEST_NAME

    def steps(self) -> list[int]:
        return checkpoint_steps(self.directory)

    def latest(self) -> Path | None:
        """The step checkpoint with the highest step, or None."""
        steps = self.steps()
        return self.step_path(steps[-1]) if steps else None

    def save(self, state: dict, step: int, *, is_best: bool) -> None:
        """Write the step checkpoint (and `best.pt` when `is_best`), then prune to `keep_last` step files."""
        self.directory.mkdir(parents=True, exist_ok=True)
        save_atomic(state, self.step_path(step))
        logger.info("saved checkpoint %s", self.step_path(step))
        if is_best:
            self.copy_to_best(self.step_path(step))
            logger.info("new best checkpoint at step %d", step)
        for old in self.steps()[: -self.keep_last]:
            self.step_path(old).unlink(missing_ok=True)

    def set_aside(self, path: Path, why: str) -> None:
        """Rename a checkpoint that training cannot go on from to `<name>.skipped` (`.skipped.1`, ...),
        out of `steps()`: left in place, its higher step would get newer checkpoints pruned in its
        stead. `best.pt`, when it is the same file (a hard link), goes with it; `why` ends the warning."""
        best = self.best_path
        if path != best and best.is_file() and os.path.samefile(path, best):
            self.set_aside(best, f"it is {path.name}")
        aside, n = path.with_name(f"{path.name}.skipped"), 0
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.skipped.{n}")
        os.replace(path, aside)
        logger.warning("moved %s aside to %s: %s", path, aside.name, why)

    def remove_temp_files(self) -> None:
        """Delete the half-written `.<name>.tmp` files a crash during a save leaves behind."""
        for tmp in self.directory.glob(".*.tmp"):
            if tmp.is_file():
                logger.info("removing %s, left by an interrupted save", tmp)
                tmp.unlink(missing_ok=True)

    def copy_to_best(self, source: Path) -> None:
        """Make `best.pt` a copy of `source` (a hard link where possible), atomically."""
        target = self.best_path
        if target.is_file() and os.path.samefile(source, target):
            return  # already linked (renaming a link over itself would leave the temp link behind)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            try:
                os.link(source, tmp)  # same bytes, no second write
            except OSError:  # no hard links here: a copy, on disk before it replaces best.pt
                shutil.copyfile(source, tmp)
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
            os.replace(tmp, target)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write checkpoint {describe_os_error(err, target)}") from None


def average_checkpoints(paths: list[Path]) -> dict:
    """A checkpoint whose weights are the element-wise mean of `paths`' (the newest gives the rest),
    without optimizer state: for translating and evaluating, not for resuming."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    newest = load_checkpoint(paths[-1])
    total = {name: tensor.double() if tensor.is_floating_point() else tensor
             for name, tensor in newest["model"].items()}
    for path in paths[:-1]:
        state = load_checkpoint(path)
        fingerprints = {state.get("tokenizers"), newest.get("tokenizers")} - {None}  # None: saved before them
        other_model = any(key.startswith("model.") for key, _, _ in config_changes(state["config"], newest["config"]))
        if state["model_args"] != newest["model_args"] or other_model or len(fingerprints) > 1:
            raise CheckpointError(f"{path}: a different model from {paths[-1].name}; only checkpoints of one "
                                  "run can be averaged")
        for name, tensor in state["model"].items():
            if tensor.is_floating_point():
                total[name] += tensor.double()
    model = {name: (tensor / len(paths)).to(newest["model"][name].dtype) if tensor.is_floating_point() else tensor
             for name, tensor in total.items()}
    return checkpoint_state(model, newest["config"], newest["model_args"], tokenizers=newest.get("tokenizers") or None,
                            train_state=newest.get("train_state", {}), averaged_from=[path.name for path in paths])


def is_average_checkpoint(path: Path) -> bool:
    """True when `path` is a checkpoint `average_checkpoints` made: the only file `tmt average` may replace."""
    try:
        return "averaged_from" in load_checkpoint(path)
    except CheckpointError:  # missing, not a checkpoint, or unreadable: someone else's file
        return False


@dataclass(frozen=True)
class LoadedRun:
    """A run's checkpoint loaded with torch and checked against the run's tokenizers."""

    model: Transformer  # the translation weights (EMA's when the run keeps them), on the CPU, in eval mode
    tokenizers: TokenizerPair
    checkpoint: Path
    cfg: Config
    config: dict  # the config as saved in the checkpoint
    model_args: dict
    step: int
    which: str  # "ema" or "model" (`checkpoint.translation_weights`)


def load_run(run_dir: Path, checkpoint: Path | None = None, tokenizers: TokenizerPair | None = None) -> LoadedRun:
    """Load `checkpoint` (default: the run's `best.pt`, else its newest) with its translation weights."""
    checkpoint = checkpoint or find_checkpoint(run_dir)
    state = load_checkpoint(checkpoint)
    try:
        cfg = config_from_dict(state["config"])
    except ConfigError as err:
        raise CheckpointError(f"{checkpoint}: the config stored in the checkpoint is invalid ({err})") from None
    tokenizers = tokenizers or TokenizerPair.load(run_dir)
    check_tokenizers(state, tokenizers.fingerprint(), checkpoint, run_dir)
    args = state["model_args"]
    sizes = args["src_vocab_size"], args["tgt_vocab_size"]
    if (tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size()) != sizes:
        raise CheckpointError(f"{run_dir}: the tokenizer files do not match the checkpoint's vocabulary sizes")
    model = build_model(cfg.model, *sizes, args["pad_id"])
    weights, which = translation_weights(state)
    model.load_state_dict(weights)
    return LoadedRun(model.eval(), tokenizers, checkpoint, cfg, state["config"], args,
                     state.get("train_state", {}).get("step", -1), which)
