"""The timing loop: warm up, decide how many rounds to time, time each round through the backend. It returns
samples; whether they are slower than a baseline is decided in verdict.py.

One round is one call of the benchmarked function (or one replay of its CUDA graph); with cold L2 the flush runs
before the round, outside the timed span. The budget follows pytest-benchmark's options: rounds =
--benchmark-max-time / (wall time of one round, flush and synchronization included), at least
--benchmark-min-rounds and at most MAX_ROUNDS (unless min-rounds asks for more); warmup covers WARMUP_SHARE of the
budget, 1 to MAX_WARMUP_ROUNDS rounds, unless the test fixes it. Then the rounds adapt (`adapt`): while the
median's confidence interval is wider than the target (a share of the tolerance), the rounds are doubled, within
a wall-time cap and MAX_ADAPTIVE_ROUNDS.

What a sample is (`Measurement.timing`):
- EAGER: a call, timed by the backend's clock (CUDA events on a GPU). On a GPU this includes the launch cost
  wherever the device waits for the CPU.
- GRAPH (graph=True): a replay of the call captured in a CUDA graph: device time, no launch cost. Beside the replays,
  LAUNCH rounds are timed: eager calls from an idle device, so they hold the whole launch cost (the host-set time).
- QUEUED (graph=True when the capture fails, on a GPU): each round behind a device-side sleep longer than the CPU
  takes to queue the call (LEAD_FACTOR times an eager round's wall time), so the device runs the call's kernels back
  to back and the span is the device's time again, as long as the call does not wait for the device. LAUNCH rounds
  beside, as in graph mode.
- HOST (host=True): the CPU's time from the call to its return, each round queued behind the same kind of sleep (no
  launch waits for the device). That is what launching the call costs the CPU: Python, dispatch and the launches.
- MEMORY: no rounds, the memory reading alone (an injected case that holds memory and adds no delay,
  lmsys.perf.injection: its verdict is the memory's).
"""

import gc
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from math import ceil
from typing import Any

from lmsys.perf.verdict import relative_half_width

MAX_ROUNDS = 1000
MAX_ADAPTIVE_ROUNDS = 10_000
MAX_WARMUP_ROUNDS = 100
WARMUP_SHARE = 0.1
# The LAUNCH rounds beside graph and queued ones take this share of the planned rounds (more where a test gates the
# host time and its precision asks for them): they are reported, and gated only on request.
LAUNCH_SHARE = 0.25
EAGER, GRAPH, QUEUED, HOST, MEMORY = "eager", "graph", "queued", "host", "memory"
# The rounds beside graph and queued ones: eager calls from an idle device, the whole launch cost in the span
# (backend.time_launch).
LAUNCH = "launch"
# Queued timing: the lead sleep is this many times an eager round's wall time, at most MAX_LEAD seconds.
LEAD_FACTOR = 1.5
MAX_LEAD = 2.0


@dataclass
class Measurement:
    """What one benchmark measured: per-round seconds and what they are (`timing`), the wall-clock seconds a round
    took, the warmup, the memory reading of the last call and its result. In graph and queued mode `launch_samples`
    are the LAUNCH rounds beside (the host-set time). `extra_info` holds what a measurement adds to the saved JSON
    beyond that (the world size of a multi-rank run, ...), `machine` the GPU's state before and after (None without
    readings), `notes` what the summary should say about the measurement."""

    samples: list[float]
    wall_seconds_per_round: float
    warmup_rounds: int
    memory: Any
    result: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    timing: str = EAGER
    launch_samples: list[float] | None = None
    machine: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Rounds:
    """How a benchmark is timed: warmup rounds (untimed) and timed rounds."""

    warmup_rounds: int
    rounds: int


@dataclass(frozen=True)
class Precision:
    """When to stop adding rounds: the median known to +-target (relative half-width of its 95% interval), or
    time_cap seconds of timed rounds spent. target None: the planned rounds only."""

    target: float | None = None
    time_cap: float = 0.0


