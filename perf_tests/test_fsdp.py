"""Fully sharded data parallel: our FSDP beside torch's `fully_shard` (FSDP2, the reference provider), our bucketed
DDP and torch's DDP, one training step on ranks spawned by the test (`gpu_benchmark.distributed`).

Per benchmark: the step time (each round the slowest rank's), the share of it spent waiting for communication after
backward (extra_info spans.comm_wait: our wrappers' finish_gradient_synchronization; torch's waits inside backward),
and each rank's memory (extra_info per_rank_memory); the gate judges the time and the largest rank's peak. On GPUs the
steps of our FSDP and bucketed DDP are timed as CUDA graph replays, as perf_tests/test_ddp.py times its steps (their
captured steps are tested to train like the eager ones: lmsys/distributed/steps.py); torch's wrappers refuse the
capture and are timed queued, with a note saying so.

On GPUs: `xl` and `2.7B`, context 512, batch 4 per rank, bf16 compute (FSDP: weights gathered in bf16, gradients
reduced in fp32; DDP: bf16 autocast), NCCL on every GPU of the machine (at least 2); on the CPU: the tiny model in
fp32 with gloo.
"""

import pytest
import torch

from lmsys.distributed.steps import setup_train_step, step_flops

HAS_CUDA = torch.cuda.is_available()
SIZES = ("xl", "2.7B") if HAS_CUDA else ("tiny",)
CONTEXT, BATCH = (512, 4) if HAS_CUDA else (64, 2)
COMPUTE = "bf16" if HAS_CUDA else "fp32"
TRANSPORT = "nccl" if HAS_CUDA else "gloo"
# Every GPU of the machine (2 at least: on one GPU the multi-rank cases skip, saying so); 2 gloo ranks on the CPU.
WORLD_SIZE = max(2, torch.cuda.device_count())
# torch DDP too: the memory target of FSDP is stated against it (our bucketed DDP already holds less).
WRAPPERS = ("fsdp", "torch-fsdp2", "bucketed-100mb", "torch-ddp")


# The default subset on GPUs: the fully sharded wrappers at xl (the DDP ones there are perf_tests/test_ddp.py's too);
# 2.7B and the DDP wrappers with --perf-full-grid. The CPU runs them all.
DEFAULT = (("xl", "fsdp"), ("xl", "torch-fsdp2"))
CASES = [
    pytest.param(size, wrapper, id=f"{size}-{COMPUTE}-{wrapper}-ws{WORLD_SIZE}-{TRANSPORT}",
                 marks=[] if not HAS_CUDA or (size, wrapper) in DEFAULT else [pytest.mark.full_grid])
    for size in SIZES
    for wrapper in WRAPPERS
]


@pytest.mark.parametrize("size, wrapper", CASES)
def test_fsdp_step(gpu_benchmark, size, wrapper):
    gpu_benchmark.distributed(
        setup_train_step, world_size=WORLD_SIZE, flops=step_flops(size, CONTEXT, BATCH), precision=COMPUTE,
        size=size, context=CONTEXT, batch=BATCH, compute=COMPUTE, wrapper=wrapper, graph=True,
    )
