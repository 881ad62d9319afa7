"""Small torch.distributed helpers that are no-ops in a single process."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_objects", "all_reduce_sum", "end_process_group", "is_distributed", "rank", "world_size"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (returns ``t``); identity without a process group."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank; ``[obj]`` without a process group."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def end_process_group() -> None:
    """Wait for every rank, then destroy the default process group (no-op without one).

    Lightning destroys only NCCL groups at exit; a process that exits with a Gloo group alive can be
    aborted at interpreter shutdown by Gloo's worker threads ("terminate called without an active
    exception"), typically the rank that finished first while rank 0 still writes its outputs."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()
