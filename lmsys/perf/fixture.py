"""The `gpu_benchmark` fixture: pytest-benchmark's `benchmark`, timed so that each sample covers the device's work,
with a memory high-water mark, throughput against the device's peak, and a verdict against the baseline.

    result = gpu_benchmark(fn, *args, flops=None, bytes=None, cold_l2=False, warmup_rounds=None, precision=None,
                           graph=False, host=False, **kwargs)

What one call measures and how it is judged is written once, in the README ("How a regression is decided");
timing.py holds the loop (warmup, adaptive rounds, CUDA-graph replays, the re-measurement of a SLOWER), this module
the tolerances it is judged with and the record it leaves: the samples go into pytest-benchmark's stats (its
table, JSON and --benchmark-save see them); extra_info gets the timing ('eager', 'graph', 'queued' or 'host', with
the eager rounds of a graph-mode call), the wall-clock seconds per round, the memory readings, the machine's state,
the tolerance and its source, TFLOP/s and GB/s from `flops`/`bytes` (the work of ONE call) and their fraction of
the device's peak in `precision` ('bf16', 'fp16', 'tf32', 'fp32'; by default the dtype of the first floating-point
tensor argument, or bf16 when there is none). The plugin fails the test after its body has run when the verdict is
SLOWER, SLOWER-EAGER or MORE-MEMORY.
"""

import dataclasses
import functools
import re
from statistics import median
from typing import Any

import pytest
import torch
from pytest_benchmark.fixture import FixtureAlreadyUsed

from lmsys import flops as flops_formulas
from lmsys.perf import baselines, compare, machine, multirank, timing
from lmsys.perf.backend import CudaBackend
from lmsys.perf.session import RECORD_KEY, SESSION_KEY, Record, Tolerance


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_arguments(flops, nbytes, warmup_rounds, precision, graph, host=False) -> None:
    for name, value in (("flops", flops), ("bytes", nbytes)):
        if value is not None and not _is_count(value):
            raise ValueError(f"gpu_benchmark: {name} must be a non-negative int (the work of one call), got {value!r}")
    if warmup_rounds is not None and not _is_count(warmup_rounds):
        raise ValueError(f"gpu_benchmark: warmup_rounds must be a non-negative int or None, got {warmup_rounds!r}")
    if precision is not None and precision not in flops_formulas.PRECISIONS:
        raise ValueError(f"gpu_benchmark: precision must be one of {flops_formulas.PRECISIONS}, got {precision!r}")
    if not isinstance(graph, bool):
        raise ValueError(f"gpu_benchmark: graph must be True or False, got {graph!r}")
    if not isinstance(host, bool):
        raise ValueError(f"gpu_benchmark: host must be True or False, got {host!r}")
    if graph and host:
        raise ValueError("gpu_benchmark: graph=True times the device, host=True the CPU; choose one")


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


