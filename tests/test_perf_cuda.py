"""The plugin on a real CUDA device (skipped without one): CUDA-event timing that agrees with triton's do_bench,
memory high-water marks, environment in the JSON, and a real out-of-memory error turned into a skip."""

import json

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import torch
import triton.testing

N = 4096


def test_mm(gpu_benchmark):
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    out = gpu_benchmark(torch.mm, a, a, flops=2 * N**3, cold_l2=True)
    assert out.shape == (N, N)
    # triton's do_bench also flushes the L2 and times with CUDA events: the two medians must agree.
    reference = triton.testing.do_bench(lambda: torch.mm(a, a), return_mode="median") * 1e-3
    gpu_benchmark.extra_info["do_bench_median"] = reference


def test_oom(gpu_benchmark):
    total = torch.cuda.get_device_properties(0).total_memory
    gpu_benchmark(torch.empty, 4 * total, dtype=torch.uint8, device="cuda")


def test_after_oom(gpu_benchmark):
    gpu_benchmark(torch.ones, 2**20, device="cuda")
"""


def test_cuda_backend_end_to_end(pytester, gpu):
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_gpu=SUITE)
    result = pytester.runpytest_inprocess(
        "--benchmark-max-time=0.2", "--benchmark-json=out.json", "-rs", "-p", "no:hypothesispytest"
    )
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*CUDA out of memory on *: tried to allocate *GiB"])
    doc = json.loads((pytester.path / "out.json").read_text())
    device = doc["machine_info"]["lmsys"]["device"]
    assert device["kind"] == "cuda" and device["sm_count"] > 0 and device["compute_capability"]
    assert doc["machine_info"]["lmsys"]["software"]["cuda"]
    benches = {bench["name"]: bench for bench in doc["benchmarks"]}
    mm = benches["test_mm"]
    info = mm["extra_info"]
    assert info["timer"] == "torch.cuda.Event"
    assert mm["stats"]["median"] == pytest.approx(info["do_bench_median"], rel=0.25)
    # The output of one 4096^2 bf16 product is allocated during the measured call.
    assert info["peak_allocated_above_start_bytes"] >= 4096 * 4096 * 2
    assert info["peak_reserved_bytes"] >= info["peak_allocated_bytes"]
    assert info["tflops"] > 1
    ones = benches["test_after_oom"]["extra_info"]
    assert ones["peak_allocated_above_start_bytes"] >= 4 * 2**20
