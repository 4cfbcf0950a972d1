"""The subjects of the distributed benchmarks (perf_tests and `lmsys-bench allreduce` / `ddp`): what one rank does in
one timed round, built by a `setup(ctx, **kwargs)` that lmsys/perf/multirank.py runs on every rank.

Unlike the wrappers beside it, this module reaches into the rest of lmsys (the model, the training step, the
optimizer) and into torch's DistributedDataParallel and fully_shard: it is where they meet for a benchmark, and
nothing in the library imports it but the benchmark tools.

`setup_all_reduce(ctx, nbytes)`: one in-place all-reduce (sum) of an fp32 tensor of `nbytes` on the rank.

`setup_train_step(ctx, ...)` returns one training step of the LM under a data-parallel wrapper: forward in the
`compute` precision ("fp32", or "bf16": autocast under DDP, weights gathered in bf16 under the fully sharded
wrappers), cross-entropy, backward, the wait for gradient communication (the span "comm_wait"), the optimizer step,
gradients cleared. Each rank draws its own batch; the model starts from the same seed everywhere (the wrappers
broadcast rank 0's parameters anyway). Memory marks per rank: "after_init" (model, wrapper and optimizer built),
"before_optimizer_step" and "after_optimizer_step" (allocated bytes at that point and the peak since the measured
call began).

Graph mode captures the step in a CUDA graph where its replays are tested to train like the eager step: the wrappers
of CAPTURED with the optimizer state replicated, those of CAPTURED_SHARDED with it sharded (ZeRO-1, ShardedOptimizer),
both with torch's AdamW (fused and capturable: its step count is a tensor on the device). Any other step raises as
soon as a capture starts, nothing recorded, and is timed uncaptured; `capture_refusal` gives its message.
"""

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lmsys import flops
from lmsys.distributed.ddp import DDPBucketed, DDPFlat, DDPIndividualParameters, DDPNaive
from lmsys.distributed.fsdp import FSDP
from lmsys.distributed.sharded_optimizer import ShardedOptimizer
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.train import cross_entropy, random_batch

