"""Collective helpers: bus bandwidth, the benchmark tensors, and the coalesced broadcast (gloo, CPU ranks)."""

import pytest
import torch
import torch.distributed as dist

from lmsys.distributed.collectives import ALL_REDUCE_SIZES, all_reduce_tensor, broadcast_coalesced, bus_bandwidth
from lmsys.distributed.launch import launch_ranks


def test_bus_bandwidth_is_the_ring_all_reduce_traffic_per_second():
    assert bus_bandwidth(10**9, 1.0, 1) == 0.0  # one rank moves nothing
    assert bus_bandwidth(10**9, 1.0, 2) == pytest.approx(1.0)
    assert bus_bandwidth(10**9, 0.5, 4) == pytest.approx(2 * 3 / 4 * 2)
    with pytest.raises(ValueError, match="seconds > 0"):
        bus_bandwidth(10**9, 0.0, 2)


def test_all_reduce_sizes_and_tensors():
    assert ALL_REDUCE_SIZES == (2**20, 10 * 2**20, 100 * 2**20, 2**30)
    tensor = all_reduce_tensor(10 * 2**20 + 3, "cpu")
    assert tensor.dtype == torch.float32 and tensor.numel() * 4 == 10 * 2**20 and not tensor.any()
    with pytest.raises(ValueError, match="at least one float32"):
        all_reduce_tensor(3, "cpu")


# Sizes in elements around the 256-byte bucket used below: packed runs, a tensor alone, a dtype change, a scalar.
SHAPES_AND_DTYPES = [
    ((3,), torch.float32),
    ((5, 2), torch.float32),
    ((64,), torch.float32),
    ((7,), torch.float32),
    ((4,), torch.float64),
    ((), torch.float64),
    ((100,), torch.float16),
    ((2, 3), torch.float32),
]


def _broadcast_from_each_rank(seed: int) -> None:
    rank = dist.get_rank()
    for src in range(dist.get_world_size()):
        expected = [
            torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)).to(dtype)
            for i, (shape, dtype) in enumerate(SHAPES_AND_DTYPES)
        ]
        tensors = [t.clone() if rank == src else torch.full_like(t, float(rank)) for t in expected]
        broadcast_coalesced(tensors, src=src, bucket_bytes=256)
        for got, want in zip(tensors, expected, strict=True):
            assert torch.equal(got, want), (src, got, want)


def test_broadcast_coalesced_delivers_every_tensor_from_every_source(seed):
    launch_ranks(_broadcast_from_each_rank, 3, seed, timeout=60)
