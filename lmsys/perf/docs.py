"""The measurements page of one GPU, generated from its committed baselines (never typed by hand):

    python -m lmsys.perf.docs baselines/NVIDIA_H100_80GB_HBM3 --out docs

writes docs/NVIDIA_H100_80GB_HBM3.md and, for each test with a grid of sequence lengths, a TFLOP/s plot per provider
in docs/NVIDIA_H100_80GB_HBM3/<test>.png (lmsys.perf.sidebyside). Every benchmark shows its newest measurement, the
one `pytest perf_tests --benchmark-compare` compares with: the median of the rounds, TFLOP/s, the fraction of the
GPU's datasheet peak where the baseline has one, and the peak memory allocated above what the call started with.
A time taken as CUDA-graph replays or queued behind a device-side sleep (device time, no launch cost) says so.
Rerun it after committing a new baseline; tests/test_perf_docs.py fails while the page is out of date.
"""

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

from lmsys.perf import baselines, sidebyside
from lmsys.perf.verdict import format_bytes, format_seconds
from lmsys.perf.report import markdown_table


def newest_benchmarks(docs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(file name, benchmark) of each benchmark's newest entry, files given oldest first, in first-seen order."""
    newest: dict[str, tuple[str, dict]] = {}
    for name, doc in docs:
        for bench in doc["benchmarks"]:
            newest[bench["fullname"]] = (name, bench)
    return list(newest.values())


def _files_table(docs: list[tuple[str, dict]], newest: list[tuple[str, dict]]) -> pd.DataFrame:
    still_newest = pd.Series([name for name, _ in newest]).value_counts()
    rows = []
    for name, doc in docs:
        software = (doc["machine_info"].get("lmsys") or {}).get("software") or {}
        commit = (doc.get("commit_info") or {}).get("id") or "unknown"
        rows.append({
            "file": f"`{name}`",
            "recorded (UTC)": doc.get("datetime", "")[:16].replace("T", " "),
            "commit": commit[:8],
            "torch": software.get("torch", ""),
            "triton": software.get("triton", ""),
            "benchmarks": len(doc["benchmarks"]),
            "newest for": int(still_newest.get(name, 0)),
        })
    return pd.DataFrame(rows)


def _timed(seconds: float, timing: str) -> str:
    """A median, marked when it is not an eager call's time: '100.9 us (graph)'."""
    return format_seconds(seconds) + ("" if timing == "eager" else f" ({timing})")


def _cell(ms: float, tflops: float | None, gbps: float | None, mem: float | None, timing: str = "eager") -> str:
    parts = [_timed(ms / 1e3, timing)]
    if tflops is not None and pd.notna(tflops):
        parts.append(f"{tflops:.4g} TFLOP/s")
    if gbps is not None and pd.notna(gbps):
        parts.append(f"{gbps:.4g} GB/s")
    if mem is not None and pd.notna(mem):
        parts.append(format_bytes(mem * 2**20))
    return ", ".join(parts)


def _natural(text: str) -> tuple:
    """'1xTx128-bf16' sorts after '1xTx16-bf16': digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def in_order(data: pd.DataFrame) -> pd.DataFrame:
    """sidebyside.frame rows by configuration family (head dim ascending), sequence length, then provider in the order
    first met, so that tables read in order and every plot panel gives a provider the same colour."""
    rank = {provider: i for i, provider in enumerate(dict.fromkeys(data["provider"]))}
    columns = zip(data["family"], data["seq"], data["provider"], strict=True)
    key = [(_natural(family), seq or 0, rank[provider]) for family, seq, provider in columns]
    return data.iloc[sorted(range(len(data)), key=key.__getitem__)]


def provider_table(data: pd.DataFrame) -> pd.DataFrame:
    """One test's providers side by side (rows in_order first): a row per configuration, a column per provider, cells
    'time, TFLOP/s or GB/s, memory'."""
    tables = {value: sidebyside.side_by_side(data, value) for value in ("ms", "tflops", "gbps", "mem")}
    timings = {(row.test, row.configuration, row.provider): row.timing for row in data.itertuples()}
    ms = tables["ms"]
    rows = []
    for key in ms.index:
        row = {"configuration": key[1] or "(its only configuration)"}
        for provider in ms.columns:
            value = ms.loc[key, provider]
            row[provider] = "" if pd.isna(value) else _cell(
                value, *(tables[name].loc[key, provider] for name in ("tflops", "gbps", "mem")),
                timings.get((*key, provider), "eager"),
            )
        rows.append(row)
    return pd.DataFrame(rows)


def plain_table(benchmarks: list[dict]) -> pd.DataFrame:
    """Benchmarks without providers: a row each with time, TFLOP/s and its fraction of peak, GB/s, and memory (for
    a benchmark on several ranks, the largest rank's); multi-rank benchmarks add the share of the step spent waiting
    for communication (the span comm_wait). Columns that no benchmark fills are left out."""
    rows = []
    for bench in benchmarks:
        info = bench.get("extra_info") or {}
        fraction = info.get("fraction_of_peak_tflops")
        above = info.get("peak_allocated_above_start_bytes")
        peak = info.get("peak_allocated_bytes")
        wait = (info.get("spans") or {}).get("comm_wait")
        rows.append({
            "benchmark": f"`{bench['name']}`",
            "median": _timed(bench["stats"]["median"], info.get("timing", "eager")),
            "TFLOP/s": "" if info.get("tflops") is None else f"{info['tflops']:.4g}",
            "of peak": "" if fraction is None else f"{fraction:.1%} of {info.get('precision', '')}",
            "GB/s": "" if info.get("gbps") is None else f"{info['gbps']:.4g}",
            "comm wait": "" if wait is None else f"{wait['share']:.1%}",
            "peak memory (above start)": "" if peak is None else f"{format_bytes(peak)} ({format_bytes(above)})",
        })
    frame = pd.DataFrame(rows)
    return frame.drop(columns=[c for c in frame.columns[2:] if (frame[c] == "").all()])


def _has_grid(data: pd.DataFrame) -> bool:
    return bool((data.groupby("family")["seq"].nunique() > 1).any())


def page(folder: Path, out: Path | None) -> str:
    """The markdown page of one GPU's baseline folder; with `out`, the grid plots are drawn into out/<folder name>/."""
    files = baselines.baseline_files(folder)
    if not files:
        raise ValueError(f"no baseline files (NNNN_name.json) in {folder}")
    docs = [(path.name, baselines.read_baseline(path)) for path in files]
    newest = newest_benchmarks(docs)
    gpu = Path(folder).name
    lines = [
        f"# Measurements on {gpu.replace('_', ' ')}",
        "",
        f"Generated from `baselines/{gpu}/` by `python -m lmsys.perf.docs baselines/{gpu} --out docs`:",
        "do not edit by hand. Each benchmark shows its newest measurement, the one",
        "`pytest perf_tests --benchmark-compare` compares with: the median of the `gpu_benchmark` rounds, TFLOP/s",
        "(with the fraction of the datasheet peak where recorded) and the peak memory allocated (for attention",
        "providers, above what the call started with).",
        "",
        "## Baseline files",
        "",
        markdown_table(_files_table(docs, newest)),
    ]
    by_test: dict[str, list[tuple[str, dict]]] = {}
    for name, bench in newest:
        by_test.setdefault(bench["name"].split("[")[0], []).append((name, bench))
    for test in sorted(by_test):
        entries = by_test[test]
        sources = ", ".join(f"`{n}`" for n in sorted({name for name, _ in entries}))
        lines += [f"## {test}", "", f"From {sources}.", ""]
        data = sidebyside.frame({"benchmarks": [bench for _, bench in entries]})
        if not data.empty:
            data = in_order(data)
        if data.empty:
            lines.append(markdown_table(plain_table([bench for _, bench in entries])))
            continue
        lines.append(markdown_table(provider_table(data)))
        if _has_grid(data):
            image = Path(gpu) / f"{test}.png"
            if out is not None:
                (out / gpu).mkdir(parents=True, exist_ok=True)
                sidebyside.plot(data, out / image)
            lines += [f"![TFLOP/s per provider, {test}]({image.as_posix()})", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmsys.perf.docs", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="one GPU's baseline folder, e.g. baselines/NVIDIA_H100_80GB_HBM3")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="where the page and plots go (default: docs)")
    args = parser.parse_args(argv)
    try:
        text = page(args.folder, args.out)
    except (ValueError, baselines.BaselineError) as exc:
        parser.error(str(exc))
    path = args.out / f"{args.folder.name}.md"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