def planned_rounds(round_seconds: float, max_time: float, min_rounds: int, warmup_rounds: int | None) -> Rounds:
    """Warmup and timed rounds for a function whose round takes round_seconds of wall time."""
    per_round = max(round_seconds, 1e-9)
    rounds = max(min_rounds, min(ceil(max_time / per_round), MAX_ROUNDS))
    if warmup_rounds is None:
        warmup_rounds = max(1, min(ceil(WARMUP_SHARE * max_time / per_round), MAX_WARMUP_ROUNDS))
    return Rounds(warmup_rounds=warmup_rounds, rounds=rounds)


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
    launch: bool = False,
) -> list[float]:
    """Per-round seconds of `rounds` calls, each preceded by an untimed flush when one is given (and timed behind the
    device-side delay `lead` when one is given: queued timing; by the CPU's clock with host=True; from an idle device,
    launch cost included, with launch=True)."""
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
        samples.append(time_call(call))
    return samples


def adapt(timed: Callable[[int], tuple[list[float], float]], rounds: int, precision: Precision = Precision()):
    """`timed(n)` times n rounds and returns their samples and the wall-clock seconds they took. Times `rounds`
    rounds, then doubles them while the median is known less precisely (relative_half_width) than precision.target
    and the next batch fits in precision.time_cap (estimated from the rounds so far); returns the samples and the
    wall seconds per round. The decision uses only what `timed` returns, so ranks that gather their samples decide
    alike (multirank.py)."""
    samples, spent = timed(rounds)
    while precision.target is not None and len(samples) < MAX_ADAPTIVE_ROUNDS:
        if relative_half_width(samples) <= precision.target:
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
    launch: bool = False,
) -> tuple[list[float], float]:
    """`adapt` over rounds of `call` timed through the backend (time_rounds: each after an untimed flush when one is
    given, behind `lead` when one is given, by the CPU's clock with host=True, from an idle device with launch=True)."""

    def timed(n: int) -> tuple[list[float], float]:
        start = clock()
        samples = time_rounds(backend, call, n, flush, lead, host, launch)
        return samples, clock() - start

    return adapt(timed, rounds, precision)


def warm_up(backend, call: Callable[[], Any], flush, max_time: float, min_rounds: int, warmup_rounds: int | None,
            rest: bool = True):
    """Runs the untimed first call (compilation, autotuning), one calibration round and the warmup; returns the
    planned rounds.

    The calibration round counts as the first warmup round. rest=False leaves out the warmup rounds after it, for a
    caller that runs them only where its timed rounds need them (`run`, for a warm call).
    """
    call()
    backend.synchronize()
    start = time.perf_counter()
    time_rounds(backend, call, 1, flush)
    chosen = planned_rounds(time.perf_counter() - start, max_time, min_rounds, warmup_rounds)
    if rest:
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


ERROR_LINE_CHARS = 100


def error_line(exc: BaseException) -> str:
    """'RuntimeError: the first line of its message' (at most ERROR_LINE_CHARS of it, then '...'), or the type's name
    alone for an empty message: a note per benchmark, not the traceback."""
    message = str(exc).strip()
    if not message:
        return type(exc).__name__
    line = message.splitlines()[0]
    if len(line) > ERROR_LINE_CHARS:
        line = line[:ERROR_LINE_CHARS].rstrip() + "..."
    return f"{type(exc).__name__}: {line}"


# The words every capture_failed_note holds (expected_notes finds them by these).
CAPTURE_FAILED = "the CUDA graph capture failed"
# What a run without a GPU says once, in place of every graph=True benchmark's capture_failed_note.
NO_CUDA_GRAPHS = "no CUDA device: graph=True benchmarks are timed eagerly"


def capture_failed_note(backend, error: str, where: str = "") -> str:
    """The note on a call whose CUDA graph capture failed (`error`: error_line; `where`: ' on rank 1'): how it is
    timed instead."""
    how = "timed queued (device time)" if backend.is_gpu else "timed eagerly"
    return f"{how}: {CAPTURE_FAILED}{where} ({error})"


