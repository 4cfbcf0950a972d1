"""The attention kernels' variants side by side in one process: the Triton backward, the Gluon backward for Hopper
(lmsys.attention.flash_hopper_bwd, whatever the problem's size: its two kernels one after the other, with its dQ
kernel beside the dK/dV one on a side stream, and, one after the other, with dQ tiles of 128 keys, with 3 stages, or
without the dK/dV kernel's statistics loaded a step ahead; or dQ accumulated by the dK/dV kernel, FUSED_DQ, with or
without FUSED_SPLIT, the heads in groups of 1, 2 or 4), the Gluon forward at d=64 at any size or never (by default it
runs long problems of few blocks: flash_hopper.plan), SDPA's cuDNN and flash backends, the default (what
flash_attention runs: the Gluon backward as flash_hopper_bwd.plan decides by the problem's programs per
multiprocessor, else the Triton one; dQ accumulated by the dK/dV kernel as flash_hopper_bwd.fused decides) and the
default with the two kernels always (as before 2026-11-26), at the CS336 leaderboard's shape (and that shape
at d=128), the causal grid's points from 8192 tokens (issue 15) and the training grid's at d=64 and 128 (--points
training). The default variant runs as the GPU's table chose (lmsys.attention.tuned); every other variant as its
settings say.

For each point (bf16, causal unless --not-causal): first each variant's output and gradients against the Triton
kernels' on the same inputs (the largest difference of each of o, dq, dk, dv relative to the Triton tensor's largest
magnitude: a wrong kernel at a shape the float64 tests do not reach shows here), then every variant in the `fwd`,
`bwd` (the forward once, untimed; each timed call one backward) and `fwd_bwd` modes, timed as `lmsys-bench
attention` times them (the regression gate's clock: CUDA events; the median of --steps calls after --warmup; with
--clock queued the device's time alone, with --clock host the CPU's time to issue a call: on the H100 a forward and
backward of one head of 16384 tokens took the CPU up to 1 ms for 0.42 ms of GPU work, flash_hopper_bwd's docstring),
--repeats times, the variants taking turns, in the order given on even repeats and reversed on odd ones (the same
kernels timed first and second in one repeat differed by 1-4%: over an even number of repeats each variant is timed
as often early as late). Prints a table (per variant, point and mode: the median of the repeats'
medians and their range) and writes every row, each repeat's, to the CSV file named on the command line. With
--kernels N, then each variant at each point and mode once more, N calls under torch.profiler: where the device time
goes, per kernel (launches and microseconds per call, share of the call's device time), printed (the largest six of
each) and written whole to <csv>-kernels.csv. With --power SECONDS, then each variant at each point and mode back to
back for SECONDS, twice (in turns, the second reversed), with the GPU's energy counter, SM clock and power-cap state
read through NVML: millijoules and watts per call, the clock it ran at, the temperature and the throttle reasons seen
(printed, and to <csv>-power.csv). On a GPU held at its power cap a kernel that takes more energy per call runs slower,
whatever its instructions.

    PYTHONPATH=. python scripts/attention_backward_variants.py variants.csv          (from the repository root)
    PYTHONPATH=. python scripts/attention_backward_variants.py variants.csv --points leaderboard --modes bwd
    PYTHONPATH=. python scripts/attention_backward_variants.py v.csv --points leaderboard --modes bwd --kernels 10
    PYTHONPATH=. python scripts/attention_backward_variants.py v.csv --points leaderboard --modes bwd --power 3
    PYTHONPATH=. python scripts/attention_backward_variants.py v.csv --points grid --seqs 16384 --head-dims 64
    PYTHONPATH=. python scripts/attention_backward_variants.py v.csv --points grid --seqs 16384 --clock host

Needs a Hopper GPU (the Gluon kernels are for sm_90): elsewhere it says so and exits with status 2.
"""

