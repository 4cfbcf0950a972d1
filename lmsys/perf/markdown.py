"""The markdown report of --perf-report=md:FILE: the comparison as GitHub markdown (a CI job summary, a pull-request
comment), failing verdicts first. Imported only when the option is given.
"""

import re
from pathlib import Path

import pandas as pd

from lmsys.perf.baselines import printable
from lmsys.perf.report import _change, _rate, markdown_table
from lmsys.perf.session import PerfSession, Record
from lmsys.perf.verdict import Verdict, format_bytes, format_seconds

# What markdown_text escapes with a backslash: the ASCII punctuation that starts markup inline (code, emphasis, links,
# images, raw HTML, entities, strike-through, table cells) or at the start of a line (headings).
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>!|~&#])")


def code_span(text) -> str:
    """text as a markdown code span that renders literally whatever it holds: fenced by one more backtick than its
    longest run of backticks, padded with a space where it starts or ends with a backtick or a space (which the
    padding rule would strip), unprintable characters escaped (printable)."""
    text = printable(text)
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_text(text) -> str:
    """text as markdown that renders literally: markup characters escaped with a backslash (_MARKDOWN_SPECIAL),
    unprintable characters escaped (printable)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", printable(text))


REPORT_FORMATS = ("md",)


def parse_report_option(value: str) -> tuple[str, Path]:
    """'md:FILE' -> ('md', Path(FILE)); ValueError naming the problem for anything else."""
    kind, sep, name = value.partition(":")
    if not sep or kind not in REPORT_FORMATS or not name:
        raise ValueError(f"expected FORMAT:FILE with FORMAT one of {', '.join(REPORT_FORMATS)}, e.g. md:perf.md")
    return kind, Path(name)


def report_frame(records: list[Record], comparing: bool) -> pd.DataFrame:
    """One row per benchmark for the markdown report, failing verdicts first (then in the order they ran)."""
    rows = []
    for record in records:
        failed = record.verdict is not None and record.verdict.failed
        verdict = record.verdict.label if record.verdict else ("" if comparing else "not compared")
        if record.remeasured:
            verdict += " (re-measured)"
        peak, baseline_peak = record.compared_peaks()
        baseline = record.baseline_median
        rates = _rate(record)
        tflops = rates["TFLOP/s"] + (f" ({rates['% of peak']})" if rates["% of peak"] and rates["TFLOP/s"] else "")
        rows.append({
            "failed": failed,
            "verdict": f"**{verdict}**" if failed else verdict,
            "benchmark": code_span(record.name),
            "median": format_seconds(record.median),
            "time change": (
                "" if baseline is None else f"{_change(record.median, baseline)} vs {format_seconds(baseline)}"
            ),
            "peak memory": "" if peak is None else format_bytes(peak),
            "memory change": _change(peak, baseline_peak),
            "TFLOP/s": tflops,
        })
    columns = ["failed", "verdict", "benchmark", "median", "time change", "peak memory", "memory change", "TFLOP/s"]
    frame = pd.DataFrame(rows, columns=columns)
    frame = frame.sort_values("failed", ascending=False, kind="stable").drop(columns="failed")
    return frame.reset_index(drop=True)


def markdown_report(
    frame: pd.DataFrame, device: str, commit: str | None, compared: list[str], notes: list[str], labels: list[str]
) -> str:
    """The whole markdown report: a title counting the regressions, the device ('GPU: NAME'), commit and baseline
    files, the table (report_frame) and the notes; text from outside (names, paths, notes) renders literally
    (code_span, markdown_text). `labels` are the benchmarks' verdict labels ('' if not compared)."""
    failing = sum(Verdict(label).failed for label in labels if label)
    counts = pd.Series([label for label in labels if label]).value_counts()
    benchmarks = f"{len(labels)} benchmark{'' if len(labels) == 1 else 's'}"
    if compared or failing:
        title = f"## lmsys perf: {failing} of {benchmarks} regressed"
    else:
        title = f"## lmsys perf: {benchmarks}, not compared with a baseline"
    commit = commit or "unknown (not a git checkout)"
    lines = [title, "", f"- {markdown_text(device)}", f"- commit: {markdown_text(commit)}"]
    if compared:
        lines.append("- baselines compared: " + ", ".join(code_span(name) for name in compared))
    if len(counts):
        lines.append("- verdicts: " + ", ".join(f"{n} {label}" for label, n in counts.items()))
    lines.append("")
    if len(frame):
        lines.append(markdown_table(frame))
    lines += [f"> {markdown_text(note)}" for note in notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def session_markdown(session: PerfSession) -> str:
    """markdown_report for a finished session."""
    root = session.rootpath

    def shown(path: Path) -> str:
        try:
            return str(Path(path).relative_to(root))
        except ValueError:
            return str(path)

    labels = [record.verdict.label if record.verdict else "" for record in session.records]
    return markdown_report(
        report_frame(session.records, session.comparing),
        f"GPU: {session.backend.name}" if session.backend.is_gpu else f"device: {session.backend.name} (CPU, no GPU)",
        session.environment.get("git_commit"),
        [shown(path) for path in session.compared_files], session.notes, labels,
    )
