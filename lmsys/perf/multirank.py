"""Benchmarks of a step that runs on several ranks (DDP variants, sharded optimizers, collectives), timed so that the
gate judges them like any single-device benchmark.

The test process spawns the ranks itself (lmsys.distributed.launch: a free port, a timeout, the failing rank's
traceback), NCCL on GPUs and gloo on the CPU. On every rank:

    step = setup(ctx, **kwargs)        the subject is built on the rank (ctx: RankContext); step() takes no arguments
    one untimed call, one calibration round (the slowest rank's round decides the rounds), warmup rounds
    (Settings.inject, when the gate is measured: lmsys.perf.injection)
    graph=True: every rank captures its step in a CUDA graph (a step that synchronizes or reads a value back
        cannot be captured: when any rank fails, every rank times its step as below, and the note names the rank
        and the error); the replays are timed as queued rounds are, the graph released before the LAUNCH rounds
    timed rounds: all ranks meet at a barrier, then each times the round on its own clock (CUDA events); on a GPU
        the rounds are queued (timing.py: every rank's step behind the same device-side lead, LEAD_FACTOR times the
        slowest rank's round, so the span holds device time) and LAUNCH rounds from an idle device follow, the
        CPU's launch cost included (the host-set time). A step whose CPU time exceeds its device time (thousands of
        small kernels: the bf16 step of a large model) drains any lead and is the CPU's time even when queued: graph
        mode is for those
    rank 0 gathers the samples: a round's time is the maximum over the ranks
    one more call per rank under reset peak memory statistics

Back in the test process the result is a timing.Measurement, judged and recorded by the fixture like any other (a
gated SLOWER spawns the ranks once more to re-measure):
the memory the gate checks is the largest rank's peak; every rank's readings, the world size, the transport and
the named spans of the step (`ctx.span("comm_wait")`: median over rounds of the slowest rank's span, and its share
of the round) go into extra_info.
"""

import contextlib
import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from lmsys.distributed.launch import init_process_group, launch_ranks
from lmsys.perf import machine, timing


