"""`lmsys-bench ddp`: one training step of the LM under each data-parallel wrapper, over the ranks: step time, the
share of it spent waiting for gradient communication, peak memory per rank, weak-scaling efficiency and MFU.

Wrappers (lmsys/distributed/steps.py builds the step on each rank): torch-ddp (torch's DistributedDataParallel);
lmsys.distributed.ddp's naive, flat, individual, bucketed-{1,10,25,100,1000}mb and bucketed-{25,100}mb-bf16reduce
(each bucket all-reduced in bf16, half the bytes, the average cast back into the fp32 gradients); fsdp
(lmsys.distributed.fsdp); torch-fsdp2 (torch's fully_shard on each block); and single, the model with no wrapper on
one rank: the weak-scaling reference. Every rank trains on its own batch of --batch sequences; bf16 is autocast
under the DDP wrappers, weights gathered in bf16 under the fully sharded ones. `--optimizer-state sharded` adds rows
with the ZeRO-1 sharded optimizer (lmsys.distributed.sharded_optimizer) under the DDP wrappers (the fully sharded
ones shard it already).

Timing (--graph, on by default on a GPU): as the regression gate times the step (perf_tests/test_ddp.py,
`gpu_benchmark.distributed(graph=True)`): every rank's step is captured in a CUDA graph and the replays are timed,
so the step time is the GPU's, not the CPU's time to launch thousands of kernels; the eager rounds, launch cost
included, are timed beside. A step that a rank cannot capture (torch's DistributedDataParallel; lmsys's AdamW, whose
step count is on the host; a wrapper, or wrapper and sharded optimizer, whose captured step is not tested to train like
the eager one, lmsys/distributed/steps.py) is timed queued, as the gate times it, and its note, printed under the
table, says why. On the CPU, and with --no-graph, the rounds are eager.

Columns: timing (graph, queued or eager); median step ms (each round the slowest rank's; mean and std beside it);
eager_ms, the median of the eager rounds beside graph or queued ones; comm_wait_share, the share of the step spent
in our wrappers' wait for gradient communication after backward (torch's wrappers wait inside backward: empty;
under --graph from the eager rounds); peak_memory_gib, the largest rank's peak allocated during one step (GPU
only); scaling_efficiency, single's step time / this step time for the same size, precision and optimizer when
single ran in the same run (weak scaling: 1.0 is perfect); tokens/s over all ranks; TFLOP/s per device and MFU
against the GPU's dense datasheet peak; note, why a step was not captured (files only).

Run it under torchrun (`torchrun --nproc-per-node 2 -m lmsys.bench ddp`), where single can run only with one process,
or let it spawn the ranks itself (`lmsys-bench ddp --world-size 2`), where single runs on one rank of its own; see
lmsys/bench/ranks.py for how the rounds are timed and what an out-of-memory case becomes.
"""

import argparse
import dataclasses
from statistics import median

import pandas as pd
import torch

from lmsys import flops
from lmsys.bench import ranks, sweep
from lmsys.bench.model import matmul_precision
from lmsys.distributed.steps import (
    DTYPES, OPTIMIZERS, SHARDED_WRAPPERS, WRAPPERS, model_config, setup_train_step, step_flops,
)
from lmsys.model import SIZES, TransformerLM

