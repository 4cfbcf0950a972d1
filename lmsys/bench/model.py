"""`lmsys-bench model`: forward, forward + backward and training-step times of the LM over sizes x context lengths x
{fp32, bf16 autocast} x {eager, torch.compile, torch.compile replayed as CUDA graphs}.

Each case builds its model afresh (the gate's clock: CUDA events on a GPU, perf_counter on the CPU), runs `--warmup`
untimed steps, then times `--steps` steps one by one: mean, std and median ms, tokens/s, model TFLOP/s (lmsys.flops:
6 * matmul parameters * tokens plus the attention matmuls; a third of that for the forward) and MFU against the
GPU's dense datasheet peak for the matmul precision, and the peak memory allocated during the timed steps. A case
that runs out of GPU memory is a row with status 'OOM: ...'; the sweep goes on. The --output files are rewritten
after every case, so a sweep stopped halfway keeps the rows it has.

Modes: `fwd` is the loss with autograd recording, as in training (its graph is dropped), `fwd_bwd` adds the
backward (gradients cleared after it), `train` is lmsys.train's step (forward, backward, optimizer step).

Profiling, per case, after the timed steps:
  --profile DIR          one more step under torch.profiler: DIR/<case>.trace.json (chrome://tracing or
                         https://ui.perfetto.dev) and the top operators by device time (by CPU time without a GPU),
                         also grouped by input shape, printed and in DIR/<case>.ops.txt
  --nvtx                 lmsys.profiling's ranges on during the timed steps (forward, backward, optimizer_step,
                         layer_N, attention/...), each timed step inside a process-wide NVTX range 'measured_step'
                         (nsys; ncu --nvtx --nvtx-include measured_step profiles the timed steps only)
  --memory-snapshot DIR  one more step with the CUDA allocator's history recorded: DIR/<case>.pickle (drag it into
                         https://pytorch.org/memory_viz), DIR/<case>.png (allocated memory over time) and the largest
                         allocations with their stacks, printed and in DIR/<case>.allocations.txt (needs CUDA)
"""

import argparse
import contextlib
import dataclasses
import functools
import pickle
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from lmsys import flops, profiling
from lmsys.attention import ATTENTION
from lmsys.bench import memory, sweep
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.train import cross_entropy, make_train_step, random_batch

MODES = ("fwd", "fwd_bwd", "train")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# graphs: compiled with mode="reduce-overhead", the forward and backward recorded and replayed as CUDA graphs
COMPILE = ("eager", "compiled", "graphs")
OPTIMIZERS = {"adamw": AdamW, "torch-fused-adamw": functools.partial(torch.optim.AdamW, fused=True)}
# The process-wide (start/end) NVTX range around each timed step: it also covers kernels that the autograd engine's
# own thread launches for the backward, which a thread-local push/pop range would miss.
MEASURED_RANGE = "measured_step"
COLUMNS = [
    "size", "params", "context", "batch", "mode", "dtype", "compile", "status", "mean_ms", "std_ms", "median_ms",
    "tokens_per_s", "tflop_per_s", "mfu", "peak_memory_gib",
]


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of the sweep."""

    size: str
    context: int
    batch: int
    mode: str
    dtype: str
    compile: str

    @property
    def name(self) -> str:
        """A file-name-safe id: small-t512-b4-train-bf16-compiled."""
        return f"{self.size}-t{self.context}-b{self.batch}-{self.mode}-{self.dtype}-{self.compile}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `lmsys-bench model`: the cases (sizes, dtypes, compile modes, modes), the timing and the profiling
    outputs."""
    default_size = "small" if torch.cuda.is_available() else "tiny"
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=[default_size],
                        help=f"model presets (default: {default_size})")
    parser.add_argument("--context", nargs="+", type=int, default=None,
                        help="context lengths (default: each preset's own, 512; tiny 64)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all three")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                        help="fp32, or bf16 autocast with fp32 master weights (default: both)")
    parser.add_argument("--compile", nargs="+", choices=COMPILE, default=["eager", "compiled"],
                        help="eager, torch.compile of the model, and/or graphs (compiled, then replayed as CUDA "
                        "graphs; CUDA only) (default: eager compiled)")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="sdpa",
                        help="the model's attention kernel (default: sdpa)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="train mode's optimizer: lmsys.optim's AdamW or torch's fused one (default: adamw)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="override the presets' layer count (a quicker profile of the same layer shapes)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5; 0 times a cold start)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--output", "-o", type=Path, action="append", default=[],
                        help="write the table to this .csv or .json file (repeatable)")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="torch.profiler trace and operator tables here")
    parser.add_argument("--top", type=int, default=25, help="rows of the operator tables (default: 25)")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges during the timed steps (nsys, ncu)")
    parser.add_argument("--memory-snapshot", type=Path, metavar="DIR",
                        help="CUDA memory history of one step: pickle, PNG timeline, largest allocations (CUDA)")