@dataclass
class RankContext:
    """What a rank's `setup` gets: its rank, the world size, its device and the measurement backend.

    `span(name)` times a part of the step on the rank's clock (device events on a GPU), e.g. the wait for gradient
    communication; `mark(name)` notes the device memory allocated at a point of the step (read during the memory
    call; None on the CPU).
    """

    rank: int
    world_size: int
    device: torch.device
    backend: Any
    _events: list = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Times the block as part of the current round (on a GPU: events on the current stream, no sync)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            yield  # a span of a captured step is not timed: graph mode's spans come from its eager rounds
        elif self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            clock = getattr(self.backend, "clock", time.perf_counter)
            start = clock()
            yield
            self._events.append((name, start, clock()))

    def mark(self, name: str) -> None:
        """Notes the device memory allocated now and its peak so far on this rank (in setup: since the rank started;
        in the step: since the memory call began, so the peak up to that point of the step). The last call's
        values are kept; on the CPU there are none."""
        if self.device.type == "cuda":
            self.marks[f"{name}_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            self.marks[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)

    def _take_spans(self) -> dict[str, float]:
        """Seconds per span name of the round that just ended (its device work has finished)."""
        spans: dict[str, float] = {}
        for name, start, end in self._events:
            seconds = start.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - start
            spans[name] = spans.get(name, 0.0) + seconds
        self._events.clear()
        return spans


@dataclass(frozen=True)
class Settings:
    """What the test process hands every rank: the subject, the round budget and how precisely to time the rounds
    (the step's own, the LAUNCH rounds beside), and the regression injected to measure the gate (injection.py)."""

    setup: Callable
    setup_kwargs: dict
    make_backend: Callable[[], Any]
    transport: str
    max_time: float
    min_rounds: int
    warmup_rounds: int | None
    disable_gc: bool
    precision: timing.Precision = timing.Precision()
    launch_precision: timing.Precision = timing.Precision()
    once: bool = False
    inject: Any = None
    queued: bool = False
    graph: bool = False
    # Before its rounds every rank leaves its GPU to cool if it reads thermally throttled (the re-measurement of a
    # SLOWER), down to the baseline's temperature before its rounds plus machine.COOL_MARGIN_C.
    cool: bool = False
    baseline_c: float | None = None


def _barrier(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


def _time_rounds(ctx: RankContext, step: Callable[[], Any], rounds: int, timer=None
                 ) -> tuple[list[float], list[dict], float]:
    """This rank's per-round seconds and spans, each round started at a barrier and timed by `timer` (default the
    backend's time_call); and the wall seconds per round."""
    timer = timer or ctx.backend.time_call
    samples, spans = [], []
    start = time.perf_counter()
    for _ in range(rounds):
        _barrier(ctx)
        samples.append(timer(step))
        spans.append(ctx._take_spans())
    return samples, spans, (time.perf_counter() - start) / max(rounds, 1)


def _capture(ctx: RankContext, step: Callable[[], Any]) -> tuple[tuple | None, str | None]:
    """(replay, release) of the step captured in a CUDA graph on every rank, or (None, a note) when any rank's
    capture failed (then no rank keeps its graph)."""
    try:
        captured, failure = ctx.backend.capture_graph(step), None
    except Exception as exc:  # a capture can fail in many ways (sync, CPU readback, unsupported op)
        captured, failure = None, timing.error_line(exc)
    ctx._events.clear()  # the spans of the capture's warm-up call
    failures = [(rank, f) for rank, f in enumerate(_gather(failure)) if f is not None]
    if not failures:
        return captured, None
    if captured is not None:
        captured[1]()
    rank, failure = failures[0]
    return None, timing.capture_failed_note(ctx.backend, failure, f" on rank {rank}")


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per round, the slowest rank's time."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def _span_summary(per_rank_spans: list[list[dict]], round_times: list[float]) -> dict[str, dict[str, float]]:
    """Per span name: the median over rounds of the slowest rank's time, and that as a share of the median round."""
    names = sorted({name for spans in per_rank_spans for round_spans in spans for name in round_spans})
    typical = median(round_times)
    summary = {}
    for name in names:
        per_round = [
            max(spans[i].get(name, 0.0) for spans in per_rank_spans) for i in range(len(round_times))
        ]
        seconds = median(per_round)
        summary[name] = {"seconds": seconds, "share": seconds / typical if typical > 0 else 0.0}
    return summary


def rank_main(settings: Settings) -> tuple[Any, dict | None]:
    """One rank's benchmark (run under lmsys.distributed.launch). Returns its last result, and on rank 0 the
    gathered measurement as a dict."""
    device = init_process_group(settings.transport)
    backend = settings.make_backend()
    ctx = RankContext(dist.get_rank(), dist.get_world_size(), device, backend)
    if settings.once:  # --benchmark-disable: the step runs once, untimed
        return settings.setup(ctx, **settings.setup_kwargs)(), None
    with timing.gc_paused(settings.disable_gc):
        step = settings.setup(ctx, **settings.setup_kwargs)
        step()  # compilation, autotuning, allocator growth
        backend.synchronize()
        if settings.inject is not None:
            step = settings.inject.held(backend, step)
        _, _, calibration = _time_rounds(ctx, step, 1)
        walls = _gather(calibration)
        budget = timing.planned_rounds(max(walls), settings.max_time, settings.min_rounds, settings.warmup_rounds)
        _time_rounds(ctx, step, budget.warmup_rounds - 1)
        captured, note = _capture(ctx, step) if settings.graph else (None, None)
        timed = step
        if captured is not None:
            timed = captured[0]
            _, _, replay_wall = _time_rounds(ctx, timed, 1)  # the graph's first replay uploads it
            walls = _gather(replay_wall)
        # Queued timing (graph replays too): every rank's rounds behind the same device-side lead, long enough for the
        # slowest rank's CPU to queue its whole step, so that the rounds hold the device's time.
        notes = [] if note is None else [note]
        if settings.cool:
            cooled = machine.cool_down(backend.machine_state, settings.baseline_c, time.sleep,
                                       machine.COOL_WAIT_SECONDS, machine.COOL_POLL_SECONDS)
            notes += [] if cooled is None else [cooled]
            _barrier(ctx)
        timer = backend.time_call
        if settings.queued or captured is not None:
            lead = backend.make_delay(min(timing.MAX_LEAD, timing.LEAD_FACTOR * max(walls)))
            timer = functools.partial(backend.time_call, lead=lead)
        if settings.inject is not None:
            timed, step = settings.inject.delayed_ranks(ctx, timed, step, timer)

        def series(subject, timer, precision):
            """The rounds of `subject` on every rank, gathered: each round the slowest rank's. Every rank holds the
            same gathered samples, so every rank takes the same decision to add rounds (timing.adapt)."""
            per_rank_spans = []

            def timed_rounds(rounds):
                samples, spans, wall = _time_rounds(ctx, subject, rounds, timer)
                gathered = _gather((samples, spans, wall))
                per_rank_spans.append([g[1] for g in gathered])
                return _slowest([g[0] for g in gathered]), max(g[2] for g in gathered) * rounds

            samples, wall = timing.adapt(timed_rounds, budget.rounds, precision)
            return samples, [sum(batch, []) for batch in zip(*per_rank_spans, strict=True)], wall

        try:
            samples, spans, wall = series(timed, timer, settings.precision)
        finally:
            if captured is not None:
                captured[1]()
        launch = None
        if settings.queued or captured is not None:  # the LAUNCH rounds beside, launch cost included (idle device)
            launch = series(step, backend.time_launch, settings.launch_precision)
        _barrier(ctx)
        result, memory = backend.measure_memory(step)
        readings = _gather((memory, dict(ctx.marks)))
        per_rank_notes = _gather(notes)
    if ctx.rank != 0:
        return result, None
    # Rank 0's notes, then the other ranks' own (a rank's GPU that had to cool), named by rank.
    notes = notes + [f"rank {rank}: {text}" for rank, texts in enumerate(per_rank_notes) if rank
                     for text in texts if text not in notes]
    out = {
        "samples": samples,
        "wall": wall,
        "warmup_rounds": budget.warmup_rounds,
        "readings": readings,
        "spans": _span_summary(spans, samples),
        "timing": timing.GRAPH if captured is not None else timing.QUEUED if settings.queued else timing.EAGER,
        "notes": notes,
    }
    if launch is not None:
        launch_samples, launch_spans, launch_wall = launch
        out.update(launch_samples=launch_samples, launch_wall=launch_wall)
        if not out["spans"]:  # a captured step's spans are not timed: the LAUNCH rounds' are
            out["spans"] = _span_summary(launch_spans, launch_samples)
    return result, out


def _largest(readings: list) -> Any:
    """The reading of the rank with the largest peak above start, as the gate compares it (the requested bytes
    where read, else the allocated ones); None when no rank has one."""
    memories = [memory for memory, _ in readings if memory is not None]
    return max(memories, key=lambda m: m.peak_compared_above_start, default=None)


def run_once(settings: Settings, world_size: int, timeout: float) -> list:
    """Each rank's result of one untimed call of its step (what --benchmark-disable runs)."""
    once = dataclasses.replace(settings, once=True)
    outputs = launch_ranks(rank_main, world_size, once, backend=settings.transport, timeout=timeout)
    return [result for result, _ in outputs]


def measure(settings: Settings, world_size: int, timeout: float) -> timing.Measurement:
    """Runs the benchmark on `world_size` ranks and returns it as one Measurement (results: a list in rank order)."""
    gc.collect()
    outputs = launch_ranks(rank_main, world_size, settings, backend=settings.transport, timeout=timeout)
    results = [result for result, _ in outputs]
    gathered = outputs[0][1]
    per_rank = []
    for memory, marks in gathered["readings"]:
        entry = {} if memory is None else memory.as_extra_info()
        entry.update(marks)
        per_rank.append(entry)
    extra = {
        "world_size": world_size,
        "dist_backend": settings.transport,
        "per_rank_memory": per_rank,
        "spans": gathered["spans"],
    }
    if "launch_samples" in gathered:
        extra["eager_wall_seconds_per_round"] = gathered["launch_wall"]
    return timing.Measurement(
        samples=gathered["samples"],
        wall_seconds_per_round=gathered["wall"],
        warmup_rounds=gathered["warmup_rounds"],
        memory=_largest(gathered["readings"]),
        result=results,
        extra_info=extra,
        timing=gathered["timing"],
        launch_samples=gathered.get("launch_samples"),
        notes=gathered["notes"],
    )
