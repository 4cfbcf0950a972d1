"""`lmsys-bench attention`: attention providers over sequence length x head dimension: a table (median, mean and
std ms, TFLOP/s, peak memory) and plots of time and of peak memory against sequence length.

Inputs are q, k, v of shape (batch, heads, seq, d), fresh random values; FLOPs as in lmsys.flops (forward 4*b*h*s^2*d,
halved when causal; backward 2.5x; both 3.5x). Modes: `fwd` (no autograd graph), `bwd` (the forward runs once,
untimed; each timed call is a backward through the kept graph), `fwd_bwd`. Gradients come from a random dO through
torch.autograd.grad. The peak memory is what one more call allocates above what was allocated before it (GPU only).

Providers (lmsys/attention/providers.py): lmsys.attention's naive reference, flash_torch (FlashAttention-2 in
PyTorch), flash_triton, PyTorch's sdpa (its own choice of backend) and sdpa_flash / sdpa_cudnn / sdpa_efficient /
sdpa_math (one SDPA backend each); `_compiled` after naive or flash_torch wraps it in torch.compile. A provider
that cannot run a point is a row whose status says why (SDPA's own words when a backend refuses the inputs); running
out of memory is a row 'OOM: ...'.

`--grid training` replaces the sequence x head-dim grid (and --seq, --dims, --batch, --heads, --causal) with the
training-shapes grid (`training_grid`, also perf_tests/test_attention.py's `test_attention_training_grid`): the head
dims language models train with at 16384 tokens a batch, causal and not.
"""

import argparse
import functools
import warnings
from pathlib import Path

import pandas as pd
import torch

from lmsys.attention.providers import NEEDS_CUDA, PROVIDERS, attention_function, timed_call
from lmsys.bench import sweep
from lmsys.flops import ATTENTION_MODES, attention_flops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COLUMNS = [
    "provider", "batch", "heads", "seq", "d", "dtype", "mode", "causal", "status", "median_ms", "mean_ms", "std_ms",
    "tflop_per_s", "peak_memory_mib",
]
HAS_CUDA = torch.cuda.is_available()

# The training-shapes grid: head dim -> heads (a model width of 2048 at d=64 and 128; at d=80 the 2.7B model's 32 heads
# of 80, at d=96 16 heads), every length with TRAINING_TOKENS tokens a batch (batch x seq), causal and not.
TRAINING_HEADS = {64: 32, 80: 32, 96: 16, 128: 16}
TRAINING_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
TRAINING_TOKENS = 16384
GRIDS = ("training",)


