"""The attention kernels' variants side by side in one process: the Triton backward, the Gluon backward for Hopper
(lmsys.attention.flash_hopper_bwd, whatever the problem's size: its kernels one after the other, with its dQ kernel
beside the dK/dV one on a side stream, and, one after the other, with dQ tiles of 128 keys, with 3 stages, or
without the dK/dV kernel's statistics loaded a step ahead; by default, or either, in the forwards' launch order:
GROUPED_ORDER), the Gluon forward at d=64 at any size or never (by
default it runs long problems of few blocks: flash_hopper.plan), SDPA's cuDNN and flash backends, and the default
(what flash_attention runs: the Gluon backward as flash_hopper_bwd.plan decides by the problem's programs per
multiprocessor, else the Triton one), at the CS336 leaderboard's shape and the causal grid's points from 8192 tokens
(issue 15).

For each point (bf16, causal unless --not-causal): first each variant's output and gradients against the Triton
kernels' on the same inputs (the largest difference of each of o, dq, dk, dv relative to the Triton tensor's largest
magnitude: a wrong kernel at a shape the float64 tests do not reach shows here), then every variant in the `fwd`,
`bwd` (the forward once, untimed; each timed call one backward) and `fwd_bwd` modes, timed as `lmsys-bench
attention` times them (the regression gate's clock: CUDA events; the median of --steps calls after --warmup),
--repeats times, the variants taking turns, in the order given on even repeats and reversed on odd ones (the same
kernels timed first and second in one repeat differed by 1-4%: over an even number of repeats each variant is timed
as often early as late). Prints a table (per variant, point and mode: the median of the repeats'
medians and their range) and writes every row, each repeat's, to the CSV file named on the command line. With
--kernels N, then each variant at each point and mode once more, N calls under torch.profiler: where the device time
goes, per kernel (launches and microseconds per call, share of the call's device time), printed (the largest six of
each) and written whole to <csv>-kernels.csv.

    PYTHONPATH=. python scripts/attention_backward_variants.py variants.csv          (from the repository root)
    PYTHONPATH=. python scripts/attention_backward_variants.py variants.csv --points leaderboard --modes bwd
    PYTHONPATH=. python scripts/attention_backward_variants.py v.csv --points leaderboard --modes bwd --kernels 10

Needs a Hopper GPU (the Gluon kernels are for sm_90): elsewhere it says so and exits with status 2.
"""

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
from torch.autograd import DeviceType

from lmsys import profiling
from lmsys.attention import flash_hopper, flash_hopper_bwd, flash_triton
from lmsys.attention.providers import attention_function, timed_call
from lmsys.bench import sweep
from lmsys.bench.attention import run_point
from lmsys.bench.ncu import short_name

