"""The optimizer step alone: ours (`lmsys.optim.AdamW`, one fused Triton kernel) beside torch's fused and foreach
AdamW, on the parameters of the `small`, `large` and `2.7B` presets (on the CPU: `tiny`).

Each call is one step over every parameter of the model, fp32, with random gradients. AdamW is memory-bound: it
reads the parameter, the gradient and both moments and writes the parameter and both moments, 28 bytes per
parameter; that is the work each call states, so the report shows GB/s and the fraction of the memory peak
(2.7B -> about 95 GB per step; what that takes at the H200's copy bandwidth: docs/training-step.md, "The perf
suite's steps").
"""

import functools

import pytest
import torch

from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW

PROVIDERS = {
    "lmsys": AdamW,
    "torch-fused": functools.partial(torch.optim.AdamW, fused=True),
    "torch-foreach": functools.partial(torch.optim.AdamW, foreach=True),
}
BYTES_PER_PARAMETER = 28  # fp32 p, g, m, v read; p, m, v written


@pytest.fixture
def released_memory():
    """Return the previous size's cached blocks before this one allocates (2.7B needs about 55 GB)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    yield


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("size", ["small", "large", "2.7B"] if torch.cuda.is_available() else ["tiny"])
def test_optimizer_step(gpu_benchmark, released_memory, device, seed, size, provider):
    # Built on the device directly (no CPU copy); only its parameters are used.
    with torch.device(device):
        params = list(TransformerLM(SIZES[size]).parameters())
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = PROVIDERS[provider](params)
    n_params = sum(param.numel() for param in params)
    # The untimed first call creates the moments; every timed call is a full step. Judged on its device time (a
    # CUDA-graph replay, or queued ahead when torch's non-capturable optimizers refuse the capture): the CPU work
    # before the kernels is judged as the eager time.
    gpu_benchmark(optimizer.step, bytes=BYTES_PER_PARAMETER * n_params, graph=device.type == "cuda")
    assert all(int(optimizer.state[param]["step"]) >= 1 for param in params)
    assert all(torch.isfinite(param).all() for param in params[:3])
