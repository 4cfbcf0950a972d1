"""All-reduce of an fp32 tensor through torch.distributed, on every world size the machine allows: the bus bandwidth
our DDP variants can hope for, measured under the gate like any other benchmark.

Each round is one `all_reduce` (sum) of S bytes on every rank, the round's time the slowest rank's. Bus bandwidth
(NCCL's convention) = 2(n-1)/n * S / time: the bytes each rank sends and receives in a ring, so it can be compared
across world sizes; the report's GB/s column is that figure (the test passes the bus bytes as `bytes`).

On GPUs: NCCL, 1 MB, 10 MB, 100 MB and 1 GB, world sizes 2 to the number of GPUs (skipped on one GPU); on the CPU:
gloo, 1 MB and 10 MB, 2 ranks.
"""

import pytest
import torch
import torch.distributed as dist

HAS_CUDA = torch.cuda.is_available()
TRANSPORT = "nccl" if HAS_CUDA else "gloo"
MB = 10**6
SIZES_MB = (1, 10, 100, 1000) if HAS_CUDA else (1, 10)
WORLD_SIZES = range(2, max(torch.cuda.device_count(), 2) + 1) if HAS_CUDA else (2,)


def setup_all_reduce(ctx, nbytes):
    """One all-reduce of an fp32 tensor of `nbytes` on this rank (random values: never time zeros)."""
    tensor = torch.randn(nbytes // 4, device=ctx.device)

    def step():
        dist.all_reduce(tensor)

    return step


def bus_bytes(nbytes: int, world_size: int) -> int:
    """The bytes each rank moves in a ring all-reduce of `nbytes`: bus bandwidth = bus_bytes / time."""
    return 2 * (world_size - 1) * nbytes // world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"ws{n}-{TRANSPORT}")
@pytest.mark.parametrize("size_mb", SIZES_MB, ids=lambda mb: f"{mb}MB")
def test_all_reduce(gpu_benchmark, size_mb, world_size):
    nbytes = size_mb * MB
    gpu_benchmark.distributed(
        setup_all_reduce, world_size=world_size, bytes=bus_bytes(nbytes, world_size), nbytes=nbytes
    )
