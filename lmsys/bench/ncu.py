"""`lmsys-bench ncu`: Nsight Compute on one training step: a per-kernel table, a summary by kernel family and by
phase (forward, backward, optimizer), and the efficiency against the GPU's DRAM bandwidth and matmul peak.

It runs `lmsys-bench model` on one case with --steps 1 --nvtx in a child process under

    ncu --clock-control none --target-processes all --nvtx --nvtx-include measured_step --metrics METRICS
        --export OUT/step --force-overwrite  python -m lmsys.bench model ... --steps 1 --nvtx

so only the timed step's kernels are profiled (warm-up, compilation and autotuning run outside the process-wide
NVTX range 'measured_step'), at the GPU's own clocks. The report OUT/step.ncu-rep (open it in the Nsight Compute
GUI) is then read back twice with `ncu --import ... --csv --page details --print-units base`, the second time with
`--print-nvtx-rename kernel` (each kernel named after its innermost NVTX push/pop range), and parsed with pandas.
`--parse CSV [--parse-nvtx CSV]` reads such CSVs instead of running anything (any machine).

Metrics (names valid on Hopper and Ampere):
  gpu__time_duration.sum                                            kernel time
  dram__bytes_read.sum, dram__bytes_write.sum                       HBM traffic
  lts__t_bytes.sum                                                  L2 traffic
  sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed   tensor-pipe use over the kernel's duration
Each kernel is replayed alone (ncu's kernel replay, caches flushed before each pass), so the times add up to the
step's kernel time without overlap or launch gaps.

Phases come from lmsys.train's ranges (forward, backward, optimizer_step). NVTX push/pop ranges belong to a thread,
and the autograd engine launches the backward's CUDA kernels from its own thread: a kernel without a range that
comes after the forward's and before the optimizer's is counted as backward. Families come from the kernel's name
(FAMILIES, first match wins).

Efficiency: DRAM bytes over kernel time against a DRAM bandwidth measured here (a 1 GiB device copy, read + write),
and the step's model FLOPs (lmsys.flops) over the summed kernel time against a matmul peak measured here (an 8192^3
product in the step's precision); with --peaks datasheet, or without a GPU, lmsys.flops's datasheet table instead.
"""

import argparse
import io
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

import lmsys
from lmsys import flops
from lmsys.attention import ATTENTION
from lmsys.bench import model as model_bench
from lmsys.bench import sweep
from lmsys.model import SIZES, TransformerLM

# Our column -> ncu metric.
METRICS = {
    "time_s": "gpu__time_duration.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
    "tensor_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
}
# Unit -> factor to the base unit (seconds, bytes); ncu's prefixes are decimal.
UNITS = {
    "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "%": 1.0, "": 1.0,
}
FAMILIES = (
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|xmma|wgmma|matmul|triton_tem_fused_mm|splitk|gemv"),
    ("optimizer", r"multi_tensor_apply|foreach|adam"),
    ("reduction", r"reduce|softmax|norm|logsumexp|nll_loss|cross_entropy|triton_red|triton_per|cub::|scan|sort"),
    ("memory", r"copy|memcpy|memset|fill|catarray|index|gather|scatter|embedding"),
    ("elementwise", r"elementwise|triton_poi|unrolled|vectorized|pointwise"),
)
PHASES = ("forward", "backward", "optimizer", "other")
REPORT_STEM = "step"


