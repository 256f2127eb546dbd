"""Where and how tensors run: device choice, mixed precision, attention kernels, seeding, RNG state."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import platform
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_mt.core.errors import UsageError

logger = logging.getLogger(__name__)


def pick_device(name: str = "auto") -> torch.device:
    """`auto` picks cuda, then mps, then cpu; a named device must be available."""
    if name == "auto":
        mps = torch.backends.mps.is_available()
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
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
    def needs_grad_scaler(self) -> bool:  # fp16's narrow exponent range: small gradients underflow
        return self.dtype == torch.float16

    def autocast(self, cache_enabled: bool = True) -> contextlib.AbstractContextManager:
        """Autocast to this precision's dtype (none for fp32). `cache_enabled=False` for CUDA graph
        capture: autocast's cache of cast weights would be captured once and then be stale."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=cache_enabled)


def device_description(device: torch.device) -> str:
    """The device as a bug report names it: `cuda: NVIDIA H100 80GB HBM3`, `cpu: x86_64`."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"{device.type}: {platform.processor() or platform.machine()}"


def machine_memory_bytes() -> int:
    """The machine's physical memory in bytes (2**62 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 2**62


def pick_precision(name: str, device: torch.device) -> Precision:
    """`auto`: bf16 on CUDA GPUs that support it, else fp16 on CUDA, fp32 on CPU and MPS."""
    if name == "auto":
        name = "fp32" if device.type != "cuda" else "bf16" if _native_bf16(device) else "fp16"
    if name == "fp32":
        return Precision(None, device.type)
    if name == "fp16" and device.type != "cuda":
        raise UsageError(f"train.precision: fp16 needs a CUDA GPU, but the device is {device.type}")
    if name == "bf16" and device.type == "cuda" and not _native_bf16(device):
        raise UsageError("train.precision: bf16 is not supported natively by this GPU (compute capability "
                         "below 8.0); use fp16 or auto")
    return Precision(torch.bfloat16 if name == "bf16" else torch.float16, device.type)


def _native_bf16(device: torch.device) -> bool:  # `is_bf16_supported()` also counts emulated bf16
    return torch.cuda.get_device_capability(device)[0] >= 8


def cpu_bf16_emulated() -> bool:
    """True on an x86 CPU without AVX512-BF16 or AMX, where oneDNN emulates bf16 matrix products."""
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


# The SDPA kernels each use may run on a CUDA GPU, best first (docs/architecture.md, "Attention kernels").
_CUDA_AUTO = {
    "train": (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
    "decode": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}
_CHOSEN = {
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH),
    "math": (SDPBackend.MATH,),
}
# torch >= 2.6 tries the kernels in the list's order; older torch in its own (flash, efficient, math).
_ORDERED_SDPA = "set_priority" in inspect.signature(sdpa_kernel).parameters


@dataclass(frozen=True)
class AttentionKernels:
    """The SDPA kernels one use (training steps or decoding) may run, best first; empty: PyTorch chooses."""

    backends: tuple[SDPBackend, ...] = ()

    @property
    def names(self) -> list[str]:
        return [backend.name for backend in self.backends]

    def enabled(self) -> contextlib.AbstractContextManager:
        """A context in which attention runs on these kernels only (tried in this order)."""
        if not self.backends:
            return contextlib.nullcontext()
        return sdpa_kernel(list(self.backends), **({"set_priority": True} if _ORDERED_SDPA else {}))


def pick_attention(name: str, device: torch.device, use: Literal["train", "decode"]) -> AttentionKernels:
    """The kernels of `train.attention_backend` / `decode.attention_backend` = `name` on `device`:
    `auto`'s on CUDA, else PyTorch's choice; a named kernel, then math; `auto`'s where it cannot run."""
    if name == "auto" or attention_fallback(name, device) is not None:
        return AttentionKernels(_CUDA_AUTO[use] if device.type == "cuda" else ())
    return AttentionKernels(_CHOSEN[name])


def attention_fallback(name: str, device: torch.device) -> str | None:
    """Why the attention choice `name` cannot run on `device` (it then falls back to `auto`), or None."""
    if name in ("auto", "math"):
        return None
    if device.type != "cuda":
        return f"{name} is a CUDA kernel; on {device.type} PyTorch picks the attention kernel itself (as with auto)"
    major, minor = torch.cuda.get_device_capability(device)
    if name in ("flash", "cudnn") and major < 8:  # both need Ampere (sm80) or later
        return (f"{name} attention needs a GPU of compute capability 8.0 or later, this one is {major}.{minor}: "
                "using auto's kernels")
    if name == "cudnn" and not torch.backends.cudnn.is_available():
        return "cudnn attention needs cuDNN, which this torch lacks: using auto's kernels"
    return None


def warn_attention_fallbacks(device: torch.device, choices: dict[str, str]) -> None:
    """One warning line per config key (e.g. `decode.attention_backend`) whose choice cannot run here."""
    for key, name in choices.items():
        if (reason := attention_fallback(name, device)) is not None:
            logger.warning("%s: %s", key, reason)


def rng_state() -> dict:
    """The global torch RNG states (dropout draws from them) of the CPU and every visible device."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def load_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved; an absent device's state is skipped, a mismatched one warned about."""
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
