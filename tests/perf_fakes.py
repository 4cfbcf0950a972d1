"""A deterministic stand-in for a GPU, for pytester runs of the lmsys.perf plugin.

An inner suite's conftest returns a FakeGpu from the plugin's `pytest_perf_backend` hook (see INNER_CONFTEST). The
clock only moves when a benchmarked function asks it to (`FakeGpu.work`), by a set time with seeded noise; memory
readings are whatever the function says it allocated. The plugin then runs its real timing loop, statistics,
storage and verdicts on these numbers.
"""

import functools
import random

from lmsys.perf.backend import MemoryReading

# What the fake device holds before a benchmarked call (inputs, other tests' leftovers).
ALLOCATED_BEFORE = 512 * 2**20

INNER_CONFTEST = """
import pytest
from perf_fakes import FakeGpu

FAKE = FakeGpu({name!r})


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
    """A fake device: a manual clock, an L2 flush that costs a whole second of clock time, and set memory peaks."""

    is_gpu = True
    timer_name = "fake clock"

    def __init__(self, name: str):
        self.name = name
        self.now = 0.0
        self.flushes = 0
        self.released = 0
        self.allocated = 0

    def describe(self) -> dict:
        return {"kind": "fake", "name": self.name}

    def synchronize(self) -> None:
        pass

    def clock(self) -> float:
        return self.now

    def time_call(self, call) -> float:
        start = self.now
        call()
        return self.now - start

    def make_l2_flush(self):
        def flush():
            # A flush that leaked into the timed span would add a whole second to a sample.
            self.flushes += 1
            self.now += 1.0

        return flush

    def measure_memory(self, call):
        self.allocated = 0
        result = call()
        reading = MemoryReading(
            allocated_before=ALLOCATED_BEFORE,
            reserved_before=ALLOCATED_BEFORE,
            peak_allocated=ALLOCATED_BEFORE + self.allocated,
            peak_reserved=ALLOCATED_BEFORE + 2 * self.allocated,
        )
        return result, reading

    def release_memory(self) -> None:
        self.released += 1

    def for_rank(self):
        # Each rank gets a fresh fake of the same name: its clock starts at 0 and moves only by the rank's own work.
        return functools.partial(FakeGpu, self.name)

    def work(self, ms: float, noise: float = 0.0, memory: int = 0, seed: int = 0, slow_calls: int = 0, slow_ms: float = 0):
        """A function for gpu_benchmark: each call takes `ms` milliseconds times (1 + noise * N(0, 1)) on the clock and
        allocates `memory` bytes at its peak; its first `slow_calls` calls take `slow_ms` instead."""
        rng = random.Random(seed)
        calls = 0

        def fn():
            nonlocal calls
            calls += 1
            base = slow_ms if calls <= slow_calls else ms
            self.now += max(base * 1e-3 * (1 + noise * rng.gauss(0.0, 1.0)), 0.0)
            self.allocated = max(self.allocated, memory)
            return calls

        return fn
