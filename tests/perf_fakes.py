"""A deterministic stand-in for a GPU, and tiny inner suites on it, for pytester runs of the lmsys.perf plugin.

An inner suite's conftest returns a FakeGpu from the plugin's `pytest_perf_backend` hook (see INNER_CONFTEST). The
clock only moves when a benchmarked function asks it to (`FakeGpu.work`), by a set time with seeded noise; memory
readings are whatever the function says it allocated. The plugin then runs its real timing loop, statistics,
storage and verdicts on these numbers. `write_suite`, `run` and `save_baseline` build and run such suites.
"""

import contextlib
import functools
import random

from lmsys.perf.backend import MemoryReading

# What the fake device holds before a benchmarked call (inputs, other tests' leftovers).
ALLOCATED_BEFORE = 512 * 2**20

INNER_CONFTEST = """
import os

import perf_fakes
import pytest

# FAKE_GPU_CLASS=CountingGpu counts what each measurement does (the cost of a detection run's passes).
FAKE = getattr(perf_fakes, os.environ.get("FAKE_GPU_CLASS", "FakeGpu"))({name!r})
FAKE.cpu_slowdown = float(os.environ.get("FAKE_CPU_SLOWDOWN", "1"))
FAKE.sleep_hides = float(os.environ.get("FAKE_SLEEP_HIDES", "0"))
FAKE.hot_readings = int(os.environ.get("FAKE_HOT_READINGS", "0"))
FAKE.thermal_slowdown = float(os.environ.get("FAKE_THERMAL_SLOWDOWN", "0"))


def pytest_perf_backend(config):
    return FAKE


def pytest_benchmark_generate_machine_info(config):
    # pytest-benchmark's own probe (py-cpuinfo) takes a second per run; the plugin adds the part that matters.
    return {{"node": "fake-node"}}


@pytest.fixture
def fake():
    return FAKE
"""


