"""Providers side by side: a table and a plot from a pytest-benchmark JSON (a saved baseline or --benchmark-json).

Perf tests that take a `provider` parameter (perf_tests/test_attention.py: naive, flash_triton, sdpa_cudnn, ...)
measure the same configuration once per provider. This module lines them up, one row per configuration and one
column per provider, and draws TFLOP/s against sequence length where a grid has several lengths:

    python -m lmsys.perf.sidebyside baselines/NVIDIA_H100_80GB_HBM3/0001_h100.json --plot attention.png
    python -m lmsys.perf.sidebyside results.json --value tflops --markdown table.md
"""

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from lmsys.perf import baselines

VALUES = {"ms": "median ms", "tflops": "TFLOP/s", "gbps": "GB/s", "mem": "peak MiB above start"}


def _configuration(params: dict, seq_as: str | None = None) -> str:
    """The parameters other than the provider, as in the test id: 16x16384x64-causal-bf16-fwd_bwd; with `seq_as`,
    the shape's sequence length is written as that (the configurations that differ only by length share it)."""
    parts = []
    for key, value in params.items():
        if key in ("provider", "seed"):
            continue
        if isinstance(value, list):
            if key == "shape" and seq_as is not None and len(value) >= 2:
                value = [*value[:-2], seq_as, value[-1]]
            value = "x".join(map(str, value))
        elif isinstance(value, bool):
            value = key if value else f"not-{key}"
        parts.append(str(value))
    return "-".join(parts)


def frame(doc: dict) -> pd.DataFrame:
    """One row per benchmark that has a provider: test, configuration, sequence length, provider, the values and how
    the time was taken (eager, graph or queued)."""
    rows = []
    for bench in doc.get("benchmarks", []):
        params = bench.get("params") or {}
        if "provider" not in params:
            continue
        info = bench.get("extra_info", {})
        shape = params.get("shape")
        above = info.get("peak_allocated_above_start_bytes")
        rows.append({
            "test": bench["name"].split("[")[0],
            "configuration": _configuration(params),
            "family": _configuration(params, seq_as="T"),
            "seq": shape[-2] if isinstance(shape, list) and len(shape) >= 2 else None,
            "provider": params["provider"],
            "ms": bench["stats"]["median"] * 1e3,
            "tflops": info.get("tflops"),
            "gbps": info.get("gbps"),
            "mem": None if above is None else above / 2**20,
            "timing": info.get("timing", "eager"),
        })
    return pd.DataFrame(
        rows, columns=["test", "configuration", "family", "seq", "provider", "ms", "tflops", "gbps", "mem", "timing"]
    )


def side_by_side(data: pd.DataFrame, value: str = "ms") -> pd.DataFrame:
    """Rows (test, configuration), columns providers in the order first met, cells `value`."""
    if value not in VALUES:
        raise ValueError(f"value must be one of {', '.join(VALUES)}, got {value!r}")
    # Every (test, configuration) row and provider column, also where no benchmark has this value (GB/s of a
    # benchmark that states only FLOPs): pivot_table drops the rows and columns that are all missing.
    table = data.pivot_table(index=["test", "configuration"], columns="provider", values=value, sort=False)
    rows = pd.MultiIndex.from_frame(data[["test", "configuration"]].drop_duplicates())
    return table.reindex(index=rows, columns=list(dict.fromkeys(data["provider"])))


def markdown(table: pd.DataFrame, value: str) -> str:
    """The side-by-side table as a GitHub markdown table (no extra dependency)."""
    header = ["test", "configuration", *table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (test, configuration), row in table.iterrows():
        cells = ["" if pd.isna(x) else f"{x:.4g}" for x in row]
        lines.append("| " + " | ".join([test, configuration, *cells]) + " |")
    return f"{VALUES[value]}, median of the rounds\n\n" + "\n".join(lines) + "\n"


def plot(data: pd.DataFrame, path: Path) -> None:
    """TFLOP/s per provider: a line over sequence length for each grid, a bar chart for single configurations."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    data = data.dropna(subset=["tflops"])
    panels = [(f"{test} {family}", group) for (test, family), group in data.groupby(["test", "family"], sort=False)]
    if not panels:
        raise ValueError("no benchmark with a provider parameter and TFLOP/s to plot")
    columns = min(3, len(panels))
    rows_n = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(5.5 * columns, 4 * rows_n), squeeze=False)
    for ax, (title, group) in zip(axes.flat, panels):
        if group["seq"].nunique() > 1:
            for provider, line in group.groupby("provider", sort=False):
                line = line.sort_values("seq")
                ax.plot(line["seq"], line["tflops"], marker="o", label=provider)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.legend(fontsize=8)
        else:
            ax.bar(group["provider"], group["tflops"])
            ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmsys.perf.sidebyside", description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="pytest-benchmark JSON (a baseline or --benchmark-json output)")
    parser.add_argument("--value", choices=VALUES, default="ms", help="what the table shows (default: ms)")
    parser.add_argument("--markdown", type=Path, help="also write the table as markdown to this (new) file")
    parser.add_argument("--plot", type=Path, help="also draw TFLOP/s per provider into this (new) image (.png, .svg)")
    parser.add_argument(
        "--overwrite", action="store_true", help="let --markdown and --plot replace existing files (never a baseline)"
    )
    args = parser.parse_args(argv)
    # The results file is often a baseline: neither it nor a folder of baselines is ever written into.
    protected = [args.results, *([args.results.parent] if baselines.baseline_files(args.results.parent) else [])]
    for option, path in (("--markdown", args.markdown), ("--plot", args.plot)):
        if path is None:
            continue
        problem = baselines.output_problem(path, args.overwrite, protected)
        if problem:
            parser.error(f"{option} {path}: {problem}")
    try:
        doc = json.loads(args.results.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read {args.results}: {exc}")
    data = frame(doc)
    if data.empty:
        parser.error(f"{args.results} has no benchmark with a 'provider' parameter")
    table = side_by_side(data, args.value)
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.float_format", "{:.4g}".format):
        print(f"{VALUES[args.value]} ({args.results})\n{table}")
    if args.markdown:
        with open(args.markdown, "w" if args.overwrite else "x", encoding="utf-8") as fh:
            fh.write(markdown(table, args.value))
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