import argparse
import math
import statistics
import sys
import time
from functools import partial
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
    "leaderboard-d128": [(16, 1, 16384, 128)],  # its shape at d=128
    "grid": [(1, 1, seq, d) for d in (64, 128) for seq in (8192, 16384, 32768, 65536)],
    # d=64 problems of many heads (15.5 or 7.8 blocks of 128 rows per multiprocessor) at several lengths
    "d64-heads": [(4, 16, 4096, 64), (2, 16, 8192, 64), (1, 8, 16384, 64), (1, 8, 32768, 64), (1, 4, 65536, 64)],
    # the training grid's points (lmsys.bench.attention: 16384 tokens a batch) where the Gluon backward runs
    "training": [(16384 // seq, heads, seq, d) for d, heads in ((64, 32), (128, 16))
                 for seq in (512, 1024, 2048, 4096, 8192, 16384)],
}
# name -> (provider, settings of lmsys.attention's modules for it: the Gluon backward, its defaults changed, the
# Gluon forward at d=64 at any size from one block per multiprocessor, or never). The Gluon variants run its two
# kernels (FUSED_DQ off) unless they name a way of accumulating dQ in the dK/dV kernel.
GLUON = {"HOPPER_BACKWARD": True, "MIN_PROGRAMS_PER_SM": 0, "MIN_PROGRAMS_PER_SM_CONCURRENT": 0,  # any size
         "FUSED_DQ": False}
# From 1 block per SM, with two consumer warpgroups a program
FORWARD_64 = {"FORWARD_64_MIN_KEYS": 0, "FORWARD_64_BELOW_PROGRAMS_PER_SM": math.inf,
              "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM": math.inf}


def _fused(split: bool, group_heads: int | None) -> dict:
    """The Gluon backward at any size with dQ accumulated in the dK/dV kernel, over half its columns (FUSED_SPLIT) or
    not, its heads in groups of `group_heads` (None: by the bytes of q and dO, as without FUSED_DQ)."""
    return {**GLUON, "FUSED_DQ": True, "FUSED_SPLIT": split, "FUSED_GROUP_HEADS": group_heads}