# (batch, heads, seq, d): the leaderboard's (16, 16384, 64) and the causal grid's (1, T, d) points, as 4-D inputs.
POINTS = {
    "leaderboard": [(16, 1, 16384, 64)],
    "grid": [(1, 1, seq, d) for d in (64, 128) for seq in (8192, 16384, 32768, 65536)],
}
# name -> (provider, settings of lmsys.attention's modules for it: the Gluon backward, its defaults changed, the
# Gluon forward at d=64 at any size from one block per multiprocessor, or never)
GLUON = {"HOPPER_BACKWARD": True, "MIN_PROGRAMS_PER_SM": 0, "MIN_PROGRAMS_PER_SM_CONCURRENT": 0}  # any size
FORWARD_64 = {"FORWARD_64_MIN_KEYS": 0, "FORWARD_64_BELOW_PROGRAMS_PER_SM": math.inf}  # from 1 block per SM
VARIANTS = {
    "triton": ("flash_triton", {"HOPPER_BACKWARD": False}),
    "default": ("flash_triton", {}),  # what flash_attention runs: Gluon or Triton backward by the problem's size
    "hopper": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False}),
    "fwd64": ("flash_triton", FORWARD_64),
    "no-fwd64": ("flash_triton", {"FORWARD_64_MIN_KEYS": math.inf}),  # the Triton forward at d=64
    "hopper-fwd64": ("flash_triton", {**GLUON, **FORWARD_64, "CONCURRENT_DQ": False}),
    "hopper-concurrent": ("flash_triton", {**GLUON, "CONCURRENT_DQ": True}),
    "hopper-dq128": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False, "TILES": {64: (64, 128), 128: (64, 128)}}),
    "hopper-3stages": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False, "NUM_STAGES": 3}),
    "hopper-no-prefetch": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False, "PREFETCH_STATS": set()}),
    "grouped": ("flash_triton", {"GROUPED_ORDER": True}),  # the default, in the forwards' launch order
    "ungrouped": ("flash_triton", {"GROUPED_ORDER": False}),
    "sdpa_cudnn": ("sdpa_cudnn", {}),
    "sdpa_flash": ("sdpa_flash", {}),
}
DEFAULTS = {
    "HOPPER_BACKWARD": (flash_triton, flash_triton.HOPPER_BACKWARD),
    "MIN_PROGRAMS_PER_SM": (flash_hopper_bwd, flash_hopper_bwd.MIN_PROGRAMS_PER_SM),
    "MIN_PROGRAMS_PER_SM_CONCURRENT": (flash_hopper_bwd, flash_hopper_bwd.MIN_PROGRAMS_PER_SM_CONCURRENT),
    "CONCURRENT_DQ": (flash_hopper_bwd, flash_hopper_bwd.CONCURRENT_DQ),
    "TILES": (flash_hopper_bwd, flash_hopper_bwd.TILES),
    "NUM_STAGES": (flash_hopper_bwd, flash_hopper_bwd.NUM_STAGES),
    "PREFETCH_STATS": (flash_hopper_bwd, flash_hopper_bwd.PREFETCH_STATS),
    "GROUPED_ORDER": (flash_hopper_bwd, flash_hopper_bwd.GROUPED_ORDER),
    "FORWARD_64_MIN_KEYS": (flash_hopper, flash_hopper.FORWARD_64_MIN_KEYS),  # where the Gluon forward runs d=64
    "FORWARD_64_BELOW_PROGRAMS_PER_SM": (flash_hopper, flash_hopper.FORWARD_64_BELOW_PROGRAMS_PER_SM),
}


def apply(settings: dict) -> None:
    """Sets every knob of DEFAULTS: the variant's value, or the default."""
    for name, (module, default) in DEFAULTS.items():
        setattr(module, name, settings.get(name, default))


def agreement(shape: tuple, variants: list[str], is_causal: bool) -> dict[str, dict[str, float]]:
    """Each variant's output and gradients against those of the Triton kernels (the "triton" variant: the Triton
    backward, the forward as flash_triton picks it) on one draw: max |a - b| / max |b|, per tensor."""
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def run() -> tuple:
        o, lse = flash_triton.forward(q, k, v, is_causal)
        return (o, *flash_triton.backward(q, k, v, o, lse, do, is_causal))

    apply(VARIANTS["triton"][1])
    expected = run()
    found = {}
    for name in variants:
        apply(VARIANTS[name][1])
        found[name] = {f"{which}_rel_diff": ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                       for which, a, b in zip(("o", "dq", "dk", "dv"), run(), expected, strict=True)}
    apply({})
    return found


def kernel_rows(events, steps: int) -> list[dict]:
    """Per kernel (each device activity of a profile's events, by name) over `steps` calls: launches and device
    microseconds per call, and its share of the device time; the largest first."""
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.device_type == DeviceType.CUDA:
            total = totals.setdefault(short_name(event.name, 70), [0, 0.0])
            total[0] += 1
            total[1] += event.device_time_total
    whole = sum(us for _, us in totals.values())
    rows = [{"kernel": name, "calls_per_step": count / steps, "us_per_step": us / steps,
             "share": us / whole if whole else None} for name, (count, us) in totals.items()]
    return sorted(rows, key=lambda row: -row["us_per_step"])


