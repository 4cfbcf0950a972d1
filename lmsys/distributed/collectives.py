"""Collective helpers: the all-reduce benchmark's sizes and bus bandwidth, and a coalesced broadcast.

Bus bandwidth (NCCL's `busbw`, nccl-tests' PERFORMANCE.md): a ring all-reduce of n bytes over N ranks moves
2 (N - 1) / N * n bytes through each rank's link, so `busbw = 2 (N - 1) / N * n / time` is comparable across world
sizes and with the hardware's link bandwidth.
"""

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn); 2.11 has the old ones only.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# 1 MiB, 10 MiB, 100 MiB, 1 GiB: the sizes of the all-reduce benchmark (the reference numbers use MiB).
ALL_REDUCE_SIZES = (2**20, 10 * 2**20, 100 * 2**20, 2**30)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """All-reduce bus bandwidth in GB/s (1e9 bytes/s): 2 (N - 1) / N * nbytes / seconds."""
    if world_size < 1 or seconds <= 0:
        raise ValueError(f"world_size must be >= 1 and seconds > 0, got {world_size} and {seconds}")
    return 2 * (world_size - 1) / world_size * nbytes / seconds / 1e9


def bus_bytes(nbytes: int, world_size: int) -> int:
    """The bytes each rank moves in a ring all-reduce of `nbytes`: bus bandwidth = bus_bytes / time."""
    return 2 * (world_size - 1) * nbytes // world_size


def all_reduce_tensor(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """An fp32 tensor of `nbytes` bytes (rounded down to whole floats), zeros: repeated all-reduces stay finite."""
    if nbytes < 4:
        raise ValueError(f"nbytes must hold at least one float32, got {nbytes}")
    return torch.zeros(nbytes // 4, dtype=torch.float32, device=device)


def broadcast_coalesced(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None = None, bucket_bytes: int = 64 * 2**20
) -> None:
    """Broadcast `tensors` in place from global rank `src`, with few collectives and little extra memory.

    A tensor of `bucket_bytes` or more goes alone, in place (no copy); smaller ones, taken in order, are packed into
    flat buffers of at most `bucket_bytes` (one per run of tensors with the same dtype and device). Every rank must
    pass tensors of the same shapes and dtypes in the same order.
    """
    run: list[torch.Tensor] = []
    run_bytes = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if run and (
            run_bytes + nbytes > bucket_bytes or (tensor.dtype, tensor.device) != (run[0].dtype, run[0].device)
        ):
            _broadcast_packed(run, src, group)
            run, run_bytes = [], 0
        if nbytes >= bucket_bytes:
            dist.broadcast(tensor, src, group=group)
        else:
            run.append(tensor)
            run_bytes += nbytes
    if run:
        _broadcast_packed(run, src, group)


def _broadcast_packed(tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    if len(tensors) == 1:
        dist.broadcast(tensors[0], src, group=group)
        return
    if dist.get_rank() == src:
        dist.broadcast(_flatten_dense_tensors(tensors), src, group=group)
        return
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    dist.broadcast(flat, src, group=group)
    torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))
