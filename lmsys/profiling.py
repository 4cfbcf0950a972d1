"""Annotations and measurements for profiling the model and its training step.

- `range(name)`: a named range, seen by Nsight Systems (NVTX, through `torch.cuda.nvtx`) and by `torch.profiler`
  (`record_function`). Ranges are off by default; while off, `range` returns one shared `nullcontext`, so the
  annotated code pays a function call and nothing else. Turn them on for a block with `enabled()`.
  Under `torch.compile` ranges stay off: the compiled graph has no Python frames to annotate.
- `profile(fn, ...)`: run `fn` under `torch.profiler` with ranges on; `table(prof)` summarises it, and
  `trace_path` exports a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev).
- `memory_snapshot(path)`: record CUDA allocator history over a block and dump it for
  https://pytorch.org/memory_viz.
- `Throughput`: tokens per second over a run, reading the clock only after the device is synchronized.
"""

import builtins
import contextlib
import time
from collections.abc import Callable, Iterator

import torch

_OFF = contextlib.nullcontext()
_enabled = False


class _Range:
    """An NVTX range (on CUDA machines) and a `record_function` range with the same name."""

    __slots__ = ("_record", "name")

    def __init__(self, name: str):
        self.name = name
        self._record = torch.profiler.record_function(name)

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self.name)
        self._record.__enter__()
        return self

    def __exit__(self, *exc_info):
        self._record.__exit__(*exc_info)
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_pop()
        return False


def range(name: str) -> contextlib.AbstractContextManager:
    """A context manager marking a named range; the shared no-op context while ranges are off or compiling."""
    # is_compiling() first: dynamo then folds the branch without reading (and guarding on) `_enabled`.
    if torch.compiler.is_compiling() or not _enabled:
        return _OFF
    return _Range(name)


def is_enabled() -> bool:
    """Whether `range` currently records anything."""
    return _enabled


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Turn ranges on (or off, with `on=False`) inside the block; the previous setting returns afterwards."""
    global _enabled
    previous, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = previous


def profile(
    fn: Callable,
    *args,
    warmup: int = 1,
    trace_path: str | None = None,
    record_shapes: bool = False,
    profile_memory: bool = False,
    **kwargs,
) -> torch.profiler.profile:
    """Call `fn(*args, **kwargs)` `warmup` times, then once under `torch.profiler` with ranges on.

    Warm-up calls keep one-time costs (allocator growth, autotuning, compilation) out of the profile. Returns the
    finished profiler (`table(prof)`, `prof.key_averages()`, `prof.events()`); with `trace_path`, also writes a
    Chrome trace there.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for _ in builtins.range(warmup):
        fn(*args, **kwargs)
    _synchronize()
    with (
        enabled(),
        torch.profiler.profile(
            activities=activities, record_shapes=record_shapes, profile_memory=profile_memory
        ) as prof,
    ):
        fn(*args, **kwargs)
        _synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return prof


def table(prof: torch.profiler.profile, row_limit: int = 30, group_by_input_shape: bool = False) -> str:
    """The profiler's per-operator table, sorted by device time on CUDA and by CPU time otherwise; with
    `group_by_input_shape`, one row per operator and input shapes (needs `profile(..., record_shapes=True)`).

    The ranges of `annotate` (and any other record_function) are left out: a range's time is that of everything
    inside it ("forward" would top the table at the whole forward's time), and the table is about operators."""
    sort_by = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    averages = prof.key_averages(group_by_input_shape=group_by_input_shape)
    averages[:] = [event for event in averages if not event.is_user_annotation]  # keeps the EventList's settings
    return averages.table(sort_by=sort_by, row_limit=row_limit)


@contextlib.contextmanager
def memory_snapshot(path: str, max_entries: int = 100_000) -> Iterator[None]:
    """Record the CUDA caching allocator's history inside the block and dump a snapshot to `path` at its end.

    The pickle opens in https://pytorch.org/memory_viz (allocations over time, with Python stacks).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memory snapshots record the CUDA caching allocator; no CUDA device is available")
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


class Throughput:
    """Tokens per second since `start()`: call `update(tokens)` after each step, read `tokens_per_second`.

    Every reading synchronizes the device first, so asynchronous CUDA work is counted when it finishes.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._tokens = 0
        self._start = None
        self._elapsed = 0.0

    def start(self) -> None:
        """Start (or restart) counting from now."""
        _synchronize()
        self._tokens, self._elapsed, self._start = 0, 0.0, self._clock()

    def update(self, tokens: int) -> None:
        """Count `tokens` more, processed by work issued since the previous reading."""
        if self._start is None:
            raise RuntimeError("call start() before update()")
        _synchronize()
        self._tokens += tokens
        self._elapsed = self._clock() - self._start

    @property
    def tokens_per_second(self) -> float:
        """Tokens counted so far divided by the seconds since `start()` at the last `update`."""
        if self._elapsed <= 0:
            raise RuntimeError("no time has been measured yet: call start(), run a step, then update(tokens)")
        return self._tokens / self._elapsed


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
