"""What the plugin needs from the hardware: a name, a clock that covers the device's work, an L2 flush, a memory
high-water mark, CUDA-graph capture (to time replays), device-side waits (queued timing's lead) and readings of the
machine's state. One class per kind of device; `detect_backend` picks one. What the gate's self-measurement adds
(device-side work, a CPU spin, memory held) lives with it, in lmsys/perf/injection.py.

Tests and other plugins can supply their own object with the same methods (see `Backend`) through the
`pytest_perf_backend(config)` hook; the plugin's tests do that to get a deterministic clock and fake memory readings.

CUDA is initialized lazily, on the first use of the name or a measurement: a pytest run that never benchmarks
(the correctness tests, which may fork worker processes) must not inherit an initialized CUDA context.
"""

import gc
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Protocol

import torch

from lmsys.perf import machine, timing

# About 0.5 ms on a GPU clocked near 2 GHz: longer than the launch latency of a Python call into a few kernels.
SLEEP_CYCLES = 1_000_000


@dataclass(frozen=True)
class MemoryReading:
    """Device memory around one call, in bytes: what was allocated/reserved before it and the peaks during it."""

    allocated_before: int
    reserved_before: int
    peak_allocated: int
    peak_reserved: int
    # The bytes the program asked for (torch's requested_bytes), None where the allocator does not count them.
    requested_before: int | None = None
    peak_requested: int | None = None

    @property
    def peak_allocated_above_start(self) -> int:
        """The call's own footprint in the allocator's blocks: the peak allocated minus what was allocated before."""
        return self.peak_allocated - self.allocated_before

    @property
    def peak_requested_above_start(self) -> int | None:
        """The call's own footprint in the bytes it asked for. The allocator hands out a whole cached block when
        what would be left of it is 1 MiB or less, so its blocks, and the allocated peak, move by a MiB or two with
        the history of the process (on the H100, the same training step read 1-2 MiB apart in fresh processes);
        the requested bytes do not."""
        if self.peak_requested is None or self.requested_before is None:
            return None
        return self.peak_requested - self.requested_before

    @property
    def peak_compared_above_start(self) -> int:
        """The peak the gate compares: the requested one where read, else the allocated one."""
        requested = self.peak_requested_above_start
        return self.peak_allocated_above_start if requested is None else requested

    @property
    def peak_reserved_above_start(self) -> int:
        """How far the caching allocator's reservation grew during the call."""
        return self.peak_reserved - self.reserved_before

    def as_extra_info(self) -> dict[str, int]:
        """The reading as pytest-benchmark extra_info entries (these names are what baselines store)."""
        info = {
            "peak_allocated_bytes": self.peak_allocated,
            "peak_reserved_bytes": self.peak_reserved,
            "peak_allocated_above_start_bytes": self.peak_allocated_above_start,
            "peak_reserved_above_start_bytes": self.peak_reserved_above_start,
            "allocated_before_bytes": self.allocated_before,
            "reserved_before_bytes": self.reserved_before,
        }
        if self.peak_requested_above_start is not None:
            info["peak_requested_above_start_bytes"] = self.peak_requested_above_start
        return info


class Backend(Protocol):
    """The interface the plugin measures through (a CUDA GPU, the CPU, or a test's fake)."""

    is_gpu: bool
    name: str
    timer_name: str
    machine_note: str | None  # why machine_state() has no readings, when that is worth saying

    def describe(self) -> dict[str, Any]: ...
    def synchronize(self) -> None: ...
    def time_call(self, call: Callable[[], Any], lead: Callable[[], None] | None = None) -> float: ...
    def time_host(self, call: Callable[[], Any], lead: Callable[[], None] | None = None) -> float: ...
    def time_launch(self, call: Callable[[], Any]) -> float: ...
    def make_l2_flush(self) -> Callable[[], None]: ...
    def measure_memory(self, call: Callable[[], Any]) -> tuple[Any, MemoryReading | None]: ...
    def release_memory(self) -> None: ...
    def for_rank(self) -> Callable[[], Any]: ...
    def capture_graph(self, call: Callable[[], Any]) -> tuple[Callable[[], None], Callable[[], None]]: ...
    def make_delay(self, seconds: float) -> Callable[[], None]: ...
    def machine_state(self) -> dict[str, Any] | None: ...


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


