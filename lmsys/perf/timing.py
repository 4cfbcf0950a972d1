"""The timing loop: warm up, decide how many rounds to time, time each round through the backend.

One round is one call of the benchmarked function (or one replay of its CUDA graph); with cold L2 the flush runs
before the round, outside the timed span. The budget follows pytest-benchmark's options: rounds =
--benchmark-max-time / (wall time of one round, flush and synchronization included), at least
--benchmark-min-rounds and at most MAX_ROUNDS (unless min-rounds asks for more); warmup covers WARMUP_SHARE of the
budget, 1 to MAX_WARMUP_ROUNDS rounds, unless the test fixes it. Then the rounds adapt (`adapt`): while the
median's confidence interval is wider than the target (a share of the tolerance), the rounds are doubled, within
a wall-time cap and MAX_ADAPTIVE_ROUNDS.

In graph mode the call is also captured in a CUDA graph and the replays are timed: the replays' samples are the
benchmark's time (device time, no CPU launch cost), the eager rounds its eager time. Those eager rounds start on an
idle device (backend.time_launch), so they hold the whole launch cost: an eager round behind the short device-side
sleep that other rounds start with would hide up to that sleep (0.5 ms) of it, and a launch-bound call's eager median
would count only what its launches take beyond the sleep (on the H100 ours at (1, 4096, 64): 0.10-0.27 ms for a
launch cost of 0.62-0.74 ms). When the capture fails, on a
GPU the call is timed queued instead: each round starts with a device-side sleep longer than the CPU takes to queue
the whole call (LEAD_FACTOR times an eager round's wall time), so the device runs the call's kernels back to back
and the span between the events is the device's time again, as long as the call does not wait for the device
(a read-back) and its launches fit in the driver's launch queue. On the CPU, and for a benchmark without
graph=True, the eager rounds are the benchmark's time.

With host=True the benchmark's time is the CPU's: each round is queued behind the same kind of device-side sleep, so
no launch waits for the device, and timed by the CPU's clock from the call to its return (the device is drained
afterwards, untimed). That is what launching the call costs the CPU: Python, dispatch and the launches.

A time that is the CPU's (host timing, and the eager rounds of graph mode, which include the launch cost) moves with
the CPU's speed, and a shared machine's CPU changes speed within seconds: on the lent H100 the same launch cost read
from 0.027 to 0.12 ms in one process. So right before each such round a CPU probe runs (backend.time_probe: a fixed
number of one-element launches and a one-element autograd backward) and its time is kept beside the round's; the gate
judges the CPU's part of each round at the baseline's CPU speed (compare.at_cpu_speed), and the samples stay what was
measured.
"""

import gc
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from math import ceil
from statistics import median
from typing import Any, NamedTuple

from lmsys.perf import machine
from lmsys.perf.compare import SLOWER, TimeComparison, at_cpu_speed, format_bytes, relative_half_width

MAX_ROUNDS = 1000
MAX_ADAPTIVE_ROUNDS = 10_000
MAX_WARMUP_ROUNDS = 100
WARMUP_SHARE = 0.1
EAGER, GRAPH, QUEUED, HOST = "eager", "graph", "queued", "host"
# The CPU probe that backend.time_probe runs, as the saved JSON names it (baselines.PROBE_KIND_KEY).
PROBE_KIND = "adds+autograd"
# How the eager rounds of graph and queued mode are timed: from an idle device, the whole launch cost in the span
# (backend.time_launch). A baseline says so beside its eager rounds (baselines.EAGER_TIMING_KEY); eager rounds timed
# otherwise (behind the short sleep, before this) are not compared with them.
LAUNCH = "launch"
# Queued timing: the lead sleep is this many times an eager round's wall time, at most MAX_LEAD seconds.
LEAD_FACTOR = 1.5
MAX_LEAD = 2.0
# The environment variable that adds a device-side delay to every benchmarked call, a fraction of the call's time:
# a regression of known size, to measure the gate (lmsys.perf.detection).
INJECT_DELAY = "LMSYS_INJECT_DELAY"
# The same for memory: this many more bytes held on the device during every benchmarked call.
INJECT_MEMORY = "LMSYS_INJECT_MEMORY"
# Regressions measured beside the unchanged call, in the same process: "DELAY[:BYTES],...", e.g. "0.03:1048576,0.05".
# After its own measurement and verdict every benchmark is measured once more per case, with that delay (a fraction,
# as INJECT_DELAY) and those bytes held (as INJECT_MEMORY), and each case's verdict is kept in its extra_info
# (INJECTED_CASES_KEY); they never fail the test. One process then measures the A/A case and every injected one.
INJECT_CASES = "LMSYS_INJECT_CASES"
INJECTED_CASES_KEY = "injected_cases"