@dataclass(frozen=True)
class Peaks:
    """What the efficiency is measured against: DRAM GB/s and matmul TFLOP/s (None: unknown), and where from."""

    dram_gbps: float | None
    tflops: float | None
    source: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `lmsys-bench ncu`: the case to profile, the output folder, the peaks, or CSVs to parse instead."""
    gpu = torch.cuda.is_available()
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="where the report, ncu's CSVs, the parsed tables and the summary go")
    parser.add_argument("--size", choices=SIZES, default=None,
                        help="model preset (default: small on a GPU, tiny on the CPU; with --parse: none, no FLOPs)")
    parser.add_argument("--context", type=int, default=None, help="default: the preset's (512; tiny 64)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", choices=model_bench.DTYPES, default="bf16")
    parser.add_argument("--compile", choices=model_bench.COMPILE, default="eager")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="sdpa",
                        help="the model's attention kernel (default: sdpa)")
    parser.add_argument("--optimizer", choices=model_bench.OPTIMIZERS, default="adamw")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="fewer layers profile quicker (ncu replays every kernel; ~2000 kernels for small)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the profiled one (default: 3)")
    parser.add_argument("--metrics", default=",".join(METRICS.values()), help="ncu metrics, comma-separated")
    parser.add_argument("--ncu", default="ncu", help="the ncu executable (default: ncu on PATH)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before ncu is stopped (default: 1800)")
    parser.add_argument("--peaks", choices=("measured", "datasheet"), default="measured" if gpu else "datasheet")
    parser.add_argument("--device-name", default=None, help="GPU for datasheet peaks (default: this machine's)")
    parser.add_argument("--top", type=int, default=30, help="rows of the per-kernel table (default: 30)")
    parser.add_argument("--parse", type=Path, metavar="CSV", help="read this `ncu --csv` output instead of profiling")
    parser.add_argument("--parse-nvtx", type=Path, metavar="CSV", help="with --parse: the --print-nvtx-rename one")


# --- commands -------------------------------------------------------------------------------------------------------

def child_command(args: argparse.Namespace) -> list[str]:
    """`python -m lmsys.bench model` on the one case, one timed step inside the NVTX range ncu filters on."""
    command = [
        sys.executable, "-m", "lmsys.bench", "model", "--sizes", args.size, "--batch", str(args.batch),
        "--modes", "train", "--dtypes", args.dtype, "--compile", args.compile, "--attention", args.attention,
        "--optimizer", args.optimizer, "--warmup", str(args.warmup), "--steps", "1", "--nvtx",
    ]
    if args.context:
        command += ["--context", str(args.context)]
    if args.num_layers:
        command += ["--num-layers", str(args.num_layers)]
    return command


def ncu_command(ncu: str, report: Path, metrics: str, child: list[str]) -> list[str]:
    """ncu profiling the child's measured step: our metrics, the GPU's own clocks, exported to report(.ncu-rep)."""
    return [
        ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include",
        model_bench.MEASURED_RANGE, "--metrics", metrics, "--export", str(report), "--force-overwrite", *child,
    ]


def import_command(ncu: str, report: Path, nvtx_rename: bool) -> list[str]:
    """ncu reading a report back as CSV (a row per kernel and metric, base units); kernels renamed after their
    innermost NVTX push/pop range with nvtx_rename."""
    command = [ncu, "--import", str(report), "--csv", "--page", "details", "--print-units", "base"]
    return command + (["--print-nvtx-rename", "kernel"] if nvtx_rename else [])


def _run(command: list[str], log: Path, timeout: float) -> int:
    """Runs command in its own process group with output to log; on timeout the whole group is stopped."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONPATH": _pythonpath()})
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise sweep.UsageError(f"ncu ran longer than --timeout {timeout:g} s and was stopped; see {log}") from None


def _pythonpath() -> str:
    """This lmsys first on the child's path, so the profiled step runs the same code as the parent."""
    root = str(Path(lmsys.__file__).resolve().parents[1])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


# --- parsing --------------------------------------------------------------------------------------------------------

def _number(value: str) -> float:
    text = value.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return float("nan")  # 'n/a' and the like: no reading


def to_base(value: str, unit: str) -> float:
    """A metric value as ncu prints it ('1,234.5' in 'usecond') in seconds, bytes or percent."""
    if unit not in UNITS:
        raise ValueError(f"unknown ncu unit {unit!r}: print with --print-units base")
    return _number(value) * UNITS[unit]


