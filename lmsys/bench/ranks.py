"""What the distributed commands (`allreduce`, `ddp`) share: their cases run on several ranks and are timed by the
regression gate's multi-rank code (lmsys/perf/multirank.py), started in either of two ways.

- Under torchrun (RANK and WORLD_SIZE in the environment), e.g. `torchrun --nproc-per-node 2 -m lmsys.bench ddp`:
  every process runs the command and measures each case with the others; rank 0 prints and writes the files. An
  error on one rank, running out of memory included, ends the run (torchrun stops the other ranks); the output files
  keep the rows of the cases before it.
- Otherwise the command spawns the ranks itself (lmsys.distributed.launch: `--world-size` of them, a timeout),
  afresh for every case, so each case starts with empty devices and a rank that runs out of memory makes its case a
  row 'OOM: ...' and the next case runs.

NCCL with one GPU per rank, else gloo on the CPU. Per case, on every rank: the subject is built (`setup(ctx, ...)`
of lmsys/distributed/steps.py), called once untimed, then one calibration round and `--warmup - 1` more untimed
rounds, then `--steps` timed rounds; each round starts at a barrier and its time is the slowest rank's. With graph
mode (`measure(..., graph=True)`, the gate's `gpu_benchmark.distributed(graph=True)`) every rank captures its step
in a CUDA graph before the timed rounds, which replay it, and `--steps` eager rounds follow; a step that a rank
cannot capture is timed queued on a GPU, eager on the CPU, with a note. One more call reads each rank's peak memory
(GPU only).
"""

import argparse
import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from lmsys.bench import sweep
from lmsys.distributed.launch import RankError, init_process_group, launch_ranks
from lmsys.perf import multirank
from lmsys.perf.backend import CpuBackend, CudaBackend
from lmsys.perf.fixture import oom_reason


@dataclass(frozen=True)
class World:
    """Where the cases run: this process's rank (0 in the process that spawns the ranks), the world size, the
    transport, whether torchrun started the processes, and the name of the device (for MFU and the header)."""

    rank: int
    size: int
    transport: str
    torchrun: bool
    device_name: str

    @property
    def leader(self) -> bool:
        """Whether this process prints and writes the files."""
        return self.rank == 0


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher that sets RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world_size() -> int | None:
    """The number of processes torchrun started, None when it did not start this one."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_world_size() -> int:
    """Ranks to spawn when --world-size is not given: one per GPU, at least 2."""
    return max(_gpus(), 2)


def world_size(args: argparse.Namespace) -> int:
    """The ranks the cases run on: the processes torchrun started, else --world-size or its default."""
    if under_torchrun():
        return torchrun_world_size()
    return default_world_size() if args.world_size is None else args.world_size


def add_arguments(parser: argparse.ArgumentParser, warmup: int, steps: int) -> None:
    """The options every distributed command has: world size, round counts, timeout, output files."""
    parser.add_argument("--world-size", type=int, default=None,
                        help=f"ranks to spawn (default: {default_world_size()}, one per GPU, at least 2); under "
                             "torchrun the number of processes it started, which this must match when given")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help=f"untimed rounds after the first call, the calibration round included (default: {warmup})")
    parser.add_argument("--steps", type=int, default=steps, help=f"timed rounds (default: {steps})")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a case may take on spawned ranks before they are killed (default: 600)")
    parser.add_argument("--output", "-o", type=Path, action="append", default=[],
                        help="write the table to this .csv or .json file (repeatable; rank 0 writes)")


def check(args: argparse.Namespace) -> None:
    """UsageError for options no case could run with (before any process group exists)."""
    sweep.check_outputs(args.output)
    size = world_size(args)
    for name, value, least in (("--warmup", args.warmup, 1), ("--steps", args.steps, 1), ("--world-size", size, 1)):
        if value < least:
            raise sweep.UsageError(f"{name} must be at least {least}, got {value}")
    if not args.timeout > 0:
        raise sweep.UsageError(f"--timeout must be positive seconds, got {args.timeout}")
    started = torchrun_world_size()
    if started is not None and args.world_size not in (None, started):
        raise sweep.UsageError(f"--world-size {args.world_size}: torchrun started {started} processes")
    gpus = _gpus()
    if started is None and 0 < gpus < size:
        raise sweep.UsageError(f"--world-size {size}: NCCL needs a GPU per rank, this machine has {gpus}")


def start(args: argparse.Namespace) -> World:
    """The world the cases run in; under torchrun this joins the process group (see `finish`)."""
    if under_torchrun():
        device = init_process_group()
        name = CudaBackend().name if device.type == "cuda" else CpuBackend().name
        return World(dist.get_rank(), dist.get_world_size(), dist.get_backend(), True, name)
    return World(0, world_size(args), "nccl" if _gpus() else "gloo", False, sweep.backend().name)


def finish(world: World) -> None:
    """Leaves the process group that `start` joined under torchrun."""
    if world.torchrun and dist.is_initialized():
        dist.destroy_process_group()


def measure_on_rank(settings: multirank.Settings) -> dict | None:
    """Rank code: one case timed by multirank.rank_main (the gathered measurement on rank 0, None elsewhere), then
    the case's memory released so the next case starts from what the process held before."""
    _, gathered = multirank.rank_main(settings)
    gc.collect()
    if settings.transport == "nccl":
        torch.cuda.empty_cache()
    return gathered


