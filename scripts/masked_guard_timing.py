"""What flash_triton's guard against masked NaN and inf (flash_triton.GUARD_MASKED: marks and a fix-up launch) costs,
on and off in one process, and a check on the GPU that it works.

The check: for each shape, on the Triton kernels alone and on the default dispatch (on Hopper the Gluon kernels take
some shapes), a NaN and then an inf planted in v[j] and then in k[j], for a j inside a diagonal tile, must leave the
output and dQ rows before j as on clean inputs with the guard on (with it off they may not: printed, not checked), and
row j, which sees it, must not be finite. Then causal bf16 attention at each shape, forward alone and forward +
backward, on both paths, timed with the guard on and off, --repeats times in turns (on first on even repeats): with
triton.testing.do_bench (eager: launches from the CPU, as a training loop without CUDA graphs makes them) and with
do_bench_cudagraph (the calls captured in a CUDA graph: the device's time alone). Prints one table: per shape, path,
mode and timer, the median over the repeats of each setting's time (ms), their range, and off -> on in percent.
With --parts the timing is per pass instead, graph-timed: flash_triton's forward and backward launches (`_fwd_impl`,
`_bwd_impl`) with the guard off and on, and each pass's fix-up launch alone on clean inputs (where it recomputes
nothing), two of each in turns.

    PYTHONPATH=. python scripts/masked_guard_timing.py                 (from the repository root)
    PYTHONPATH=. python scripts/masked_guard_timing.py --repeats 9 --shapes 1x1x4096x64
    PYTHONPATH=. python scripts/masked_guard_timing.py --repeats 0     (the check alone)
    PYTHONPATH=. python scripts/masked_guard_timing.py --parts --shapes 16x32x1024x64 4x32x512x80

Needs a CUDA device: elsewhere it says so and exits with status 2. Exits with status 1 when the check fails.
"""

import argparse
import statistics
import sys

import torch
import triton.testing

from lmsys.attention import flash_triton
from lmsys.attention.flash_triton import FlashAttentionTriton

SHAPES = ("1x1x4096x64", "16x32x1024x64", "4x16x4096x128", "4x32x512x80", "2x16x4096x96")
PATHS = ("triton", "default")
MODES = ("fwd", "fwd_bwd")
TIMERS = {
    "eager": lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"),
    "graph": lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"),
}


def _settings(guard: bool, path: str) -> None:
    # Each assignment forgets flash_triton's plans (lmsys.attention.plans.watch): the next call launches accordingly.
    flash_triton.GUARD_MASKED = guard
    flash_triton.HOPPER_FORWARD = flash_triton.HOPPER_BACKWARD = path == "default"


def _inputs(shape, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(4)]