def _csv(text: str) -> pd.DataFrame:
    # ncu's own lines (==PROF==, ==WARNING==) and the profiled program's output are not CSV rows.
    rows = [line for line in text.splitlines() if line.startswith('"')]
    if not rows:
        raise ValueError("no CSV rows in this ncu output (expected `ncu --csv` lines, each starting with a quote)")
    return pd.read_csv(io.StringIO("\n".join(rows)), dtype=str, keep_default_na=False)


def metrics_frame(text: str) -> pd.DataFrame:
    """`ncu --csv` output -> one row per profiled kernel, in launch order: id, kernel (ncu's name), and one column per
    metric in base units. Reads the details page (a row per kernel and metric) and the raw page (a column per metric,
    the first row holding the units)."""
    raw = _csv(text)
    for column in ("ID", "Kernel Name"):
        if column not in raw:
            raise ValueError(f"no {column!r} column in this ncu CSV (columns: {', '.join(raw.columns[:12])}, ...)")
    if "Metric Name" in raw:
        values = [to_base(v, u) for v, u in zip(raw["Metric Value"], raw["Metric Unit"], strict=True)]
        long = pd.DataFrame({"id": raw["ID"].astype(int), "kernel": raw["Kernel Name"], "metric": raw["Metric Name"],
                             "value": values})
        wide = long.set_index(["id", "kernel", "metric"])["value"].unstack("metric").reset_index()
    else:
        has_units = raw["ID"].iloc[0] == ""
        units = raw.iloc[0] if has_units else pd.Series("", index=raw.columns)
        data = raw.iloc[1:] if has_units else raw
        metrics = [c for c in raw.columns if "__" in c]
        wide = pd.DataFrame({"id": data["ID"].astype(int), "kernel": data["Kernel Name"]})
        for metric in metrics:
            wide[metric] = [to_base(v, units[metric]) for v in data[metric]]
    wide.columns.name = None
    return wide.sort_values("id", kind="stable").reset_index(drop=True)


def family(kernel: str) -> str:
    """The kernel family of a kernel name (FAMILIES, first match, case-insensitive), 'other' when none matches."""
    for name, pattern in FAMILIES:
        if re.search(pattern, kernel, re.IGNORECASE):
            return name
    return "other"


def range_of(renamed: str) -> str:
    """The NVTX range path that `--print-nvtx-rename kernel` put before a kernel's name ("layer_0/void at::...",
    "attention/rope/_attn_fwd"), '' for a kernel outside any range: the text before the last '/' that comes before the
    kernel name's first space, '<' or '('. (The renamed report spells a kernel's name unlike the plain one, with its
    whole signature, so it cannot be compared with it.)"""
    return re.split(r"[ <(]", renamed, maxsplit=1)[0].rpartition("/")[0]


def phases(ranges: list[str]) -> list[str]:
    """The phase of each kernel, in launch order, from its innermost NVTX range ('' for none): optimizer_step ->
    optimizer, backward -> backward, any other range -> forward; no range between the forward and the optimizer ->
    backward (the autograd engine's thread), elsewhere -> other."""
    out, forward_seen, optimizer_seen = [], False, False
    for name in ranges:
        if "optimizer" in name:
            phase, optimizer_seen = "optimizer", True
        elif "backward" in name:
            phase = "backward"
        elif name:
            phase, forward_seen = "forward", True
        else:
            phase = "backward" if forward_seen and not optimizer_seen else "other"
        out.append(phase)
    return out


def short_name(kernel: str, width: int = 90) -> str:
    """A kernel name for a table: no 'void ', no parameter list, cut to width. A parenthesis after a space is not a
    parameter list: the profiler's "Memset (Device)" stays whole."""
    name = kernel.removeprefix("void ")
    if name.endswith(")") and "(" in name:
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name if name[i - 1 : i] == " " else name[:i]
                break
    return name if len(name) <= width else name[: width - 1] + "…"


