"""The `gpu_benchmark` fixture: pytest-benchmark's `benchmark`, timed so that each sample covers the device's work,
with a memory high-water mark, throughput against the device's peak, and a verdict against the baseline.

    result = gpu_benchmark(fn, *args, flops=None, bytes=None, cold_l2=False, warmup_rounds=None, precision=None,
                           graph=False, host=False, **kwargs)

One call: check the arguments, measure (timing.py: samples, memory), decide (verdict.py, with the tolerances
session.py picks; a gated SLOWER measured once more), record. The samples go into pytest-benchmark's stats (its
table, JSON and --benchmark-save see them); extra_info gets the timing ('eager', 'graph', 'queued' or 'host', and the
LAUNCH rounds beside graph or queued ones), the wall-clock seconds per round, the memory readings, the machine's
state, the tolerance, its source and the resolution, TFLOP/s and GB/s from `flops`/`bytes` (the work of ONE call) and
their fraction of the device's peak in `precision` ('bf16', 'fp16', 'tf32', 'fp32'; by default the dtype of the
first floating-point tensor argument, or bf16 when there is none). The plugin fails the test after its body has run
when the verdict fails (verdict.FAILING).
"""

import dataclasses
import functools
import re
import time
from statistics import median

import pytest
import torch
from pytest_benchmark.fixture import FixtureAlreadyUsed

