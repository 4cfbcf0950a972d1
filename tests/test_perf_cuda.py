"""The plugin on a real CUDA device (skipped without one): CUDA-event timing that agrees with triton's do_bench,
memory high-water marks, environment in the JSON, a real out-of-memory error turned into a skip, CUDA-graph timing
and its fallback, an injected device-side delay of the size asked for, and NVML machine readings."""

import json

import pytest
from perf_fakes import INJECTION

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


GRAPH_SUITE = """
import torch

from lmsys.perf.timing import spin


def test_small_mm(gpu_benchmark):
    a = torch.randn(256, 256, device="cuda")
    out = gpu_benchmark(torch.mm, a, a, graph=True)
    torch.testing.assert_close(out, a @ a)


def test_reads_back(gpu_benchmark):
    x = torch.ones(1024, device="cuda")
    # .item() synchronizes, which a CUDA graph capture refuses: timed queued, with a note.
    assert gpu_benchmark(lambda: x.sum().item(), graph=True) == 1024


def test_draws_random_numbers_and_reads_back(gpu_benchmark):
    # The capture fails after drawing random numbers inside it.
    assert gpu_benchmark(lambda: torch.rand(1024, device="cuda").gt(2).sum().item(), graph=True) == 0


def test_launch_bound_not_capturable(gpu_benchmark):
    x = torch.zeros(1024, device="cuda")

    def launches():
        for _ in range(100):
            x.add_(1)
        spin(0.001)  # 1 ms more of CPU: launch-bound on any host (a fast one queues 100 launches in 0.3 ms)
        torch.cuda.current_stream().query()  # not permitted while capturing; no wait for the device

    gpu_benchmark(launches, graph=True)


def test_random_numbers_after_failed_captures(gpu_benchmark):
    x = torch.randn(1024, device="cuda")
    gpu_benchmark(torch.mul, x, 2.0, graph=True)
"""


def test_graph_mode_on_cuda(pytester, gpu):
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_graph=GRAPH_SUITE)
    result = pytester.runpytest_inprocess("--benchmark-max-time=0.2", "--benchmark-json=out.json",
                                          "-p", "no:hypothesispytest")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["test_reads_back: timed queued (device time): the CUDA graph capture failed*"])
    benches = {b["name"]: b for b in json.loads((pytester.path / "out.json").read_text())["benchmarks"]}
    small = benches["test_small_mm"]
    assert small["extra_info"]["timing"] == "graph"
    # A replay skips the Python and dispatch cost of the eager call: never slower than the eager rounds.
    assert small["stats"]["median"] <= small["extra_info"]["eager_median"] * 1.05
    assert benches["test_reads_back"]["extra_info"]["timing"] == "queued"
    # Launch-bound and not capturable: queued, the rounds time the device's share of the eager time only.
    queued = benches["test_launch_bound_not_capturable"]
    assert queued["extra_info"]["timing"] == "queued"
    assert queued["stats"]["median"] < 0.7 * queued["extra_info"]["eager_median"]


def test_memory_reading_leaves_out_garbage_that_only_a_reference_cycle_keeps(gpu):
    import gc

    import torch

    from lmsys.perf.backend import CudaBackend

    backend = CudaBackend()
    torch.cuda.synchronize()
    gc.collect()  # garbage of earlier tests (the inner pytest runs' backends, their CPU probe's tensors) goes first
    clean = torch.cuda.memory_allocated()
    gc.disable()
    try:
        cycle = {"tensor": torch.empty(2**20, dtype=torch.uint8, device="cuda")}
        cycle["self"] = cycle
        del cycle  # 1 MiB that only the garbage collector frees
        _, reading = backend.measure_memory(lambda: torch.empty(2**20, dtype=torch.uint8, device="cuda"))
    finally:
        gc.enable()
    assert reading.allocated_before == clean
    assert reading.peak_allocated_above_start == 2**20
    assert reading.peak_requested_above_start == 2**20