def injected_case_label(delay: float, held: int) -> str:
    """'+3.0%', '1 MiB held' or '+3.0% and 1 MiB held': an injected case, for the summary."""
    return " and ".join([f"+{delay:.1%}"] * bool(delay) + [f"{format_bytes(held)} held"] * bool(held))

# samples, the CPU probe's time before each (None when not probed), the device's time of the call (the part of an
# eager sample that is not the CPU's; 0 for host timing) -> the comparison with the baseline (None without one).
Judge = Callable[[list[float], list[float] | None, float], TimeComparison | None]


@dataclass
class Measurement:
    """What one benchmark measured: per-round seconds, the wall-clock seconds a round took, the warmup, the memory
    reading of the last call and its result; the time comparison with the baseline (None without one) and whether
    the rounds were timed a second time because the first comparison said SLOWER. `extra_info` holds what a
    measurement adds to the saved JSON beyond that (the world size of a multi-rank run, ...).

    `timing` says what the samples are: EAGER calls, GRAPH replays or QUEUED calls (graph mode when the capture
    failed: device time, the call queued behind a long device-side sleep); in graph mode `eager_samples` are the eager
    rounds (CPU launch cost included) and `eager_comparison` their comparison. `machine` holds the readings of the
    GPU's state before and after (None without them); `notes` what the summary should say about the measurement.
    `probes` and `eager_probes` are the CPU probe's times before each host-timed round and each eager round of graph
    mode (how fast the CPU ran then: the CPU's part of those rounds is judged at the baseline's CPU speed).
    """

    samples: list[float]
    wall_seconds_per_round: float
    warmup_rounds: int
    memory: Any
    result: Any
    time_comparison: TimeComparison | None = None
    remeasured: bool = False
    extra_info: dict[str, Any] = field(default_factory=dict)
    timing: str = EAGER
    eager_samples: list[float] | None = None
    eager_comparison: TimeComparison | None = None
    machine: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    probes: list[float] | None = None
    eager_probes: list[float] | None = None


class Series(NamedTuple):
    """One judged series of rounds: samples, wall seconds per round, the comparison, whether it was re-measured, and
    the CPU probe's time before each round (None when not probed)."""

    samples: list[float]
    wall: float
    comparison: TimeComparison | None
    remeasured: bool
    probes: list[float] | None


@dataclass(frozen=True)
class Plan:
    """How a benchmark is timed: warmup rounds (untimed) and timed rounds."""

    warmup_rounds: int
    rounds: int


@dataclass(frozen=True)
class Precision:
    """When to stop adding rounds: the median known to +-target (relative half-width of its 95% interval), or
    time_cap seconds of timed rounds spent. target None: the planned rounds only."""

    target: float | None = None
    time_cap: float = 0.0


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


def time_rounds(
    backend,
    call: Callable[[], Any],
    rounds: int,
    flush: Callable[[], None] | None,
    lead: Callable[[], None] | None = None,
    host: bool = False,
    probes: list[float] | None = None,
    launch: bool = False,
) -> list[float]:
    """Per-round seconds of `rounds` calls, each preceded by an untimed flush when one is given (and timed behind the
    device-side delay `lead` when one is given: queued timing; by the CPU's clock with host=True; from an idle device,
    launch cost included, with launch=True). With a `probes` list, the CPU probe (backend.time_probe) runs right before
    each call and its time is appended there."""
    if host:
        time_call = partial(backend.time_host, lead=lead)
    elif launch:
        time_call = backend.time_launch
    else:
        time_call = partial(backend.time_call, lead=lead)
    samples = []
    for _ in range(rounds):
        if flush is not None:
            flush()
        if probes is not None:
            probes.append(backend.time_probe())
        samples.append(time_call(call))
    return samples


