"""The `gpu_benchmark` fixture: pytest-benchmark's `benchmark`, timed so that each sample covers the device's work,
with a memory high-water mark, throughput against the device's peak, and a verdict against the baseline.

    result = gpu_benchmark(fn, *args, flops=None, bytes=None, cold_l2=False, warmup_rounds=None, precision=None,
                           **kwargs)

What one call does, in order:
1. an untimed call of fn (compilation and autotuning land here), one calibration round, then warmup rounds
   (timing.py says how many);
2. timed rounds, one call each; on CUDA every sample is the device time between two CUDA events around the call,
   on the CPU it is pytest-benchmark's clock (--benchmark-timer); with cold_l2=True the L2 cache is flushed before
   every round, outside the timed span;
3. when comparing and the time is SLOWER, the rounds are timed once more and that second measurement decides
   (and is the one stored);
4. one more call under reset peak-memory statistics: its result is returned and its high-water marks are stored;
5. the samples go into pytest-benchmark's stats (its table, JSON and --benchmark-save see them); extra_info gets
   the wall-clock seconds per timed round (what the loop costs, synchronization and flush included), the memory
   readings, TFLOP/s and GB/s from `flops`/`bytes` (the work of ONE call) and their fraction of the device's peak
   in `precision` ('bf16', 'fp16', 'tf32', 'fp32'; by default the dtype of the first floating-point tensor
   argument, or bf16 when there is none);
6. the verdict is kept for the plugin, which fails the test after its body has run when it is SLOWER or MORE-MEMORY.

Tolerances come from --perf-time-tolerance/--perf-mem-tolerance, or per test from
@pytest.mark.perf_tolerance(time=..., memory=...).
"""

import functools
import re
from statistics import median
from typing import Any

import pytest
import torch
from pytest_benchmark.fixture import FixtureAlreadyUsed

from lmsys import flops as flops_formulas
from lmsys.perf import baselines, compare, timing
from lmsys.perf.session import PerfSession, Record

SESSION_KEY = pytest.StashKey[PerfSession]()
RECORD_KEY = pytest.StashKey[Record]()


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_work(name: str, value) -> None:
    if value is not None and not _is_count(value):
        raise ValueError(f"gpu_benchmark: {name} must be a non-negative int (the work of one call), got {value!r}")


def _dtype_precision(dtype: torch.dtype) -> str | None:
    if dtype == torch.float32:
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def infer_precision(args: tuple, kwargs: dict) -> str | None:
    """The peak to compare with: from the first floating-point tensor (or module parameter) among the arguments,
    looking one level into lists and tuples; 'bf16' when there is none; None for dtypes without a peak (fp64)."""
    for value in (*args, *kwargs.values()):
        for candidate in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(candidate, torch.nn.Module):
                candidate = next((p for p in candidate.parameters() if p.is_floating_point()), None)
            if isinstance(candidate, torch.Tensor) and candidate.is_floating_point():
                return _dtype_precision(candidate.dtype)
    return "bf16"


def oom_reason(message: str, device_name: str) -> str:
    """A skip reason for a CUDA out-of-memory error that says how much was asked for."""
    asked = re.search(r"Tried to allocate ([0-9.]+ ?[KMGTP]?i?B)", message)
    amount = asked.group(1) if asked else "an amount the error does not state"
    return f"CUDA out of memory on {device_name}: tried to allocate {amount}"


def rates(median_seconds: float, device_name: str, flops: int | None, nbytes: int | None, precision: str | None):
    """TFLOP/s, GB/s and their fractions of the device's peak (absent when unknown) as extra_info entries."""
    out: dict[str, Any] = {}
    if median_seconds <= 0:
        return out
    if flops is not None:
        out["flops"] = flops
        out["tflops"] = flops_formulas.tflops_per_second(flops, median_seconds)
        peak = flops_formulas.peak_tflops(device_name, precision) if precision else None
        if peak:
            out.update(precision=precision, peak_tflops=peak, fraction_of_peak_tflops=out["tflops"] / peak)
    if nbytes is not None:
        out["bytes"] = nbytes
        out["gbps"] = flops_formulas.gigabytes_per_second(nbytes, median_seconds)
        peak = flops_formulas.peak_gbps(device_name)
        if peak:
            out.update(peak_gbps=peak, fraction_of_peak_gbps=out["gbps"] / peak)
    return out