def cases(args: argparse.Namespace) -> list[Case]:
    """The sweep in the order it runs: sizes, context lengths, precisions, eager/compiled, modes."""
    return [
        Case(size, context or SIZES[size].context_length, args.batch, mode, dtype, compile)
        for size in args.sizes
        for context in (args.context or [None])
        for dtype in args.dtypes
        for compile in args.compile
        for mode in args.modes
    ]


def config_for(case: Case, args: argparse.Namespace):
    """The ModelConfig of a case: the preset with this context length, attention and (optional) layer count."""
    config = dataclasses.replace(SIZES[case.size], context_length=case.context, attention=args.attention)
    return dataclasses.replace(config, num_layers=args.num_layers) if args.num_layers else config


def step_function(case: Case, model: TransformerLM, optimizer: str, inputs, targets) -> Callable[[], object]:
    """The work of one step of the case's mode, as a function of no arguments."""
    autocast_dtype = DTYPES[case.dtype]
    compiled, graphs = case.compile != "eager", case.compile == "graphs"
    if case.mode == "train":
        step = make_train_step(model, OPTIMIZERS[optimizer](model.parameters()), autocast_dtype=autocast_dtype,
                               compile=compiled, cuda_graphs=graphs)
        return functools.partial(step, inputs, targets)
    forward = torch.compile(model, mode="reduce-overhead" if graphs else None) if compiled else model

    def loss():
        with (
            profiling.range("forward"),
            torch.autocast(inputs.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
        ):
            return cross_entropy(forward(inputs), targets)

    if case.mode == "fwd":
        return loss

    def forward_backward():
        value = loss()
        with profiling.range("backward"):
            value.backward()
        model.zero_grad(set_to_none=True)

    return forward_backward


def matmul_precision(dtype: str) -> str:
    """The peak a dtype's matmuls run at: bf16, or fp32 / tf32 by torch's float32 matmul precision."""
    if dtype == "bf16":
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _in_measured_range(fn: Callable[[], object]) -> Callable[[], object]:
    if not torch.cuda.is_available():
        return fn

    def step():
        handle = torch.cuda.nvtx.range_start(MEASURED_RANGE)
        try:
            return fn()
        finally:
            torch.cuda.nvtx.range_end(handle)

    return step


def _profile(case: Case, fn, directory: Path, top: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    trace = directory / f"{case.name}.trace.json"
    prof = profiling.profile(fn, warmup=0, trace_path=str(trace), record_shapes=True)
    text = (
        f"== {case.name}: top operators ==\n{profiling.table(prof, row_limit=top)}\n"
        f"== {case.name}: top operators by input shape ==\n"
        f"{profiling.table(prof, row_limit=top, group_by_input_shape=True)}\n"
    )
    (directory / f"{case.name}.ops.txt").write_text(text)
    print(text + f"trace: {trace}")


def _memory_snapshot(case: Case, fn, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{case.name}.pickle"
    with profiling.memory_snapshot(str(path)):
        fn()
    with open(path, "rb") as fh:
        snapshot = pickle.load(fh)
    device = torch.cuda.current_device()
    memory.plot_timeline(memory.timeline(snapshot, device), directory / f"{case.name}.png", f"{case.name}: one step")
    text = memory.format_allocations(memory.largest_allocations(snapshot, device=device))
    (directory / f"{case.name}.allocations.txt").write_text(text + "\n")
    print(f"== {case.name}: largest allocations of one step ==\n{text}\n"
          f"snapshot: {path} (https://pytorch.org/memory_viz)")


def measure(case: Case, args: argparse.Namespace, device) -> dict:
    """Builds the case's model and batch, warms up, times the steps; returns the row's measurements."""
    config = config_for(case, args)
    where = "cuda" if device.is_gpu else "cpu"
    with torch.device(where):
        model = TransformerLM(config)
    inputs, targets = random_batch(args.batch, case.context, config.vocab_size, where)
    fn = step_function(case, model, args.optimizer, inputs, targets)
    for _ in range(args.warmup):
        fn()
    read_peak = sweep.peak_memory(device)
    with profiling.enabled() if args.nvtx else contextlib.nullcontext():
        samples = sweep.time_steps(device, _in_measured_range(fn) if args.nvtx else fn, 0, args.steps)
    peak = read_peak()
    if args.profile:
        _profile(case, fn, args.profile, args.top)
    if args.memory_snapshot:
        _memory_snapshot(case, fn, args.memory_snapshot)
    return {**sweep.summary(samples), "peak_memory_gib": sweep.gib(peak)}


def run_case(case: Case, args: argparse.Namespace, device) -> dict:
    """One row of the table: the case, its size and FLOPs, and its measurements or why there are none."""
    config = config_for(case, args)
    with torch.device("meta"):
        meta = TransformerLM(config)
    tokens = case.batch * case.context
    work = flops.training_step_flops(meta.num_parameters(embedding=False), case.batch, case.context,
                                     config.num_layers, config.d_model)
    if case.mode == "fwd":
        work //= 3  # the forward's share: 2 of the 6 FLOPs per parameter and token, 1 of 3 attention passes
    row = {**dataclasses.asdict(case), "params": meta.num_parameters(), "status": sweep.OK}
    try:
        with sweep.out_of_memory_as_status(device, row):
            row.update(measure(case, args, device))
    finally:
        if case.compile != "eager":
            torch.compiler.reset()  # compiled graphs hold the model's memory and would hit the recompile limit
        device.release_memory()
    if row["status"] == sweep.OK:
        seconds = row["mean_ms"] / 1e3
        rates = flops.rates(seconds, device.name, work, None, matmul_precision(case.dtype))
        row.update(tokens_per_s=tokens / seconds, tflop_per_s=rates.get("tflops"),
                   mfu=rates.get("fraction_of_peak_tflops"))
    return row


def table(rows: list[dict]) -> pd.DataFrame:
    """The rows with every column of COLUMNS (missing measurements empty), in that order."""
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def shown(frame: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: short headers, MFU in percent, parameters in millions."""
    out = frame.copy()
    out["params"] = [f"{p / 1e6:.0f}M" for p in out["params"]]
    out["mfu"] = [None if pd.isna(v) else f"{v:.1%}" for v in out["mfu"]]
    return out.drop(columns=["batch", "median_ms"]).rename(columns={
        "context": "ctx", "mean_ms": "mean ms", "std_ms": "std ms", "tokens_per_s": "tokens/s",
        "tflop_per_s": "TFLOP/s", "mfu": "MFU", "peak_memory_gib": "peak GiB",
    })


def run(args: argparse.Namespace) -> int:
    """Times every case of `args` (a row each, an out-of-memory case a row with its status), prints the table and writes
    the outputs; returns the exit status."""
    sweep.check_outputs(args.output)
    device = sweep.backend()
    if args.memory_snapshot and not device.is_gpu:
        raise sweep.UsageError("--memory-snapshot records the CUDA caching allocator's history: it needs a CUDA device")
    if "graphs" in args.compile and not device.is_gpu:
        raise sweep.UsageError("--compile graphs replays the compiled model as CUDA graphs: it needs a CUDA device")
    for name, value, least in (("--batch", args.batch, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--num-layers", args.num_layers or 1, 1), ("--context", min(args.context or [1]), 1)):
        if value < least:
            raise sweep.UsageError(f"{name} must be at least {least}, got {value}")
    todo = cases(args)
    print(f"lmsys-bench model on {device.name} (torch {torch.__version__}): {len(todo)} cases, "
          f"batch {args.batch}, {args.warmup} warmup + {args.steps} timed steps, attention {args.attention}")
    progress = sweep.Progress(len(todo))
    rows = []
    for case in todo:
        progress.start(case.name)
        rows.append(run_case(case, args, device))
        sweep.write_outputs(table(rows), args.output)  # a sweep stopped halfway keeps the rows it has
    progress.close()
    print(sweep.format_table(shown(table(rows))))
    return 0