VARIANTS = {
    "triton": ("flash_triton", {"HOPPER_BACKWARD": False}),
    # What flash_attention runs: the Gluon or the Triton backward by the problem's size, dQ accumulated in the dK/dV
    # kernel by the problem's size (`flash_hopper_bwd.fused`; FUSED_SPLIT, groups of one head)
    "default": ("flash_triton", {}),
    "two-kernels": ("flash_triton", {"FUSED_DQ": False}),  # the default before 2026-11-26: never FUSED_DQ
    "hopper": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False}),
    "fwd64": ("flash_triton", FORWARD_64),
    "no-fwd64": ("flash_triton", {"FORWARD_64_MIN_KEYS": math.inf,  # the Triton forward at d=64
                                   "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM": math.inf}),
    # The Gluon forward at d=64 as fwd64, with three consumer warpgroups (192 query rows) a program
    "fwd64-3wg": ("flash_triton", {"FORWARD_64_WIDE_MIN_KEYS": 0, "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM": 0}),
    # The default before session 59: never three consumer warpgroups
    "no-3wg": ("flash_triton", {"FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM": math.inf}),
    "hopper-fwd64": ("flash_triton", {**GLUON, **FORWARD_64, "CONCURRENT_DQ": False}),
    "hopper-concurrent": ("flash_triton", {**GLUON, "CONCURRENT_DQ": True}),
    "hopper-dq128": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False, "TILES": {64: (64, 128), 128: (64, 128)}}),
    "hopper-3stages": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False, "NUM_STAGES": 3}),
    "hopper-no-prefetch": ("flash_triton", {**GLUON, "CONCURRENT_DQ": False, "PREFETCH_STATS": set()}),
    "hopper-fused": ("flash_triton", _fused(False, None)),  # each warpgroup's dQ over its keys (d=64)
    "hopper-fused-split": ("flash_triton", _fused(True, None)),  # half of dQ's columns over the program's keys
    # FUSED_DQ with the dK/dV kernel's heads in groups of 1, 2 or 4 (6 by the bytes at the leaderboard; 3 would end the
    # leaderboard's 16 heads on a group of one, whose heaviest programs come last: 4% longer in a list-scheduling model)
    **{f"hopper-fused{split}-g{n}": ("flash_triton", _fused(bool(split), n))
       for split in ("", "-split") for n in (1, 2, 4)},
    # The default with dQ accumulated in the dK/dV kernel at d=64 alone (as before 2026-11-26's session 55)
    "fused-64": ("flash_triton", {"FUSED_HEAD_DIMS": (64,)}),
    "fused-ds-smem": ("flash_triton", {"FUSED_DS_SMEM": True}),  # dK's dS^T from shared memory at d=64 at any size
    # or from registers (with K_IN_REGISTERS the default's choice at d=64 already)
    "fused-ds-registers": ("flash_triton", {"FUSED_DS_SMEM": False}),
    # The default with S^T's A operand K from shared memory (as before session 56; dK's dS^T by ds_from_shared's size)
    "k-shared": ("flash_triton", {"K_IN_REGISTERS": False}),
    # The default with 3 stages of Q and dO tiles
    "fused-3stages": ("flash_triton", {"NUM_STAGES": 3}),
    "grouped": ("flash_triton", {"GROUPED_ORDER": True}),  # the default: the forwards' launch order
    "ungrouped": ("flash_triton", {"GROUPED_ORDER": False}),  # the default before 2026-11-25: a grid of (blocks, heads)
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
    "FUSED_DQ": (flash_hopper_bwd, flash_hopper_bwd.FUSED_DQ),
    "FUSED_SPLIT": (flash_hopper_bwd, flash_hopper_bwd.FUSED_SPLIT),
    "FUSED_GROUP_HEADS": (flash_hopper_bwd, flash_hopper_bwd.FUSED_GROUP_HEADS),
    "FUSED_HEAD_DIMS": (flash_hopper_bwd, flash_hopper_bwd.FUSED_HEAD_DIMS),
    "FUSED_DS_SMEM": (flash_hopper_bwd, flash_hopper_bwd.FUSED_DS_SMEM),
    "K_IN_REGISTERS": (flash_hopper_bwd, flash_hopper_bwd.K_IN_REGISTERS),
    "FORWARD_64_MIN_KEYS": (flash_hopper, flash_hopper.FORWARD_64_MIN_KEYS),  # where the Gluon forward runs d=64
    "FORWARD_64_BELOW_PROGRAMS_PER_SM": (flash_hopper, flash_hopper.FORWARD_64_BELOW_PROGRAMS_PER_SM),
    "FORWARD_64_WIDE_MIN_KEYS": (flash_hopper, flash_hopper.FORWARD_64_WIDE_MIN_KEYS),
    "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM": (flash_hopper, flash_hopper.FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM),
}


def apply(settings: dict) -> None:
    """Sets every knob of DEFAULTS: the variant's value, or the default."""
    for name, (module, default) in DEFAULTS.items():
        setattr(module, name, settings.get(name, default))
    # The GPU's measured choice of backward (lmsys.attention.tuned) is the default's; every other variant is its own.
    flash_hopper.MEASURED = flash_hopper_bwd.MEASURED = settings.get("MEASURED", not settings)


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


class EnergyCounter:
    """The GPU's total energy counter (mJ since the driver loaded), read through NVML (pynvml, of the optional
    nvidia-ml-py package), for --power; its clock, temperature and throttle reasons come from the gate's reader
    (`CudaBackend.machine_state`)."""

    def __init__(self, pynvml, handle):
        self.nvml, self.handle = pynvml, handle

    @classmethod
    def open(cls) -> "tuple[EnergyCounter | None, str | None]":
        """The current CUDA device's, or (None, why not)."""
        try:
            import pynvml
        except ImportError:
            return None, "pynvml (the nvidia-ml-py package) is not installed"
        try:
            pynvml.nvmlInit()
            uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode())
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError as exc:
            return None, f"NVML cannot read the GPU's energy: {exc}"
        return cls(pynvml, handle), None

    def energy_mj(self) -> float:
        return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))


