"""Where and how tensors run: device choice, mixed precision, seeding, RNG state."""

from __future__ import annotations

import contextlib
import logging
import platform
from dataclasses import dataclass

import torch

from transformer_mt.errors import UsageError

logger = logging.getLogger(__name__)


def pick_device(name: str = "auto") -> torch.device:
    """`auto` picks cuda, then mps, then cpu; a named device must be available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' was requested but no CUDA GPU is available (use 'auto' or 'cpu')")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("device 'mps' was requested but MPS is not available (use 'auto' or 'cpu')")
    return torch.device(name)


@dataclass(frozen=True)
class Precision:
    """The autocast dtype (None = plain fp32) and whether a gradient scaler is needed."""

    dtype: torch.dtype | None
    device_type: str

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    @property
    def needs_grad_scaler(self) -> bool:
        # fp16 has a narrow exponent range: small gradients underflow without loss scaling.
        return self.dtype == torch.float16

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def pick_precision(name: str, device: torch.device) -> Precision:
    """`auto`: bf16 on CUDA GPUs that support it, else fp16 on CUDA, fp32 on CPU and MPS."""
    if name == "auto":
        if device.type != "cuda":
            return Precision(None, device.type)
        name = "bf16" if _native_bf16(device) else "fp16"
    if name == "fp32":
        return Precision(None, device.type)
    if name == "fp16" and device.type != "cuda":
        raise UsageError(f"train.precision: fp16 needs a CUDA GPU, but the device is {device.type}")
    if name == "bf16" and device.type == "cuda" and not _native_bf16(device):
        raise UsageError("train.precision: bf16 is not supported natively by this GPU (compute capability "
                         "below 8.0); use fp16 or auto")
    return Precision(torch.bfloat16 if name == "bf16" else torch.float16, device.type)


def _native_bf16(device: torch.device) -> bool:
    # `torch.cuda.is_bf16_supported()` also says yes for emulated (slow) bf16 on pre-Ampere GPUs.
    return torch.cuda.get_device_capability(device)[0] >= 8


def cpu_bf16_emulated() -> bool:
    """True on an x86 CPU without AVX512-BF16 or AMX, where oneDNN emulates bf16 matrix products.
    (Other architectures, or a torch without these private probes: not known, so no claim.)"""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def warn_if_bf16_emulated(precision: Precision, device: torch.device) -> None:
    """Warn when bf16 was asked for on a CPU that emulates it: it may then be slower than fp32."""
    if precision.name == "bf16" and device.type == "cpu" and cpu_bf16_emulated():
        logger.warning("train.precision bf16 on an x86 CPU without bf16 instructions (AVX512-BF16 or AMX): its "
                       "matrix products are emulated and may well be slower than fp32; compare the tokens/s")


def seed_everything(seed: int) -> None:
    """Seed torch's CPU and CUDA generators (tmt draws no randomness from `random` or numpy)."""
    torch.manual_seed(seed)


def rng_state() -> dict:
    """The global torch RNG states (dropout draws from them), as tensors for a checkpoint: the
    CPU's, every visible CUDA device's, and the MPS device's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def load_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved. A device's state is skipped when that device is not here
    (a GPU run resumed on a CPU); when it is here but cannot be restored (another number of
    visible CUDA devices), a warning says the resumed run's dropout will differ."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("the checkpoint holds the RNG states of %d CUDA devices, and %d are visible now: "
                           "from here on, dropout differs from an uninterrupted run", len(state["cuda"]),
                           torch.cuda.device_count())
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
