"""Does an injected delay read as its size on a GPU at its power cap? The numbers behind the gate's choice of delay
(docs/gate-measurements.md): the sleeping kernel (torch.cuda._sleep) against tensor-core work (lmsys/perf/spin.py).

    PYTHONPATH=. python scripts/injection_study.py OUT.csv [--fraction 0.05] [--reps 3] [--block-seconds 1.5]

For each call (the leaderboard's forward + backward, (16, 16384, 64) bf16 causal, by SDPA's cuDNN backend and by
flash_triton; a 2 GiB copy that stays below the power cap), blocks of rounds are timed in turn, `--reps` times over:
the call alone, then followed by a delay of `--fraction` of its time (the median of the first block alone): `sleep`
(CudaBackend.make_delay, a kernel spinning on the clock) and `work` (lmsys.perf.injection.make_work, tensor-core
multiplies: what the injection adds). Each round is timed as the gate times
one, behind a short sleep, with events before the call, after it and after the delay, so the table shows where the
time went: the call's own median, the delay's, and the whole round's change against the call alone in the same
repetition. NVML's power, SM clock and throttle reasons are sampled every 10 ms during each block.
"""

import argparse
import csv
import statistics
import sys
import threading
import time

import torch

from lmsys.attention.providers import attention_function, timed_call
from lmsys.perf.backend import SLEEP_CYCLES, CudaBackend
from lmsys.perf.injection import make_work


class Sampler:
    """NVML readings (backend.machine_state) every `period` seconds in a thread, between start() and stop()."""

    def __init__(self, backend, period=0.01):
        self.backend, self.period, self.samples = backend, period, []
        self._stop, self._thread = threading.Event(), None

    def start(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.backend.machine_state())
            time.sleep(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        power = [s["power_w"] for s in self.samples if s["power_w"] is not None]
        clock = [s["sm_clock_mhz"] for s in self.samples if s["sm_clock_mhz"] is not None]
        capped = [bool(s["throttle"]) and "sw_power_cap" in s["throttle"] for s in self.samples]
        return {"power_w": statistics.mean(power) if power else None,
                "sm_clock_mhz": statistics.mean(clock) if clock else None,
                "power_capped": sum(capped) / len(capped) if capped else None}


def time_block(call, delay, seconds):
    """Rounds of lead sleep, e0, call, e1, delay, e2 until `seconds` pass; (call, delay, round) medians in s."""
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    calls, delays, rounds = [], [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(rounds) < 5:
        torch.cuda._sleep(SLEEP_CYCLES)
        e0.record()
        call()
        e1.record()
        if delay is not None:
            delay()
        e2.record()
        e2.synchronize()
        calls.append(e0.elapsed_time(e1) / 1e3)
        delays.append(e1.elapsed_time(e2) / 1e3)
        rounds.append(e0.elapsed_time(e2) / 1e3)
    return statistics.median(calls), statistics.median(delays), statistics.median(rounds), len(rounds)


def calls():
    q, k, v = (torch.randn(16, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for provider in ("sdpa_cudnn", "flash_triton"):
        fn, args = timed_call(attention_function(provider), q.clone(), k.clone(), v.clone(), True, "fwd_bwd")
        yield f"leaderboard-{provider}", (lambda fn=fn, args=args: fn(*args))
    src = torch.empty(2**30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    yield "copy-2GiB", lambda: dst.copy_(src)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write, one row per block")
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-seconds", type=float, default=1.5)
    args = parser.parse_args()
    backend = CudaBackend()
    print(f"{backend.name}; NVML: {backend.machine_note or 'yes'}", flush=True)
    sampler = None if backend.machine_state() is None else Sampler(backend)
    rows = []
    for name, call in calls():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        base = time_block(call, None, args.block_seconds)[2]
        target = args.fraction * base
        variants = {"none": None, "sleep": backend.make_delay(target), "work": make_work(backend, target)}
        print(f"{name}: call {base * 1e3:.3f} ms, delay {target * 1e6:.1f} us", flush=True)
        for rep in range(args.reps):
            for variant, delay in variants.items():  # "none" first: the repetition's reference
                if sampler:
                    sampler.start()
                call_s, delay_s, round_s, n = time_block(call, delay, args.block_seconds)
                state = sampler.stop() if sampler else {}
                if delay is None:
                    alone_call, alone_round = call_s, round_s
                rows.append({"call": name, "rep": rep, "variant": variant, "rounds": n, "intended_us": target * 1e6,
                             "call_ms": call_s * 1e3, "delay_us": delay_s * 1e6, "round_ms": round_s * 1e3,
                             "change_pct": 100 * (round_s / alone_round - 1),
                             "call_change_pct": 100 * (call_s / alone_call - 1), **state})
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{'call':24} {'rep':>3} {'variant':10} {'call ms':>8} {'delay us':>9} {'round ms':>9} {'change':>8} "
          f"{'call chg':>8} {'W':>6} {'MHz':>6} {'capped':>6}")
    for r in rows:
        w = "-" if r.get("power_w") is None else f"{r['power_w']:.0f}"
        mhz = "-" if r.get("sm_clock_mhz") is None else f"{r['sm_clock_mhz']:.0f}"
        capped = "-" if r.get("power_capped") is None else f"{r['power_capped']:.0%}"
        print(f"{r['call']:24} {r['rep']:>3} {r['variant']:10} {r['call_ms']:8.3f} {r['delay_us']:9.1f} "
              f"{r['round_ms']:9.3f} {r['change_pct']:+7.2f}% {r['call_change_pct']:+7.2f}% {w:>6} {mhz:>6} "
              f"{capped:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