class FakeGpu:
    """A fake device: a manual clock, an L2 flush that costs a whole second of clock time, set memory peaks, CUDA
    graphs whose replays skip the CPU launch cost, a device-side delay, and machine readings a test can change."""

    is_gpu = True
    timer_name = "fake clock"
    machine_note = None

    def __init__(self, name: str, cpu_slowdown: float = 1.0, hot_readings: int = 0, thermal_slowdown: float = 0.0):
        self.name = name
        self.now = 0.0
        self.flushes = 0
        self.released = 0
        self.allocated = 0
        self.requested = 0
        self.capturing = False
        self.replaying = False
        self.queued = False
        self.hosting = False
        self.captures = 0
        self.held = 0
        # How many times slower the CPU runs than at full speed: launch costs take this much longer.
        self.cpu_slowdown = cpu_slowdown
        # Seconds of launch cost that the short device-side sleep before a round (time_call without a lead) hides, as
        # on a GPU; time_launch hides none.
        self.sleep_hides = 0.0
        self.hidden = 0.0
        # A hot GPU: the next `hot_readings` machine readings say sw_thermal_slowdown at 80 C, and while they last the
        # device time of work() is `thermal_slowdown` longer (a fraction).
        self.hot_readings = hot_readings
        self.thermal_slowdown = thermal_slowdown
        # What machine_state() returns: a healthy GPU unless a test says otherwise (None: no NVML).
        self.machine = {"sm_clock_mhz": 1980, "memory_clock_mhz": 2619, "max_sm_clock_mhz": 1980,
                        "temperature_c": 40, "power_w": 300.0, "throttle": [], "processes": [1], "other_processes": 0}

    def describe(self) -> dict:
        return {"kind": "fake", "name": self.name}

    def synchronize(self) -> None:
        pass

    def clock(self) -> float:
        return self.now

    def time_call(self, call, lead=None) -> float:
        """A lead (queued timing) lets the CPU queue the whole call ahead: its launch cost leaves the span; without one
        the short sleep hides `sleep_hides` of it."""
        if lead is not None:
            lead()
        start = self.now
        self.queued = lead is not None
        self.hidden = self.sleep_hides
        try:
            call()
        finally:
            self.queued = False
            self.hidden = 0.0
        return self.now - start

    def time_launch(self, call) -> float:
        """From an idle device: the whole launch cost is in the span."""
        start = self.now
        call()
        return self.now - start

    def time_host(self, call, lead=None) -> float:
        """The CPU's time to issue the call: its launch cost only (the device works behind the lead)."""
        if lead is not None:
            lead()
        start = self.now
        self.hosting = True
        try:
            call()
        finally:
            self.hosting = False
        return self.now - start

    def make_l2_flush(self):
        def flush():
            # A flush that leaked into the timed span would add a whole second to a sample.
            self.flushes += 1
            self.now += 1.0

        return flush

    def measure_memory(self, call):
        self.allocated = self.requested = 0
        result = call()
        reading = MemoryReading(
            allocated_before=ALLOCATED_BEFORE,
            reserved_before=ALLOCATED_BEFORE,
            peak_allocated=ALLOCATED_BEFORE + self.allocated,
            peak_reserved=ALLOCATED_BEFORE + 2 * self.allocated,
            requested_before=ALLOCATED_BEFORE,
            peak_requested=ALLOCATED_BEFORE + self.requested,
        )
        return result, reading

    def release_memory(self) -> None:
        self.released += 1

    def for_rank(self):
        # Each rank gets a fresh fake of the same name, CPU speed and heat: its clock starts at 0 and moves only by
        # the rank's own work.
        return functools.partial(FakeGpu, self.name, self.cpu_slowdown, self.hot_readings, self.thermal_slowdown)

    def capture_graph(self, call):
        """Records the call without running it (a work function that is not capturable raises); a replay costs the
        call's device time only."""
        self.capturing = True
        try:
            call()
        finally:
            self.capturing = False
        self.captures += 1

        def replay():
            self.replaying = True
            try:
                call()
            finally:
                self.replaying = False

        return replay, lambda: None

    def make_delay(self, seconds: float):
        def delay():
            if not (self.capturing or self.hosting):
                self.now += seconds

        return delay

    def make_work(self, seconds: float):
        return self.make_delay(seconds)

    def make_host_delay(self, seconds: float):
        def delay():
            self.now += seconds

        return delay

    @contextlib.contextmanager
    def holding(self, nbytes: int):
        self.held += nbytes
        try:
            yield
        finally:
            self.held -= nbytes

    def machine_state(self):
        if self.machine is None:
            return None
        if self.hot_readings > 0:
            self.hot_readings -= 1
            return {**self.machine, "temperature_c": 80, "throttle": ["sw_thermal_slowdown"]}
        return dict(self.machine)

    def work(self, ms: float, noise: float = 0.0, memory: int = 0, seed: int = 0, slow_calls: int = 0,
             slow_ms: float = 0, launch_ms: float = 0.0, launch_noise: float = 0.0, capturable: bool = True,
             slack: int = 0):
        """A function for gpu_benchmark: each call takes `ms` milliseconds times (1 + noise * N(0, 1)) of device time
        on the clock (not in host timing) plus `launch_ms` times (1 + launch_noise * N(0, 1)) times cpu_slowdown of
        CPU launch cost (not in a graph replay nor in a queued round; less the `sleep_hides` that the sleep before an
        eager round hides)
        and allocates `memory` bytes at its peak (the allocator's blocks `slack` bytes more, as a cached block
        handed out whole); its first `slow_calls` calls take `slow_ms` instead. Capturing it in a graph fails unless
        capturable."""
        rng = random.Random(seed)
        calls = 0

        def fn():
            nonlocal calls
            if self.capturing:
                if not capturable:
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
                return calls
            calls += 1
            base = slow_ms if calls <= slow_calls else ms
            device = max(base * 1e-3 * (1 + noise * rng.gauss(0.0, 1.0)), 0.0)
            if self.hot_readings > 0:
                device *= 1 + self.thermal_slowdown
            if not self.hosting:
                self.now += device
            if launch_ms and not (self.replaying or self.queued):
                launch = launch_ms * 1e-3 * self.cpu_slowdown * max(1 + launch_noise * rng.gauss(0.0, 1.0), 0.0)
                self.now += max(launch - self.hidden, 0.0)
            self.requested = max(self.requested, memory + self.held)
            self.allocated = max(self.allocated, memory + self.held + slack)
            return calls

        return fn