def adapt(timed: Callable[[int], tuple[list[float], float]], rounds: int, precision: Precision = Precision(),
          width: Callable[[list[float]], float] = relative_half_width):
    """`timed(n)` times n rounds and returns their samples and the wall-clock seconds they took. Times `rounds`
    rounds, then doubles them while the median is known less precisely (`width`) than precision.target and the next
    batch fits in precision.time_cap (estimated from the rounds so far); returns the samples and the wall seconds per
    round. The decision uses only what `timed` returns, so ranks that gather their samples decide alike
    (multirank.py)."""
    samples, spent = timed(rounds)
    while precision.target is not None and len(samples) < MAX_ADAPTIVE_ROUNDS:
        if width(samples) <= precision.target:
            break
        per_round = spent / len(samples)
        more = min(len(samples), MAX_ADAPTIVE_ROUNDS - len(samples))
        if per_round > 0:
            more = min(more, int((precision.time_cap - spent) / per_round))
        if more < 1:
            break
        extra, extra_spent = timed(more)
        samples += extra
        spent += extra_spent
    return samples, spent / len(samples)


def sample(
    backend,
    call: Callable[[], Any],
    rounds: int,
    flush: Callable[[], None] | None,
    precision: Precision = Precision(),
    clock: Callable[[], float] = time.perf_counter,
    lead: Callable[[], None] | None = None,
    host: bool = False,
    probes: list[float] | None = None,
    device_time: float = 0.0,
    launch: bool = False,
) -> tuple[list[float], float]:
    """`adapt` over rounds of `call` timed through the backend (each after an untimed flush when one is given, and
    behind `lead` when one is given; by the CPU's clock with host=True; from an idle device with launch=True). With a
    `probes` list each round is probed (time_rounds), and the precision is that of the samples at one CPU speed
    (at_cpu_speed, above device_time)."""

    def timed(n: int) -> tuple[list[float], float]:
        start = clock()
        samples = time_rounds(backend, call, n, flush, lead, host, probes, launch)
        return samples, clock() - start

    return adapt(timed, rounds, precision, partial(probed_width, probes=probes, device_time=device_time))


def probed_width(samples: list[float], probes: list[float] | None = None, device_time: float = 0.0) -> float:
    """How precisely the samples know their median (relative_half_width), where probed at one CPU speed (the probes'
    median; at_cpu_speed above device_time): what `adapt` narrows."""
    if probes is None:
        return relative_half_width(samples)
    return relative_half_width(at_cpu_speed(samples, probes, median(probes), device_time))


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


def queue_lead(backend, call: Callable[[], Any], flush) -> Callable[[], None]:
    """The device-side delay that queued timing puts before each round: LEAD_FACTOR times the wall time of one
    eager round (the CPU's time to queue the call is within it), at most MAX_LEAD seconds."""
    start = time.perf_counter()
    time_rounds(backend, call, 1, flush)
    return backend.make_delay(min(MAX_LEAD, LEAD_FACTOR * (time.perf_counter() - start)))


def spin(seconds: float) -> None:
    """Keeps the CPU busy for `seconds` (a sleep would give the CPU away and come back late)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def with_delay(backend, call: Callable[[], Any], flush, fraction: float, graph: bool, host: bool = False
               ) -> Callable[[], Any]:
    """call followed by device-side work (make_work) of `fraction` of its time: a regression of known size, injected to
    measure the gate. The time is the median of three rounds of what the benchmark will judge: the call, or with
    graph=True the replays of a trial capture, or queued rounds when it cannot be captured (a launch-bound call's
    eager time is mostly CPU). With host=True the delay is the CPU's (make_host_delay), a fraction of the host time."""
    if host:
        lead = queue_lead(backend, call, flush)
        delay = backend.make_host_delay(fraction * median(time_rounds(backend, call, 3, flush, lead, host=True)))
    else:
        delay = _device_delay(backend, call, flush, fraction, graph)
    return followed_by(call, delay)