class GpuBenchmark:
    """The object the `gpu_benchmark` fixture returns; call it once per test (see the module docstring)."""

    def __init__(self, benchmark, node: pytest.Item):
        self._benchmark = benchmark
        self._session = node.config.stash[SESSION_KEY]
        self._node = node

    @property
    def extra_info(self) -> dict:
        """pytest-benchmark's extra_info of this benchmark (saved in the JSON); tests may add entries."""
        return self._benchmark.extra_info

    @property
    def device(self) -> torch.device:
        """The device the benchmark is timed on: the current CUDA device when there is one, else the CPU. Put the
        call's inputs there; a test needs no fixture of its own project for it."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _marker(self) -> dict:
        marker = self._node.get_closest_marker("perf_tolerance")
        return marker.kwargs if marker else {}

    def _tolerance(self, timed: str, eager: bool = False) -> Tolerance:
        return self._session.time_tolerance_for(self._benchmark.fullname, timed, self._marker(), eager)

    def _baseline_temperature(self) -> float | None:
        """The GPU's temperature before the baseline's rounds (None without a baseline or its readings)."""
        baseline = self._session.baseline(self._benchmark.fullname)
        info = {} if baseline is None else baseline.get("extra_info") or {}
        return ((info.get("machine") or {}).get("before") or {}).get("temperature_c")

    def _claim(self) -> None:
        # pytest-benchmark's fixture is single-use; taking its (private) mode makes a second call of either fail loudly.
        bench = self._benchmark
        if bench._mode:
            raise FixtureAlreadyUsed(f"Fixture can only be used once. Previously it was used in {bench._mode} mode.")
        bench._mode = "gpu_benchmark(...)"

    def _reference(self, timed: str, tolerance: Tolerance) -> compare.Reference | None:
        """What rounds timed `timed` are judged against (None without a baseline of them): the baseline's samples
        timed alike and, where they were probed (timing.py), its CPU speed (the median of its probe times) and its
        samples taken at that speed."""
        baseline = self._session.baseline(self._benchmark.fullname)
        reference = None if baseline is None else baselines.samples(baseline, timed)
        if reference is None:
            return None
        reference_probes = baselines.probes(baseline, timed)
        speed = median(reference_probes) if reference_probes else None
        at_speed = None if speed is None else baselines.at_cpu_speed(baseline, timed, speed)
        return compare.Reference(reference, tolerance.value, tolerance.source, speed, at_speed)

    def _judge(self, timed: str, tolerance: Tolerance) -> timing.Judge:
        """samples timed `timed` -> their comparison with the baseline's samples timed alike (None without one):
        compare.Reference.judge."""
        reference = self._reference(timed, tolerance)
        return (lambda samples, probes, device_time: None) if reference is None else reference.judge

    def __call__(
        self, fn, *args, flops=None, bytes=None, cold_l2=False, warmup_rounds=None, precision=None, graph=False,
        host=False, **kwargs,
    ):
        """Benchmarks fn(*args, **kwargs) and returns the result of its last call."""
        _check_arguments(flops, bytes, warmup_rounds, precision, graph, host)
        self._claim()
        call = functools.partial(fn, *args, **kwargs)
        if self._benchmark.disabled:
            return call()
        session, backend = self._session, self._session.backend
        primary = timing.GRAPH if graph else timing.HOST if host else timing.EAGER
        # Graph mode's eager rounds: on a GPU timed from an idle device (timing.LAUNCH), on the CPU eager rounds.
        eager_timed = timing.LAUNCH if backend.is_gpu else timing.EAGER
        time_tolerance = self._tolerance(primary, eager=host)
        eager_tolerance = self._tolerance(eager_timed, eager=True) if graph else time_tolerance
        queued_tolerance = self._tolerance(timing.QUEUED)
        flush = backend.make_l2_flush() if cold_l2 else None

        def measure(delay: float, extra_memory: int) -> timing.Measurement:
            with timing.gc_paused(session.disable_gc):
                return timing.run(
                    backend, call, flush=flush, max_time=session.max_time, min_rounds=session.min_rounds,
                    warmup_rounds=warmup_rounds, judge=self._judge(primary, time_tolerance),
                    precision=session.precision(time_tolerance), graph=graph,
                    eager_judge=self._judge(eager_timed, eager_tolerance),
                    eager_precision=session.precision(eager_tolerance), delay=delay, extra_memory=extra_memory,
                    queued_judge=self._judge(timing.QUEUED, queued_tolerance),
                    queued_precision=session.precision(queued_tolerance), host=host,
                    baseline_c=self._baseline_temperature(),
                )

        measurement = measure(session.injected_delay, session.injected_memory)
        measurement.extra_info["cold_l2"] = bool(cold_l2)
        if graph and measurement.timing == timing.EAGER:
            # The capture failed on the CPU: the eager rounds are the benchmark's time, judged as eager rounds.
            time_tolerance = eager_tolerance
        elif measurement.timing == timing.QUEUED:
            time_tolerance = queued_tolerance
        self._record(measurement, flops, bytes, precision or infer_precision(args, kwargs), time_tolerance)
        self._measure_injected_cases(measure)
        del flush
        return measurement.result

    def _measure_injected_cases(self, measure) -> None:
        """LMSYS_INJECT_CASES: the call measured once more per case, with its delay and its bytes held, each judged
        against the same baseline; the verdicts go into extra_info and the summary's notes, and fail nothing."""
        session, bench = self._session, self._benchmark
        if not session.injected_cases or not session.comparing or session.baseline(bench.fullname) is None:
            return
        cases = []
        for delay, held in session.injected_cases:
            verdict = self._verdict(measure(delay, held))
            cases.append({"delay": delay, "memory": held, "verdict": None if verdict is None else verdict.label,
                          "time_change": None if verdict is None or verdict.time is None else verdict.time.change})
        bench.extra_info[timing.INJECTED_CASES_KEY] = cases
        self._node.stash[RECORD_KEY].notes.append("injected: " + "; ".join(
            f"{timing.injected_case_label(case['delay'], case['memory'])}: {case['verdict']}" for case in cases))

    def distributed(
        self,
        setup,
        *,
        world_size: int,
        flops=None,
        bytes=None,
        warmup_rounds=None,
        precision=None,
        graph: bool = False,
        timeout: float = 600.0,
        **setup_kwargs,
    ) -> list:
        """Benchmarks a step on `world_size` ranks, spawned here (see lmsys/perf/multirank.py); returns each rank's
        result of its last call, in rank order.

        `setup(ctx, **setup_kwargs)` runs on every rank and returns the step, a function of no arguments;
        `setup` must be importable (a module-level function) and its arguments and results picklable. On a GPU the
        ranks talk NCCL, one GPU each, and the test is skipped on a machine with fewer GPUs; on the CPU, gloo.
        `flops` is the work of one rank's step (so TFLOP/s and the fraction of peak are per device); `bytes` the bytes
        each rank moves over the interconnect in one step (for an all-reduce of S bytes, the bus bytes
        2(n-1)/n * S), reported as GB/s with no fraction of a peak (the device table has memory bandwidths, not
        link bandwidths). A rank that fails fails the test with that rank's traceback; ranks still running after
        `timeout` seconds are killed and the test fails. `graph=True` captures each rank's step in a CUDA graph and
        times the replays (device time even for a step whose CPU time exceeds its device time), with the eager rounds
        beside; when a rank cannot capture its step, queued rounds on a GPU, eager ones on the CPU, with a note.
        """
        _check_arguments(flops, bytes, warmup_rounds, precision, graph)
        if not _is_count(world_size) or world_size < 1:
            raise ValueError(f"gpu_benchmark.distributed: world_size must be a positive int, got {world_size!r}")
        if not timeout > 0:
            raise ValueError(f"gpu_benchmark.distributed: timeout must be positive seconds, got {timeout!r}")
        self._claim()
        session, backend = self._session, self._session.backend
        transport = "nccl" if isinstance(backend, CudaBackend) else "gloo"
        if transport == "nccl" and torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
        baseline = session.baseline(self._benchmark.fullname)
        if baseline is not None:
            info = baseline.get("extra_info") or {}
            recorded = (info.get("world_size"), info.get("dist_backend"))
            if recorded != (world_size, transport):
                pytest.fail(
                    f"{self._benchmark.name}: the baseline was measured with world size and transport {recorded}, "
                    f"this run uses {(world_size, transport)}: name them in the test id so each has its own baseline",
                    pytrace=False,
                )
        # On a GPU the rounds are queued (device time) and the eager rounds, timed from an idle device, are the
        # CPU's part, as in graph mode; on the CPU the eager rounds are the benchmark's time.
        queued = backend.is_gpu
        timed = timing.QUEUED if queued else timing.EAGER
        tolerance = self._tolerance(timed)
        eager_tolerance = self._tolerance(timing.LAUNCH, eager=True)
        graph_tolerance = self._tolerance(timing.GRAPH)
        settings = multirank.Settings(
            setup=setup,
            setup_kwargs=setup_kwargs,
            make_backend=backend.for_rank(),
            transport=transport,
            max_time=session.max_time,
            min_rounds=session.min_rounds,
            warmup_rounds=warmup_rounds,
            disable_gc=session.disable_gc,
            reference=self._reference(timed, tolerance),
            precision=session.precision(tolerance),
            delay=session.injected_delay,
            extra_memory=session.injected_memory,
            queued=queued,
            eager_reference=self._reference(timing.LAUNCH, eager_tolerance),
            eager_precision=session.precision(eager_tolerance),
            graph=graph,
            graph_reference=self._reference(timing.GRAPH, graph_tolerance),
            graph_precision=session.precision(graph_tolerance),
            baseline_c=self._baseline_temperature(),
        )
        try:
            if self._benchmark.disabled:
                return multirank.run_once(settings, world_size, timeout)
            measurement = multirank.measure(settings, world_size, timeout)
        except RuntimeError as exc:
            if "CUDA out of memory" in str(exc):
                pytest.skip(oom_reason(str(exc), backend.name) + f" on one of {world_size} ranks")
            raise
        if measurement.timing == timing.GRAPH:
            tolerance = graph_tolerance
        self._record(
            measurement, flops, bytes, precision or infer_precision((), {}), tolerance, memory_bandwidth=False
        )
        self._measure_injected_cases(lambda delay, extra_memory: multirank.measure(
            dataclasses.replace(settings, delay=delay, extra_memory=extra_memory), world_size, timeout))
        return measurement.result

    def _verdict(self, measurement: timing.Measurement) -> compare.Verdict | None:
        """The verdict on a measurement against the baseline (None when not comparing): its time comparisons, made
        while it was timed, and its memory, compared here."""
        session, bench = self._session, self._benchmark
        if not session.comparing:
            return None
        baseline = session.baseline(bench.fullname)
        memory = measurement.memory
        peaks = None
        if memory is not None and baseline is not None:
            peaks = baselines.gated_peaks(memory.as_extra_info(), baseline.get("extra_info") or {})
        memory_comparison = None
        if peaks is not None:
            memory_tolerance, floor, source = session.memory_allowance(bench.fullname, self._marker())
            now_peak, baseline_peak, measure = peaks
            memory_comparison = compare.compare_memory(
                now_peak, baseline_peak, memory_tolerance, floor, source, measure
            )
        uncompared = None
        if baseline is not None and measurement.time_comparison is None:
            uncompared = f"the baseline was timed {baselines.timing(baseline)}, this run {measurement.timing}"
        elif measurement.eager_samples is not None and baseline is not None and measurement.eager_comparison is None:
            uncompared = "the baseline has no eager rounds"
            if baselines.eager_timed_behind_sleep(baseline):
                uncompared = ("the baseline's eager rounds were timed behind a device-side sleep that hid up to 0.5 ms "
                              "of the launch cost, this run's from an idle device")
        return compare.judge(measurement.time_comparison, memory_comparison, measurement.eager_comparison, uncompared)

    def _record(
        self,
        measurement: timing.Measurement,
        flops,
        nbytes,
        precision,
        tolerance: Tolerance | None = None,
        memory_bandwidth: bool = True,
    ):
        """Judges the memory, combines the verdict and stores the record (summary, plugin) and the stats (JSON).
        `memory_bandwidth=False`: the bytes did not go through device memory, so GB/s has no fraction of its peak."""
        session, bench = self._session, self._benchmark
        tolerance = tolerance or self._tolerance(measurement.timing)
        if measurement.time_comparison is not None:  # as judged: a CPU's part may have been given more (judge)
            tolerance = Tolerance(measurement.time_comparison.tolerance, measurement.time_comparison.source)
        baseline = session.baseline(bench.fullname)
        memory = measurement.memory
        verdict = self._verdict(measurement)

        # Private pytest-benchmark API, the same in 5.2 and 5.3: the stats object its own timing loop would fill.
        stats = bench._make_stats(1)
        for sample in measurement.samples:
            stats.update(sample)
        typical = median(measurement.samples)
        rates = flops_formulas.rates(typical, session.backend.name, flops, nbytes, precision)
        if not memory_bandwidth:
            rates.pop("peak_gbps", None)
            rates.pop("fraction_of_peak_gbps", None)
        eager = measurement.eager_samples
        baseline_info = {} if baseline is None else baseline.get("extra_info") or {}
        record = Record(
            name=bench.name,
            fullname=bench.fullname,
            median=typical,
            rounds=len(measurement.samples),
            memory=memory,
            rates=rates,
            baseline_median=None if baseline is None else float(baseline["stats"]["median"]),
            baseline_peak=baselines.allocated_peak(baseline_info),
            verdict=verdict,
            remeasured=measurement.remeasured,
            timing=measurement.timing,
            tolerance=tolerance,
            eager_median=None if eager is None else median(eager),
            baseline_eager_median=_eager_median(baseline),
            notes=list(measurement.notes),
        )
        readings = measurement.machine or {}
        record.notes += machine.problems(
            readings.get("before"), readings.get("after"), (baseline_info.get("machine") or {}).get("after")
        )
        record.notes += _cpu_speed_notes(measurement, baseline)
        if measurement.machine is None and session.backend.machine_note:
            session.note(f"no machine readings (clocks, throttling, other processes): {session.backend.machine_note}")
        bench.extra_info.update(
            device=session.backend.name, timer=session.backend.timer_name, warmup_rounds=measurement.warmup_rounds,
            wall_seconds_per_round=measurement.wall_seconds_per_round, remeasured=measurement.remeasured,
            timing=measurement.timing, time_tolerance=tolerance.value, time_tolerance_source=tolerance.source,
            **measurement.extra_info, **record.rates,
        )
        if eager is not None:
            bench.extra_info.update({baselines.EAGER_KEY: eager, "eager_median": record.eager_median,
                                     baselines.EAGER_TIMING_KEY: timing.LAUNCH})
        for key, probes in ((baselines.PROBE_KEY, measurement.probes),
                            (baselines.EAGER_PROBE_KEY, measurement.eager_probes)):
            if probes is not None:
                bench.extra_info[key] = probes
                bench.extra_info[baselines.PROBE_KIND_KEY] = timing.PROBE_KIND
        if measurement.machine is not None:
            bench.extra_info["machine"] = measurement.machine
        if record.notes:
            bench.extra_info["notes"] = record.notes
        if memory is not None:
            bench.extra_info.update(memory.as_extra_info())
        if verdict is not None:
            bench.extra_info["verdict"] = verdict.label
            if verdict.time is not None:
                bench.extra_info["time_change"] = verdict.time.change
            if verdict.eager is not None:  # what a SLOWER-EAGER (or an IMPROVED of the launch cost) was judged on
                bench.extra_info.update(eager_change=verdict.eager.change, eager_tolerance=verdict.eager.tolerance,
                                        eager_tolerance_source=verdict.eager.source)
        session.records.append(record)
        self._node.stash[RECORD_KEY] = record


