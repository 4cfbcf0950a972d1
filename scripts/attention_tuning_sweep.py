"""flash_triton's launch configs and head-dim layouts at the training grid's points, beside cuDNN and FA2, in one
process (issue 63: which configs to keep per shape).

Points: lmsys.bench.attention's training grid (`lmsys-bench attention --grid training`), bf16, filtered by --head-dims,
--seqs and --masks. At each point, in two phases (phase 1 at every point before phase 2 at any, so that a run cut short
by --budget-s still compares the variants everywhere):

1. `fwd`, `bwd` (the forward once, untimed; each timed call one backward) and `fwd_bwd` of SDPA's cuDNN and flash
   backends and of flash_triton as it ships (`default`: the autotuner's choice among its configs, this GPU's pinned
   configs off (lmsys.attention.tuned), the Gluon kernels where they take the inputs) and, at head dims 65 to 96, split
   along the head dim (`split`: flash_triton.SPLIT_HEAD_DIMS, 64 columns + 16 or 32), the autotuner choosing again; the
   configs the autotuner chose are in the `config` column.
2. Each candidate config forced alone, the Gluon forward off (flash_triton.HOPPER_FORWARD): at head dims 65 to 96
   (where the Triton kernels run) the forward's (FWD_CANDIDATES) timed `fwd` and the backward's (all of
   flash_triton's) timed `bwd`, padded and split; at d=64 the forward's (FWD_64_CANDIDATES: the Gluon forward takes
   only 16384 keys of the grid there). The Gluon backward takes d=64 and 128 at every point of the grid.

Every flash_triton row is checked against SDPA's flash backend on the same inputs (`err`: the largest difference of
o, or of dq, dk, dv, relative to the reference's largest magnitude; `ok`: err below TOLERANCE). Times are
triton.testing.do_bench's medians in ms (as in the issue's table). Rows go to the CSV named on the command line as
they are measured; at the end a table per point: each variant's time and its ratio to cuDNN, and the fastest forced
config of each kind and layout.

    PYTHONPATH=. python scripts/attention_tuning_sweep.py $OUT/tuning.csv                  (from the repository root)
    PYTHONPATH=. python scripts/attention_tuning_sweep.py $OUT/t.csv --masks full --seqs 1024 4096
    PYTHONPATH=. python scripts/attention_tuning_sweep.py $OUT/t.csv --head-dims 80 96 --phases 2

Needs a CUDA GPU: elsewhere it says so and exits with status 2.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import triton

from lmsys.attention import flash_triton, launcher, plans, tuned
from lmsys.attention.providers import attention_function, timed_call
from lmsys.bench.attention import TRAINING_HEADS, TRAINING_SEQS, training_grid

REFERENCES = ("sdpa_cudnn", "sdpa_flash")
MODES = ("fwd", "bwd", "fwd_bwd")
SPLITTABLE = range(65, 97)
# The forward's candidates at head dims 65 to 96: its table for 128-wide tiles (the padded width) and the two fastest of
# its table for 64 (the split's first chunk), fp32's 64 x 32 left out (this sweep is bf16).
FWD_CANDIDATES = list(dict.fromkeys(
    [c for c in flash_triton._FWD_CONFIGS[128] if c.kwargs["BLOCK_N"] > 32] + flash_triton._FWD_CONFIGS[64][:2]
))
# At head dim 64, where the Triton forward runs below 16384 keys at these sizes: its table, fp32's tile left out.
FWD_64_CANDIDATES = [c for c in flash_triton._FWD_CONFIGS[64] if c.kwargs["BLOCK_N"] > 32]
# Largest difference from SDPA's flash backend, relative to its largest magnitude, for a bf16 row to count as right.
TOLERANCE = 3e-2
DEVICE, DTYPE = "cuda", torch.bfloat16
COLUMNS = ["batch", "heads", "seq", "d", "causal", "phase", "variant", "mode", "config", "ms", "ratio_cudnn", "err",
           "ok"]


def config_name(config) -> str:
    """A config in a few characters: tiles, warps, stages (and TMA, maxnreg where set)."""
    kw = config.kwargs
    tiles = ("x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N")) if "BLOCK_M" in kw
             else "/".join(str(kw[k]) for k in ("BLOCK_BIG", "BLOCK_M1", "BLOCK_N2")))
    extra = ("-tma" if kw.get("USE_TMA") else "") + (f"-r{config.maxnreg}" if config.maxnreg else "")
    return f"{tiles}-w{config.num_warps}-s{config.num_stages}{extra}"


def chosen(kernel) -> str:
    """The config the autotuner ran last (its choice), or '' when it has none."""
    best = getattr(kernel, "best_config", None)
    return config_name(best) if best is not None else ""


class Settings:
    """flash_triton set for one variant: SPLIT_HEAD_DIMS, and each kernel's configs (one forced, or all: the
    autotuner's choice); every launch and plan kept before forgotten, so the next call launches what is set."""

    def __init__(self):
        self.configs = {k: k.configs for k in (flash_triton._flash_fwd_kernel, flash_triton._flash_bwd_kernel)}

    def apply(self, split_dims=frozenset(), forced=None):
        flash_triton.SPLIT_HEAD_DIMS = frozenset(split_dims)  # a watched module: its plans are forgotten
        for kernel, configs in self.configs.items():
            # A forward config has BLOCK_M, a backward one BLOCK_BIG: each forces its own kernel.
            mine = forced is not None and ("BLOCK_M" in forced.kwargs) == (kernel is flash_triton._flash_fwd_kernel)
            kernel.configs = [forced] if mine else configs
            kernel.cache = {}
            kernel.best_config = None  # a choice of an earlier variant is not this one's (the Gluon kernels make none)
        launcher._launches.clear()
        plans.forget()