def measure(world: World, setup: Callable, setup_kwargs: dict, args: argparse.Namespace,
            world_size: int | None = None, graph: bool = False) -> dict | None:
    """Times `setup(ctx, **setup_kwargs)`'s step on the ranks (`world_size` spawned ones, default the world's; under
    torchrun the processes it started). Returns multirank's gathered measurement on the leader, None elsewhere.

    `graph=True` times the step as the gate's graph mode does (gpu_benchmark.distributed(graph=True)): every rank's
    step captured in a CUDA graph and its replays timed, the eager rounds beside (`eager_samples`); a step that a
    rank cannot capture is timed queued on a GPU (eager on the CPU) and `notes` says why."""
    backend = sweep.backend()
    settings = multirank.Settings(
        setup=setup,
        setup_kwargs=setup_kwargs,
        make_backend=backend.for_rank(),
        transport=world.transport,
        max_time=0.0,  # exactly --steps rounds
        min_rounds=args.steps,
        warmup_rounds=args.warmup,
        disable_gc=False,
        queued=graph and backend.is_gpu,
        graph=graph,
    )
    if world.torchrun:
        return measure_on_rank(settings)
    return launch_ranks(measure_on_rank, world_size or world.size, settings, backend=world.transport,
                  timeout=args.timeout)[0]


@contextlib.contextmanager
def out_of_memory_as_status(world: World, row: dict) -> Iterator[None]:
    """Runs the block; a spawned rank's CUDA out-of-memory error becomes row['status'] ('OOM: tried to allocate ... on
    rank R'), any other failure of a rank is raised."""
    try:
        yield
    except RankError as exc:
        if "CUDA out of memory" not in exc.details:
            raise
        reason = oom_reason(exc.details, world.device_name).rsplit(": ", 1)[1]
        row["status"] = f"OOM: {reason} on rank {exc.rank}"


def run_cases(world: World, labels: list[str], run_case: Callable[[int], dict | None],
              table: Callable[[list[dict]], pd.DataFrame], outputs: list[Path]) -> pd.DataFrame | None:
    """Runs `run_case(i)` for each case in order (on every rank under torchrun). The leader shows the progress,
    keeps the rows and rewrites the output files after every case (a run stopped halfway keeps its rows); it returns
    the table, the other ranks None."""
    progress = sweep.Progress(len(labels)) if world.leader else None
    rows = []
    for index, label in enumerate(labels):
        if progress:
            progress.start(label)
        row = run_case(index)
        if world.leader:
            rows.append(row)
            sweep.write_outputs(table(rows), outputs)
    if progress:
        progress.close()
    return table(rows) if world.leader else None