def followed_by(call: Callable[[], Any], after: Callable[[], None]) -> Callable[[], Any]:
    """call, then after() (an injected delay), returning call's result."""

    def delayed():
        result = call()
        after()
        return result

    return delayed


def _device_delay(backend, call: Callable[[], Any], flush, fraction: float, graph: bool) -> Callable[[], None]:
    typical = median(time_rounds(backend, call, 3, flush))
    if graph:
        try:
            replay, release = backend.capture_graph(call)
        except Exception:  # run() notes the failed capture when it captures for real
            if backend.is_gpu:
                typical = median(time_rounds(backend, call, 3, flush, queue_lead(backend, call, flush)))
        else:
            typical = median(time_rounds(backend, replay, 3, flush))
            release()
    return backend.make_work(fraction * typical)


def with_allocation(backend, call: Callable[[], Any], nbytes: int) -> Callable[[], Any]:
    """call with `nbytes` more held on the device while it runs: a memory regression of known size."""

    def holding():
        with backend.holding(nbytes):
            return call()

    return holding


def judged(measure: Callable[[], tuple], judge: Callable[[tuple], TimeComparison | None],
           before_remeasure: Callable[[], None] | None = None):
    """`measure()` returns a measurement; `judge(measurement)` compares it; when that says SLOWER, measured once more
    (after `before_remeasure()`: cooler) and the second measurement decides. Returns the measurement, its comparison
    and whether it was re-measured."""
    measured = measure()
    comparison = judge(measured)
    remeasured = comparison is not None and comparison.verdict == SLOWER
    if remeasured:
        if before_remeasure is not None:
            before_remeasure()
        measured = measure()
        comparison = judge(measured)
    return measured, comparison, remeasured


def cooler(backend, baseline_c: float | None, notes: list[str]) -> Callable[[], None]:
    """What runs before a SLOWER is re-measured: a GPU that reads thermally throttled is left idle until it cools
    (machine.cool_down; `baseline_c`: the baseline's temperature before its rounds), and the note says so."""

    def cool() -> None:
        note = machine.cool_down(backend.machine_state, baseline_c, time.sleep, machine.COOL_WAIT_SECONDS,
                                 machine.COOL_POLL_SECONDS)
        if note is not None and note not in notes:
            notes.append(note)

    return cool


def _series(backend, call, rounds, flush, precision: Precision, judge: Judge, lead=None, host=False,
            launch=False, device_time=0.0, cool: Callable[[], None] | None = None) -> Series:
    """The judged series of rounds: timed as `lead`, `host` and `launch` say (time_rounds); a time that is the CPU's
    (host=True, and launch=True: the eager rounds of graph and queued mode) has each round probed (the CPU's speed),
    and device_time is the device's part of a round, which the CPU's speed does not change. `cool` runs before a
    SLOWER is re-measured (cooler)."""

    def measure() -> tuple:
        probes = [] if host or launch else None
        samples, wall = sample(backend, call, rounds, flush, precision, lead=lead, host=host, probes=probes,
                               device_time=device_time, launch=launch)
        return samples, probes, wall

    (samples, probes, wall), comparison, remeasured = judged(
        measure, lambda measured: judge(measured[0], measured[1], device_time), cool
    )
    return Series(samples, wall, comparison, remeasured, probes)


