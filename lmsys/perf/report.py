"""What the plugin prints and writes at the end: the results/comparison table and the GPU memory report.

Tables are pandas DataFrames: printed with to_string, written with to_csv / to_json by the file's extension.
"""

from pathlib import Path

import pandas as pd

from lmsys.perf.compare import format_bytes, format_seconds
from lmsys.perf.session import PerfSession, Record

MEMORY_REPORT_SUFFIXES = (".csv", ".json")


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def _rate(record: Record) -> dict[str, str]:
    r = record.rates
    fractions = [f"{r[k]:.1%}" for k in ("fraction_of_peak_tflops", "fraction_of_peak_gbps") if k in r]
    return {
        "TFLOP/s": f"{r['tflops']:.4g}" if "tflops" in r else "",
        "GB/s": f"{r['gbps']:.4g}" if "gbps" in r else "",
        "% of peak": " / ".join(fractions),
    }


def _change(now: float | None, then: float | None) -> str:
    return "" if now is None or not then else _percent(now / then - 1)


def results_frame(records: list[Record], comparing: bool) -> pd.DataFrame:
    """One row per benchmark: time and memory, with baseline, change, tolerance and verdict columns when comparing;
    benchmarks timed in a CUDA graph also show their eager time (CPU launch cost included)."""
    graphs = any(record.eager_median is not None for record in records)
    rows = []
    for record in records:
        peak = None if record.memory is None else record.memory.peak_allocated_above_start
        row = {"benchmark": record.name}
        now = format_seconds(record.median) + (" (graph)" if record.timing == "graph" else "")
        eager = "" if record.eager_median is None else format_seconds(record.eager_median)
        if comparing:
            label = record.verdict.label if record.verdict else ""
            tolerance = record.tolerance
            row.update({
                "baseline": "" if record.baseline_median is None else format_seconds(record.baseline_median),
                "now": now,
                "time": _change(record.median, record.baseline_median),
                "tolerance": "" if tolerance is None else f"{tolerance.value * 100:.3g}% {tolerance.source}",
            })
            if graphs:
                row.update({"eager": eager, "eager change": _change(record.eager_median, record.baseline_eager_median)})
            row.update({
                "baseline mem": "" if record.baseline_peak is None else format_bytes(record.baseline_peak),
                "now mem": "" if peak is None else format_bytes(peak),
                "memory": _change(peak, record.baseline_peak),
                "verdict": label + (" (re-measured)" if record.remeasured else ""),
            })
        else:
            row.update({"median": now, "rounds": record.rounds})
            if graphs:
                row["eager"] = eager
            row["peak mem"] = "n/a (no GPU)" if peak is None else format_bytes(peak)
        row.update(_rate(record))
        rows.append(row)
    frame = pd.DataFrame(rows)
    unused = [c for c in ("TFLOP/s", "GB/s", "% of peak") if c in frame and (frame[c] == "").all()]
    return frame.drop(columns=unused)


def memory_frame(session: PerfSession) -> pd.DataFrame:
    """Every benchmark's memory high-water marks in bytes, largest peak allocated first (the --gpu-mem-report data)."""
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


def write_memory_report(frame: pd.DataFrame, path: Path, overwrite: bool = False) -> None:
    """Writes the memory table as CSV or JSON (a list of records), chosen by the file's extension; a file that
    appeared since the run began is only replaced with overwrite."""
    if path.suffix == ".csv":
        text = frame.to_csv(index=False)
    elif path.suffix == ".json":
        text = frame.to_json(orient="records", indent=2)
    else:
        raise ValueError(f"--gpu-mem-report file must end in {' or '.join(MEMORY_REPORT_SUFFIXES)}, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w" if overwrite else "x", encoding="utf-8") as fh:
        fh.write(text)


def _memory_lines(frame: pd.DataFrame) -> list[str]:
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


def summary_lines(session: PerfSession) -> list[str]:
    """The results table (with the comparison when there is one) and the session's notes."""
    lines = []
    if session.compared_files:
        lines += [f"compared with {path}" for path in session.compared_files]
    if session.records:
        lines += results_frame(session.records, session.comparing).to_string(index=False).splitlines()
        lines += [f"{record.name}: {'; '.join(record.notes)}" for record in session.records if record.notes]
    lines += session.notes
    lines += session.saving_notes()
    if session.report_error:
        lines.append(session.report_error)
    return lines


def memory_report_lines(session: PerfSession, written: Path | None) -> list[str]:
    """The --gpu-mem-report table, or why there is none."""
    frame = memory_frame(session)
    if frame.empty:
        lines = ["no benchmarks ran"]
    elif frame["peak_allocated_bytes"].isna().all():
        lines = ["no GPU memory readings: this run has no CUDA device (CPU timings only)"]
    else:
        lines = _memory_lines(frame)
    if written is not None:
        lines.append(f"memory report written to {written}")
    return lines
