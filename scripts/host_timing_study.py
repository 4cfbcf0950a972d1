"""How a launch cost (host timing) moves between fresh processes, by clock and by CPU probe: the numbers behind
the gate's choice of what to judge for host-timed benchmarks (docs/gate.md, "Launch cost (host timing)").

    PYTHONPATH=. python scripts/host_timing_study.py OUT.csv [--processes 8] [--rounds 200] [--pin CPU]

Each of `--processes` fresh processes (with --pin, as many more pinned to that CPU by `taskset`, taking turns with
the others) times the causal attention calls of test_attention_launch_cost ((1, 1, 4096, 64) bf16 on a GPU,
(1, 1, 128, 32) fp32 on the CPU), in two blocks a few seconds apart. Every round is queued behind a device-side sleep
and read on three clocks at once: perf_counter (the gate's), the thread's CPU time, and the instructions the thread
retired in user space (a hardware counter, where perf_event_open allows it). Before each round three CPU probes run:
`adds` (ten one-element adds, the gate's probe when this study ran), `autograd` (a one-element forward and backward
through autograd, the shape of a fwd_bwd call; the gate's probe is now both) and `python` (a loop of pure Python).
The table gives, for each call and each measure, the spread between processes of the median (a measure over a
probe: the median of the per-round ratios, what compare.at_cpu_speed judges): max/min and the coefficient of
variation, and the same between the two blocks of one process. A measure whose spread between processes is small
is one the gate can judge with a small tolerance.
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CALLS = [("flash_triton", "fwd"), ("flash_triton", "fwd_bwd"), ("sdpa", "fwd"), ("sdpa", "fwd_bwd")]
PROBES = ("adds", "autograd", "python")
CLOCKS = ("wall", "thread", "instructions")


class InstructionCounter:
    """The user-space instructions this thread retires (perf_event_open, PERF_COUNT_HW_INSTRUCTIONS); `available` is
    False, with `why`, where the kernel or the container refuses it."""

    def __init__(self):
        self.fd, self.why = -1, ""
        if platform.system() != "Linux" or platform.machine() != "x86_64":
            self.why = f"no perf_event_open on {platform.system()} {platform.machine()}"
            return
        attr = (ctypes.c_uint8 * 128)()
        fields = ctypes.c_uint32 * 2
        fields.from_buffer(attr, 0)[:] = [0, 128]  # PERF_TYPE_HARDWARE, sizeof(attr)
        ctypes.c_uint64.from_buffer(attr, 8).value = 1  # PERF_COUNT_HW_INSTRUCTIONS
        ctypes.c_uint64.from_buffer(attr, 40).value = (1 << 5) | (1 << 6)  # exclude_kernel, exclude_hv
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(298, ctypes.byref(attr), 0, -1, -1, 0)  # __NR_perf_event_open: this thread, any CPU
        if fd < 0:
            self.why = f"perf_event_open: {os.strerror(ctypes.get_errno())}"
            return
        self.fd = fd
        if self.read() == 0 and self.read() == 0:
            self.why, self.fd = "the instruction counter reads 0 (no PMU in this machine)", -1

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def read(self) -> int:
        return int.from_bytes(os.read(self.fd, 8), "little") if self.fd >= 0 else 0


def _measure(args) -> dict:
    """One process's measurement: per call, per block, the rounds on every clock and the probes before them."""
    import torch

    from lmsys.attention.providers import attention_function, timed_call

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape, dtype = ((1, 1, 4096, 64), torch.bfloat16) if cuda else ((1, 1, 128, 32), torch.float32)
    counter = InstructionCounter()
    calls = {}
    for provider, mode in CALLS:
        if provider == "flash_triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
        fn, fn_args = timed_call(attention_function(provider), q, k, v, True, mode)
        calls[f"{provider}-{mode}"] = (fn, fn_args)
    x = torch.ones(1, device=device)
    out = torch.empty(1, device=device)
    leaf = torch.ones(1, device=device, requires_grad=True)

    def adds():
        for _ in range(10):
            torch.add(x, x, out=out)

    def autograd():
        torch.autograd.grad((leaf * 2).sin().sum(), (leaf,))

    def python():
        total = 0
        for i in range(2000):
            total += i & 7
        return total

    probes = {"adds": adds, "autograd": autograd, "python": python}

    def lead():
        if cuda:
            torch.cuda._sleep(4_000_000)  # a few ms: longer than any of these calls takes the CPU

    def drain():
        if cuda:
            torch.cuda.synchronize()

    for fn, fn_args in calls.values():  # compilation, autotuning, the caches
        for _ in range(5):
            fn(*fn_args)
    drain()
    result = {"counter": counter.why or "instructions", "blocks": []}
    for block in range(2):
        if block:
            time.sleep(args.gap)
        rounds = {name: {**{clock: [] for clock in CLOCKS}, **{probe: [] for probe in PROBES}} for name in calls}
        for _ in range(args.rounds):
            for name, (fn, fn_args) in calls.items():
                lead()
                for probe, run in probes.items():
                    start = time.perf_counter()
                    run()
                    rounds[name][probe].append(time.perf_counter() - start)
                wall, thread, instructions = time.perf_counter(), time.thread_time(), counter.read()
                fn(*fn_args)
                rounds[name]["instructions"].append(counter.read() - instructions)
                rounds[name]["thread"].append(time.thread_time() - thread)
                rounds[name]["wall"].append(time.perf_counter() - wall)
                drain()
        result["blocks"].append(rounds)
    return result