class GpuBenchmark:
    """The object the `gpu_benchmark` fixture returns; call it once per test (see the module docstring)."""

    def __init__(self, benchmark, session: PerfSession, node: pytest.Item):
        self._benchmark = benchmark
        self._session = session
        self._node = node

    @property
    def extra_info(self) -> dict:
        """pytest-benchmark's extra_info of this benchmark (saved in the JSON); tests may add entries."""
        return self._benchmark.extra_info

    def _tolerances(self) -> tuple[float, float]:
        marker = self._node.get_closest_marker("perf_tolerance")
        given = marker.kwargs if marker else {}
        return given.get("time", self._session.time_tolerance), given.get("memory", self._session.memory_tolerance)

    def __call__(self, fn, *args, flops=None, bytes=None, cold_l2=False, warmup_rounds=None, precision=None, **kwargs):
        """Benchmarks fn(*args, **kwargs) and returns the result of its last call."""
        _check_work("flops", flops)
        _check_work("bytes", bytes)
        if warmup_rounds is not None and not _is_count(warmup_rounds):
            raise ValueError(f"gpu_benchmark: warmup_rounds must be a non-negative int or None, got {warmup_rounds!r}")
        if precision is not None and precision not in flops_formulas.PRECISIONS:
            raise ValueError(f"gpu_benchmark: precision must be one of {flops_formulas.PRECISIONS}, got {precision!r}")
        bench = self._benchmark
        # pytest-benchmark's fixture is single-use; taking its (private) mode makes a second call of either fail loudly.
        if bench._mode:
            raise FixtureAlreadyUsed(f"Fixture can only be used once. Previously it was used in {bench._mode} mode.")
        bench._mode = "gpu_benchmark(...)"
        call = functools.partial(fn, *args, **kwargs)
        if bench.disabled:
            return call()

        session, backend = self._session, self._session.backend
        time_tolerance, memory_tolerance = self._tolerances()
        baseline = session.baseline(bench.fullname)
        flush = backend.make_l2_flush() if cold_l2 else None
        with timing.gc_paused(session.disable_gc):
            plan = timing.warm_up(backend, call, flush, session.max_time, session.min_rounds, warmup_rounds)
            samples, wall = timing.measure(backend, call, plan.rounds, flush)
            time_comparison = None
            remeasured = False
            if baseline is not None:
                time_comparison = compare.compare_time(samples, baselines.samples(baseline), time_tolerance)
                if time_comparison.verdict == compare.SLOWER:
                    remeasured = True
                    samples, wall = timing.measure(backend, call, plan.rounds, flush)
                    time_comparison = compare.compare_time(samples, baselines.samples(baseline), time_tolerance)
        del flush
        result, memory = backend.measure_memory(call)

        memory_comparison = None
        baseline_peak = baselines.peak_memory(baseline) if baseline is not None else None
        if memory is not None and baseline_peak is not None:
            memory_comparison = compare.compare_memory(
                memory.peak_allocated_above_start, baseline_peak, memory_tolerance, session.memory_floor
            )
        verdict = compare.judge(time_comparison, memory_comparison) if session.comparing else None

        # Private pytest-benchmark API, the same in 5.2 and 5.3: the stats object its own timing loop would fill.
        stats = bench._make_stats(1)
        for sample in samples:
            stats.update(sample)
        typical = median(samples)
        record = Record(
            name=bench.name,
            fullname=bench.fullname,
            median=typical,
            rounds=len(samples),
            memory=memory,
            rates=rates(typical, backend.name, flops, bytes, precision or infer_precision(args, kwargs)),
            baseline_median=None if baseline is None else float(baseline["stats"]["median"]),
            baseline_peak=baseline_peak,
            verdict=verdict,
            remeasured=remeasured,
        )
        bench.extra_info.update(
            device=backend.name, timer=backend.timer_name, cold_l2=bool(cold_l2),
            warmup_rounds=plan.warmup_rounds, wall_seconds_per_round=wall, remeasured=remeasured, **record.rates,
        )
        if memory is not None:
            bench.extra_info.update(memory.as_extra_info())
        if verdict is not None:
            bench.extra_info["verdict"] = verdict.label
        session.records.append(record)
        self._node.stash[RECORD_KEY] = record
        return result


@pytest.fixture
def gpu_benchmark(request, benchmark) -> GpuBenchmark:
    """Benchmark a function with device-synchronized timing, memory high-water marks and a baseline verdict.

    Usage: ``out = gpu_benchmark(fn, *args, flops=..., bytes=..., cold_l2=False, warmup_rounds=None, **kwargs)``.
    """
    return GpuBenchmark(benchmark, request.config.stash[SESSION_KEY], request.node)
