"""A matrix product: the smallest real check of the regression gate, and its demonstration.

On a GPU a bf16 4096^3 matmul, steady enough from process to process for a 5% gate (docs/profiling.md, "The perf
suite's smallest benchmarks"); on the CPU an fp32 256^3 one.

LMSYS_INJECT_SLOWDOWN=0.2 adds 20% more work to every call: a second product over the first fifth of the rows.
Compared against a baseline saved without it, the test must fail as SLOWER; that is how to see the gate fire:

    pytest perf_tests/test_matmul.py --benchmark-save=matmul
    LMSYS_INJECT_SLOWDOWN=0.2 pytest perf_tests/test_matmul.py --benchmark-compare
"""

import os

import torch

from lmsys import flops


def injected_slowdown() -> float:
    """The extra work asked for by LMSYS_INJECT_SLOWDOWN, as a fraction of one product (0 when unset)."""
    text = os.environ.get("LMSYS_INJECT_SLOWDOWN", "0")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"LMSYS_INJECT_SLOWDOWN must be a fraction such as 0.2, got {text!r}") from None
    if not 0 <= value <= 1:
        raise ValueError(f"LMSYS_INJECT_SLOWDOWN must be between 0 and 1, got {value}")
    return value


def test_matmul(gpu_benchmark, device, seed):
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    extra_rows = round(injected_slowdown() * n)

    def matmul():
        if extra_rows:
            torch.mm(a[:extra_rows], b)
        return torch.mm(a, b)

    # The nominal work: with a slowdown injected the same FLOPs take longer, as with a real regression.
    out = gpu_benchmark(matmul, flops=flops.matmul_flops(n, n, n))
    torch.testing.assert_close(out, a @ b)