class CountingGpu(FakeGpu):
    """A FakeGpu that counts what the measurements ask of it, by kind (`counts`): the untimed first calls of a warm-up
    ('first calls': each is followed by the one synchronize of timing.warm_up), eager rounds (behind the short sleep:
    warm-up, calibration and eager timed rounds, the lead's round, the injection's sizing rounds), graph replays timed
    ('replays'), queued rounds, LAUNCH rounds, host rounds, graph captures, memory readings and the injected work made
    ('works'). How much of a detection run each pass costs, counted: docs/gate-measurements.md."""

    KINDS = ("first calls", "eager rounds", "replays", "queued rounds", "launch rounds", "host rounds", "captures",
             "memory readings", "works")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = dict.fromkeys(self.KINDS, 0)

    def synchronize(self) -> None:
        self.counts["first calls"] += 1

    def time_call(self, call, lead=None) -> float:
        replay = getattr(call, "is_replay", False)
        kind = "queued rounds" if lead is not None else "replays" if replay else "eager rounds"
        self.counts[kind] += 1
        return super().time_call(call, lead)

    def time_launch(self, call) -> float:
        self.counts["launch rounds"] += 1
        return super().time_launch(call)

    def time_host(self, call, lead=None) -> float:
        self.counts["host rounds"] += 1
        return super().time_host(call, lead)

    def capture_graph(self, call):
        replay, release = super().capture_graph(call)
        self.counts["captures"] += 1

        def counted_replay():
            replay()

        counted_replay.is_replay = True
        return counted_replay, release

    def measure_memory(self, call):
        self.counts["memory readings"] += 1
        return super().measure_memory(call)

    def make_work(self, seconds: float):
        self.counts["works"] += 1
        return super().make_work(seconds)


# max-time 0 makes every run exactly min-rounds rounds, whatever the machine's speed.
# The hypothesis plugin would be imported afresh by every inner run (pytester restores sys.modules): 2 s each.
RUN_ARGS = (
    "--benchmark-max-time=0", "--benchmark-min-rounds=21", "-rfEs",
    "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
)
# The plugin that reads LMSYS_INJECT_* (what lmsys.perf.detection adds to the runs it spawns).
INJECTION = ("-p", "lmsys.perf.injection")
GPU = "Fake GPU 80GB"
MACHINE = "Fake_GPU_80GB"
MIB = 2**20


def write_suite(pytester, tests: dict, seed: int, gpu: str = GPU) -> None:
    """An inner suite: one test per entry, benchmarking fake.work(**spec); 'marker' and 'call' (extra keyword
    arguments of the gpu_benchmark call, as source text) are taken out of the spec."""
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(INNER_CONFTEST.format(name=gpu))
    lines = ["import pytest", ""]
    for index, (name, spec) in enumerate(tests.items()):
        spec = {"noise": 0.01, "memory": 64 * MIB, **spec}
        marker = spec.pop("marker", None)
        call = spec.pop("call", "")
        if marker:
            lines.append(f"@pytest.mark.{marker}")
        args = ", ".join(f"{key}={value!r}" for key, value in spec.items())
        lines += [
            f"def {name}(gpu_benchmark, fake):",
            f"    gpu_benchmark(fake.work({args}, seed={seed * 100 + index}){call})",
            "",
        ]
    pytester.makepyfile(test_suite="\n".join(lines))


def run(pytester, *args, **kwargs):
    """Runs the inner suite in-process with RUN_ARGS and args (kwargs go to pytester's inline_run)."""
    return pytester.runpytest_inprocess(*RUN_ARGS, *args, **kwargs)


def save_baseline(pytester, tests: dict, name: str = "base", gpu: str = GPU):
    """Writes the suite (seed 1) and saves it as a baseline named `name`; the run must pass."""
    write_suite(pytester, tests, seed=1, gpu=gpu)
    result = run(pytester, f"--benchmark-save={name}")
    assert result.ret == 0, result.stdout.str()
    return result


def baseline_files(pytester, machine: str = MACHINE) -> list:
    """The files in the inner project's baseline folder of `machine`, sorted."""
    return sorted((pytester.path / "baselines" / machine).glob("*.json"))
