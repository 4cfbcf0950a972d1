"""The timing loop: warm up, decide how many rounds fit the time budget, time each round through the backend.

One round is one call of the benchmarked function; with cold L2 the flush runs before the round, outside the timed
span. The budget follows pytest-benchmark's options: rounds = --benchmark-max-time / (wall time of one round,
flush and synchronization included), at least --benchmark-min-rounds and at most MAX_ROUNDS (unless min-rounds asks
for more); warmup covers WARMUP_SHARE of the budget, 1 to MAX_WARMUP_ROUNDS rounds, unless the test fixes it.
"""

import gc
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import ceil
from typing import Any

from lmsys.perf.compare import SLOWER, TimeComparison

MAX_ROUNDS = 1000
MAX_WARMUP_ROUNDS = 100
WARMUP_SHARE = 0.1


@dataclass
class Measurement:
    """What one benchmark measured: per-round seconds, the wall-clock seconds a round took, the warmup, the memory
    reading of the last call and its result; the time comparison with the baseline (None without one) and whether
    the rounds were timed a second time because the first comparison said SLOWER. `extra_info` holds what a
    measurement adds to the saved JSON beyond that (the world size of a multi-rank run, ...)."""

    samples: list[float]
    wall_seconds_per_round: float
    warmup_rounds: int
    memory: Any
    result: Any
    time_comparison: TimeComparison | None = None
    remeasured: bool = False
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """How a benchmark is timed: warmup rounds (untimed) and timed rounds."""

    warmup_rounds: int
    rounds: int


def plan(round_seconds: float, max_time: float, min_rounds: int, warmup_rounds: int | None) -> Plan:
    """Warmup and timed rounds for a function whose round takes round_seconds of wall time."""
    per_round = max(round_seconds, 1e-9)
    rounds = max(min_rounds, min(ceil(max_time / per_round), MAX_ROUNDS))
    if warmup_rounds is None:
        warmup_rounds = max(1, min(ceil(WARMUP_SHARE * max_time / per_round), MAX_WARMUP_ROUNDS))
    return Plan(warmup_rounds=warmup_rounds, rounds=rounds)


@contextmanager
def gc_paused(pause: bool):
    """Disables the garbage collector inside the block when asked (--benchmark-disable-gc)."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()


def time_rounds(backend, call: Callable[[], Any], rounds: int, flush: Callable[[], None] | None) -> list[float]:
    """Per-round seconds of `rounds` calls, each preceded by an untimed flush when one is given."""
    samples = []
    for _ in range(rounds):
        if flush is not None:
            flush()
        samples.append(backend.time_call(call))
    return samples


def measure(backend, call: Callable[[], Any], rounds: int, flush: Callable[[], None] | None):
    """time_rounds, and the wall-clock seconds per round that it took."""
    start = time.perf_counter()
    samples = time_rounds(backend, call, rounds, flush)
    return samples, (time.perf_counter() - start) / rounds


def warm_up(backend, call: Callable[[], Any], flush, max_time: float, min_rounds: int, warmup_rounds: int | None):
    """Runs the untimed first call (compilation, autotuning), one calibration round and the warmup; returns the plan.

    The calibration round counts as the first warmup round.
    """
    call()
    backend.synchronize()
    start = time.perf_counter()
    time_rounds(backend, call, 1, flush)
    chosen = plan(time.perf_counter() - start, max_time, min_rounds, warmup_rounds)
    time_rounds(backend, call, chosen.warmup_rounds - 1, flush)
    return chosen


def run(
    backend,
    call: Callable[[], Any],
    *,
    flush: Callable[[], None] | None,
    max_time: float,
    min_rounds: int,
    warmup_rounds: int | None,
    judge: Callable[[list[float]], TimeComparison | None],
) -> Measurement:
    """Warm up, time the rounds, judge them (`judge` compares with the baseline, None without one); when the verdict
    is SLOWER time the rounds once more and let that decide; then one call under the memory reading."""
    chosen = warm_up(backend, call, flush, max_time, min_rounds, warmup_rounds)
    samples, wall = measure(backend, call, chosen.rounds, flush)
    comparison = judge(samples)
    remeasured = comparison is not None and comparison.verdict == SLOWER
    if remeasured:
        samples, wall = measure(backend, call, chosen.rounds, flush)
        comparison = judge(samples)
    result, memory = backend.measure_memory(call)
    return Measurement(samples, wall, chosen.warmup_rounds, memory, result, comparison, remeasured)
