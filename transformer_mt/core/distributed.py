"""Several processes, one run: torchrun's environment, the process group, and the collectives the
ranks meet in. Rank 0 alone writes files; without torchrun, `Distributed()` is a world of one."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from transformer_mt.core.errors import UsageError

ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

MAIN_FIRST_TIMEOUT = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Distributed:
    """This process's place in the run: `rank` of `world_size`, `local_rank` on its machine."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and prints progress."""
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> Distributed:
        """Read torchrun's RANK, LOCAL_RANK and WORLD_SIZE; a world of one when they are absent."""
        values = {name: os.environ.get(name) for name in ENV_VARS}
        if all(value is None for value in values.values()):
            return cls()
        try:
            rank, local_rank, world_size = (int(values[name] or "") for name in ENV_VARS)
        except ValueError:
            found = ", ".join(f"{name}={value!r}" for name, value in values.items())
            raise UsageError(f"incomplete or non-integer torchrun environment ({found}); launch with torchrun, "
                             "or unset these variables for a single process") from None
        if not 0 <= rank < world_size or local_rank < 0:
            raise UsageError(f"RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world_size} are inconsistent")
        return cls(rank, local_rank, world_size)

    def local_device(self, device: torch.device) -> torch.device:
        """This rank's device: on CUDA, the GPU of its `local_rank`; otherwise `device` itself."""
        if self.enabled and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def start(self, device: torch.device) -> None:
        """Join the process group (NCCL on CUDA, gloo on CPU) where torchrun's MASTER_ADDR/PORT say."""
        if not self.enabled or dist.is_initialized():
            return
        if device.type == "mps":
            raise UsageError("training with several processes needs CUDA GPUs or the CPU; set train.device: cpu "
                             "or run one process on MPS")
        device = self.local_device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def stop(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Run the body on rank 0 first (it writes the shared files: tokenizers, splits, token cache),
        then on the other ranks, which wait in a gloo barrier of their own with a day's timeout (in
        the default group NCCL's watchdog would abort a long data preparation after 10 minutes)."""
        if not self.enabled:
            yield
            return
        waiting_room = dist.new_group(backend="gloo", timeout=MAIN_FIRST_TIMEOUT)
        if not self.is_main:
            dist.barrier(group=waiting_room)
        yield
        if self.is_main:
            dist.barrier(group=waiting_room)
        dist.destroy_process_group(waiting_room)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place; returns it."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of `tensor` over all ranks, in place; returns it."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def gather(self, obj: object) -> list[object]:
        """Every rank's `obj` (picklable), indexed by rank, on every rank."""
        if not self.enabled:
            return [obj]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered


def interleave(parts: list[list]) -> list:
    """Undo a `items[rank::world_size]` split: parts[r][i] was item i·W + r."""
    return [part[i] for i in range(len(parts[0])) for part in parts if i < len(part)]