def expected_notes(backend, notes: list[str]) -> tuple[list[str], list[str]]:
    """(the notes that stay the benchmark's own, the lines the run says once instead). Without a GPU a capture
    always fails and that is expected, so it is said once per run (NO_CUDA_GRAPHS); on a GPU a failed capture is
    the benchmark's own news."""
    if backend.is_gpu or not any(CAPTURE_FAILED in note for note in notes):
        return notes, []
    return [note for note in notes if CAPTURE_FAILED not in note], [NO_CUDA_GRAPHS]


def _capture(backend, call, flush, max_time, min_rounds, notes: list[str]):
    """(replay, release, the replays' planned rounds), or None when the capture fails (then noted)."""
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
    precision: Precision = Precision(),
    launch_precision: Precision = Precision(),
    graph: bool = False,
    host: bool = False,
    inject=None,
) -> Measurement:
    """Warm up, time the rounds (the module docstring says which), then one call under the memory reading.

    `precision` is the target of the benchmark's own rounds, `launch_precision` that of the LAUNCH rounds beside graph
    and queued ones. `inject` (lmsys.perf.injection.Injection, when the gate is measured) holds its bytes during every
    call and adds its delay to every timed one; its `launch_rounds` False leaves out the LAUNCH rounds (an injected
    case whose host-set time is not gated: nothing of its verdict reads them), its `warm` True the eager warmup
    rounds before captured replays (a call measured in this process already: compiled, tuned, the clocks up), its
    `timed` False every round: the memory reading alone (MEMORY), for a case that only holds memory.
    """
    if inject is not None:
        call = inject.held(backend, call)
        if not inject.timed:
            result, memory = backend.measure_memory(call)
            return Measurement([], 0.0, 0, memory, result, timing=MEMORY)
    before = backend.machine_state()
    # A warm call (inject.warm: measured in this process already) timed as graph replays is warmed by the replays' own
    # warm-up, right before them; its eager warmup rounds run only when the capture fails and eager or queued rounds
    # follow instead.
    deferred = graph and inject is not None and inject.warm
    chosen = warm_up(backend, call, flush, max_time, min_rounds, warmup_rounds, rest=not deferred)
    timed = call if inject is None else inject.delayed(backend, call, flush, graph, host)
    notes = []
    captured = _capture(backend, timed, flush, max_time, min_rounds, notes) if graph else None
    queued = graph and captured is None and backend.is_gpu
    if deferred and captured is None:
        time_rounds(backend, call, chosen.warmup_rounds - 1, flush)
    launch = None
    if host:
        lead = queue_lead(backend, timed, flush)
        samples, wall = sample(backend, timed, chosen.rounds, flush, precision, lead=lead, host=True)
    elif queued:
        lead = queue_lead(backend, timed, flush)
        samples, wall = sample(backend, timed, chosen.rounds, flush, precision, lead=lead)
    elif captured is None:
        samples, wall = sample(backend, timed, chosen.rounds, flush, precision)
    else:
        replay, release, replay_rounds = captured
        try:
            samples, wall = sample(backend, replay, replay_rounds.rounds, flush, precision)
        finally:
            release()
    if (queued or captured is not None) and (inject is None or inject.launch_rounds):
        rounds = max(min_rounds, ceil(LAUNCH_SHARE * chosen.rounds))
        launch = sample(backend, timed, rounds, flush, launch_precision, launch=True)
    result, memory = backend.measure_memory(call)
    after = backend.machine_state()
    measurement = Measurement(
        samples, wall, 1 if deferred and captured is not None else chosen.warmup_rounds, memory, result,
        timing=HOST if host else QUEUED if queued else EAGER if captured is None else GRAPH,
        machine=None if before is None and after is None else {"before": before, "after": after},
        notes=notes,
    )
    if launch is not None:
        measurement.launch_samples, measurement.extra_info["eager_wall_seconds_per_round"] = launch
    return measurement
