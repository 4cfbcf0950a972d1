"""All-reduce of an fp32 tensor through torch.distributed, on every world size the machine allows: the bus bandwidth
our DDP variants can hope for, measured under the gate like any other benchmark.

Each round is one `all_reduce` (sum) of S bytes on every rank, the round's time the slowest rank's. Bus bandwidth
(NCCL's convention) = 2(n-1)/n * S / time: the bytes each rank sends and receives in a ring, so it can be compared
across world sizes; the report's GB/s column is that figure (the test passes the bus bytes as `bytes`).

On GPUs: NCCL, 1 MiB, 10 MiB, 100 MiB and 1 GiB, world sizes 2 to the number of GPUs (skipped on one GPU), the default
subset 100 MiB and 1 GiB on every GPU; on the CPU: gloo, 1 MiB and 10 MiB, 2 ranks.
"""

import pytest
import torch

from lmsys.distributed.collectives import ALL_REDUCE_SIZES, bus_bytes
from lmsys.distributed.steps import setup_all_reduce

HAS_CUDA = torch.cuda.is_available()
TRANSPORT = "nccl" if HAS_CUDA else "gloo"
MIB = 2**20
SIZES = ALL_REDUCE_SIZES if HAS_CUDA else ALL_REDUCE_SIZES[:2]
WORLD_SIZES = range(2, max(torch.cuda.device_count(), 2) + 1) if HAS_CUDA else (2,)


# The default subset on GPUs: the two large sizes on every GPU of the machine; the rest with --perf-full-grid.
SIZE_PARAMS = [pytest.param(n, id=f"{n // MIB}MiB",
                            marks=[] if not HAS_CUDA or n >= 100 * MIB else [pytest.mark.full_grid])
               for n in SIZES]
WORLD_SIZE_PARAMS = [pytest.param(n, id=f"ws{n}-{TRANSPORT}",
                                  marks=[] if not HAS_CUDA or n == WORLD_SIZES[-1] else [pytest.mark.full_grid])
                     for n in WORLD_SIZES]


@pytest.mark.parametrize("world_size", WORLD_SIZE_PARAMS)
@pytest.mark.parametrize("nbytes", SIZE_PARAMS)
def test_all_reduce(gpu_benchmark, nbytes, world_size):
    gpu_benchmark.distributed(
        setup_all_reduce, world_size=world_size, bytes=bus_bytes(nbytes, world_size), nbytes=nbytes
    )