def kernels(text: str, nvtx_text: str | None = None) -> pd.DataFrame:
    """Per-kernel frame: id, kernel, range (innermost NVTX range, '' for none), phase, family and METRICS' columns
    (NaN for a metric the capture does not have). `nvtx_text` is the same report printed with --print-nvtx-rename."""
    data = metrics_frame(text)
    if METRICS["time_s"] not in data:
        raise ValueError(f"the ncu CSV has no {METRICS['time_s']}: capture it with --metrics")
    frame = pd.DataFrame({"id": data["id"], "kernel": data["kernel"]})
    ranges = pd.Series("", index=data.index)
    if nvtx_text is not None:
        renamed = metrics_frame(nvtx_text).set_index("id")["kernel"]
        ranges = data["id"].map(renamed).fillna("").map(range_of)
    frame["range"] = ranges
    frame["phase"] = phases(list(ranges))
    frame["family"] = [family(k) for k in data["kernel"]]
    for column, metric in METRICS.items():
        frame[column] = data[metric] if metric in data else float("nan")
    return frame


def summarize(frame: pd.DataFrame, by: str, peaks: Peaks) -> pd.DataFrame:
    """Per group (family or phase): kernels, time, its share, DRAM traffic and bandwidth (and its fraction of the DRAM
    peak), L2 traffic and the time-weighted tensor-pipe utilisation; largest time first, a total row last."""
    total_time = frame["time_s"].sum()

    def row(name, group):
        time, dram = group["time_s"].sum(), (group["dram_read_bytes"] + group["dram_write_bytes"]).sum(min_count=1)
        gbps = dram / time / 1e9 if time else float("nan")
        weighted = (group["tensor_pct"] * group["time_s"]).sum(min_count=1)
        return {
            by: name, "kernels": len(group), "time_ms": time * 1e3, "share": time / total_time if total_time else 0.0,
            "dram_gb": dram / 1e9, "dram_gbps": gbps,
            "dram_of_peak": gbps / peaks.dram_gbps if peaks.dram_gbps else float("nan"),
            "l2_gb": group["l2_bytes"].sum(min_count=1) / 1e9,
            "tensor_pct": weighted / time if time else float("nan"),
        }

    rows = [row(name, group) for name, group in frame.groupby(by, sort=False)]
    rows.sort(key=lambda r: -r["time_ms"])
    return pd.DataFrame([*rows, row("total", frame)])


def efficiency(frame: pd.DataFrame, step_flops: int | None, peaks: Peaks) -> list[str]:
    """The step against the peaks: model TFLOP/s over the summed kernel time, average DRAM bandwidth, tensor pipe."""
    total = summarize(frame, "phase", peaks).iloc[-1]
    seconds = frame["time_s"].sum()
    lines = [f"{len(frame)} kernels, {seconds * 1e3:.3f} ms of kernel time (each kernel timed alone by ncu)",
             f"peaks: {peaks.source}"]
    if step_flops and seconds:
        tflops = step_flops / seconds / 1e12
        against = f" = {tflops / peaks.tflops:.1%} of {peaks.tflops:.4g} TFLOP/s" if peaks.tflops else ""
        lines.append(f"model FLOPs {step_flops:.4g} (lmsys.flops) -> {tflops:.4g} TFLOP/s over the kernel time"
                     + against)
    if pd.notna(total["dram_gbps"]):
        against = f" = {total['dram_of_peak']:.1%} of {peaks.dram_gbps:.4g} GB/s" if peaks.dram_gbps else ""
        lines.append(f"DRAM {total['dram_gb']:.4g} GB read + written -> {total['dram_gbps']:.4g} GB/s on average"
                     + against)
    if pd.notna(total["tensor_pct"]):
        lines.append(f"tensor pipe active {total['tensor_pct']:.3g}% of the elapsed cycles, time-weighted")
    return lines


# --- peaks ----------------------------------------------------------------------------------------------------------