def profile_point(provider: str, shape: tuple, mode: str, is_causal: bool, steps: int) -> list[dict]:
    """kernel_rows of `steps` calls of one point (bf16), after one untimed call of them."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn, fn_args = timed_call(attention_function(provider), q, k, v, is_causal, mode)
    prof = profiling.profile(lambda: [fn(*fn_args) for _ in range(steps)], warmup=1)
    return kernel_rows(prof.events(), steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="where to write every row (a new .csv file)")
    parser.add_argument("--points", nargs="+", choices=POINTS, default=list(POINTS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--modes", nargs="+", choices=["fwd", "bwd", "fwd_bwd"], default=["fwd", "bwd", "fwd_bwd"])
    parser.add_argument("--not-causal", action="store_true", help="time the points without the causal mask")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=4,
                        help="times each point's variants are timed, taking turns, the order reversed on odd repeats "
                        "(default 4): the table gives the median of their medians and their spread, so that a drift "
                        "of the machine and the position in a turn fall on all alike")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="then profile N calls of each variant, point and mode: device time per kernel, to "
                        "<csv>-kernels.csv (default 0: none)")
    args = parser.parse_args(argv)
    is_causal = not args.not_causal
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.kernels < 0:
        parser.error("--repeats and --steps must be at least 1, --warmup and --kernels at least 0")
    kernels_csv = args.csv.with_name(args.csv.stem + "-kernels.csv")
    for path in (args.csv, kernels_csv) if args.kernels else (args.csv,):
        if path.suffix != ".csv" or path.exists():
            parser.error(f"{path}: give a new file ending in .csv")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs a Hopper GPU (compute capability 9.0): the Gluon backward runs nowhere else", file=sys.stderr)
        return 2
    device = sweep.backend()
    timing = SimpleNamespace(warmup=args.warmup, steps=args.steps)
    shapes = [shape for name in args.points for shape in POINTS[name]]
    profiled = len(args.variants) * len(args.modes) if args.kernels else 0
    progress = sweep.Progress(len(shapes) * (1 + args.repeats * len(args.variants) * len(args.modes) + profiled))
    rows, kernels = [], []
    try:
        for shape in shapes:
            progress.start(f"{shape} agreement")
            changed = [name for name in args.variants if VARIANTS[name][0] == "flash_triton" and name != "triton"]
            checked, status = {}, {}
            with sweep.out_of_memory_as_status(device, status):
                checked = agreement(shape, changed, is_causal)
            for repeat in range(args.repeats):
                for mode in args.modes:
                    for name in turns(args.variants, repeat):
                        provider, settings = VARIANTS[name]
                        progress.start(f"{shape} {mode} {name} ({repeat + 1}/{args.repeats})")
                        apply(settings)
                        row = run_point(provider, shape, "bf16", mode, is_causal, timing, device)
                        rows.append({"variant": name, "repeat": repeat, **row, **checked.get(name, {})})
            for mode in args.modes if args.kernels else ():
                for name in args.variants:
                    provider, settings = VARIANTS[name]
                    progress.start(f"{shape} {mode} {name} profiled")
                    apply(settings)
                    point = {"variant": name, "batch": shape[0], "seq": shape[2], "d": shape[3], "mode": mode,
                             "causal": is_causal}
                    status = {}
                    with sweep.out_of_memory_as_status(device, status):
                        kernels += [{**point, **row} for row in profile_point(provider, shape, mode, is_causal,
                                                                            args.kernels)]
                    if status:
                        kernels.append({**point, "kernel": status["status"]})
    finally:
        progress.close()
        apply({})
    frame = pd.DataFrame(rows)
    sweep.write_outputs(frame, [args.csv])
    print("causal" if is_causal else "not causal", "bf16")
    print(sweep.format_table(summary(frame)))
    if args.kernels:
        profiles = pd.DataFrame(kernels)
        sweep.write_outputs(profiles, [kernels_csv])
        print(sweep.format_table(profiles.groupby(["variant", "batch", "seq", "d", "mode"], sort=False).head(6)))
    return 0


def turns(variants: list[str], repeat: int) -> list[str]:
    """The order in which the variants are timed in repeat `repeat`: as given on even repeats, reversed on odd ones."""
    return list(variants) if repeat % 2 == 0 else list(reversed(variants))


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """A row per variant, point and mode: the median over the repeats of each repeat's median, their smallest and
    largest (the spread to read a difference against), the status of the first repeat, and the agreement with the
    Triton kernels."""
    keys = ["variant", "batch", "seq", "d", "mode"]
    timed = frame.dropna(subset=["median_ms"]) if "median_ms" in frame else frame.iloc[0:0]
    spread = timed.groupby(keys, sort=False)["median_ms"].agg(median_ms="median", min_ms="min", max_ms="max")
    first = frame.groupby(keys, sort=False).first()
    extra = [c for c in ("status", "o_rel_diff", "dq_rel_diff", "dk_rel_diff", "dv_rel_diff") if c in first]
    return first[extra].join(spread).reset_index()[keys + ["status", *spread.columns, *extra[1:]]]


if __name__ == "__main__":
    sys.exit(main())
