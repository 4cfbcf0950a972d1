"""What the plugin prints at the end: the results table (with the comparison when there is one) and the notes. The
GPU memory report is memory_report.py's, the markdown report of --perf-report markdown.py's.

Tables are pandas DataFrames, printed with to_string or written as markdown by markdown_table.
"""

import pandas as pd

from lmsys.perf.baselines import printable
from lmsys.perf.verdict import format_bytes, format_seconds
from lmsys.perf.session import PerfSession, Record
from lmsys.perf.timing import CAPTURE_FAILED


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
    """One row per benchmark: time and memory, with baseline, change, tolerance, resolution (the smallest slowdown the
    comparison could catch) and verdict columns when comparing; benchmarks timed in a CUDA graph also show their
    LAUNCH rounds' time (CPU launch cost included: reported, gated only where the test asks)."""
    graphs = any(record.launch_median is not None for record in records)
    rows = []
    for record in records:
        peak = None if record.memory is None else record.memory.peak_allocated_above_start
        row = {"benchmark": record.name}
        now = format_seconds(record.median) + ("" if record.timing == "eager" else f" ({record.timing})")
        launch = "" if record.launch_median is None else format_seconds(record.launch_median)
        if comparing:
            label = record.verdict.label if record.verdict else ""
            compared = record.verdict.time if record.verdict else None
            row.update({
                "baseline": "" if record.baseline_median is None else format_seconds(record.baseline_median),
                "now": now,
                "time": _change(record.median, record.baseline_median),
                "tolerance": "" if compared is None else f"{compared.tolerance * 100:.3g}% {compared.source}",
                "catches": "" if compared is None else f">{compared.resolution:.1%}",
            })
            if graphs:
                row.update({"launch": launch,
                            "launch change": _change(record.launch_median, record.baseline_launch_median)})
            now_peak, base_peak = record.compared_peaks()
            row.update({
                "baseline mem": "" if base_peak is None else format_bytes(base_peak),
                "now mem": "" if now_peak is None else format_bytes(now_peak),
                "memory": _change(now_peak, base_peak),
                "verdict": label + (" (re-measured)" if record.remeasured else ""),
            })
        else:
            row.update({"median": now, "rounds": record.rounds})
            if graphs:
                row["launch"] = launch
            row["peak mem"] = "n/a (no GPU)" if peak is None else format_bytes(peak)
        row.update(_rate(record))
        rows.append(row)
    frame = pd.DataFrame(rows)
    unused = [c for c in ("TFLOP/s", "GB/s", "% of peak") if c in frame and (frame[c] == "").all()]
    return frame.drop(columns=unused)


def shared_notes(records: list[Record]) -> list[str]:
    """The notes that every one of several benchmarks has (the machine's state through the whole run): the summary
    says them once. A failed CUDA graph capture stays with each benchmark: on a GPU it is that call's own news."""
    if len(records) < 2:
        return []
    return [note for note in records[0].notes
            if CAPTURE_FAILED not in note and all(note in record.notes for record in records[1:])]


def summary_lines(session: PerfSession) -> list[str]:
    """The results table (with the comparison when there is one) and the session's notes."""
    lines = []
    if session.compared_files:
        lines += [f"compared with {path}" for path in session.compared_files]
    if session.records:
        lines += results_frame(session.records, session.comparing).to_string(index=False).splitlines()
        shared = shared_notes(session.records)
        for record in session.records:
            own = [note for note in record.notes if note not in shared]
            if own:
                lines.append(f"{record.name}: {'; '.join(own)}")
        lines += [f"every benchmark: {note}" for note in shared]
    lines += session.notes
    lines += session.saving_notes()
    if session.report_error:
        lines.append(session.report_error)
    return [printable(line) for line in lines]


def _escape(cell) -> str:
    return "" if cell is None or (isinstance(cell, float) and pd.isna(cell)) else str(cell).replace("|", "\\|")


def markdown_table(frame: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table, cells as their str() ('|' escaped, missing values empty).

    pandas' own to_markdown needs `tabulate`, which is not a dependency.
    """
    lines = ["| " + " | ".join(_escape(c) for c in frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"