from lmsys import flops as flops_formulas
from lmsys.perf import baselines, machine, timing, verdict
from lmsys.perf.backend import CudaBackend
from lmsys.perf.session import RECORD_KEY, SESSION_KEY, Record
from lmsys.perf.verdict import Tolerance


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

    def _claim(self) -> None:
        # pytest-benchmark's fixture is single-use; taking its (private) mode makes a second call of either fail loudly.
        bench = self._benchmark
        if bench._mode:
            raise FixtureAlreadyUsed(f"Fixture can only be used once. Previously it was used in {bench._mode} mode.")
        bench._mode = "gpu_benchmark(...)"

    def _precisions(self) -> tuple[timing.Precision, timing.Precision]:
        """How precisely the benchmark's own rounds and the LAUNCH rounds beside them are timed: to a share of the
        tolerance each is judged with (the planned rounds only for an ungated host-set time)."""
        session, marker = self._session, self._marker()
        host = session.host_gate(marker)
        device = session.tolerance_for(self._benchmark.fullname, marker)
        return session.precision(device), (timing.Precision() if host is None else session.precision(host))

    def _measured(self, measure) -> tuple[timing.Measurement, verdict.Verdict | None, bool]:
        """measure(cool=False) once, judged; a gated SLOWER is measured once more with cool=True (a thermally
        throttled GPU left to cool first: `cool_down`) and the second measurement decides. Returns the measurement,
        its verdict and whether it was re-measured."""
        measurement = measure(cool=False)
        decided = self._verdict(measurement)
        if decided is None or not decided.slower:
            return measurement, decided, False
        measurement = measure(cool=True)
        return measurement, self._verdict(measurement), True

    def _cool_down(self) -> str | None:
        """Leaves a thermally throttled GPU idle until it cools (machine.cool_down, against the baseline's temperature
        before its rounds); the note saying so, or None."""
        return machine.cool_down(self._session.backend.machine_state, self._baseline_temperature(), time.sleep,
                                 machine.COOL_WAIT_SECONDS, machine.COOL_POLL_SECONDS)

    def _baseline_temperature(self) -> float | None:
        """The GPU's temperature before the baseline's rounds (None without a baseline or its readings)."""
        baseline = self._session.baseline(self._benchmark.fullname)
        info = {} if baseline is None else baseline.get("extra_info") or {}
        return ((info.get("machine") or {}).get("before") or {}).get("temperature_c")

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
        flush = backend.make_l2_flush() if cold_l2 else None
        own, beside = self._precisions()

        def measure(inject=session.injection, cool: bool = False):
            note = self._cool_down() if cool else None
            with timing.gc_paused(session.disable_gc):
                measurement = timing.run(
                    backend, call, flush=flush, max_time=session.max_time, min_rounds=session.min_rounds,
                    warmup_rounds=warmup_rounds, precision=beside if host else own, launch_precision=beside,
                    graph=graph, host=host, inject=inject,
                )
            measurement.notes += [] if note is None else [note]
            return measurement

        measurement, decided, remeasured = self._measured(measure)
        measurement.extra_info["cold_l2"] = bool(cold_l2)
        self._record(measurement, decided, remeasured, flops, bytes, precision or infer_precision(args, kwargs))
        self._measured_hook(measure)
        return measurement.result

    def _measured_hook(self, measure) -> None:
        """Calls pytest_perf_measured (hookspecs.py) once the benchmark is recorded."""
        self._node.config.hook.pytest_perf_measured(
            item=self._node, benchmark=self,
            remeasure=lambda inject: self._measured(functools.partial(measure, inject))[1],
        )

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
        times the replays (device time even for a step whose CPU time exceeds its device time), with LAUNCH rounds
        beside; when a rank cannot capture its step, queued rounds on a GPU, eager ones on the CPU, with a note.
        """
        from lmsys.perf import multirank  # the ranks' machinery: imported by the tests that spawn ranks

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
        own, beside = self._precisions()
        settings = multirank.Settings(
            setup=setup,
            setup_kwargs=setup_kwargs,
            make_backend=backend.for_rank(),
            transport=transport,
            max_time=session.max_time,
            min_rounds=session.min_rounds,
            warmup_rounds=warmup_rounds,
            disable_gc=session.disable_gc,
            precision=own,
            launch_precision=beside,
            # On a GPU the rounds are queued (device time) with LAUNCH rounds beside, as in graph mode.
            queued=backend.is_gpu,
            graph=graph,
            inject=session.injection,
        )

        def measure(inject=session.injection, cool: bool = False):
            # cool=True: every rank leaves its own GPU to cool before its rounds, if it reads thermally throttled.
            return multirank.measure(dataclasses.replace(
                settings, inject=inject, cool=cool, baseline_c=self._baseline_temperature(),
            ), world_size, timeout)

        try:
            if self._benchmark.disabled:
                return multirank.run_once(settings, world_size, timeout)
            measurement, decided, remeasured = self._measured(measure)
        except RuntimeError as exc:
            if "CUDA out of memory" in str(exc):
                pytest.skip(oom_reason(str(exc), backend.name) + f" on one of {world_size} ranks")
            raise
        self._record(measurement, decided, remeasured, flops, bytes, precision or infer_precision((), {}),
                     memory_bandwidth=False)
        self._measured_hook(measure)
        return measurement.result

    def _verdict(self, measurement: timing.Measurement) -> verdict.Verdict | None:
        """The verdict on a measurement against the baseline (verdict.judge; None when not comparing): the device
        time, the host-set time (a host-timed benchmark's, or the LAUNCH rounds beside graph or queued ones) and the
        memory, each with the tolerance session.py picks for it; of a MEMORY measurement, the memory alone."""
        session, bench, marker = self._session, self._benchmark, self._marker()
        if not session.comparing:
            return None
        baseline = session.baseline(bench.fullname)
        if baseline is None:
            return verdict.judge(None, None)
        host_gate = session.host_gate(marker)
        reference = baselines.samples(baseline, measurement.timing)
        device = host = uncompared = None
        if measurement.timing == timing.MEMORY:
            pass  # no rounds, the memory reading alone (an injected case of memory alone): no time to judge
        elif reference is None:
            uncompared = f"the baseline was timed {baselines.timing(baseline)}, this run {measurement.timing}"
        elif measurement.timing == timing.HOST:
            host = _compare(measurement.samples, reference, host_gate)
        else:
            tolerance = session.tolerance_for(bench.fullname, marker)
            device = verdict.compare_time(measurement.samples, reference, tolerance.value, source=tolerance.source)
        launch_reference = baselines.samples(baseline, timing.LAUNCH)
        if measurement.launch_samples is not None and launch_reference is not None:
            host = _compare(measurement.launch_samples, launch_reference, host_gate)
        elif measurement.launch_samples is not None and host_gate is not None and uncompared is None:
            uncompared = "the baseline has no LAUNCH rounds (the host-set time this test gates)"
        memory = None
        peaks = None if measurement.memory is None else baselines.gated_peaks(
            measurement.memory.as_extra_info(), baseline.get("extra_info") or {})
        if peaks is not None:
            tolerance, floor, source = session.memory_allowance(bench.fullname, marker)
            memory = verdict.compare_memory(peaks[0], peaks[1], tolerance, floor, source, peaks[2])
        return verdict.judge(device, memory, host, uncompared, host_gated=host_gate is not None)

    def _record(
        self,
        measurement: timing.Measurement,
        decided: verdict.Verdict | None,
        remeasured: bool,
        flops,
        nbytes,
        precision,
        memory_bandwidth: bool = True,
    ):
        """Stores the record (summary, plugin) and the stats and extra_info (JSON). `memory_bandwidth=False`: the
        bytes did not go through device memory, so GB/s has no fraction of its peak."""
        session, bench = self._session, self._benchmark
        baseline = session.baseline(bench.fullname)
        memory = measurement.memory
        # Private pytest-benchmark API, the same in 5.2 and 5.3: the stats object its own timing loop would fill.
        stats = bench._make_stats(1)
        for sample in measurement.samples:
            stats.update(sample)
        typical = median(measurement.samples)
        rates = flops_formulas.rates(typical, session.backend.name, flops, nbytes, precision)
        if not memory_bandwidth:
            rates.pop("peak_gbps", None)
            rates.pop("fraction_of_peak_gbps", None)
        launch = measurement.launch_samples
        own_notes, run_notes = timing.expected_notes(session.backend, measurement.notes)
        for line in run_notes:
            session.note(line)
        baseline_info = {} if baseline is None else baseline.get("extra_info") or {}
        baseline_launch = None if baseline is None else baselines.samples(baseline, timing.LAUNCH)
        record = Record(
            name=bench.name,
            fullname=bench.fullname,
            median=typical,
            rounds=len(measurement.samples),
            memory=memory,
            rates=rates,
            baseline_median=None if baseline is None else float(baseline["stats"]["median"]),
            baseline_peak=baselines.allocated_peak(baseline_info),
            verdict=decided,
            remeasured=remeasured,
            timing=measurement.timing,
            launch_median=None if launch is None else median(launch),
            baseline_launch_median=None if baseline_launch is None else median(baseline_launch),
            notes=list(own_notes),
        )
        readings = measurement.machine or {}
        record.notes += machine.problems(
            readings.get("before"), readings.get("after"), (baseline_info.get("machine") or {}).get("after")
        )
        if decided is not None:
            note = verdict.host_note(decided.host, decided.host_gated)
            if note is not None:
                record.notes.append(note)
        if measurement.machine is None and session.backend.machine_note:
            session.note(f"no machine readings (clocks, throttling, other processes): {session.backend.machine_note}")
        tolerance = None if decided is None else decided.time
        bench.extra_info.update(
            device=session.backend.name, timer=session.backend.timer_name, warmup_rounds=measurement.warmup_rounds,
            wall_seconds_per_round=measurement.wall_seconds_per_round, remeasured=remeasured,
            timing=measurement.timing, **measurement.extra_info, **record.rates,
        )
        if tolerance is not None:
            bench.extra_info.update(time_tolerance=tolerance.tolerance, time_tolerance_source=tolerance.source,
                                    time_resolution=tolerance.resolution)
        if launch is not None:
            bench.extra_info.update({baselines.EAGER_KEY: launch, "eager_median": record.launch_median,
                                     baselines.EAGER_TIMING_KEY: timing.LAUNCH})
        if measurement.machine is not None:
            bench.extra_info["machine"] = measurement.machine
        if record.notes:
            bench.extra_info["notes"] = record.notes
        if memory is not None:
            bench.extra_info.update(memory.as_extra_info())
        if decided is not None:
            bench.extra_info["verdict"] = decided.label
            if decided.time is not None:
                bench.extra_info["time_change"] = decided.time.change
            if decided.host is not None:
                bench.extra_info["host_change"] = decided.host.change
        session.records.append(record)
        self._node.stash[RECORD_KEY] = record


def _compare(samples: list[float], reference: list[float], gate: Tolerance | None) -> verdict.TimeComparison:
    """A host-set time against the baseline's: at the test's gate when it has one, else at verdict.HOST_NOTE (then
    reported only)."""
    tolerance = gate or Tolerance(verdict.HOST_NOTE, "not gated")
    return verdict.compare_time(samples, reference, tolerance.value, source=tolerance.source)


@pytest.fixture
def gpu_benchmark(request, benchmark) -> GpuBenchmark:
    """Benchmark a function with device-synchronized timing, memory high-water marks and a baseline verdict.

    Usage: ``out = gpu_benchmark(fn, *args, flops=..., bytes=..., cold_l2=False, warmup_rounds=None, graph=False,
    host=False, **kwargs)``.
    """
    return GpuBenchmark(benchmark, request.node)