def training_grid() -> list[tuple[tuple[int, int, int, int], bool]]:
    """The training-shapes grid's points: ((batch, heads, seq, d), causal), by head dim, then length, causal first."""
    return [((TRAINING_TOKENS // seq, heads, seq, d), causal) for d, heads in TRAINING_HEADS.items()
            for seq in TRAINING_SEQS for causal in (True, False)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `lmsys-bench attention`: providers, grid (sequence lengths, head dims, batch, heads), dtypes,
    modes, timing, outputs and plots."""
    gpu = HAS_CUDA
    providers = ["naive", "flash_triton", "sdpa_flash", "sdpa_cudnn"] if gpu else ["naive", "flash_torch", "sdpa"]
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=providers,
                        help=f"default: {' '.join(providers)}")
    parser.add_argument("--seq", nargs="+", type=int, default=[256, 1024, 4096, 8192, 16384] if gpu else [64, 128],
                        help="sequence lengths (default on a GPU: 256 1024 4096 8192 16384; on the CPU: 64 128)")
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128] if gpu else [32],
                        help="head dimensions (default on a GPU: 64 128; on the CPU: 32)")
    parser.add_argument("--batch", type=int, default=8, help="default: 8 (the seeds' grid)")
    parser.add_argument("--heads", type=int, default=1, help="default: 1 (the seeds' grid: (batch, seq, d) inputs)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16" if gpu else "fp32")
    parser.add_argument("--modes", nargs="+", choices=ATTENTION_MODES, default=["fwd_bwd"], help="default: fwd_bwd")
    parser.add_argument("--causal", action="store_true", help="causal masking (default: full attention)")
    parser.add_argument("--grid", choices=GRIDS,
                        help="training: the training-shapes grid (d 64, 80, 96, 128 x seq 512 ... 16384 at 16384 "
                        "tokens a batch, causal and not) in place of --seq, --dims, --batch, --heads and --causal")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after the first (default: 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed calls (default: 10)")
    parser.add_argument("--clock", choices=sweep.CLOCKS, default="eager",
                        help="eager (default): the device's time from a short device-side sleep on, the CPU's launch "
                        "delays that outlast it included; queued: the device's time alone; host: the CPU's time to "
                        "issue a call")
    parser.add_argument("--output", "-o", type=Path, action="append", default=[],
                        help="write the table to this .csv or .json file (repeatable)")
    parser.add_argument("--plots", type=Path, metavar="DIR",
                        help="write DIR/attention_time.png and DIR/attention_memory.png")


def _refusal(exc: RuntimeError, caught: list) -> str:
    """Why a provider refused the inputs: the warnings SDPA gives its reasons in, else the error's first line."""
    reasons = " ".join(str(w.message) for w in caught) or str(exc)
    return "unsupported: " + " ".join(reasons.split())[:200]


def measure(provider: str, shape: tuple, dtype: str, mode: str, causal: bool, args, device) -> dict:
    """One point: the first call (compilation, a refusal) untimed, warmup, timed calls, one call for the memory."""
    if provider in NEEDS_CUDA and not device.is_gpu:
        return {"status": NEEDS_CUDA[provider]}
    q, k, v = (torch.randn(shape, device="cuda" if device.is_gpu else "cpu", dtype=DTYPES[dtype]) for _ in range(3))
    attend = attention_function(provider)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn, fn_args = timed_call(attend, q, k, v, causal, mode)
            call = functools.partial(fn, *fn_args)
            call()
        except RuntimeError as exc:
            if provider.startswith("sdpa"):
                return {"status": _refusal(exc, caught)}
            raise
    samples = sweep.time_steps(device, call, args.warmup, args.steps, args.clock)
    _, reading = device.measure_memory(call)
    batch, heads, seq, d = shape
    seconds = sweep.summary(samples)["median_ms"] / 1e3
    flops = attention_flops(batch, heads, seq, seq, d, causal, mode)
    return {
        **sweep.summary(samples),
        # A time of the CPU's (--clock host) says nothing of the device's arithmetic.
        "tflop_per_s": None if args.clock == "host" else flops / seconds / 1e12,
        "peak_memory_mib": None if reading is None else reading.peak_allocated_above_start / 2**20,
    }


def run_point(provider: str, shape: tuple, dtype: str, mode: str, causal: bool, args, device) -> dict:
    """One row: the point and its measurements, or the status saying why there are none."""
    batch, heads, seq, d = shape
    row = {"provider": provider, "batch": batch, "heads": heads, "seq": seq, "d": d, "dtype": dtype, "mode": mode,
           "causal": causal, "status": sweep.OK}
    try:
        with sweep.out_of_memory_as_status(device, row):
            row.update(measure(provider, shape, dtype, mode, causal, args, device))
    finally:
        if provider.endswith("_compiled"):
            torch.compiler.reset()  # each shape compiles anew; old graphs would hit dynamo's recompile limit
    return row


def plot(frame: pd.DataFrame, directory: Path) -> list[Path]:
    """attention_time.png and attention_memory.png: one panel per (d, dtype, mode), a line per provider over the
    sequence length (log-log); the memory plot says so when there are no readings (no GPU)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    measured = frame[frame["status"] == sweep.OK]
    panels = list(measured.groupby(["d", "dtype", "mode", "causal"], sort=False))
    written = []
    for column, label, name in (("median_ms", "median ms", "attention_time.png"),
                                ("peak_memory_mib", "peak MiB above start", "attention_memory.png")):
        fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4), squeeze=False)
        for ax, ((d, dtype, mode, causal), group) in zip(axes.flat, panels, strict=False):
            for provider, line in group.dropna(subset=[column]).groupby("provider", sort=False):
                line = line.sort_values("seq")
                ax.plot(line["seq"], line[column], marker="o", label=provider)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.set_title(f"d={d} {dtype} {mode}{' causal' if causal else ''}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no readings (memory needs a GPU)" if column == "peak_memory_mib" else "no data",
                        ha="center", va="center", transform=ax.transAxes)
        if not panels:
            axes[0, 0].text(0.5, 0.5, "no point ran", ha="center", va="center")
        fig.suptitle(f"attention on {frame.attrs.get('device', '')}", fontsize=10)
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def grid_points(args: argparse.Namespace) -> list[tuple[tuple[int, int, int, int], bool]]:
    """The ((batch, heads, seq, d), causal) points the arguments ask for: the named grid's, or --dims x --seq."""
    if args.grid == "training":
        return training_grid()
    return [((args.batch, args.heads, s, d), args.causal) for d in args.dims for s in args.seq]


def run(args: argparse.Namespace) -> int:
    """Times every point of the grid for every provider, prints the table and writes the outputs and plots; returns the
    exit status."""
    sweep.check_outputs(args.output)
    for name, values, least in (("--seq", args.seq, 1), ("--dims", args.dims, 1), ("--batch", [args.batch], 1),
                                ("--heads", [args.heads], 1), ("--steps", [args.steps], 1),
                                ("--warmup", [args.warmup], 0)):
        if min(values) < least:
            raise sweep.UsageError(f"{name} must be at least {least}, got {min(values)}")
    device = sweep.backend()
    points = [(p, shape, m, causal) for shape, causal in grid_points(args) for m in args.modes for p in args.providers]
    masking = "causal and full" if args.grid else "causal" if args.causal else "full"
    print(f"lmsys-bench attention on {device.name} (torch {torch.__version__}): {len(points)} points, "
          f"{args.dtype}, {masking}, {args.warmup} warmup + {args.steps} timed calls ({args.clock} clock)")
    progress = sweep.Progress(len(points))
    rows = []
    for provider, shape, mode, causal in points:
        progress.start(f"{provider} {'x'.join(map(str, shape))}{' causal' if causal else ''} {mode}")
        rows.append(run_point(provider, shape, args.dtype, mode, causal, args, device))
        sweep.write_outputs(pd.DataFrame(rows).reindex(columns=COLUMNS), args.output)  # kept if the sweep stops
    progress.close()
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS)
    frame.attrs["device"] = device.name if device.is_gpu else f"{device.name} (CPU)"
    shown = frame.drop(columns=["batch", "heads", "dtype", "causal", "status"]).assign(status=frame["status"].str[:60])
    print(sweep.format_table(shown))
    if args.plots:
        for path in plot(frame, args.plots):
            print(f"plot: {path}")
    return 0