SINGLE = "single"
WRAPPER_NAMES = (SINGLE, *WRAPPERS, *SHARDED_WRAPPERS)
OPTIMIZER_STATES = ("replicated", "sharded")
COLUMNS = [
    "size", "params", "context", "batch", "dtype", "wrapper", "optimizer", "optimizer_state", "world_size",
    "transport", "status", "timing", "median_ms", "mean_ms", "std_ms", "eager_ms", "comm_wait_share",
    "peak_memory_gib", "scaling_efficiency", "tokens_per_s", "tflop_per_s", "mfu", "note",
]
# What a single row is matched on to give another row its weak-scaling efficiency.
SAME_WORK = ["size", "context", "batch", "dtype", "optimizer"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table."""

    dtype: str
    wrapper: str
    optimizer_state: str
    world_size: int

    @property
    def name(self) -> str:
        """A label for the progress line: bf16-bucketed-100mb-sharded-ws2."""
        state = "-sharded" if self.optimizer_state == "sharded" else ""
        return f"{self.dtype}-{self.wrapper}{state}-ws{self.world_size}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `lmsys-bench ddp`: the model, batch and dtypes, the wrappers and optimizer, and the ranks' options
    (lmsys.bench.ranks)."""
    gpu = torch.cuda.is_available()
    size, batch, dtypes = ("xl", 4, ["fp32", "bf16"]) if gpu else ("tiny", 2, ["fp32"])
    parser.add_argument("--size", choices=SIZES, default=size, help=f"model preset (default: {size})")
    parser.add_argument("--context", type=int, default=None,
                        help="context length (default: the preset's own, 512; tiny 64)")
    parser.add_argument("--batch", type=int, default=batch, help=f"sequences per rank and step (default: {batch})")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=dtypes,
                        help=f"fp32, or bf16 compute with fp32 master weights (default: {' '.join(dtypes)})")
    parser.add_argument("--wrappers", nargs="+", choices=WRAPPER_NAMES, default=None, metavar="WRAPPER",
                        help=f"{', '.join(WRAPPER_NAMES)} (default: all; under torchrun with more than one process "
                             "all but single)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="torch-adamw",
                        help="torch's AdamW (fused on a GPU) or lmsys.optim's (default: torch-adamw)")
    parser.add_argument("--optimizer-state", nargs="+", choices=OPTIMIZER_STATES, default=["replicated"],
                        help="replicated on every rank, and/or sharded across the ranks (ZeRO-1; DDP wrappers only; "
                             "default: replicated)")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=gpu,
                        help="time each rank's step captured in a CUDA graph, as the perf tests do, the eager rounds "
                             "beside; a step that cannot be captured is timed queued, with a note (default: on with "
                             "a GPU; --no-graph: eager rounds)")
    ranks.add_arguments(parser, warmup=3, steps=10)


def wrappers(args: argparse.Namespace) -> list[str]:
    """The wrappers to run: single only where it can run (not under torchrun with several processes)."""
    started = ranks.torchrun_world_size()
    if args.wrappers is None:
        return [w for w in WRAPPER_NAMES if w != SINGLE or started in (None, 1)]
    if SINGLE in args.wrappers and started not in (None, 1):
        raise sweep.UsageError(f"single runs on one rank and torchrun started {started} processes: run it under "
                               "torchrun --nproc-per-node 1, or without torchrun (it spawns the ranks itself)")
    return args.wrappers


def cases(args: argparse.Namespace, world_size: int) -> list[Case]:
    """The run in order: precisions, wrappers, optimizer states; single on one rank with its optimizer unsharded
    (one shard is the whole state), the fully sharded wrappers without the sharded optimizer."""
    out = []
    for dtype in args.dtypes:
        for wrapper in wrappers(args):
            for state in args.optimizer_state:
                if wrapper == SINGLE and state == "replicated":
                    out.append(Case(dtype, wrapper, state, 1))
                elif wrapper != SINGLE and not (wrapper in SHARDED_WRAPPERS and state == "sharded"):
                    out.append(Case(dtype, wrapper, state, world_size))
    return out


def _largest_peak(readings: list) -> int | None:
    peaks = [memory.peak_allocated for memory, _ in readings if memory is not None]
    return max(peaks, default=None)


def run_case(case: Case, args: argparse.Namespace, world: ranks.World, context: int, params: int) -> dict | None:
    """One row: the case's measurement on the leader (None on the other ranks)."""
    row = {"size": args.size, "params": params, "context": context, "batch": args.batch, "dtype": case.dtype,
           "wrapper": case.wrapper, "optimizer": args.optimizer, "optimizer_state": case.optimizer_state,
           "world_size": case.world_size, "transport": world.transport, "status": sweep.OK}
    setup_kwargs = {"size": args.size, "context": context, "batch": args.batch, "compute": case.dtype,
                    "wrapper": case.wrapper, "optimizer": args.optimizer,
                    "sharded": case.optimizer_state == "sharded"}
    with ranks.out_of_memory_as_status(world, row):
        gathered = ranks.measure(world, setup_train_step, setup_kwargs, args, world_size=case.world_size,
                                 graph=args.graph)
        if not world.leader:
            return None
        eager = gathered.get("eager_samples")
        row.update(sweep.summary(gathered["samples"]), timing=gathered.get("timing"),
                   eager_ms=median(eager) * 1e3 if eager else None,
                   note="; ".join(gathered.get("notes", [])) or None,
                   comm_wait_share=gathered["spans"].get("comm_wait", {}).get("share"),
                   peak_memory_gib=sweep.gib(_largest_peak(gathered["readings"])))
    if row["status"] == sweep.OK:
        seconds = row["median_ms"] / 1e3
        work = step_flops(args.size, context, args.batch)
        rates = flops.rates(seconds, world.device_name, work, None, matmul_precision(case.dtype))
        row.update(tokens_per_s=case.world_size * args.batch * context / seconds, tflop_per_s=rates.get("tflops"),
                   mfu=rates.get("fraction_of_peak_tflops"))
    return row