def datasheet_peaks(device_name: str | None, dtype: str) -> Peaks:
    """lmsys.flops's dense datasheet numbers for the GPU (None for one not in the table)."""
    if device_name is None:
        return Peaks(None, None, "none known (no GPU named; pass --device-name for datasheet peaks)")
    precision = model_bench.matmul_precision(dtype)
    peak = flops.device_peak(device_name)
    if peak is None:
        return Peaks(None, None, f"none known: {device_name} is not in lmsys.flops's table")
    return Peaks(peak.memory_gbps, getattr(peak, precision),
                 f"datasheet (lmsys.flops) for {device_name}: {peak.memory_gbps:g} GB/s, {precision} "
                 f"{getattr(peak, precision):g} TFLOP/s")


def _median_seconds(device, fn) -> float:
    return statistics.median(sweep.time_steps(device, fn, 3, 10))


def _copy_gbps(device) -> float:
    source = torch.empty(2**28, device="cuda")  # 1 GiB of fp32
    target = torch.empty_like(source)
    return 2 * source.nbytes / _median_seconds(device, lambda: target.copy_(source)) / 1e9


def _matmul_tflops(device, dtype: torch.dtype, n: int) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * n**3 / _median_seconds(device, lambda: a @ b) / 1e12


def measured_peaks(dtype: str) -> Peaks:
    """DRAM GB/s of a 1 GiB device-to-device copy (read + write) and TFLOP/s of an 8192^3 matmul in the step's
    precision on this GPU, medians of 10 after 3 warm-up calls, timed with CUDA events."""
    device = sweep.backend()
    dram = _copy_gbps(device)
    tflops = _matmul_tflops(device, model_bench.DTYPES[dtype] or torch.float32, 8192)
    device.release_memory()
    precision = model_bench.matmul_precision(dtype)
    return Peaks(dram, tflops, f"measured here on {device.name}: 1 GiB copy {dram:.4g} GB/s, {precision} "
                 f"8192^3 matmul {tflops:.4g} TFLOP/s")


# --- the command ----------------------------------------------------------------------------------------------------

def step_flops(args: argparse.Namespace) -> int:
    """Model FLOPs of the profiled training step (lmsys.flops), counted on a model on the meta device."""
    case = model_bench.Case(args.size, args.context or SIZES[args.size].context_length, args.batch, "train",
                            args.dtype, args.compile)
    config = model_bench.config_for(case, args)
    with torch.device("meta"):
        meta = TransformerLM(config)
    return flops.training_step_flops(meta.num_parameters(embedding=False), case.batch, case.context,
                                     config.num_layers, config.d_model)


def _shown_kernels(frame: pd.DataFrame, top: int) -> pd.DataFrame:
    largest = frame.sort_values("time_s", ascending=False, kind="stable").head(top)
    return pd.DataFrame({
        "id": largest["id"], "phase": largest["phase"], "family": largest["family"],
        "time us": largest["time_s"] * 1e6,
        "DRAM MB": (largest["dram_read_bytes"] + largest["dram_write_bytes"]) / 1e6,
        "GB/s": (largest["dram_read_bytes"] + largest["dram_write_bytes"]) / largest["time_s"] / 1e9,
        "L2 MB": largest["l2_bytes"] / 1e6, "tensor %": largest["tensor_pct"],
        "kernel": [short_name(k) for k in largest["kernel"]],
    })


def _shown_summary(summary: pd.DataFrame) -> pd.DataFrame:
    out = summary.copy()
    out["share"] = [f"{v:.1%}" for v in out["share"]]
    out["dram_of_peak"] = [None if pd.isna(v) else f"{v:.1%}" for v in out["dram_of_peak"]]
    return out.rename(columns={"time_ms": "time ms", "dram_gb": "DRAM GB", "dram_gbps": "DRAM GB/s",
                               "dram_of_peak": "of DRAM peak", "l2_gb": "L2 GB", "tensor_pct": "tensor %"})