def relative_error(actual, expected) -> float:
    """The largest |actual - expected| over the largest |expected| (at least 1), in float32."""
    diff = max((a.float() - e.float()).abs().max().item() for a, e in zip(actual, expected, strict=True))
    scale = max(max(e.float().abs().max().item() for e in expected), 1.0)
    return diff / scale


def outputs(attend, q, k, v, do, causal, mode):
    """What `mode` checks: the output (fwd) or the gradients of q, k, v (bwd, fwd_bwd), on fresh leaves."""
    q, k, v = (x.detach().clone().requires_grad_(mode != "fwd") for x in (q, k, v))
    if mode == "fwd":
        with torch.no_grad():
            return (attend(q, k, v, causal),)
    return torch.autograd.grad(attend(q, k, v, causal), (q, k, v), do)


def measure(attend, q, k, v, do, causal, mode) -> float:
    fn, args = timed_call(attend, *(x.detach().clone() for x in (q, k, v)), causal, mode, do=do)
    fn(*args)
    return triton.testing.do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median")


def run_row(point, phase, variant, mode, attend, inputs, reference, config=None, kernel=None) -> dict:
    """One measurement (and, for flash_triton, its check against the reference): a CSV row."""
    (batch, heads, seq, d), causal = point
    q, k, v, do = inputs
    row = {"batch": batch, "heads": heads, "seq": seq, "d": d, "causal": causal, "phase": phase, "variant": variant,
           "mode": mode, "config": config or ""}
    try:
        if reference is not None:
            err = relative_error(outputs(attend, q, k, v, do, causal, mode), reference[mode])
            row.update(err=err, ok=err < TOLERANCE)
        row["ms"] = measure(attend, q, k, v, do, causal, mode)
        if kernel is not None and not config:
            row["config"] = chosen(kernel)
    except Exception as exc:  # a config that does not compile or fit (shared memory), SDPA refusing: a row saying so
        row.update(config=f"{row['config']} failed: {' '.join(str(exc).split())[:120]}", ok=False)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="the rows, written as they are measured (a new .csv file)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=sorted(TRAINING_HEADS),
                        choices=sorted(TRAINING_HEADS), help="default: 64 80 96 128")
    parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 4096, 16384], choices=TRAINING_SEQS,
                        help="default: 1024 4096 16384")
    parser.add_argument("--masks", nargs="+", choices=["causal", "full"], default=["causal"], help="default: causal")
    parser.add_argument("--phases", nargs="+", type=int, choices=[1, 2], default=[1, 2], help="default: 1 2")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no measurement after this many seconds (default: 420); the rows so far are kept")
    args = parser.parse_args(argv)
    if args.csv.suffix != ".csv" or args.csv.exists():
        parser.error(f"give a new file ending in .csv, got {args.csv}")
    masks = {"causal": True, "full": False}
    wanted = [(shape, causal) for shape, causal in training_grid()
              if shape[3] in args.head_dims and shape[2] in args.seqs and causal in {masks[m] for m in args.masks}]
    if not wanted:
        parser.error("no point of the training grid has these --head-dims, --seqs and --masks")
    # The autotuner's own choices, not this GPU's pinned ones (lmsys.attention.tuned).
    os.environ[tuned.ENV] = "0"
    if not torch.cuda.is_available():
        print("attention_tuning_sweep needs a CUDA GPU (it times kernels)", file=sys.stderr)
        return 2
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    settings = Settings()
    ours = attention_function("flash_triton")
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: "
          f"{len(wanted)} points, phases {args.phases}", flush=True)

    def keep(row):
        rows.append(row)
        pd.DataFrame(rows).reindex(columns=COLUMNS).to_csv(args.csv, index=False)
        print(f"  {row['variant']:>10} {row['mode']:>7} {row.get('ms', float('nan')):8.4f} ms "
              f"err {row.get('err', float('nan')):.1e} {row['config']}", flush=True)

    def over_budget() -> bool:
        return time.monotonic() - start > args.budget_s

    data = {}
    for phase in args.phases:
        for point in wanted:
            (batch, heads, seq, d), causal = point
            print(f"phase {phase}: ({batch}, {heads}, {seq}, {d}) {'causal' if causal else 'full'}", flush=True)
            if point not in data:
                gen = torch.Generator(device=DEVICE).manual_seed(seq * 1000 + d)
                inputs = tuple(torch.randn((batch, heads, seq, d), device=DEVICE, dtype=DTYPE, generator=gen)
                               for _ in range(4))
                flash = attention_function("sdpa_flash")
                data[point] = (inputs, {m: [x.detach() for x in outputs(flash, *inputs[:3], inputs[3], causal, m)]
                                        for m in ("fwd", "bwd")})
            inputs, ref = data[point]
            reference = {**ref, "fwd_bwd": ref["bwd"]}
            if phase == 1:
                for mode in MODES:
                    for name in REFERENCES:
                        if over_budget():
                            break
                        keep(run_row(point, 1, name, mode, attention_function(name), inputs, None))
                    layouts = [("default", ())] + ([("split", (d,))] if d in SPLITTABLE else [])
                    for variant, split in layouts:
                        if over_budget():
                            break
                        settings.apply(split)
                        kernel = flash_triton._flash_fwd_kernel if mode == "fwd" else flash_triton._flash_bwd_kernel
                        keep(run_row(point, 1, variant, mode, ours, inputs, reference, kernel=kernel))
            else:
                hopper_forward, flash_triton.HOPPER_FORWARD = flash_triton.HOPPER_FORWARD, False
                for layout, split, mode, candidates in phase_two(d, settings):
                    for config in candidates:
                        if over_budget():
                            break
                        settings.apply(split, forced=config)
                        keep(run_row(point, 2, layout, mode, ours, inputs, reference, config=config_name(config)))
                flash_triton.HOPPER_FORWARD = hopper_forward
            settings.apply()
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS)
    frame = with_ratios(frame)
    frame.to_csv(args.csv, index=False)
    print(summary(frame).to_string(), flush=True)
    if over_budget():
        print(f"stopped at the budget ({args.budget_s:.0f} s): rows of later measurements are missing", flush=True)
    return 0


