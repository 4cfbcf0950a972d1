"""Attention providers side by side: time, TFLOP/s and memory high-water of forward, backward and both.

Providers: the naive reference (eager and compiled), FlashAttention-2 in PyTorch (compiled), FlashAttention-2 in
Triton, and PyTorch SDPA restricted to its FlashAttention-2 or its cuDNN backend. A provider that cannot run a
configuration is skipped with the reason: the Triton kernels and cuDNN need CUDA, and SDPA's backends refuse some
dtypes (FlashAttention-2 and cuDNN take no float32 on CUDA; the reason quoted is SDPA's own).

Configurations, from the CS336 seeds (GPU sizes; the CPU runs one small point of each test):
- `test_attention_seeds_grid`: batch 8, no heads ((B, T, D) inputs), not causal, d in {16, 32, 64, 128} x
  seq in {256, 1024, 4096, 8192, 16384}, fp32 (the seeds' dtype) and bf16. Naive attention runs out of memory
  at the top: the `gpu_benchmark` fixture records that as a skip with the size asked for.
- `test_attention_causal_grid`: batch 1, causal, (B, T, D), seq 128 ... 65536 (powers of two) x d in
  {16, 32, 64, 128} x {bf16, fp32}.
- `test_attention_anchors`: (batch, heads, seq, d) reference points (ANCHOR_SHAPES), e.g. (4, 16, 8192, 128) causal.
- `test_attention_training_grid`: the shapes language models train with (lmsys.bench.attention's `training_grid`,
  also `lmsys-bench attention --grid training`): d in {64, 80, 96, 128} x seq 512 ... 16384 at 16384 tokens a batch,
  heads (B, H, T, d) with H*d of 1536 to 2560, causal and not, bf16; flash_triton beside SDPA's cuDNN and flash
  backends.
- `test_attention_leaderboard`: the CS336 leaderboard, q, k, v of shape (16, 16384, 64), bf16, causal, forward +
  backward, every provider under torch.compile.
- `test_attention_launch_cost`: the CPU's time per call (host timing) of flash_triton and SDPA at (1, 1, 4096, 64)
  causal bf16, forward and forward + backward (SDPA restricted to one backend with --perf-full-grid).
Modes: "fwd" (no autograd graph), "bwd" (the forward runs once, untimed; each call is one backward through the
kept graph) and "fwd_bwd". Gradients are taken with a random dO through `torch.autograd.grad`, so nothing
accumulates into `.grad` across rounds.

The default run is a representative subset, each point with flash_triton and SDPA's cuDNN backend: the leaderboard,
the (4, 16, 8192, 128) causal bf16 forward, bf16 forward + backward at seq 4096 (d 64 and 128 in the causal grid, d 64
in the seeds' grid), four training shapes' forward + backward (TRAINING_DEFAULT, one per head dim), and the launch
costs; every other point and provider is marked `full_grid` (run them with --perf-full-grid).
"""

import math
import warnings

import pytest
import torch

from lmsys.attention.providers import NEEDS_CUDA, SDPA_BACKENDS, attention_function, sdpa_with, timed_call
from lmsys.bench.attention import training_grid
from lmsys.flops import attention_flops