def sustained(call, seconds: float, energy_mj, read, synchronize, now=time.perf_counter, batch: int = 10) -> dict:
    """`call` back to back for `seconds` (in batches of `batch`, each followed by a reading of the GPU, `read()` as
    lmsys.perf.machine.Reader.read gives it, taken while the batch runs, then a wait for it): milliseconds,
    millijoules (the difference of `energy_mj()`) and mean watts per call, the median SM clock of the readings, the
    highest temperature, and each throttle reason seen with the share of readings it held ("sw_power_cap 40%"). On a
    GPU held at its power cap a call runs slower the more energy it takes; a clock below the GPU's top with no reason
    seen is the GPU's own choice at that load."""
    synchronize()
    energy0, start, calls, readings, clocks, temperatures, held = energy_mj(), now(), 0, 0, [], [], {}
    while calls == 0 or now() - start < seconds:
        for _ in range(batch):
            call()
        calls += batch
        reading = read()  # a field NVML refuses is None: left out
        clocks += [reading["sm_clock_mhz"]] if reading["sm_clock_mhz"] is not None else []
        temperatures += [reading["temperature_c"]] if reading["temperature_c"] is not None else []
        readings += 1
        for reason in reading["throttle"] or ():
            held[reason] = held.get(reason, 0) + 1
        synchronize()
    elapsed, energy = now() - start, energy_mj() - energy0
    return {"calls": calls, "ms_per_call": 1e3 * elapsed / calls, "mj_per_call": energy / calls,
            "power_w": energy / 1e3 / elapsed, "sm_clock_mhz": statistics.median(clocks) if clocks else None,
            "max_temperature_c": max(temperatures, default=None),
            "held_by": ", ".join(f"{reason} {count / readings:.0%}" for reason, count in held.items()) or "-"}


def power_rows(shapes, variants, modes, is_causal: bool, seconds: float, counter, device) -> list[dict]:
    """sustained() for every point, mode and variant, each variant twice: the variants in the order given, then
    reversed (the GPU warms as it goes). A case out of device memory says so in its status, and the others go on."""
    rows = []
    progress = sweep.Progress(len(shapes) * len(modes) * 2 * len(variants))
    try:
        for shape in shapes:
            rows += _power_point(shape, variants, modes, is_causal, seconds, counter, device, progress)
    finally:
        progress.close()
        apply({})
    return rows