def phase_two(d: int, settings: Settings) -> list[tuple]:
    """(layout, split head dims, mode, configs) that phase 2 forces at head dim d."""
    if d in SPLITTABLE:
        backward = settings.configs[flash_triton._flash_bwd_kernel]
        return [(layout, split, mode, configs) for layout, split in (("padded", ()), ("split", (d,)))
                for mode, configs in (("fwd", FWD_CANDIDATES), ("bwd", backward))]
    return [("padded", (), "fwd", FWD_64_CANDIDATES)] if d == 64 else []


def with_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Each row's time over cuDNN's at the same point and mode (the column `ratio_cudnn`)."""
    keys = ["batch", "heads", "seq", "d", "causal", "mode"]
    cudnn = frame[frame["variant"] == "sdpa_cudnn"].set_index(keys)["ms"]
    index = pd.MultiIndex.from_frame(frame[keys])
    frame = frame.copy()
    frame["ratio_cudnn"] = frame["ms"].to_numpy() / cudnn.reindex(index).to_numpy()
    return frame


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per point and mode: each phase-1 variant's ms (and ratio to cuDNN), and per layout the fastest forced config of
    phase 2 that matched the reference."""
    keys = ["seq", "d", "causal", "mode"]
    one = frame[frame["phase"] == 1]
    table = one.pivot_table(index=keys, columns="variant", values="ms", aggfunc="min")
    for variant in ("default", "split"):
        if variant in table and "sdpa_cudnn" in table:
            table[f"{variant}/cudnn"] = table[variant] / table["sdpa_cudnn"]
    two = frame[(frame["phase"] == 2) & (frame["ok"] == True)]  # noqa: E712 (a column of objects: NaN where unchecked)
    if not two.empty:
        best = two.loc[two.groupby(keys + ["variant"])["ms"].idxmin()]
        for layout, rows in best.groupby("variant"):
            rows = rows.set_index(keys)
            table[f"best {layout}"] = rows["config"]
            table[f"best {layout} ms"] = rows["ms"]
    return table.round(4)


if __name__ == "__main__":
    sys.exit(main())