def report(frame: pd.DataFrame, flops_of_step: int | None, peaks: Peaks, top: int) -> str:
    """Everything the command prints: the largest kernels, the family and phase summaries, the efficiency."""
    return "\n\n".join([
        f"== the {min(top, len(frame))} longest kernels of {len(frame)} ==\n"
        + sweep.format_table(_shown_kernels(frame, top)),
        "== by kernel family ==\n" + sweep.format_table(_shown_summary(summarize(frame, "family", peaks))),
        "== by phase ==\n" + sweep.format_table(_shown_summary(summarize(frame, "phase", peaks))),
        "== efficiency ==\n" + "\n".join(efficiency(frame, flops_of_step, peaks)),
    ]) + "\n"


def _profile(args: argparse.Namespace) -> tuple[str, str]:
    """Runs ncu on the step and reads the report back; returns the two CSV texts (plain, NVTX-renamed)."""
    ncu = shutil.which(args.ncu)
    if ncu is None:
        raise sweep.UsageError(f"{args.ncu!r} not found: install Nsight Compute or give --ncu PATH "
                               "(or --parse CSV to read an earlier capture)")
    report_path = args.out / f"{REPORT_STEM}.ncu-rep"
    command = ncu_command(ncu, args.out / REPORT_STEM, args.metrics, child_command(args))
    (args.out / "ncu.command").write_text(" ".join(command) + "\n")
    print(f"profiling one training step under ncu (log: {args.out / 'ncu.log'}) ...", flush=True)
    status = _run(command, args.out / "ncu.log", args.timeout)
    if status != 0 or not report_path.exists():
        tail = "\n".join((args.out / "ncu.log").read_text(errors="replace").splitlines()[-20:])
        state = "written" if report_path.exists() else "missing"
        raise sweep.UsageError(f"ncu exited with status {status} (report {state}); the end of its log:\n{tail}")
    texts = []
    for nvtx_rename, name in ((False, "kernels.csv"), (True, "kernels_nvtx.csv")):
        done = subprocess.run(import_command(ncu, report_path, nvtx_rename), capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0:
            raise sweep.UsageError(f"ncu --import failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        (args.out / name).write_text(done.stdout)
        texts.append(done.stdout)
    return texts[0], texts[1]


def run(args: argparse.Namespace) -> int:
    """Profiles one training step under Nsight Compute (or parses `--parse`'s CSVs), writes the tables and prints the
    summary; returns the exit status."""
    args.out.mkdir(parents=True, exist_ok=True)
    if args.size is None and not args.parse:
        args.size = "small" if torch.cuda.is_available() else "tiny"
    if args.parse:
        text = args.parse.read_text()
        nvtx_text = args.parse_nvtx.read_text() if args.parse_nvtx else None
    else:
        if args.parse_nvtx:
            raise sweep.UsageError("--parse-nvtx goes with --parse")
        text, nvtx_text = _profile(args)
    try:
        frame = kernels(text, nvtx_text)
    except ValueError as exc:
        raise sweep.UsageError(f"cannot read the ncu CSV: {exc}") from None
    if frame.empty:
        raise sweep.UsageError(f"ncu profiled no kernel (was the NVTX range '{model_bench.MEASURED_RANGE}' seen?)")
    gpu = torch.cuda.is_available()
    if args.peaks == "measured" and gpu:
        peaks = measured_peaks(args.dtype)
    else:
        peaks = datasheet_peaks(args.device_name or (torch.cuda.get_device_name() if gpu else None), args.dtype)
    text_report = report(frame, step_flops(args) if args.size else None, peaks, args.top)
    print(text_report, end="")
    (args.out / "summary.txt").write_text(text_report)
    frame.to_csv(args.out / "kernels_parsed.csv", index=False)
    summarize(frame, "family", peaks).to_csv(args.out / "families.csv", index=False)
    summarize(frame, "phase", peaks).to_csv(args.out / "phases.csv", index=False)
    print(f"files: {args.out}/ (step.ncu-rep for the Nsight Compute GUI, kernels_parsed.csv, families.csv, "
          "phases.csv, summary.txt)")
    return 0