def table(rows: list[dict]) -> pd.DataFrame:
    """The rows with every column of COLUMNS, in that order; each row's weak-scaling efficiency filled in from the
    single row of the same work (size, context, batch, precision, optimizer) when there is one."""
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS)
    single = frame[(frame["wrapper"] == SINGLE) & (frame["status"] == sweep.OK)]
    reference = single.set_index(SAME_WORK)["median_ms"].to_dict()
    frame["scaling_efficiency"] = [
        None if row["wrapper"] == SINGLE or pd.isna(row["median_ms"])
        else reference.get(tuple(row[SAME_WORK]), float("nan")) / row["median_ms"]
        for _, row in frame.iterrows()
    ]
    return frame


def shown(frame: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: short headers, shares in percent, without the notes (printed under it)."""
    out = frame.copy()
    for column in ("comm_wait_share", "scaling_efficiency", "mfu"):
        out[column] = [None if pd.isna(v) else f"{v:.1%}" for v in out[column]]
    varying = [c for c in ("optimizer", "optimizer_state") if out[c].nunique() > 1]
    fixed = ["size", "params", "context", "batch", "transport", "mean_ms", "optimizer", "optimizer_state"]
    if out["eager_ms"].isna().all():
        fixed.append("eager_ms")
    return out.drop(columns=[c for c in fixed if c not in varying] + ["note"]).rename(columns={
        "optimizer_state": "opt state", "world_size": "ranks", "median_ms": "median ms", "std_ms": "std ms",
        "eager_ms": "eager ms",
        "comm_wait_share": "comm wait", "peak_memory_gib": "peak GiB", "scaling_efficiency": "scaling eff",
        "tokens_per_s": "tokens/s", "tflop_per_s": "TFLOP/s", "mfu": "MFU",
    })


def _timing(graph: bool, transport: str) -> str:
    """How the header names the timing."""
    if not graph:
        return "eager"
    return "CUDA graphs, eager rounds beside" if transport == "nccl" else "eager (no CUDA graphs on the CPU)"


def run(args: argparse.Namespace) -> int:
    """Times one training step per case on the ranks (spawned, or torchrun's), prints the table on the leader and writes
    the outputs; returns the exit status."""
    ranks.check(args)
    for name, value in (("--batch", args.batch), ("--context", 1 if args.context is None else args.context)):
        if value < 1:
            raise sweep.UsageError(f"{name} must be at least 1, got {value}")
    todo = cases(args, ranks.world_size(args))
    if not todo:
        raise sweep.UsageError("no case to run: single and the fully sharded wrappers run with the optimizer state "
                               "replicated only")
    context = args.context or SIZES[args.size].context_length
    with torch.device("meta"):
        params = TransformerLM(model_config(args.size, context)).num_parameters()
    world = ranks.start(args)
    try:
        if world.leader:
            print(f"lmsys-bench ddp on {world.size} x {world.device_name} ({world.transport}, torch "
                  f"{torch.__version__}{', under torchrun' if world.torchrun else ''}): {args.size} "
                  f"({params / 1e6:.0f}M parameters), context {context}, batch {args.batch} per rank, "
                  f"{args.optimizer}, {len(todo)} cases, {args.warmup} warmup + {args.steps} timed rounds, "
                  f"{_timing(args.graph, world.transport)}")
        frame = ranks.run_cases(world, [case.name for case in todo],
                                lambda i: run_case(todo[i], args, world, context, params), table, args.output)
    finally:
        ranks.finish(world)
    if world.leader:
        print(sweep.format_table(shown(frame)))
        for _, row in frame[frame["note"].notna()].iterrows():
            print(f"note: {Case(row['dtype'], row['wrapper'], row['optimizer_state'], row['world_size']).name}: "
                  f"{row['note']}")
    return 0
