"""`lmsys-bench allreduce`: all-reduce (sum) of an fp32 tensor of each size over the ranks: median time, algorithm
bandwidth and bus bandwidth.

Each round is one in-place `all_reduce` of the size on every rank (lmsys.distributed.steps.setup_all_reduce). The
algorithm bandwidth is size / time; the bus bandwidth (NCCL's busbw, lmsys.distributed.collectives) is
2 (N - 1) / N * size / time: the bytes that go through each rank's link in a ring, comparable across world sizes and
with the link's own bandwidth. GB are 1e9 bytes.

Run it under torchrun (`torchrun --nproc-per-node 2 -m lmsys.bench allreduce`) or let it spawn `--world-size` ranks
itself; see lmsys/bench/ranks.py for how the rounds are timed. Sizes default to the perf test's (1 MiB, 10 MiB,
100 MiB, 1 GiB on GPUs; 1 MiB and 10 MiB on the CPU).
"""

import argparse
import re

import pandas as pd
import torch

from lmsys.bench import ranks, sweep
from lmsys.distributed.collectives import ALL_REDUCE_SIZES, bus_bandwidth
from lmsys.distributed.steps import setup_all_reduce

UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
COLUMNS = [
    "size", "bytes", "world_size", "transport", "status", "median_ms", "mean_ms", "std_ms", "algbw_gbps",
    "busbw_gbps",
]


def parse_size(text: str) -> int:
    """Bytes of a size such as 1MiB, 512KiB, 1GiB, 10M or 4096 (binary units); a whole number of fp32 values."""
    match = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", text.strip())
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 1MiB, 512KiB, 1GiB or a number of bytes")
    nbytes = int(match.group(1)) * UNITS[unit]
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: the tensor holds fp32 values, so a positive multiple of 4 bytes")
    return nbytes


def format_size(nbytes: int) -> str:
    """1048576 -> '1MiB': the largest binary unit that divides the size."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `lmsys-bench allreduce`: the sizes, and the ranks' options (lmsys.bench.ranks)."""
    sizes = ALL_REDUCE_SIZES if torch.cuda.is_available() else ALL_REDUCE_SIZES[:2]
    shown = " ".join(format_size(n) for n in sizes)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=list(sizes),
                        help=f"bytes per rank, e.g. 1MiB 512KiB 1GiB (default: {shown})")
    ranks.add_arguments(parser, warmup=5, steps=20)


def run_case(nbytes: int, args: argparse.Namespace, world: ranks.World) -> dict | None:
    """One row: the size's measurement on the leader (None on the other ranks)."""
    row = {"size": format_size(nbytes), "bytes": nbytes, "world_size": world.size, "transport": world.transport,
           "status": sweep.OK}
    with ranks.out_of_memory_as_status(world, row):
        gathered = ranks.measure(world, setup_all_reduce, {"nbytes": nbytes}, args)
        if not world.leader:
            return None
        row.update(sweep.summary(gathered["samples"]))
    if row["status"] == sweep.OK:
        seconds = row["median_ms"] / 1e3
        row.update(algbw_gbps=nbytes / seconds / 1e9, busbw_gbps=bus_bandwidth(nbytes, seconds, world.size))
    return row


def table(rows: list[dict]) -> pd.DataFrame:
    """The rows with every column of COLUMNS (missing measurements empty), in that order."""
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def shown(frame: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: short headers."""
    return frame.drop(columns=["bytes", "transport"]).rename(columns={
        "world_size": "ranks", "median_ms": "median ms", "mean_ms": "mean ms", "std_ms": "std ms",
        "algbw_gbps": "algbw GB/s", "busbw_gbps": "busbw GB/s",
    })


def run(args: argparse.Namespace) -> int:
    """Times one all-reduce per size on the ranks (spawned, or torchrun's), prints the table on the leader and writes
    the outputs; returns the exit status."""
    ranks.check(args)
    world = ranks.start(args)
    try:
        if world.leader:
            print(f"lmsys-bench allreduce on {world.size} x {world.device_name} ({world.transport}, torch "
                  f"{torch.__version__}{', under torchrun' if world.torchrun else ''}): {len(args.sizes)} sizes, fp32, "
                  f"{args.warmup} warmup + {args.steps} timed rounds")
        frame = ranks.run_cases(world, [format_size(n) for n in args.sizes],
                                lambda i: run_case(args.sizes[i], args, world), table, args.output)
    finally:
        ranks.finish(world)
    if world.leader:
        print(sweep.format_table(shown(frame)))
    return 0
