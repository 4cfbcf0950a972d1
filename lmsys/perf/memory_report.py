"""The GPU memory report of --perf-mem-report (--gpu-mem-report): every benchmark's memory high-water marks,
printed largest first, and with =FILE written as CSV or JSON. Imported only when the option is given.
"""

from pathlib import Path

import pandas as pd

from lmsys.perf import baselines
from lmsys.perf.baselines import printable
from lmsys.perf.session import PerfSession
from lmsys.perf.verdict import format_bytes

SUFFIXES = (".csv", ".json")


def table(session: PerfSession) -> pd.DataFrame:
    """Every benchmark's memory high-water marks in bytes, largest peak allocated first (the --perf-mem-report data)."""
    rows = []
    for record in session.records:
        memory = record.memory
        above = None if memory is None else memory.peak_allocated_above_start
        change = None
        if above is not None and record.baseline_peak:
            change = above / record.baseline_peak - 1
        rows.append({
            "benchmark": record.fullname,
            "peak_allocated_bytes": None if memory is None else memory.peak_allocated,
            "peak_allocated_above_start_bytes": above,
            "peak_reserved_bytes": None if memory is None else memory.peak_reserved,
            "peak_reserved_above_start_bytes": None if memory is None else memory.peak_reserved_above_start,
            "baseline_peak_allocated_above_start_bytes": record.baseline_peak,
            "change": change,
        })
    columns = [
        "benchmark", "peak_allocated_bytes", "peak_allocated_above_start_bytes", "peak_reserved_bytes",
        "peak_reserved_above_start_bytes", "baseline_peak_allocated_above_start_bytes", "change",
    ]
    frame = pd.DataFrame(rows, columns=columns)
    return frame.sort_values("peak_allocated_bytes", ascending=False, na_position="last", kind="stable")


def write(frame: pd.DataFrame, path: Path, overwrite: bool = False) -> None:
    """Writes the memory table as CSV or JSON (a list of records), chosen by the file's extension, atomically; a file
    that appeared since the run began is only replaced with overwrite (FileExistsError otherwise)."""
    if path.suffix == ".csv":
        text = frame.to_csv(index=False)
    elif path.suffix == ".json":
        text = frame.to_json(orient="records", indent=2)
    else:
        raise ValueError(f"--perf-mem-report file must end in {' or '.join(SUFFIXES)}, got {path}")
    if overwrite:
        baselines.replace_file(path, text)
    else:
        baselines.write_new_file(path, text)


def _shown(frame: pd.DataFrame) -> list[str]:
    def cell(value, formatter):
        return "" if pd.isna(value) else formatter(value)

    shown = pd.DataFrame({
        "benchmark": frame["benchmark"],
        "peak allocated": [cell(v, format_bytes) for v in frame["peak_allocated_bytes"]],
        "above start": [cell(v, format_bytes) for v in frame["peak_allocated_above_start_bytes"]],
        "peak reserved": [cell(v, format_bytes) for v in frame["peak_reserved_bytes"]],
        "baseline (above start)": [cell(v, format_bytes) for v in frame["baseline_peak_allocated_above_start_bytes"]],
        "change": [cell(v, lambda x: f"{x:+.1%}") for v in frame["change"]],
    })
    return shown.to_string(index=False).splitlines()


def summary(session: PerfSession, written: Path | None) -> list[str]:
    """The --perf-mem-report table, or why there is none."""
    frame = table(session)
    if frame.empty:
        lines = ["no benchmarks ran"]
    elif frame["peak_allocated_bytes"].isna().all():
        lines = ["no GPU memory readings: this run has no CUDA device (CPU timings only)"]
    else:
        lines = _shown(frame)
    if written is not None:
        lines.append(f"memory report written to {written}")
    return [printable(line) for line in lines]