BUCKET_SIZES_MB = (1, 10, 25, 100, 1000)
# Bucket sizes also run with every bucket all-reduced in bf16 (DDPBucketed's reduce_dtype): half the bytes of fp32.
BF16_REDUCE_BUCKET_SIZES_MB = (25, 100)
BUCKETED = (
    *(f"bucketed-{mb}mb" for mb in BUCKET_SIZES_MB),
    *(f"bucketed-{mb}mb-bf16reduce" for mb in BF16_REDUCE_BUCKET_SIZES_MB),
)
WRAPPERS = {
    "torch-ddp": None,  # built in wrap(): it needs the rank's device
    "naive": DDPNaive,
    "flat": DDPFlat,
    "individual": DDPIndividualParameters,
    **{f"bucketed-{mb}mb": functools.partial(DDPBucketed, bucket_size_mb=mb) for mb in BUCKET_SIZES_MB},
    **{f"bucketed-{mb}mb-bf16reduce": functools.partial(DDPBucketed, bucket_size_mb=mb, reduce_dtype=torch.bfloat16)
       for mb in BF16_REDUCE_BUCKET_SIZES_MB},
}
# torch's AdamW runs fused on a GPU (the reference numbers' optimizer); lmsys's is fused by construction.
OPTIMIZERS = {"torch-adamw": torch.optim.AdamW, "adamw": AdamW}
# Fully sharded wrappers compute in the given dtype themselves (weights gathered in it); the others run under autocast.
SHARDED_WRAPPERS = ("fsdp", "torch-fsdp2")
# The steps whose CUDA graph replays are tested to train like the eager step (tests/test_distributed_ddp.py): these
# wrappers with the optimizer state replicated, the CAPTURED_SHARDED ones with it sharded (ZeRO-1), both with an
# optimizer of CAPTURED_OPTIMIZERS. Graph mode captures these only; the others refuse the capture (capture_refusal)
# and are timed uncaptured.
CAPTURED = ("single", "naive", "flat", "individual", *BUCKETED, "fsdp")
CAPTURED_SHARDED = ("naive", "flat", "individual", *BUCKETED)
CAPTURED_OPTIMIZERS = ("torch-adamw",)
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def capture_refusal(wrapper: str, optimizer: str = "torch-adamw", sharded: bool = False) -> str | None:
    """Why graph mode does not capture this step (the message its step raises when a capture starts), or None when
    its captured step is tested to train like the eager one (CAPTURED, CAPTURED_SHARDED, CAPTURED_OPTIMIZERS)."""
    if wrapper not in ("single", *WRAPPERS, *SHARDED_WRAPPERS):
        raise ValueError(f"unknown wrapper {wrapper!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    if wrapper == "torch-ddp":
        # Its reducer's work fails the capture midway (cudaErrorStreamCaptureUnsupported on two H200s), and the
        # benchmark then skips out of memory.
        return "torch's DistributedDataParallel is not captured in a CUDA graph here"
    if wrapper not in (CAPTURED_SHARDED if sharded else CAPTURED):
        what = f"{wrapper} with ShardedOptimizer" if sharded else wrapper
        return f"the captured step of {what} is not tested to train like the eager one: it is not captured"
    if optimizer not in CAPTURED_OPTIMIZERS:
        # A replay would repeat the captured step's update: lmsys's AdamW counts steps on the host (the bias
        # corrections are written into each step's table) and copies that table from pinned memory.
        return (f"{optimizer} (lmsys.optim.AdamW) keeps its step count on the host, so a replay would repeat one "
                "step's update: it is not captured")
    return None


def torch_fully_shard(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """torch's FSDP2 as torchtitan applies it: `fully_shard` on each block, then on the root; parameters gathered in
    `dtype` (when given) and gradients reduced in fp32."""
    # Imported here: torch.distributed.fsdp brings DTensor and sympy, a slow import (docs/distributed.md, "Starting
    # the ranks") that collecting the perf tests does not need.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def wrap(name: str, model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> torch.nn.Module:
    """The model under the named data-parallel wrapper ("single": no wrapper, for world size 1)."""
    if name == "single":
        return model
    if name == "torch-ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if name == "fsdp":
        return FSDP(model, compute_dtype=dtype)
    if name == "torch-fsdp2":
        return torch_fully_shard(model, dtype)
    return WRAPPERS[name](model)


def model_config(size: str, context: int):
    """The preset at this context length, with SDPA as the attention (the reference numbers' setting)."""
    return dataclasses.replace(SIZES[size], context_length=context, attention="sdpa")


def step_flops(size: str, context: int, batch: int) -> int:
    """Model FLOPs of one rank's training step (the embedding is a lookup; every other weight a matmul)."""
    config = model_config(size, context)
    with torch.device("meta"):
        params = TransformerLM(config).num_parameters(embedding=False)
    return flops.training_step_flops(params, batch, context, config.num_layers, config.d_model)


def setup_train_step(ctx, size, context, batch, compute, wrapper, optimizer="torch-adamw", sharded=False):
    """Builds the model, the wrapper and the optimizer on this rank; returns the step (see the module docstring)."""
    return build_train_step(ctx, size, context, batch, compute, wrapper, optimizer, sharded)[0]


def build_train_step(ctx, size, context, batch, compute, wrapper, optimizer="torch-adamw", sharded=False):
    """setup_train_step's step, and the parameters it updates (this rank's shards under a sharded wrapper)."""
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = TransformerLM(model_config(size, context))
    dtype = DTYPES[compute]
    wrapped = wrap(wrapper, model, ctx.device, dtype)
    cls = OPTIMIZERS[optimizer]
    # Capturable: the step count on the device, so that the whole step can be captured in a CUDA graph (graph mode).
    options = {"fused": True, "capturable": True} if cls is torch.optim.AdamW and ctx.device.type == "cuda" else {}
    # A fully sharded wrapper's parameters are this rank's shards; the optimizer steps those.
    params = list(wrapped.parameters())
    opt = ShardedOptimizer(params, cls, **options) if sharded else cls(params, **options)
    autocast = dtype if wrapper not in SHARDED_WRAPPERS else None
    generator = torch.Generator(ctx.device).manual_seed(1000 + ctx.rank)
    inputs, targets = random_batch(batch, context, model.config.vocab_size, ctx.device, generator)
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    # A step refuses a CUDA graph capture before anything is recorded unless its replays are tested.
    refusal = capture_refusal(wrapper, optimizer, sharded)
    ctx.mark("after_init")

    def step():
        if refusal is not None and ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(refusal)
        with torch.autocast(ctx.device.type, dtype=autocast, enabled=autocast is not None):
            loss = cross_entropy(wrapped(inputs), targets)
        loss.backward()
        if finish is not None:
            with ctx.span("comm_wait"):
                finish()
        ctx.mark("before_optimizer_step")
        opt.step()
        ctx.mark("after_optimizer_step")
        opt.zero_grad(set_to_none=True)

    return step, params


def setup_all_reduce(ctx, nbytes):
    """One in-place all-reduce (sum) of an fp32 tensor of `nbytes` on this rank. It starts random (never time
    zeros); the sums grow each round and may reach inf, which changes nothing in what the collective moves."""
    tensor = torch.randn(nbytes // 4, device=ctx.device)

    def step():
        dist.all_reduce(tensor)

    return step