PROVIDERS = ("naive", "naive_compiled", "flash_torch_compiled", "flash_triton", "sdpa_flash", "sdpa_cudnn")
# Up to this length the fused kernels are launch-bound on an H100 (the CPU's launch path costs more than the
# kernels): on a GPU they are timed as CUDA-graph replays, their eager time kept beside (docs/gate.md, "Graph mode").
GRAPH_PROVIDERS = ("flash_triton", "sdpa_flash", "sdpa_cudnn")
GRAPH_MAX_SEQ = 4096
MODES = ("fwd", "bwd", "fwd_bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HAS_CUDA = torch.cuda.is_available()


def _refusal(backend, q, k, v, is_causal) -> str | None:
    """Why SDPA's `backend` refuses these inputs, in SDPA's words (its warnings), or None when it runs them."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            sdpa_with(backend)(q, k, v, is_causal)
        except RuntimeError as exc:
            return " ".join(str(w.message) for w in caught) or str(exc)
    return None


def attention_for(provider: str, q, k, v, is_causal: bool, compile_all: bool = False):
    """The provider's attention function for these inputs, or a pytest.skip saying why it cannot run them."""
    if provider in NEEDS_CUDA and q.device.type != "cuda":
        pytest.skip(NEEDS_CUDA[provider])
    if provider in SDPA_BACKENDS:
        reason = _refusal(SDPA_BACKENDS[provider], q, k, v, is_causal)
        if reason is not None:
            pytest.skip(f"SDPA's {provider.removeprefix('sdpa_')} backend refuses {q.dtype} {tuple(q.shape)}: {reason}")
    return attention_function(provider, compile=compile_all)


def run_case(gpu_benchmark, device, provider, shape, is_causal, dtype, mode, compile_all=False):
    """Benchmark one provider in one mode on fresh random (q, k, v) of `shape`; returns nothing, checks finiteness.

    Launch-bound points of the fused kernels on a GPU are timed in a CUDA graph (GRAPH_PROVIDERS, GRAPH_MAX_SEQ)."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    attend = attention_for(provider, q, k, v, is_causal, compile_all)
    graph = device.type == "cuda" and provider in GRAPH_PROVIDERS and shape[-2] <= GRAPH_MAX_SEQ and not compile_all
    batch, heads = (shape[0], 1) if len(shape) == 3 else shape[:2]
    work = attention_flops(batch, heads, shape[-2], shape[-2], shape[-1], is_causal, mode)
    fn, args = timed_call(attend, q, k, v, is_causal, mode)
    out = gpu_benchmark(fn, *args, flops=work, graph=graph)
    assert all(torch.isfinite(x).all() for x in (out if isinstance(out, tuple) else (out,)))


def point(shape, causal, dtype, mode, default=False):
    """One configuration as a pytest.param: behind --perf-full-grid unless it is in the default subset."""
    marks = [] if default else [pytest.mark.full_grid]
    if math.prod(shape[:-1]) <= 8 * 1024:
        # At most 8192 query rows (one batch of 8 x 1024 tokens): runs of tens of microseconds, which launch jitter
        # alone moves by more than the tolerance's floors.
        marks.append(pytest.mark.perf_tolerance(time=0.15))
    name = f"{'x'.join(map(str, shape))}-{'causal' if causal else 'full'}-{dtype}-{mode}"
    return pytest.param(shape, causal, dtype, mode, marks=marks, id=name)


def _seeds_points():
    if not HAS_CUDA:
        return [point((2, 128, 64), False, "fp32", "fwd_bwd", default=True)]
    return [
        point((8, seq, d), False, dtype, mode, default=(seq, d, dtype, mode) == (4096, 64, "bf16", "fwd_bwd"))
        for d in (16, 32, 64, 128)
        for seq in (256, 1024, 4096, 8192, 16384)
        for dtype in ("fp32", "bf16")
        for mode in MODES
    ]


def _causal_points():
    if not HAS_CUDA:
        return [point((1, 256, 64), True, "fp32", "fwd_bwd", default=True)]
    return [
        point((1, seq, d), True, dtype, mode, default=seq == 4096 and d >= 64 and (dtype, mode) == ("bf16", "fwd_bwd"))
        for d in (16, 32, 64, 128)
        for seq in (2**i for i in range(7, 17))
        for dtype in ("bf16", "fp32")
        for mode in MODES
    ]


# (shape, causal, dtype) reference points: the shapes of the reference timings of SDPA's backends on an H100
# (docs/attention.md, "The anchors and the leaderboard's dO"); the first one's forward is in the default subset. Our
# numbers: docs/NVIDIA_H100_80GB_HBM3.md.
ANCHOR_SHAPES = [
    ((4, 16, 8192, 128), True, "bf16"),
    ((4, 16, 8192, 128), False, "bf16"),
    ((1, 16, 16384, 64), True, "bf16"),
    ((1, 16, 4096, 64), True, "bf16"),
    ((8, 16, 1024, 64), True, "bf16"),
    ((4, 16, 2048, 64), True, "fp32"),
]


def _anchor_points():
    if not HAS_CUDA:
        return [point((1, 2, 128, 32), True, "bf16", mode, default=True) for mode in ("fwd", "bwd")]
    return [
        point(shape, causal, dtype, mode, default=(shape, causal, dtype, mode) == (*ANCHOR_SHAPES[0], "fwd"))
        for shape, causal, dtype in ANCHOR_SHAPES
        for mode in MODES
    ]


# Compiling these takes minutes per shape (flash_torch unrolls its tile loop) or they are 10-50x off the fused
# kernels; on a GPU SDPA's FlashAttention-2 backend is a second reference beside cuDNN, SDPA's fastest on Hopper (on
# the CPU it is the SDPA path that runs). They run only with --perf-full-grid, so the default subset times our
# kernels against cuDNN's in under a minute.
FULL_GRID_PROVIDERS = ("naive", "naive_compiled", "flash_torch_compiled") + ("sdpa_flash",) * HAS_CUDA


def providers(names):
    """Each provider as a pytest.param, those of FULL_GRID_PROVIDERS behind --perf-full-grid."""
    return [pytest.param(name, marks=[pytest.mark.full_grid] if name in FULL_GRID_PROVIDERS else [], id=name)
            for name in names]


def with_providers(points, names=PROVIDERS, full_grid_only=FULL_GRID_PROVIDERS):
    """Each grid point once per provider of `names`; the default point of a provider in `full_grid_only` moves behind
    --perf-full-grid."""
    params = []
    for p in points:
        for provider in names:
            marks = list(p.marks)
            if provider in full_grid_only and not any(m.name == "full_grid" for m in marks):
                marks.append(pytest.mark.full_grid)
            params.append(pytest.param(provider, *p.values, marks=marks, id=f"{p.id}-{provider}"))
    return params


@pytest.mark.parametrize("provider, shape, causal, dtype, mode", with_providers(_seeds_points()))
def test_attention_seeds_grid(gpu_benchmark, fresh_compiler, device, seed, provider, shape, causal, dtype, mode):
    run_case(gpu_benchmark, device, provider, shape, causal, DTYPES[dtype], mode)


@pytest.mark.parametrize("provider, shape, causal, dtype, mode", with_providers(_causal_points()))
def test_attention_causal_grid(gpu_benchmark, fresh_compiler, device, seed, provider, shape, causal, dtype, mode):
    run_case(gpu_benchmark, device, provider, shape, causal, DTYPES[dtype], mode)


@pytest.mark.parametrize("provider", providers(PROVIDERS))
@pytest.mark.parametrize("shape, causal, dtype, mode", _anchor_points())
def test_attention_anchors(gpu_benchmark, fresh_compiler, device, seed, provider, shape, causal, dtype, mode):
    run_case(gpu_benchmark, device, provider, shape, causal, DTYPES[dtype], mode)


# The training grid's providers, and its points in the default subset (forward +
# backward, flash_triton and cuDNN): one per head dim, causal as language models train, one full.
TRAINING_PROVIDERS = ("flash_triton", "sdpa_cudnn", "sdpa_flash")
TRAINING_DEFAULT = (
    ((16, 32, 1024, 64), True),
    ((4, 32, 4096, 80), True),
    ((8, 16, 2048, 96), True),
    ((4, 16, 4096, 128), False),
)


def _training_params():
    """Each training point once per provider, behind --perf-full-grid but for TRAINING_DEFAULT's forward + backward
    with flash_triton and cuDNN (the CPU: one small point at d=80)."""
    if not HAS_CUDA:
        points = [point((1, 2, 64, 80), True, "fp32", "fwd_bwd", default=True)]
    else:
        points = [point(shape, causal, "bf16", mode, default=(shape, causal) in TRAINING_DEFAULT and mode == "fwd_bwd")
                  for shape, causal in training_grid() for mode in MODES]
    return with_providers(points, TRAINING_PROVIDERS)


@pytest.mark.parametrize("provider, shape, causal, dtype, mode", _training_params())
def test_attention_training_grid(gpu_benchmark, fresh_compiler, device, seed, provider, shape, causal, dtype, mode):
    run_case(gpu_benchmark, device, provider, shape, causal, DTYPES[dtype], mode)


# Every provider is compiled here, so "naive" would repeat "naive_compiled".
@pytest.mark.parametrize("provider", providers(p for p in PROVIDERS if p != "naive"))
def test_attention_leaderboard(gpu_benchmark, fresh_compiler, device, seed, provider):
    """CS336 leaderboard: (16, 16384, 64) bf16 causal, forward + backward, compiled (CPU: (2, 256, 64)).

    The dO is random; the leaderboard's harness backpropagates o.sum() (dO of ones), which times SDPA's cuDNN
    backend lower on an H100 (docs/attention.md, "The anchors and the leaderboard's dO").
    """
    shape = (16, 16384, 64) if HAS_CUDA else (2, 256, 64)
    run_case(gpu_benchmark, device, provider, shape, True, torch.bfloat16, "fwd_bwd", compile_all=True)


# The CPU's cost of one call (host timing: docs/gate.md, "Launch cost (host timing)"), at a size where the GPU's work
# is less than it (the causal grid's 1x4096x64 forward + backward in docs/NVIDIA_H100_80GB_HBM3.md): what a model
# with many small attention layers pays per layer.
# `sdpa` is the plain call, SDPA picking its backend; the restricted backends pay for sdpa_kernel's context too.
LAUNCH_SHAPE = (1, 1, 4096, 64)
LAUNCH_PROVIDERS = ("flash_triton", "sdpa", "sdpa_flash", "sdpa_cudnn")


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("provider", [pytest.param(p, marks=[pytest.mark.full_grid] * (p in FULL_GRID_PROVIDERS + (
    "sdpa_cudnn",)), id=p) for p in LAUNCH_PROVIDERS])
def test_attention_launch_cost(gpu_benchmark, device, seed, provider, mode):
    """CPU time per causal call through autograd, bf16 (1, 1, 4096, 64) (CPU: fp32 (1, 1, 128, 32))."""
    shape, dtype = (LAUNCH_SHAPE, torch.bfloat16) if HAS_CUDA else ((1, 1, 128, 32), torch.float32)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    attend = attention_for(provider, q, k, v, True)
    fn, args = timed_call(attend, q, k, v, True, mode)
    gpu_benchmark(fn, *args, host=True)