def _summaries(rounds: dict) -> dict:
    """name -> measure -> median: each clock's median, and the wall clock's median per-round ratio to each probe."""
    out = {}
    for name, r in rounds.items():
        measures = {clock: statistics.median(r[clock]) for clock in CLOCKS}
        for probe in PROBES:
            measures[f"wall/{probe}"] = statistics.median(w / p for w, p in zip(r["wall"], r[probe], strict=True))
        out[name] = measures
    return out


def _spread(values: list[float]) -> tuple[float, float]:
    """(max/min, coefficient of variation) of positive values; (nan, nan) when there are none."""
    values = [v for v in values if v > 0]
    if len(values) < 2:
        return float("nan"), float("nan")
    return max(values) / min(values), statistics.stdev(values) / statistics.mean(values)


def table(processes: list[dict]) -> list[dict]:
    """One row per (setting, call, measure): the spread of its median between processes (first block) and between
    the two blocks of one process (the largest max/min over processes)."""
    rows = []
    for setting in sorted({p["setting"] for p in processes}):
        group = [p for p in processes if p["setting"] == setting]
        firsts = [_summaries(p["blocks"][0]) for p in group]
        seconds = [_summaries(p["blocks"][1]) for p in group]
        for name in firsts[0]:
            for measure in firsts[0][name]:
                values = [s[name][measure] for s in firsts]
                ratio, cv = _spread(values)
                within = max(_spread([a[name][measure], b[name][measure]])[0] for a, b in zip(firsts, seconds))
                rows.append({"setting": setting, "call": name, "measure": measure, "median": statistics.median(values),
                             "max/min": ratio, "cv": cv, "within max/min": within})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="CSV file for the table (the processes' rounds go to OUT.json beside it)")
    parser.add_argument("--processes", type=int, default=8, help="fresh processes per setting (default 8)")
    parser.add_argument("--rounds", type=int, default=200, help="rounds per call and block (default 200)")
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between a process's two blocks (default 3)")
    parser.add_argument("--pin", type=int, default=None, help="also run as many processes pinned to this CPU")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        json.dump(_measure(args), sys.stdout)
        return 0
    if args.processes < 2 or args.rounds < 1:
        parser.error("--processes must be at least 2 and --rounds at least 1")
    rounds_file = os.path.splitext(args.out)[0] + ".json"
    if not args.out.endswith(".csv") or os.path.exists(args.out) or os.path.exists(rounds_file):
        parser.error(f"{args.out}: give a new file ending in .csv (nothing is overwritten, {rounds_file} neither)")
    settings = [("free", [])] + ([(f"pinned-{args.pin}", ["taskset", "-c", str(args.pin)])] if args.pin is not None
                                 else [])
    processes = []
    child = [sys.executable, __file__, args.out, "--child", "--rounds", str(args.rounds), "--gap", str(args.gap)]
    for i in range(args.processes):
        for setting, prefix in settings:
            started = time.perf_counter()
            done = subprocess.run(prefix + child, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"process {i} ({setting}) failed:\n{done.stderr[-3000:]}")
            processes.append({"setting": setting, **json.loads(done.stdout)})
            print(f"process {i + 1}/{args.processes} {setting}: {time.perf_counter() - started:.1f} s, "
                  f"{processes[-1]['counter']}", flush=True)
    import pandas as pd

    frame = pd.DataFrame(table(processes))
    frame.to_csv(args.out, index=False)
    with open(rounds_file, "w", encoding="utf-8") as fh:
        json.dump(processes, fh)
    with pd.option_context("display.width", 160, "display.max_rows", 500):
        print(frame.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