def error_line(exc: BaseException) -> str:
    """'RuntimeError: the first line of its message', or the type's name alone for an empty message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__


def capture_failed_note(backend, error: str, where: str = "") -> str:
    """The note on a call whose CUDA graph capture failed (`error`: error_line; `where`: ' on rank 1'): how it is
    timed instead."""
    how = "timed queued (device time)" if backend.is_gpu else "timed eagerly"
    return f"{how}: the CUDA graph capture failed{where} ({error})"


def _capture(backend, call, flush, max_time, min_rounds, notes: list[str]):
    """(replay, release, plan of the replays), or None when the capture fails (then noted)."""
    try:
        replay, release = backend.capture_graph(call)
    except Exception as exc:  # a capture can fail in many ways (sync, CPU readback, unsupported op)
        notes.append(capture_failed_note(backend, error_line(exc)))
        return None
    return replay, release, warm_up(backend, replay, flush, max_time, min_rounds, None)


def run(
    backend,
    call: Callable[[], Any],
    *,
    flush: Callable[[], None] | None,
    max_time: float,
    min_rounds: int,
    warmup_rounds: int | None,
    judge: Judge,
    precision: Precision = Precision(),
    graph: bool = False,
    eager_judge: Judge | None = None,
    eager_precision: Precision = Precision(),
    delay: float = 0.0,
    extra_memory: int = 0,
    queued_judge: Judge | None = None,
    queued_precision: Precision | None = None,
    host: bool = False,
    baseline_c: float | None = None,
) -> Measurement:
    """Warm up, time the rounds, judge them (`judge` compares with the baseline, None without one); when the verdict
    is SLOWER time the rounds once more and let that decide; then one call under the memory reading.

    With graph=True the eager rounds are judged by `eager_judge` (with `eager_precision`) and the replays of the
    captured call by `judge`; when the capture fails the eager rounds are the benchmark's time, judged by
    `eager_judge`, or on a GPU the queued rounds are, judged by `queued_judge` (with `queued_precision`).
    With host=True the rounds are timed by the CPU's clock behind a device-side sleep (host timing) and judged by
    `judge`. `delay` > 0 adds a device-side delay of that fraction of the call's time to every call (a CPU spin with
    host=True), `extra_memory` > 0 that many bytes held on the device during every call. Before a SLOWER is
    re-measured, a GPU that reads thermally throttled is left to cool (cooler; `baseline_c`: the baseline's temperature
    before its rounds).
    """
    if extra_memory:
        call = with_allocation(backend, call, extra_memory)
    before = backend.machine_state()
    chosen = warm_up(backend, call, flush, max_time, min_rounds, warmup_rounds)
    timed = with_delay(backend, call, flush, delay, graph, host) if delay else call
    notes = []
    cool = cooler(backend, baseline_c, notes)
    eager_judge = eager_judge or judge
    captured = _capture(backend, timed, flush, max_time, min_rounds, notes) if graph else None
    queued = graph and captured is None and backend.is_gpu
    eager = None
    if host:
        lead = queue_lead(backend, timed, flush)
        primary = _series(backend, timed, chosen.rounds, flush, precision, judge, lead, host=True, cool=cool)
    elif queued:
        lead = queue_lead(backend, timed, flush)
        primary = _series(
            backend, timed, chosen.rounds, flush, queued_precision or precision, queued_judge or judge, lead,
            cool=cool,
        )
        eager = _series(backend, timed, chosen.rounds, flush, eager_precision, eager_judge, launch=True,
                        device_time=median(primary.samples), cool=cool)
    elif captured is None:
        primary = _series(backend, timed, chosen.rounds, flush, eager_precision if graph else precision,
                          eager_judge if graph else judge, cool=cool)
    else:
        replay, release, replay_plan = captured
        try:
            primary = _series(backend, replay, replay_plan.rounds, flush, precision, judge, cool=cool)
        finally:
            release()
        eager = _series(backend, timed, chosen.rounds, flush, eager_precision, eager_judge, launch=True,
                        device_time=median(primary.samples), cool=cool)
    result, memory = backend.measure_memory(call)
    after = backend.machine_state()
    measurement = Measurement(
        primary.samples, primary.wall, chosen.warmup_rounds, memory, result, primary.comparison, primary.remeasured,
        timing=HOST if host else QUEUED if queued else EAGER if captured is None else GRAPH,
        machine=None if before is None and after is None else {"before": before, "after": after},
        notes=notes, probes=primary.probes,
    )
    if eager is not None:
        measurement.eager_samples = eager.samples
        measurement.eager_probes = eager.probes
        measurement.eager_comparison = eager.comparison
        measurement.remeasured = primary.remeasured or eager.remeasured
        measurement.extra_info["eager_wall_seconds_per_round"] = eager.wall
    if delay:
        measurement.extra_info["injected_delay"] = delay
    if extra_memory:
        measurement.extra_info["injected_memory"] = extra_memory
    return measurement
