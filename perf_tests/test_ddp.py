"""Data-parallel training: our DDP variants (steps.WRAPPERS) beside torch's DistributedDataParallel (the reference
provider), and the same step on one device for the scaling ratio, each on ranks spawned by the test
(`gpu_benchmark.distributed`).

Per benchmark: the step time (each round the slowest rank's; on GPUs device time, each rank's step replayed as a
CUDA graph, or queued when a rank cannot capture it, with the eager rounds, launch cost included, beside as the CPU's
part: docs/gate.md, "Several ranks"), the share of it spent waiting for gradient communication after backward
(extra_info spans.comm_wait, from the eager rounds; torch DDP waits inside backward, so it has none), each rank's
memory (extra_info per_rank_memory: after initialization, before and after the optimizer step); the gate judges the
time and the largest rank's peak. Weak-scaling efficiency = single-device step / N-rank step.

On GPUs: the `xl` model, context 512, batch 4 per rank, fp32 and bf16 autocast, NCCL on every GPU of the machine,
at least 2 (skipped, saying so, on a machine with fewer); on the CPU: the tiny model with gloo on 2 ranks. Graph mode
because the bf16 step is the CPU's time otherwise: the CPU takes longer to issue its kernels than the GPU takes to run
them, and queued rounds of it spread between processes (docs/distributed.md, "Why the DDP steps are graph-timed").
"""

import pytest
import torch

from lmsys.distributed.steps import WRAPPERS, setup_train_step, step_flops

HAS_CUDA = torch.cuda.is_available()
SIZE, CONTEXT, BATCH = ("xl", 512, 4) if HAS_CUDA else ("tiny", 64, 2)
TRANSPORT = "nccl" if HAS_CUDA else "gloo"
PRECISIONS = ("fp32", "bf16") if HAS_CUDA else ("fp32",)
# Every GPU of the machine (2 at least: on one GPU the multi-rank cases skip, saying so); 2 gloo ranks on the CPU.
WORLD_SIZE = max(2, torch.cuda.device_count())
# The default subset on GPUs (each step compiles the xl model on every rank): one GPU, torch DDP and our best bucketing
# per precision; every other wrapper with --perf-full-grid. The CPU runs them all.
DEFAULT = {"bf16": ("single", "torch-ddp", "bucketed-25mb", "bucketed-25mb-bf16reduce"),
           "fp32": ("single", "torch-ddp", "bucketed-100mb")}


def case(precision, wrapper, world_size, name):
    default = not HAS_CUDA or wrapper in DEFAULT[precision]
    return pytest.param(precision, wrapper, world_size, id=name, marks=[] if default else [pytest.mark.full_grid])


def cases():
    for precision in PRECISIONS:
        yield case(precision, "single", 1, f"{SIZE}-{precision}-single-ws1-{TRANSPORT}")
        for wrapper in WRAPPERS:
            yield case(precision, wrapper, WORLD_SIZE, f"{SIZE}-{precision}-{wrapper}-ws{WORLD_SIZE}-{TRANSPORT}")


@pytest.mark.parametrize("precision, wrapper, world_size", list(cases()))
def test_ddp_step(gpu_benchmark, precision, wrapper, world_size):
    gpu_benchmark.distributed(
        setup_train_step, world_size=world_size, flops=step_flops(SIZE, CONTEXT, BATCH), precision=precision,
        size=SIZE, context=CONTEXT, batch=BATCH, compute=precision, wrapper=wrapper, graph=True,
    )
