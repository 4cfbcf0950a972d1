"""What every `lmsys-bench` command shares: the device's clock (the regression gate's backend: CUDA events on a GPU,
perf_counter on the CPU), a progress line on stderr, an out-of-memory case recorded as a row instead of ending the
sweep, and the results as a printed table and CSV/JSON files (pandas)."""

import contextlib
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from lmsys.perf import timing
from lmsys.perf.backend import CpuBackend, CudaBackend, detect_backend
from lmsys.perf.fixture import oom_reason

OUTPUT_SUFFIXES = (".csv", ".json")
OK = "ok"


class UsageError(ValueError):
    """A bad command line: the tool prints the message and exits with status 2, without a traceback."""


def backend() -> CpuBackend | CudaBackend:
    """The CUDA device when there is one, else the CPU, with the regression gate's clock for it."""
    return detect_backend(time.perf_counter)


# What time_steps reads: "eager", the device's time from a short device-side sleep on (the gate's eager clock: a call
# that takes the CPU longer than the sleep to issue is timed waiting for it); "queued", the device's time alone, behind
# a sleep longer than the CPU takes to issue the call (the gate's queued timing); "host", the CPU's time to issue it,
# behind such a sleep (the gate's host timing).
CLOCKS = ("eager", "queued", "host")


def time_steps(device, fn: Callable[[], Any], warmup: int, steps: int, clock: str = "eager") -> list[float]:
    """Seconds of each of `steps` calls of fn after `warmup` untimed ones, each synchronized with the device, read on
    `clock` (CLOCKS)."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"warmup must be >= 0 and steps >= 1, got {warmup} and {steps}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    for _ in range(warmup):
        fn()
    device.synchronize()
    if clock == "eager":
        return [device.time_call(fn) for _ in range(steps)]
    return timing.time_rounds(device, fn, steps, None, timing.queue_lead(device, fn, None), host=clock == "host")


def summary(samples: list[float]) -> dict[str, float]:
    """Mean, standard deviation (0 for one sample) and median of per-step seconds, in milliseconds."""
    return {
        "mean_ms": statistics.fmean(samples) * 1e3,
        "std_ms": statistics.stdev(samples) * 1e3 if len(samples) > 1 else 0.0,
        "median_ms": statistics.median(samples) * 1e3,
    }


class Progress:
    """'[3/24] label' on stderr: rewritten in place on a terminal, one line per case otherwise (CI logs)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self._inline = self.stream.isatty()

    def start(self, label: str) -> None:
        """Announces the next case."""
        self.done += 1
        text = f"[{self.done}/{self.total}] {label}"
        self.stream.write(f"\r\033[K{text}" if self._inline else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the in-place line."""
        if self._inline and self.done:
            self.stream.write("\n")
            self.stream.flush()


@contextlib.contextmanager
def out_of_memory_as_status(device, row: dict) -> Iterator[None]:
    """Runs the block; a CUDA out-of-memory error inside it becomes row['status'] ('OOM: tried to allocate ...') and
    the memory it held is released, so the sweep goes on with the next case."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        row["status"] = "OOM: " + oom_reason(str(exc), device.name).rsplit(": ", 1)[1]
        # The traceback's frames hold the case's tensors; without clearing them nothing could be freed.
        traceback.clear_frames(exc.__traceback__)
        device.release_memory()


def peak_memory(device) -> Callable[[], int | None]:
    """Resets the device's peak-memory statistics now; the returned function reads the peak allocated bytes since
    (None on the CPU, which has no such reading)."""
    if not device.is_gpu:
        return lambda: None
    device.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return lambda: (device.synchronize(), torch.cuda.max_memory_allocated())[1]


def check_outputs(paths: list[Path]) -> None:
    """UsageError for an output file with an unknown extension (before a sweep runs, not after)."""
    for path in paths:
        if path.suffix not in OUTPUT_SUFFIXES:
            raise UsageError(f"--output {path}: the file must end in {' or '.join(OUTPUT_SUFFIXES)}")


def write_outputs(frame: pd.DataFrame, paths: list[Path]) -> None:
    """The results as CSV or JSON (a list of records), by each file's extension."""
    check_outputs(paths)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".csv":
            frame.to_csv(path, index=False)
        else:
            frame.to_json(path, orient="records", indent=2)


def _cell(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def format_table(frame: pd.DataFrame, digits: int = 4) -> str:
    """The frame as aligned text, floats to `digits` significant digits, missing values blank."""
    shown = frame.apply(lambda column: [_cell(v, digits) for v in column]) if len(frame) else frame
    return shown.to_string(index=False)


def gib(nbytes: int | None) -> float | None:
    """Bytes in GiB, None passed through."""
    return None if nbytes is None else nbytes / 2**30
