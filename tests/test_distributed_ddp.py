"""The four DDP variants against a single process trained on the whole batch (gloo, CPU ranks); on GPUs, the
benchmarked training step captured in a CUDA graph against the same step run eagerly.

Each rank trains the wrapped model on its slice of a batch and, beside it, a single-process copy on the whole batch;
after every backward the averaged gradients must equal the copy's, and after several steps so must the parameters.
Every rank initializes its model from a different seed, so the comparison also checks the broadcast at wrap.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lmsys.distributed.ddp import DDPBucketed, DDPFlat, DDPIndividualParameters, DDPNaive
from lmsys.distributed.launch import init_process_group, launch_ranks
from lmsys.distributed.sharded_optimizer import ShardedOptimizer
from lmsys.distributed.steps import (
    CAPTURED, CAPTURED_SHARDED, OPTIMIZERS, SHARDED_WRAPPERS, WRAPPERS, build_train_step,
    capture_refusal,
)
from lmsys.model import SIZES, TransformerLM
from lmsys.perf.backend import CudaBackend
from lmsys.perf.multirank import RankContext
from lmsys.train import cross_entropy

# Bucket sizes for the tiny LM (embedding and head 2.4 MiB each, block weights 16-64 KiB): one parameter per
# bucket, several buckets, one bucket.
VARIANTS = {
    "naive": DDPNaive,
    "flat": DDPFlat,
    "individual": DDPIndividualParameters,
    "bucketed_per_parameter": lambda module: DDPBucketed(module, bucket_size_mb=1e-6),
    "bucketed_several": lambda module: DDPBucketed(module, bucket_size_mb=0.1),
    "bucketed_one": lambda module: DDPBucketed(module, bucket_size_mb=1000),
    "bucketed_bf16_reduce": lambda module: DDPBucketed(module, bucket_size_mb=0.1, reduce_dtype=torch.bfloat16),
}
# Reducing in bf16 rounds each rank's gradient and the average to 8 significant bits (relative error 2^-8 each): the
# averaged gradients must be within 2% of the largest element of the single process's fp32 gradient of that parameter.
# A rank that kept its own gradient, or a bucket never cast back, is off by the gradient's own size.
BF16_REDUCE = {"bucketed_bf16_reduce"}
BF16_GRADIENT_TOLERANCE = 2e-2
STEPS = 3
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]
BACKENDS = ["gloo", pytest.param("nccl", marks=TWO_GPUS)]


class TiedFrozen(nn.Module):
    """Tied embedding and head, a frozen layer, a parameter never used, one used only by rows that start with 0.

    Used only by such rows: a rank whose slice has none gets no gradient for `extra` at all (its backward has no
    such edge), while another rank does; the wrappers must still issue the same collectives on every rank.
    """

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.unused = nn.Parameter(torch.randn(5))
        self.frozen = nn.Linear(dim, dim).requires_grad_(False)
        self.hidden = nn.Linear(dim, dim)
        self.extra = nn.Parameter(torch.randn(dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embedding.weight
        self.register_buffer("mark", torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.hidden(self.frozen(self.embedding(tokens))))  # (B, T, D)
        flagged = tokens[:, :1] == 0  # (B, 1)
        if flagged.any():
            x = x + flagged.unsqueeze(-1) * self.extra
        return self.head(x)  # (B, T, V)


def _tied_frozen_batch(generator: torch.Generator, batch: int, length: int = 7, vocab: int = 11):
    tokens = torch.randint(1, vocab, (batch, length + 1), generator=generator)
    tokens[: batch // dist.get_world_size(), 0] = 0  # only rank 0's rows are flagged
    return tokens[:, :-1], tokens[:, 1:]


def _lm_batch(generator: torch.Generator, batch: int, length: int = 16):
    tokens = torch.randint(SIZES["tiny"].vocab_size, (batch, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _train_like_single_process(seed: int, model_name: str, variant_names: list[str]) -> dict:
    """Train each variant for STEPS steps beside a single-process copy; assert equality; return bucket counts."""
    device = init_process_group()  # the CPU under gloo, this rank's GPU under NCCL
    rank, world_size = dist.get_rank(), dist.get_world_size()
    build, make_batch = {
        "lm": (lambda: TransformerLM(SIZES["tiny"]), _lm_batch),
        "tied_frozen": (TiedFrozen, _tied_frozen_batch),
    }[model_name]
    per_rank = 2
    bucket_counts = {}
    for name in variant_names:
        torch.manual_seed(seed + rank)  # every rank starts elsewhere: the wrap broadcasts rank 0's parameters
        with device:
            model = build()
        if model_name == "tied_frozen":
            model.mark.fill_(rank)
        ddp = VARIANTS[name](model)
        torch.manual_seed(seed)
        with device:
            reference = build()
        optimizer = _optimizer(name, ddp.parameters())
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
        start = [p.detach().clone() for p in reference.parameters()]
        generator = torch.Generator().manual_seed(seed + 1)
        for step in range(STEPS):
            inputs, targets = (t.to(device) for t in make_batch(generator, per_rank * world_size))
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            cross_entropy(ddp(inputs[mine]), targets[mine]).backward()
            ddp.finish_gradient_synchronization()
            cross_entropy(reference(inputs), targets).backward()
            for (param_name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
                if expected.grad is not None and name in BF16_REDUCE:
                    scale = expected.grad.abs().max().item()
                    torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=BF16_GRADIENT_TOLERANCE * scale,
                                               msg=lambda m: f"{name} {param_name}: {m}")
                elif expected.grad is not None:
                    torch.testing.assert_close(param.grad, expected.grad, msg=lambda m: f"{name} {param_name}: {m}")
                elif param.requires_grad:  # no rank produced a gradient: a zero one, the same on every rank
                    assert torch.equal(param.grad, torch.zeros_like(param)), f"{name} {param_name}"
                else:
                    assert param.grad is None
            optimizer.step()
            reference_optimizer.step()
            # Both ways of clearing: a fresh gradient is copied into its bucket, a kept one is accumulated into.
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            reference_optimizer.zero_grad()
        for (param_name, param), expected, initial in zip(model.named_parameters(), reference.parameters(), start,
                                                          strict=True):
            # bf16-reduced updates carry the gradients' rounding: within 2% of how far the parameter moved.
            moved = (expected - initial).abs().max().item()
            tolerance = {"rtol": 0, "atol": BF16_GRADIENT_TOLERANCE * moved} if name in BF16_REDUCE else {}
            torch.testing.assert_close(param, expected, **tolerance,
                                       msg=lambda m: f"{name} {param_name} after {STEPS} steps: {m}")
        if model_name == "tied_frozen":
            assert model.mark.item() == rank, "buffers are left alone"
            assert model.head.weight is model.embedding.weight
        bucket_counts[name] = len(ddp.buckets)
    return bucket_counts


def _optimizer(variant: str, params) -> torch.optim.Optimizer:
    # The sharded optimizer rides along with one variant: with averaged gradients it must step like SGD itself.
    if variant == "bucketed_several":
        return ShardedOptimizer(params, torch.optim.SGD, lr=0.2, momentum=0.9)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_variant_trains_the_lm_like_a_single_process(seed, backend):
    counts = launch_ranks(_train_like_single_process, 2, seed, "lm", list(VARIANTS), backend=backend, timeout=120)
    assert counts[0] == counts[1]
    trainable = len(list(TransformerLM(SIZES["tiny"]).parameters()))
    assert counts[0]["bucketed_per_parameter"] == counts[0]["naive"] == counts[0]["individual"] == trainable
    assert counts[0]["bucketed_one"] == counts[0]["flat"] == 1
    assert 2 < counts[0]["bucketed_several"] < trainable


@pytest.mark.parametrize("world_size", [2, 3])
def test_tied_frozen_and_unused_parameters_like_a_single_process(seed, world_size):
    counts = launch_ranks(_train_like_single_process, world_size, seed, "tied_frozen", list(VARIANTS), timeout=120)
    assert counts[0]["bucketed_per_parameter"] == 5  # embedding (= head), unused, hidden weight and bias, extra
    assert counts[0]["bucketed_one"] == 1


def _in_flight(ddp) -> int:
    """The number of all-reduces `ddp` launched and has not waited for."""
    return sum(bucket.work is not None for bucket in ddp._buckets)


def _backward_twice() -> tuple[str, int]:
    ddp = DDPBucketed(TiedFrozen(), bucket_size_mb=1e-6)
    inputs = torch.ones(2, 3, dtype=torch.long)
    ddp(inputs).sum().backward()
    try:
        ddp(inputs).sum().backward()
    except RuntimeError as error:
        return str(error), _in_flight(ddp)
    return "no error", _in_flight(ddp)


def test_second_backward_without_synchronization_is_an_error_that_leaves_nothing_in_flight():
    for message, in_flight in launch_ranks(_backward_twice, 2, timeout=60):
        assert "became ready twice without finish_gradient_synchronization()" in message, message
        assert in_flight == 0  # the first backward's all-reduces, waited for before the error


def _abandoned_step_then_a_fresh_one(variants: list[str]) -> dict[str, tuple[int, int]]:
    """Per variant: a backward without finish_gradient_synchronization, wait_for_pending_work, then a whole step whose
    gradients are those of one process (every rank gets the same batch), with nothing of the abandoned step in them.
    Returns the all-reduces in flight before and after the wait."""
    in_flight = {}
    for variant in variants:
        torch.manual_seed(0)
        model = TransformerLM(SIZES["tiny"])
        reference = TransformerLM(SIZES["tiny"])
        reference.load_state_dict(model.state_dict())
        ddp = VARIANTS[variant](model)
        inputs, targets = _lm_batch(torch.Generator().manual_seed(1), 2, length=8)
        cross_entropy(ddp(inputs[:, :4]), targets[:, :4]).backward()  # abandoned
        before = _in_flight(ddp)
        ddp.wait_for_pending_work()
        in_flight[variant] = (before, _in_flight(ddp))
        ddp.zero_grad()
        cross_entropy(ddp(inputs), targets).backward()
        ddp.finish_gradient_synchronization()
        cross_entropy(reference(inputs), targets).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.grad, expected.grad, msg=lambda m: f"{variant} {name}: {m}")
    return in_flight


def test_waiting_for_pending_work_after_an_abandoned_step_leaves_nothing_in_flight():
    """What lmsys.distributed.launch calls before it destroys a rank's group (a gloo group destroyed with collectives
    in flight has aborted FSDP's ranks): it waits for the abandoned step's all-reduces, and the next step is whole."""
    variants = ["individual", "bucketed_several"]
    for in_flight in launch_ranks(_abandoned_step_then_a_fresh_one, 2, variants, timeout=60):
        assert all(before > 0 and after == 0 for before, after in in_flight.values()), in_flight


def test_wrapping_needs_a_process_group():
    with pytest.raises(RuntimeError, match="DDPFlat needs an initialized default process group"):
        DDPFlat(nn.Linear(2, 2))


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_size_mb must be positive, got 0"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=0)


def test_reduce_dtype_must_be_a_floating_point_dtype():
    with pytest.raises(ValueError, match="reduce_dtype must be a floating-point torch.dtype or None, got torch.int8"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=1, reduce_dtype=torch.int8)
    with pytest.raises(ValueError, match="got 'bf16'"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=1, reduce_dtype="bf16")


def _cuda_rank() -> RankContext:
    """This rank's context as the gate's multi-rank benchmarks build it, on NCCL."""
    device = init_process_group("nccl")
    return RankContext(dist.get_rank(), dist.get_world_size(), device, CudaBackend())


def _captured_against_eager(wrapper: str, compute: str, sharded: bool) -> float:
    """On this rank: two copies of the benchmarked step (perf_tests/test_ddp.py, the tiny model; with the optimizer
    state sharded, perf_tests/test_sharded_optimizer.py; fsdp, perf_tests/test_fsdp.py), one run eagerly three times,
    the other captured in a CUDA graph as the gate captures it (a step run on a side stream first, then two replays);
    returns how far apart their parameters end, relative to how far the eager ones moved (under fsdp this rank's
    shards and the replicated parameters)."""
    ctx = _cuda_rank()
    eager, eager_params = build_train_step(ctx, "tiny", 64, 2, compute, wrapper, sharded=sharded)
    graphed, graphed_params = build_train_step(ctx, "tiny", 64, 2, compute, wrapper, sharded=sharded)
    start = [p.detach().clone() for p in eager_params]
    for _ in range(3):
        eager()
    replay, release = ctx.backend.capture_graph(graphed)
    replay()
    replay()
    torch.cuda.synchronize()
    release()
    moved = sum((p - s).double().square().sum() for p, s in zip(eager_params, start, strict=True)).sqrt()
    apart = sum((p - q).double().square().sum() for p, q in zip(eager_params, graphed_params, strict=True)).sqrt()
    return float(apart / moved)


# Every captured step: the wrappers of CAPTURED (fsdp among them) with the optimizer state replicated, those of
# CAPTURED_SHARDED with ShardedOptimizer (ZeRO-1); single on one GPU, the others on two.
CAPTURED_CASES = [
    pytest.param(wrapper, sharded, id=f"{wrapper}-sharded" if sharded else wrapper,
                 marks=[] if wrapper == "single" else TWO_GPUS)
    for sharded, wrappers in ((False, CAPTURED), (True, CAPTURED_SHARDED))
    for wrapper in wrappers
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
@pytest.mark.parametrize("wrapper, sharded", CAPTURED_CASES)
def test_the_captured_step_trains_like_the_eager_one(wrapper, sharded, compute):
    # Graph mode of the DDP benchmarks times replays of the captured steps: they must be the step (backward,
    # synchronization, optimizer step; under ZeRO-1 the broadcast of every rank's updated share; under FSDP the
    # all-gathers into buffers allocated and freed within the step, and the reduce-scatters), not a part of it. A
    # replay that skipped the update or applied it twice would leave the copies a third apart; one that skipped a
    # collective, or replayed a buffer since reused, would leave the other rank's share behind.
    world_size = 1 if wrapper == "single" else 2
    results = launch_ranks(_captured_against_eager, world_size, wrapper, compute, sharded, backend="nccl",
                           timeout=300)
    for rank, apart in enumerate(results):
        assert apart < 0.02, f"rank {rank}: the captured step's parameters end {apart:.1%} from the eager step's"


def _refused_then_stepped(wrapper: str, optimizer: str, sharded: bool) -> str:
    ctx = _cuda_rank()
    step, _ = build_train_step(ctx, "tiny", 64, 2, "bf16", wrapper, optimizer, sharded)
    with pytest.raises(RuntimeError, match="not captured") as refused:
        ctx.backend.capture_graph(step)
    step()  # nothing was recorded: the step still runs
    torch.cuda.synchronize()
    return str(refused.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("wrapper, optimizer, sharded, named", [
    ("torch-ddp", "torch-adamw", False, "DistributedDataParallel"),
    ("torch-fsdp2", "torch-adamw", False, "the captured step of torch-fsdp2 is not tested"),
    ("single", "torch-adamw", True, "the captured step of single with ShardedOptimizer is not tested"),
    ("bucketed-100mb", "adamw", False, "adamw (lmsys.optim.AdamW) keeps its step count on the host"),
    ("bucketed-100mb", "adamw", True, "adamw (lmsys.optim.AdamW) keeps its step count on the host"),
])
def test_a_step_outside_captured_refuses_the_capture_before_recording_anything(wrapper, optimizer, sharded, named):
    # torch's DistributedDataParallel fails a capture midway (its reducer), which left a rank out of memory; lmsys's
    # AdamW would replay one step's bias corrections; the replays of the others are not checked against the eager
    # step. The benchmarked step refuses the capture at once, so graph mode times it queued, and the rank goes on as
    # before.
    (message,) = launch_ranks(_refused_then_stepped, 1, wrapper, optimizer, sharded, backend="nccl", timeout=300)
    assert named in message


def _benchmarked_steps():
    """Every (wrapper, optimizer, sharded) that lmsys-bench ddp and the perf tests build (lmsys/bench/ddp.py's
    cases: no ShardedOptimizer with single or a fully sharded wrapper)."""
    for wrapper in ("single", *WRAPPERS, *SHARDED_WRAPPERS):
        for optimizer in OPTIMIZERS:
            for sharded in (False, True):
                if not (sharded and (wrapper == "single" or wrapper in SHARDED_WRAPPERS)):
                    yield wrapper, optimizer, sharded


def test_graph_mode_captures_exactly_the_tested_steps():
    # What the GPU test above checks (CAPTURED, CAPTURED_SHARDED, with torch's capturable AdamW) is what graph mode
    # captures; every other step has a message that names why.
    captured = {case for case in _benchmarked_steps() if capture_refusal(*case) is None}
    assert captured == {
        *((wrapper, "torch-adamw", False) for wrapper in CAPTURED),
        *((wrapper, "torch-adamw", True) for wrapper in CAPTURED_SHARDED),
    }
    assert {"bucketed-100mb", "bucketed-25mb", "bucketed-25mb-bf16reduce"} <= set(CAPTURED_SHARDED)
    for case in set(_benchmarked_steps()) - captured:
        assert capture_refusal(*case).endswith("not captured in a CUDA graph here" if case[0] == "torch-ddp"
                                               else "it is not captured"), case
    assert capture_refusal("torch-ddp", "adamw", True) == (
        "torch's DistributedDataParallel is not captured in a CUDA graph here")
    assert capture_refusal("torch-fsdp2") == (
        "the captured step of torch-fsdp2 is not tested to train like the eager one: it is not captured")
    assert capture_refusal("bucketed-100mb", "torch-adamw", True) is None
    assert capture_refusal("bucketed-100mb", "adamw", True) == (
        "adamw (lmsys.optim.AdamW) keeps its step count on the host, so a replay would repeat one step's update: it is "
        "not captured")


def test_capture_refusal_names_an_unknown_wrapper_or_optimizer():
    with pytest.raises(ValueError, match="unknown wrapper 'bucketed-2mb'"):
        capture_refusal("bucketed-2mb")
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        capture_refusal("flat", "sgd")