def _power_point(shape, variants, modes, is_causal, seconds, counter, device, progress) -> list[dict]:
    rows = []
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for mode in modes:
        for repeat in range(2):
            for name in turns(variants, repeat):
                provider, settings = VARIANTS[name]
                progress.start(f"{shape} {mode} {name} back to back ({repeat + 1}/2)")
                apply(settings)
                row = {"variant": name, "repeat": repeat, "batch": shape[0], "seq": shape[2], "d": shape[3],
                       "mode": mode, "status": sweep.OK}
                with sweep.out_of_memory_as_status(device, row):
                    fn, fn_args = timed_call(attention_function(provider), q, k, v, is_causal, mode)
                    fn(*fn_args)  # compiled, and its buffers allocated, before the window
                    row.update(sustained(partial(fn, *fn_args), seconds, counter.energy_mj, device.machine_state,
                                         device.synchronize))
                rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="where to write every row (a new .csv file)")
    parser.add_argument("--points", nargs="+", choices=POINTS, default=list(POINTS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--modes", nargs="+", choices=["fwd", "bwd", "fwd_bwd"], default=["fwd", "bwd", "fwd_bwd"])
    parser.add_argument("--seqs", nargs="+", type=int, metavar="T",
                        help="only the points of these sequence lengths (default: every point's)")
    parser.add_argument("--head-dims", nargs="+", type=int, metavar="D",
                        help="only the points of these head dimensions (default: every point's)")
    parser.add_argument("--not-causal", action="store_true", help="time the points without the causal mask")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--clock", choices=sweep.CLOCKS, default="eager",
                        help="eager (default, the gate's eager clock): the device's time from a short device-side "
                        "sleep on, which a call the CPU issues slower than that sleep waits for; queued: the device's "
                        "time alone, behind a sleep longer than the CPU's issue time; host: the CPU's time to issue it")
    parser.add_argument("--repeats", type=int, default=4,
                        help="times each point's variants are timed, taking turns, the order reversed on odd repeats "
                        "(default 4): the table gives the median of their medians and their spread, so that a drift "
                        "of the machine and the position in a turn fall on all alike")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="then profile N calls of each variant, point and mode: device time per kernel, to "
                        "<csv>-kernels.csv (default 0: none)")
    parser.add_argument("--power", type=float, default=0, metavar="SECONDS",
                        help="then run each variant, point and mode back to back for SECONDS, twice, and read the "
                        "GPU's energy, SM clock, temperature and throttle reasons through NVML: mJ and W per call, to "
                        "<csv>-power.csv (default 0: none)")
    args = parser.parse_args(argv)
    is_causal = not args.not_causal
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.kernels < 0 or args.power < 0:
        parser.error("--repeats and --steps must be at least 1, --warmup, --kernels and --power at least 0")
    shapes = [shape for name in args.points for shape in POINTS[name]
              if (args.seqs is None or shape[2] in args.seqs)
              and (args.head_dims is None or shape[3] in args.head_dims)]
    if not shapes:
        parser.error(f"no point of {' '.join(args.points)} has --seqs {args.seqs} and --head-dims {args.head_dims}")
    kernels_csv = args.csv.with_name(args.csv.stem + "-kernels.csv")
    power_csv = args.csv.with_name(args.csv.stem + "-power.csv")
    for path in [args.csv] + [kernels_csv] * bool(args.kernels) + [power_csv] * bool(args.power):
        if path.suffix != ".csv" or path.exists():
            parser.error(f"{path}: give a new file ending in .csv")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs a Hopper GPU (compute capability 9.0): the Gluon backward runs nowhere else", file=sys.stderr)
        return 2
    device = sweep.backend()
    counter = None
    if args.power:
        counter, why = EnergyCounter.open()
        if counter is not None and device.machine_state() is None:  # the gate's reader: clock, temperature, reasons
            why = device.machine_note
        if why:
            print(f"--power: {why}", file=sys.stderr)
            return 2
    timing = SimpleNamespace(warmup=args.warmup, steps=args.steps, clock=args.clock)
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
                        rows.append({"variant": name, "repeat": repeat, "clock": args.clock, **row,
                                     **checked.get(name, {})})
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
    print("causal" if is_causal else "not causal", "bf16,", f"the {args.clock} clock")
    print(sweep.format_table(summary(frame)))
    if args.kernels:
        profiles = pd.DataFrame(kernels)
        sweep.write_outputs(profiles, [kernels_csv])
        print(sweep.format_table(profiles.groupby(["variant", "batch", "seq", "d", "mode"], sort=False).head(6)))
    if args.power:
        print(f"each variant back to back for {args.power:g} s, twice: energy per call and the clock it ran at")
        power = pd.DataFrame(power_rows(shapes, args.variants, args.modes, is_causal, args.power, counter, device))
        sweep.write_outputs(power, [power_csv])
        print(sweep.format_table(power_summary(power)))
    return 0


def turns(variants: list[str], repeat: int) -> list[str]:
    """The order in which the variants are timed in repeat `repeat`: as given on even repeats, reversed on odd ones."""
    return list(variants) if repeat % 2 == 0 else list(reversed(variants))


def power_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """A row per variant, point and mode of --power's rows: the first window's status, the mean of the measured
    windows, and their throttle reasons side by side."""
    keys = ["variant", "batch", "seq", "d", "mode"]
    numbers = ["calls", "ms_per_call", "mj_per_call", "power_w", "sm_clock_mhz", "max_temperature_c"]
    frame = frame.reindex(columns=[*keys, "status", *numbers, "held_by"])
    groups = frame.groupby(keys, sort=False)
    reasons = groups["held_by"].agg(lambda held: " / ".join(held.dropna()))
    return groups[["status"]].first().join(groups[numbers].mean()).join(reasons).reset_index()


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