# A CPU probe this much slower or faster than the baseline's is noted beside the verdict.
CPU_SPEED_NOTE = 0.2


def _cpu_speed_notes(measurement: timing.Measurement, baseline: dict | None) -> list[str]:
    """A note when the CPU probe ran far from the baseline's (the CPU's part was judged at the baseline's speed)."""
    if baseline is None:
        return []
    notes = []
    for timed, what, probes in ((timing.HOST, "host", measurement.probes),
                                (timing.LAUNCH, "eager", measurement.eager_probes)):
        reference = baselines.probes(baseline, timed)
        stale = baselines.stale_probe_kind(baseline, timed)
        if probes and stale:
            notes.append(f"the baseline's CPU probe ({stale}) is not this version's ({timing.PROBE_KIND}): the {what} "
                         "time was judged on raw times; save a baseline again")
        elif probes and not reference and baselines.samples(baseline, timed) is not None:
            notes.append(f"the baseline's {what} rounds were not probed (saved before they were): the {what} time "
                         "was judged on raw times; save a baseline again")
        if probes and reference:
            change = median(probes) / median(reference) - 1
            if abs(change) > CPU_SPEED_NOTE:
                notes.append(f"the CPU probe took {change:+.0%} against the baseline's: the CPU's part of the {what} "
                             "time was judged at the baseline's CPU speed")
    return notes


def _eager_median(baseline: dict | None) -> float | None:
    if baseline is None:
        return None
    eager = baselines.samples(baseline, timing.LAUNCH)
    return None if eager is None else median(eager)


@pytest.fixture
def gpu_benchmark(request, benchmark) -> GpuBenchmark:
    """Benchmark a function with device-synchronized timing, memory high-water marks and a baseline verdict.

    Usage: ``out = gpu_benchmark(fn, *args, flops=..., bytes=..., cold_l2=False, warmup_rounds=None, graph=False,
    host=False, **kwargs)``.
    """
    return GpuBenchmark(benchmark, request.node)
