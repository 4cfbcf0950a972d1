"""ZeRO stage 1 (`lmsys.distributed.ShardedOptimizer`) against the unsharded optimizer, in the same DDP step.

Both run the bucketed DDP wrapper (100 MB buckets) on ranks spawned by the test; the sharded run keeps each rank's
AdamW state for its share of the parameters only. What to read: the step time, and each rank's memory after the
optimizer step (extra_info per_rank_memory: after_optimizer_step_allocated_bytes): sharding should save about
(N-1)/N of AdamW's state (8 bytes per parameter in fp32) per rank.

On GPUs the steps with torch's AdamW are timed as CUDA graph replays, as perf_tests/test_ddp.py times its steps (their
captured steps are tested to train like the eager ones: lmsys/distributed/steps.py); those with ours refuse the
capture (it keeps its step count on the host) and are timed queued, with a note saying so.

On GPUs: the `xl` model, context 512, batch 4 per rank, fp32 and bf16 autocast, torch's fused AdamW and ours, NCCL on
every GPU of the machine (at least 2); on the CPU: the tiny model with gloo.
"""

import pytest

from lmsys.distributed.steps import setup_train_step, step_flops
from perf_tests.test_ddp import BATCH, CONTEXT, HAS_CUDA, PRECISIONS, SIZE, TRANSPORT, WORLD_SIZE

OPTIMIZERS = ("torch-adamw", "adamw")
# The default subset on GPUs: torch's AdamW in bf16 (its steps capture), sharded and not; the rest with
# --perf-full-grid (the CPU runs all).
DEFAULT = ("bf16", "torch-adamw")


def cases():
    for precision in PRECISIONS:
        for optimizer in OPTIMIZERS:
            for sharded in (False, True):
                kind = "sharded" if sharded else "unsharded"
                name = f"{SIZE}-{precision}-{optimizer}-{kind}-ws{WORLD_SIZE}-{TRANSPORT}"
                default = not HAS_CUDA or (precision, optimizer) == DEFAULT
                yield pytest.param(precision, optimizer, sharded, id=name,
                                   marks=[] if default else [pytest.mark.full_grid])


@pytest.mark.parametrize("precision, optimizer, sharded", list(cases()))
def test_sharded_optimizer_step(gpu_benchmark, precision, optimizer, sharded):
    gpu_benchmark.distributed(
        setup_train_step, world_size=WORLD_SIZE, flops=step_flops(SIZE, CONTEXT, BATCH), precision=precision,
        size=SIZE, context=CONTEXT, batch=BATCH, compute=precision, wrapper="bucketed-100mb", optimizer=optimizer,
        sharded=sharded, graph=True,
    )