def test_the_requested_peak_counts_bytes_asked_for_not_the_block_handed_out(gpu):
    # A free cached block of 2.5 MiB between allocated ones: a 2 MiB request takes it whole (the allocator does not
    # split 512 KiB off a large block), so the allocated peak reads 2.5 MiB; the requested one, 2 MiB.
    import torch

    from lmsys.perf.backend import CudaBackend

    backend = CudaBackend()
    torch.cuda.empty_cache()
    mib = 2**20
    hole = torch.empty(5 * mib // 2, dtype=torch.uint8, device="cuda")  # a new 20 MiB segment: 2.5 MiB of it
    rest = torch.empty(35 * mib // 2, dtype=torch.uint8, device="cuda")  # and the other 17.5 MiB
    del hole
    _, reading = backend.measure_memory(lambda: torch.empty(2 * mib, dtype=torch.uint8, device="cuda"))
    del rest
    assert reading.peak_requested_above_start == 2 * mib
    assert reading.peak_allocated_above_start == 5 * mib // 2


DELAY_SUITE = """
import torch

N = 4096


def test_mm(gpu_benchmark):
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    gpu_benchmark(torch.mm, a, a)


def test_mm_graph(gpu_benchmark):
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    gpu_benchmark(torch.mm, a, a, graph=True)
"""


def test_an_injected_delay_is_the_fraction_asked_for_and_caught(pytester, gpu, monkeypatch):
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_delay=DELAY_SUITE)
    args = ("--benchmark-max-time=0.3", "-p", "no:hypothesispytest")
    pytester.runpytest_inprocess(*args, "--benchmark-save=reference").assert_outcomes(passed=2)
    monkeypatch.setenv("LMSYS_INJECT_DELAY", "0.2")
    result = pytester.runpytest_inprocess(*args, *INJECTION, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(failed=2)
    for bench in json.loads((pytester.path / "out.json").read_text())["benchmarks"]:
        assert bench["extra_info"]["verdict"].startswith("SLOWER")
        assert bench["extra_info"]["time_change"] == pytest.approx(0.2, abs=0.05)


def test_machine_readings_on_cuda(pytester, gpu):
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_one="import torch\n\ndef test_ones(gpu_benchmark):\n"
                                 "    gpu_benchmark(torch.ones, 2**20, device='cuda')\n")
    result = pytester.runpytest_inprocess("--benchmark-max-time=0.1", "--benchmark-json=out.json",
                                          "-p", "no:hypothesispytest")
    result.assert_outcomes(passed=1)
    (bench,) = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    try:
        import pynvml  # noqa: F401
    except ImportError:
        result.stdout.fnmatch_lines(["no machine readings (clocks, throttling, other processes): pynvml*"])
        return
    after = bench["extra_info"]["machine"]["after"]
    assert after["sm_clock_mhz"] > 0 and after["memory_clock_mhz"] > 0 and isinstance(after["throttle"], list)


def test_host_timing_takes_the_cpus_time_to_issue_a_call(gpu):
    """A call that queues 20 ms of device work and spins the CPU for 1 ms: host timing says about 1 ms, device
    timing at least 20 ms."""
    import torch

    from lmsys.perf import timing
    from lmsys.perf.backend import CudaBackend

    backend = CudaBackend()
    sleep = backend.make_delay(0.02)

    def call():
        sleep()
        timing.spin(0.001)

    lead = backend.make_delay(0.05)
    host = sorted(backend.time_host(call, lead) for _ in range(5))[2]
    device = sorted(backend.time_call(call) for _ in range(5))[2]
    assert 0.001 <= host < 0.005
    assert device >= 0.019
    # The CPU probe: ten launches, a few microseconds each on the CPU, whatever the device is busy with.
    sleep()
    probe = sorted(backend.time_probe() for _ in range(5))[2]
    assert 0 < probe < 0.002
    torch.cuda.synchronize()


def test_launch_timing_starts_on_an_idle_device_and_holds_the_whole_launch_cost(gpu):
    """A call whose CPU takes 1 ms before its one launch: behind the short sleep (time_call) about 0.5 ms of it is
    hidden; timed from an idle device (time_launch, the eager rounds of graph mode) all of it is in the span."""
    import torch

    from lmsys.perf import timing
    from lmsys.perf.backend import CudaBackend

    backend = CudaBackend()
    x = torch.zeros(1, device="cuda")

    def call():
        timing.spin(0.001)
        x.add_(1)

    behind_sleep = sorted(backend.time_call(call) for _ in range(5))[2]
    from_idle = sorted(backend.time_launch(call) for _ in range(5))[2]
    assert 0.001 <= from_idle < 0.003
    assert behind_sleep < from_idle - 0.0002