class CpuBackend:
    """The CPU: times with pytest-benchmark's clock (--benchmark-timer), has no L2 flush and no memory reading."""

    is_gpu = False
    machine_note = None

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.timer_name = f"{getattr(clock, '__module__', '')}.{getattr(clock, '__name__', repr(clock))}"

    @cached_property
    def name(self) -> str:
        """The processor model."""
        return _cpu_model()

    def describe(self) -> dict[str, Any]:
        """Device facts for the JSON's machine_info."""
        return {"kind": "cpu", "name": self.name, "machine": platform.machine()}

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the CPU."""

    def time_call(self, call: Callable[[], Any], lead: Callable[[], None] | None = None) -> float:
        """Seconds that one call takes by the clock (there is no device to queue work ahead on: `lead` is unused)."""
        start = self.clock()
        call()
        return self.clock() - start

    def time_host(self, call: Callable[[], Any], lead: Callable[[], None] | None = None) -> float:
        """On the CPU the host's time is the call's time."""
        return self.time_call(call, lead)

    def time_launch(self, call: Callable[[], Any]) -> float:
        """On the CPU the call's time: nothing is queued ahead of it."""
        return self.time_call(call)

    def make_l2_flush(self) -> Callable[[], None]:
        """No cache flush on the CPU: cold_l2 is ignored there."""
        return lambda: None

    def measure_memory(self, call: Callable[[], Any]) -> tuple[Any, MemoryReading | None]:
        """Calls once; the CPU has no allocator high-water mark to read."""
        return call(), None

    def release_memory(self) -> None:
        """Collects garbage."""
        gc.collect()

    def for_rank(self) -> Callable[[], "CpuBackend"]:
        """A picklable maker of the same backend in a rank process (multi-rank benchmarks)."""
        return partial(CpuBackend, self.clock)

    def capture_graph(self, call: Callable[[], Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        """There are no CUDA graphs on the CPU: graph=True falls back to eager timing, with a note."""
        raise RuntimeError("CUDA graphs need a CUDA device")

    def make_delay(self, seconds: float) -> Callable[[], None]:
        """A function that keeps the CPU, the device here, busy for `seconds` (a sleep would give the CPU away and come
        back late)."""
        return partial(timing.spin, seconds)

    def machine_state(self) -> None:
        """No readings on the CPU."""
        return None


class CudaBackend:
    """The current CUDA device: CUDA events around each round, an L2 flush by overwriting a buffer twice the L2's size,
    and the caching allocator's peak statistics."""

    is_gpu = True
    timer_name = "torch.cuda.Event"

    @cached_property
    def index(self) -> int:
        """The device index measured on (the current device at first use)."""
        return torch.cuda.current_device()

    @cached_property
    def properties(self):
        """torch.cuda.get_device_properties of the device (initializes CUDA)."""
        return torch.cuda.get_device_properties(self.index)

    @property
    def name(self) -> str:
        """The device name as CUDA reports it, e.g. 'NVIDIA H100 80GB HBM3'."""
        return self.properties.name

    def describe(self) -> dict[str, Any]:
        """Device facts for the JSON's machine_info."""
        props = self.properties
        return {
            "kind": "cuda",
            "index": self.index,
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "l2_cache_bytes": getattr(props, "L2_cache_size", None),
            "uuid": None if getattr(props, "uuid", None) is None else f"GPU-{props.uuid}",
        }

    def synchronize(self) -> None:
        """Waits for all work queued on the device."""
        torch.cuda.synchronize(self.index)

    @cached_property
    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        # Reused across rounds: each round waits for its end event before the pair is recorded again.
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def time_call(self, call: Callable[[], Any], lead: Callable[[], None] | None = None) -> float:
        """Seconds of device time between events recorded before and after the call on the current stream.

        A device-side sleep is queued first: the start event fires when it ends, by which time the CPU has queued
        the call's first kernels, so the Python and dispatch latency before the first launch is not timed (the
        device would otherwise sit idle through it; triton's do_bench hides it behind its cache flush the same
        way). CPU overhead that starves the device later in the call is still timed, as it should be. `lead` replaces
        that sleep: a device-side delay (make_delay) longer than the CPU takes to queue the whole call leaves only the
        device's time in the span (queued timing, lmsys/perf/timing.py); a drain (synchronize) leaves the whole launch
        cost in it (time_launch).
        """
        start, end = self._events
        self._queue_lead(lead)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def time_launch(self, call: Callable[[], Any]) -> float:
        """Seconds of device time between events recorded before and after the call, on an idle device: the device
        is drained first and nothing is queued ahead of the start event, so the span holds the CPU's whole launch
        cost (Python, dispatch, every launch) wherever the device waits for it, and the device's work. The eager
        rounds of graph and queued mode are timed so: time_call's sleep would hide up to 0.5 ms of the launch cost."""
        return self.time_call(call, lead=self.synchronize)

    @staticmethod
    def _queue_lead(lead: Callable[[], None] | None) -> None:
        if lead is None:
            torch.cuda._sleep(SLEEP_CYCLES)
        else:
            lead()

    def time_host(self, call: Callable[[], Any], lead: Callable[[], None] | None = None) -> float:
        """Seconds the CPU takes to issue the call, by perf_counter from the call to its return; the device is
        drained afterwards, untimed. `lead` (a device-side delay longer than the call takes the CPU) is queued first,
        so that no launch waits for the device; without it a short device-side sleep is."""
        self._queue_lead(lead)
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize(self.index)
        return elapsed

    def make_l2_flush(self) -> Callable[[], None]:
        """A function that evicts the L2 cache by writing a buffer twice its size; the buffer lives as long as it."""
        l2_bytes = getattr(self.properties, "L2_cache_size", 0) or 128 * 2**20
        buffer = torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device=self.index)
        return buffer.zero_

    def measure_memory(self, call: Callable[[], Any]) -> tuple[Any, MemoryReading]:
        """Calls once under reset peak statistics; returns the call's result and the reading.

        Garbage is collected first: tensors that only a reference cycle keeps (a released CUDA graph's pool, earlier
        results) would otherwise count as allocated before the call or not, as the collector happened to run."""
        gc.collect()
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.index)
        before = torch.cuda.memory_stats(self.index)
        result = call()
        self.synchronize()
        after = torch.cuda.memory_stats(self.index)
        reading = MemoryReading(
            allocated_before=before.get("allocated_bytes.all.current", 0),
            reserved_before=before.get("reserved_bytes.all.current", 0),
            peak_allocated=after.get("allocated_bytes.all.peak", 0),
            peak_reserved=after.get("reserved_bytes.all.peak", 0),
            requested_before=before.get("requested_bytes.all.current"),
            peak_requested=after.get("requested_bytes.all.peak"),
        )
        return result, reading

    def release_memory(self) -> None:
        """Collects garbage and returns the allocator's cached blocks to the device (after an out-of-memory error)."""
        gc.collect()
        torch.cuda.empty_cache()

    def for_rank(self) -> Callable[[], "CudaBackend"]:
        """A picklable maker of the backend in a rank process: it measures the rank's current device."""
        return CudaBackend

    def capture_graph(self, call: Callable[[], Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        """Captures one call in a CUDA graph; returns (replay, release). Raises what the capture raises (a call that
        synchronizes, reads a value back to the CPU or allocates pinned memory cannot be captured).

        As torch.cuda.graph's documentation asks, the call runs once on a side stream first (lazy workspaces, autograd
        state); the graph keeps its outputs and its memory pool until release().
        """
        current = torch.cuda.current_stream(self.index)
        side = torch.cuda.Stream(self.index)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            call()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        kept = {}
        generator = torch.cuda.default_generators[self.index]
        before = generator.clone_state()
        try:
            with torch.cuda.graph(graph):
                kept["output"] = call()
        except BaseException:
            # A failed capture leaves the device's random generator marked as capturing (torch resets it only when
            # the capture ends), and every later random draw on the device fails with "Offset increment outside
            # graph capture encountered unexpectedly": give it back its state from before the capture.
            generator.graphsafe_set_state(before)
            raise

        def release():
            kept.clear()
            graph.reset()

        return graph.replay, release

    @cached_property
    def _sleep_cycles_per_second(self) -> float:
        # torch.cuda._sleep spins for a number of GPU clock cycles: time a long one to convert seconds to cycles.
        start, end = self._events
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        torch.cuda._sleep(20 * SLEEP_CYCLES)
        end.record()
        end.synchronize()
        return 20 * SLEEP_CYCLES / (start.elapsed_time(end) / 1e3)

    def make_delay(self, seconds: float) -> Callable[[], None]:
        """A function that queues a device-side wait of `seconds` (a kernel spinning on the clock) on the current
        stream: the lead of queued timing, which should draw no power."""
        cycles = max(1, round(seconds * self._sleep_cycles_per_second))
        return lambda: torch.cuda._sleep(cycles)

    @cached_property
    def _machine(self) -> tuple[machine.Reader | None, str | None]:
        props = self.properties
        uuid = getattr(props, "uuid", None)
        bus = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        pci = None if None in bus else f"{bus[0]:08x}:{bus[1]:02x}:{bus[2]:02x}.0"
        return machine.open_device(None if uuid is None else f"GPU-{uuid}", pci)

    @property
    def machine_note(self) -> str | None:
        """Why there are no machine readings (NVML missing), or None when there are."""
        return self._machine[1]

    def machine_state(self) -> dict[str, Any] | None:
        """Clocks, temperature, power, throttle reasons and other processes (NVML), or None without NVML."""
        reader = self._machine[0]
        return None if reader is None else reader.read()


def detect_backend(clock: Callable[[], float]) -> CpuBackend | CudaBackend:
    """The CUDA backend when a GPU is visible (without initializing CUDA), else the CPU backend with `clock`."""
    return CudaBackend() if torch.cuda.is_available() else CpuBackend(clock)