def _attend(q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = FlashAttentionTriton.apply(q, k, v, True)
    dq, _, _ = torch.autograd.grad(o, (q, k, v), do)
    return o, dq


def check(shape, path) -> bool:
    """Whether, with the guard on, rows before a planted NaN or inf in v or k stay as on clean inputs and row j does
    not come out finite (printed, with the guard off too)."""
    q, k, v, do = _inputs(shape)
    n = shape[2]
    j = n // 2 + 37  # inside a diagonal tile of every tile size, not first in it
    ok = True
    for guard in (True, False):
        _settings(guard, path)
        clean_o, clean_dq = _attend(q, k, v, do)
        for tensor in ("v", "k"):
            for value in (float("nan"), float("inf")):
                planted = {"k": k.clone(), "v": v.clone()}
                planted[tensor][..., j, :] = value
                o, dq = _attend(q, planted["k"], planted["v"], do)
                same = all(torch.allclose(a[..., :j, :], b[..., :j, :], rtol=1e-2, atol=1e-2)
                           for a, b in ((o, clean_o), (dq, clean_dq)))
                row_j = not torch.isfinite(o[..., j, :]).all().item()
                print(f"check {'x'.join(map(str, shape))} {path} guard {'on ' if guard else 'off'} {value} in "
                      f"{tensor}[{j}]: rows before j as on clean inputs: {same}; row j not finite: {row_j}")
                if guard:
                    ok = ok and same and row_j
    return ok


def _timed(shape, mode):
    q, k, v, do = _inputs(shape)
    if mode == "fwd":
        return lambda: FlashAttentionTriton.apply(q, k, v, True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fwd_bwd():
        o = FlashAttentionTriton.apply(q, k, v, True)
        torch.autograd.grad(o, (q, k, v), do)

    return fwd_bwd


def time_parts(shape, path) -> None:
    """Prints, per pass, its launches' graph-timed medians with the guard off and on and its fix-up's alone (us)."""
    q, k, v, do = _inputs(shape)
    times = {}
    for repeat in range(2):
        for guard in (True, False) if repeat == 0 else (False, True):
            _settings(guard, path)
            o, lse = flash_triton._fwd_impl(q, k, v, True)
            flash_triton._bwd_impl(q, k, v, o, lse, do, True)  # compiles (and tunes) outside the timing
            calls = {"fwd": lambda: flash_triton._fwd_impl(q, k, v, True),
                     "bwd": lambda: flash_triton._bwd_impl(q, k, v, o, lse, do, True)}
            if guard:  # the plans of these inputs, made by the calls above
                fwd_plan = next(iter(flash_triton._FORWARD_PLANS.values()))
                bwd_plan = next(iter(flash_triton._BACKWARD_PLANS.values()))
                marks = torch.zeros(lse.shape, dtype=torch.int8, device=q.device)
                fwd_args = (q, k, v, o, lse, *fwd_plan.fixup_scalars)
                bwd_args = (q, k, v, do, torch.empty_like(q), lse, torch.empty_like(lse), marks,
                            *bwd_plan.fixup_scalars)
                calls["fwd fix-up"] = lambda: fwd_plan.fixup(fwd_args)
                calls["bwd fix-up"] = lambda: bwd_plan.fixup(bwd_args)
            for part, fn in calls.items():
                times.setdefault((part, guard), []).append(1e3 * TIMERS["graph"](fn))
    name = "x".join(map(str, shape))
    for part in ("fwd", "bwd"):
        off, on = (statistics.median(times[(part, guard)]) for guard in (False, True))
        alone = statistics.median(times[(f"{part} fix-up", True)])
        print(f"{name:<15} {path:<8} {part}: off {off:8.1f} us, on {on:8.1f} us ({100 * (on / off - 1):+5.1f}%), "
              f"fix-up alone {alone:6.1f} us", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="BxHxTxD, default: %(default)s")
    parser.add_argument("--repeats", type=int, default=5, help="timings per setting; 0: the check alone")
    parser.add_argument("--parts", action="store_true", help="time each pass's launches and fix-up instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    print(torch.cuda.get_device_name(), "| bf16, causal")
    checked = all([check(shape, path) for shape in shapes for path in PATHS])
    print("guard check:", "passed" if checked else "FAILED", flush=True)
    rows = []
    for shape in shapes if args.parts and args.repeats > 0 else ():
        for path in PATHS:
            time_parts(shape, path)
    for shape in shapes if args.repeats > 0 and not args.parts else ():
        for path in PATHS:
            for mode in MODES:
                for timer, bench in TIMERS.items():
                    times = {True: [], False: []}
                    for repeat in range(args.repeats):
                        for guard in (True, False) if repeat % 2 == 0 else (False, True):
                            _settings(guard, path)
                            fn = _timed(shape, mode)
                            fn()  # compiles (and tunes) outside the timing
                            times[guard].append(bench(fn))
                    off, on = statistics.median(times[False]), statistics.median(times[True])
                    rows.append(("x".join(map(str, shape)), path, mode, timer, off, min(times[False]),
                                 max(times[False]), on, min(times[True]), max(times[True]), 100 * (on / off - 1)))
                    print(*rows[-1], flush=True)  # progress
    if rows:
        print(f"{'shape':<15} {'path':<8} {'mode':<8} {'timer':<6} {'off ms':>9} {'(range)':>19} {'on ms':>9} "
              f"{'(range)':>19} {'on/off':>8}")
    for shape, path, mode, timer, off, off_lo, off_hi, on, on_lo, on_hi, pct in rows:
        print(f"{shape:<15} {path:<8} {mode:<8} {timer:<6} {off:9.4f} {f'{off_lo:.4f}-{off_hi:.4f}':>19} {on:9.4f} "
              f"{f'{on_lo:.4f}-{on_hi:.4f}':>19} {pct:+7.1f}%")
    _settings(True, "default")
    return 0 if checked else 1


if __name__ == "__main__":
    sys.exit(main())
