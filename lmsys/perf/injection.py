"""Regressions of known size injected into every benchmarked call, to measure the gate: a pytest plugin that
`python -m lmsys.perf.detection` loads into the runs it spawns (`-p lmsys.perf.injection`). A run without it never
imports this module or reads these variables.

    LMSYS_INJECT_DELAY=f     every benchmarked call is followed by device-side work (make_work) of f times its
                             own time, measured as the benchmark is judged: the call, the replays of a trial capture
                             (graph=True), queued rounds when it cannot be captured; with host=True a CPU spin of f
                             times its host time. On several ranks every rank gets the same work: f times the slowest
                             rank's round.
    LMSYS_INJECT_MEMORY=B    B more bytes held on the device during every benchmarked call (holding).
    LMSYS_INJECT_CASES=...   "DELAY[:BYTES],...", e.g. "0.03:1048576,0.05": after its own measurement and verdict,
                             each benchmark with a baseline is measured once more per case and judged against the same
                             baseline; the verdicts go into its extra_info (INJECTED_CASES_KEY) and the summary,
                             and fail nothing. One process then measures the A/A case and every injected one.
                             A benchmark's delays are sized once (Sizing: the median of its own measurement, and
                             each delay's work length measured where it runs), and shared by its cases and their
                             re-measurements; a case whose pass added a share off its delay is resized once and
                             measured again (Sizing.resize). A case's passes leave out what its verdict does not
                             read: the LAUNCH rounds, unless the test gates its host-set time; and a graph=True
                             call's eager warmup rounds, its replays warmed by their own; every round of a case of
                             memory alone (its verdict is the memory's: one call under the memory reading).
    LMSYS_INJECT_DELAYS_FROM=s  with LMSYS_INJECT_CASES: the delays only into benchmarks whose baseline's median is
                             at least s seconds; the others are measured again with each size of memory the cases
                             hold, without a delay (the memory is still judged on every benchmark).

The gate reaches this module through two seams: PerfSession.injection (an Injection, handed to timing.run and to
every rank in multirank.Settings) and the pytest_perf_measured hook, called after each benchmark is recorded. The work,
the CPU spin and the memory held are made here, for the CUDA and CPU backends; a backend that another plugin or a test
supplies (the pytest_perf_backend hook) and that is measured so brings its own make_work, make_host_delay and holding.
"""

import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache, partial
from statistics import median
from typing import Any

import pytest
import torch

from lmsys.perf import timing
from lmsys.perf.backend import CudaBackend
from lmsys.perf.session import RECORD_KEY, SESSION_KEY
from lmsys.perf.verdict import format_bytes

INJECT_DELAY = "LMSYS_INJECT_DELAY"
INJECT_MEMORY = "LMSYS_INJECT_MEMORY"
INJECT_CASES = "LMSYS_INJECT_CASES"
INJECT_DELAYS_FROM = "LMSYS_INJECT_DELAYS_FROM"
INJECTED_CASES_KEY = "injected_cases"
INJECTED_SIZING_KEY = "injected_sizing"
_CASES_KEY = pytest.StashKey[list]()
_FROM_KEY = pytest.StashKey[float]()
# Sizing a benchmark's delays where they run (Injection._lengths): blocks of rounds, each SIZING_SETTLE seconds untimed
# (a power-capped GPU's clocks settle to what the block runs) and then SIZING_BLOCK seconds timed, at least
# SIZING_MIN_ROUNDS and at most SIZING_MAX_ROUNDS rounds each; a work's length stays within SIZING_LIMIT times its
# nominal length either way.
SIZING_SETTLE = 0.05
SIZING_BLOCK = 0.15
SIZING_MIN_ROUNDS = 7
SIZING_MAX_ROUNDS = 200
SIZING_LIMIT = 2.0


def block_rounds(typical: float) -> tuple[int, int]:
    """(untimed, timed) rounds of a sizing block for a call whose rounds take `typical` seconds."""
    return tuple(min(max(math.ceil(seconds / typical), SIZING_MIN_ROUNDS), SIZING_MAX_ROUNDS)
                 for seconds in (SIZING_SETTLE, SIZING_BLOCK))


# An in-process case whose delay added a share further than this part of the delay from it (its pass's median against
# the benchmark's own) has its work resized once and is measured again (Sizing.resize).
RESIZE_SHARE = 0.08
# make_work: below this a wait, since a launch of the tensor-core kernel alone takes a few microseconds;
# WORK_PROBE_ITERATIONS (about 0.3 ms on the H100) give the first estimate of a count.
MIN_WORK_SECONDS = 20e-6
WORK_PROBE_ITERATIONS = 256


def make_work(backend, seconds: float) -> Callable[[], None]:
    """A function that queues about `seconds` of work on the backend's device: on a CUDA GPU tensor-core multiplies
    on the current stream (spin.MmaSpin), on the CPU its spin (make_delay). Unlike CudaBackend.make_delay's wait the
    multiplies draw power as a slower kernel would: after a wait, a GPU at its power cap runs the next kernels faster
    and gives back part of the delay (docs/gate-measurements.md, "Why the injection changed", has the H100's numbers).
    The iterations are timed alone, from an idle device; a delay shorter than MIN_WORK_SECONDS, below the kernel's own
    start-up, is a wait."""
    if hasattr(backend, "make_work"):
        return backend.make_work(seconds)
    if not isinstance(backend, CudaBackend) or seconds < MIN_WORK_SECONDS:
        return backend.make_delay(seconds)
    work = _mma_spin(backend.index)
    iterations = max(1, round(seconds / (_time_work(backend, work, WORK_PROBE_ITERATIONS) / WORK_PROBE_ITERATIONS)))
    for _ in range(2):  # the probe's time holds the launch: rescale by the time of the count itself
        iterations = max(1, round(iterations * seconds / _time_work(backend, work, iterations)))
    return partial(work, iterations)


@cache
def _mma_spin(index: int):
    from lmsys.perf.spin import MmaSpin  # Triton is imported where work is injected on a GPU

    return MmaSpin(index)


def _time_work(backend, work: Callable[[int], None], iterations: int) -> float:
    """The median of three timings of work(iterations), each behind a wait (time_call)."""
    return sorted(backend.time_call(partial(work, iterations)) for _ in range(3))[1]


def make_host_delay(backend, seconds: float) -> Callable[[], None]:
    """A function that keeps the CPU busy for `seconds` (host timing's injected delay)."""
    if hasattr(backend, "make_host_delay"):
        return backend.make_host_delay(seconds)
    return partial(timing.spin, seconds)


@contextmanager
def holding(backend, nbytes: int):
    """Holds `nbytes` more of device memory inside the block, an allocation that lives as long as it (nothing on the
    CPU, which has no memory reading)."""
    if hasattr(backend, "holding"):
        with backend.holding(nbytes):
            yield
        return
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=backend.index) if isinstance(backend, CudaBackend) else None
    try:
        yield
    finally:
        del buffer


@dataclass
class Sizing:
    """What one benchmark's injected delays are sized by, measured once in its process and shared by its cases and
    their re-measurements: `delays`, every delay its cases inject; `typical`, the median of the rounds the benchmark
    judges (its own measurement's with LMSYS_INJECT_CASES, else three rounds); `lengths`, each delay's work in
    seconds, measured where it runs (Injection._lengths); `points`, what that measurement read: (nominal share of the
    work, share it added to the round); `resized`, the delays resized after a case's pass (resize). `works` keeps
    each delay's work, so that a re-measurement adds the same work. Picklable without `works`: a multi-rank
    benchmark's Injection travels to its ranks, which size nothing here (Injection.delayed_ranks)."""

    delays: tuple[float, ...]
    typical: float | None = None
    lengths: dict | None = None
    points: list = field(default_factory=list)
    resized: set = field(default_factory=set)
    works: dict = field(default_factory=dict)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "works": {}}

    def within_limit(self, delay: float, length: float) -> float:
        """`length` (seconds of work for `delay`) held within SIZING_LIMIT times the delay's nominal length."""
        nominal = delay * self.typical
        return min(max(length, nominal / SIZING_LIMIT), nominal * SIZING_LIMIT)

    def resize(self, delay: float, added: float | None) -> bool:
        """After a case of `delay` added `added` to the benchmark's median over the gate's whole pass (its rounds
        follow each other for about a second, as the sizing's blocks do not: a GPU's clocks can follow a slower part
        of what runs): when that is further from the delay than RESIZE_SHARE of it, shifts the works of this delay
        and of every delay not resized yet by the shortfall, within SIZING_LIMIT of their nominal lengths, once per
        delay; returns whether it did (and the case is to be measured again). The shift is the shortfall itself, a
        point of work per point short: over a whole pass a work adds about its own length more for each length more
        (on the H200's compiled leaderboards 0.84-1.01 of it), where the sizing's short blocks can read much less
        (0.6-0.75 there), and a shift through their line overshoots by as much (docs/gate-measurements.md)."""
        if (self.lengths is None or delay in self.resized or added is None or not math.isfinite(added)
                or abs(added - delay) <= RESIZE_SHARE * delay):
            return False
        shift = (delay - added) * self.typical
        for other in self.lengths:
            if other == delay or other not in self.resized:
                self.lengths[other] = self.within_limit(other, self.lengths[other] + shift)
                self.works.pop(other, None)
        self.resized.add(delay)
        return True


@dataclass(frozen=True)
class Injection:
    """A delay (a fraction of each call's time) and a number of bytes held during each call, with the benchmark's
    Sizing when its cases share one, and what its measurement leaves out (no part of what is injected, read by
    timing.run): `launch_rounds` False, the LAUNCH rounds beside graph replays or queued rounds, which an in-process
    case whose host-set time is not gated does not read; `warm` True, the eager warmup rounds of a graph=True call
    whose capture succeeds: an in-process case runs after the benchmark's own measurement in the same process (its
    compilation and autotuning done, the GPU busy with the same call), and the replays keep their own warmup right
    before them; `timed` False, every round of a case that only holds memory, whose verdict is then the memory's
    (timing.MEMORY: one call under the memory reading). Picklable: multi-rank benchmarks hand it to every rank, which
    measure every case in full."""

    delay: float = 0.0
    memory: int = 0
    sizing: Sizing | None = field(default=None, compare=False, repr=False)
    launch_rounds: bool = field(default=True, compare=False)
    warm: bool = field(default=False, compare=False)
    timed: bool = field(default=True, compare=False)

    @property
    def label(self) -> str:
        """'+3.0%', '1 MiB held' or '+3.0% and 1 MiB held'."""
        return " and ".join([f"+{self.delay:.1%}"] * bool(self.delay) + [f"{format_bytes(self.memory)} held"]
                            * bool(self.memory))

    def held(self, backend, call: Callable[[], Any]) -> Callable[[], Any]:
        """call with the bytes held on the device while it runs."""
        if not self.memory:
            return call

        def with_bytes_held():
            with holding(backend, self.memory):
                return call()

        return with_bytes_held

    def delayed(self, backend, call: Callable[[], Any], flush, graph: bool, host: bool) -> Callable[[], Any]:
        """call followed by the delay: device-side work that adds the fraction `delay` to the typical time of what the
        benchmark judges (the call; with graph=True the replays of a trial capture, or queued rounds when it cannot be
        captured: a launch-bound call's eager time is mostly CPU), its length measured where it runs (_lengths), or
        with host=True a CPU spin of the fraction of its host time. The typical time, the lengths and the work come
        from the benchmark's Sizing where it has them already, and are measured into it where not."""
        if not self.delay:
            return call
        sizing = self.sizing if self.sizing is not None else Sizing((self.delay,))
        if self.delay not in sizing.works:
            if host:
                if sizing.typical is None:
                    lead = timing.queue_lead(backend, call, flush)
                    sizing.typical = median(timing.time_rounds(backend, call, 3, flush, lead, host=True))
                sizing.works[self.delay] = make_host_delay(backend, self.delay * sizing.typical)
            else:
                if sizing.lengths is None or self.delay not in sizing.lengths:
                    sizing.delays = tuple(sorted({*sizing.delays, self.delay}))
                    self._lengths(backend, call, flush, graph, sizing)
                sizing.works[self.delay] = make_work(backend, sizing.lengths[self.delay])
        return _followed_by(call, sizing.works[self.delay])

    @staticmethod
    def _lengths(backend, call, flush, graph: bool, sizing: Sizing) -> None:
        """Measures the length of each delay's work where it runs into sizing.lengths (and sizing.typical, when it is
        not known: the median of three rounds of the call as the benchmark judges it).

        The work's iterations are timed alone on an idle device, but behind a kernel at the power cap it adds more or
        less than its length (less where the clocks rise while it runs and the call after it runs faster), and by a
        share that is not proportional to its length (docs/gate-measurements.md, "Sizing the delays"). So the call
        alone and the call followed by work of two nominal lengths (the smallest and the largest delay's; with one
        delay, half of it and it) are timed in turns as the benchmark is (graph replays; queued rounds when a
        graph=True call cannot be captured on a GPU), twice, each block SIZING_SETTLE seconds untimed and then
        SIZING_BLOCK seconds timed, so that the clocks settle to what the block runs. The shares the two added give a
        line; each delay gets the length that the line says adds its share (the largest point's proportion where
        the line does not rise), within SIZING_LIMIT times its nominal length either way."""
        lead, releases = None, []
        alone = call
        if graph:
            try:
                alone, release = backend.capture_graph(call)
                releases.append(release)
            except Exception:  # timing.run notes the failed capture when it captures for real
                if backend.is_gpu:
                    lead = timing.queue_lead(backend, call, flush)
                graph = False
        try:
            if sizing.typical is None:
                sizing.typical = median(timing.time_rounds(backend, alone, 3, flush, lead))
            low, high = min(sizing.delays), max(sizing.delays)
            shares = (low if low < high else high / 2, high)
            delayed = [_followed_by(call, make_work(backend, share * sizing.typical)) for share in shares]
            timed = [alone, *delayed]
            if graph:
                try:
                    for index, function in enumerate(delayed, start=1):
                        timed[index], release = backend.capture_graph(function)
                        releases.append(release)
                except Exception:  # the work cannot be captured: every block timed as the call is when not captured
                    timed = [call, *delayed]
            settle, rounds = block_rounds(sizing.typical)
            samples = [[] for _ in timed]
            for _ in range(2):
                for function, kept in zip(timed, samples):
                    timing.time_rounds(backend, function, settle, flush, lead)
                    kept.extend(timing.time_rounds(backend, function, rounds, flush, lead))
        finally:
            for release in releases:
                release()
        alone_median = median(samples[0])
        added = [median(kept) / alone_median - 1 for kept in samples[1:]]
        sizing.points = list(zip(shares, added))
        slope = (added[1] - added[0]) / (shares[1] - shares[0])
        lengths = {}
        for delay in sizing.delays:
            if slope > 0:
                share = shares[1] + (delay - added[1]) / slope
            else:
                share = delay * shares[1] / added[1] if added[1] > 0 else delay
            if not math.isfinite(share):
                share = delay
            lengths[delay] = sizing.within_limit(delay, share * sizing.typical)
        sizing.lengths = lengths

    def delayed_ranks(self, ctx, timed: Callable[[], Any], step: Callable[[], Any], timer):
        """(timed, step) of a multi-rank benchmark followed by the same device-side work on every rank: the fraction
        of the median of three rounds of the slowest rank, timed by `timer` as the judged rounds are, so that the
        judged round, the slowest rank's, grows by that fraction."""
        if not self.delay:
            return timed, step
        from lmsys.perf import multirank

        samples, _, _ = multirank._time_rounds(ctx, timed, 3, timer)
        work = make_work(ctx.backend, self.delay * median(multirank._slowest(multirank._gather(samples))))
        return _followed_by(timed, work), _followed_by(step, work)


def _followed_by(call: Callable[[], Any], after: Callable[[], None]) -> Callable[[], Any]:
    def delayed():
        result = call()
        after()
        return result

    return delayed


def _fraction(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 10):
        raise ValueError(f"{name}={text}: must be a fraction of a call's time between 0 and 10")
    return value


def _bytes(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a non-negative whole number of bytes")
    return int(text)


def _cases(text: str) -> list[Injection]:
    cases = []
    for case in text.split(",") if text.strip() else ():
        delay, _, held = case.strip().partition(":")
        try:
            injection = Injection(_fraction(INJECT_CASES, delay), _bytes(held) if held else 0)
        except ValueError:
            injection = Injection()
        if not injection.label:
            raise pytest.UsageError(
                f"{INJECT_CASES}={text}: each case is DELAY[:BYTES], a fraction of a call's time between 0 and 10 and "
                "the bytes held during every call, not both zero (e.g. 0.03:1048576,0.05:1048576)"
            )
        cases.append(injection)
    return cases


def _memory_only(cases: list[Injection]) -> list[Injection]:
    """The cases of a benchmark whose delays are left out (LMSYS_INJECT_DELAYS_FROM): each size of memory the cases
    hold, once, without a delay."""
    return [Injection(0.0, memory) for memory in dict.fromkeys(case.memory for case in cases if case.memory)]


def _delays_from(cases: list[Injection]) -> float:
    """LMSYS_INJECT_DELAYS_FROM in seconds (0 when unset); a value that is not a finite number of seconds, or one
    without LMSYS_INJECT_CASES, is a usage error."""
    text = os.environ.get(INJECT_DELAYS_FROM, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise pytest.UsageError(f"{INJECT_DELAYS_FROM}={text}: must be a non-negative number of seconds (a baseline's "
                                "median)")
    if not cases:
        raise pytest.UsageError(f"{INJECT_DELAYS_FROM} chooses which benchmarks get the delays of {INJECT_CASES}: "
                                f"set {INJECT_CASES} too")
    return value


def pytest_configure(config):
    """Reads the variables (a bad value is a usage error) into the gate's session, once the plugin has made it."""
    perf = config.stash.get(SESSION_KEY, None)
    if perf is None:
        return
    try:
        delay = _fraction(INJECT_DELAY, os.environ.get(INJECT_DELAY, "0"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    text = os.environ.get(INJECT_MEMORY, "0")
    try:
        memory = _bytes(text)
    except ValueError as exc:
        raise pytest.UsageError(f"{INJECT_MEMORY}={text}: {exc} (a number of bytes held during every call)") from None
    cases = _cases(os.environ.get(INJECT_CASES, ""))
    if cases and (delay or memory):
        raise pytest.UsageError(f"{INJECT_CASES} measures each call unchanged first: leave out {INJECT_DELAY} and "
                                f"{INJECT_MEMORY}")
    if delay or memory:
        perf.injection = Injection(delay, memory)
    config.stash[_CASES_KEY] = cases
    config.stash[_FROM_KEY] = _delays_from(cases)


def pytest_runtest_setup(item):
    """With LMSYS_INJECT_DELAY, each test's benchmark gets a Sizing of its own: its measurement sizes the delay, and
    a re-measurement adds the same work."""
    perf = item.config.stash.get(SESSION_KEY, None)
    if perf is not None and perf.injection is not None and perf.injection.delay:
        perf.injection = replace(perf.injection, sizing=Sizing((perf.injection.delay,)))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    perf = session.config.stash.get(SESSION_KEY, None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if perf is None or not perf.active or reporter is None:
        return
    injection, cases = perf.injection, session.config.stash.get(_CASES_KEY, [])
    if injection is not None and injection.delay:
        reporter.write_line(f"lmsys perf: {INJECT_DELAY}={injection.delay}: every benchmarked call gets a device-side "
                            f"delay of {injection.delay:.1%} of its time (measuring the gate)")
    if injection is not None and injection.memory:
        reporter.write_line(f"lmsys perf: {INJECT_MEMORY}={injection.memory}: every benchmarked call holds "
                            f"{format_bytes(injection.memory)} more on the device (measuring the gate)")
    if cases:
        reporter.write_line(f"lmsys perf: {INJECT_CASES}: every benchmark is measured again with "
                            f"{', '.join(case.label for case in cases)}, judged beside its own verdict (measuring "
                            "the gate; these verdicts fail no test)")
    threshold = session.config.stash.get(_FROM_KEY, 0.0)
    if cases and threshold:
        held = _memory_only(cases)
        rest = f"with {', '.join(case.label for case in held)}" if held else "not at all"
        reporter.write_line(f"lmsys perf: {INJECT_DELAYS_FROM}={threshold:g}: the delays only where the baseline's "
                            f"median is at least {threshold * 1e3:g} ms; the other benchmarks are measured again "
                            f"{rest}")


def pytest_perf_measured(item, benchmark, remeasure):
    """Notes the injection in the benchmark's extra_info; with LMSYS_INJECT_CASES, measures and judges each case."""
    perf, record = item.config.stash[SESSION_KEY], item.stash[RECORD_KEY]
    if perf.injection is not None and perf.injection.delay:
        benchmark.extra_info["injected_delay"] = perf.injection.delay
    if perf.injection is not None and perf.injection.memory:
        benchmark.extra_info["injected_memory"] = perf.injection.memory
    cases = item.config.stash.get(_CASES_KEY, [])
    if not cases or not perf.comparing or perf.baseline(record.fullname) is None:
        return
    if record.baseline_median < item.config.stash.get(_FROM_KEY, 0.0):
        cases = _memory_only(cases)
        if not cases:
            return
    # The benchmark's delays share one Sizing: its typical time is the median its own measurement judged.
    delays = [case.delay for case in cases if case.delay]
    sizing = Sizing(tuple(sorted(set(delays))), typical=record.median) if delays else None
    # A case's verdict reads the LAUNCH rounds only where the test gates its host-set time (fixture._verdict).
    marker = item.get_closest_marker("perf_tolerance")
    launch_rounds = perf.host_gate(marker.kwargs if marker else {}) is not None
    results = []
    for case in cases:
        measured = replace(case, sizing=sizing if case.delay else None, launch_rounds=launch_rounds, warm=True,
                           timed=bool(case.delay))
        decided = remeasure(measured)
        added = first = _added(decided, record)
        resized = bool(case.delay) and sizing is not None and sizing.resize(case.delay, added)
        if resized:
            decided = remeasure(measured)
            added = _added(decided, record)
        results.append({"delay": case.delay, "memory": case.memory,
                        "verdict": None if decided is None else decided.label,
                        "time_change": None if decided is None or decided.time is None else decided.time.change,
                        "time_resolution": None if decided is None or decided.time is None else decided.time.resolution,
                        **({"added": added, "resized": resized} if case.delay else {}),
                        **({"added_before_resize": first} if resized else {})})
    benchmark.extra_info[INJECTED_CASES_KEY] = results
    if sizing is not None and sizing.lengths is not None:
        # What the delays were sized by: the nominal shares tried and what each added, and each delay's work.
        benchmark.extra_info[INJECTED_SIZING_KEY] = {
            "typical": sizing.typical, "points": [[share, added] for share, added in sizing.points],
            "shares": {f"{delay:g}": length / sizing.typical for delay, length in sizing.lengths.items()}}
    record.notes.append("injected: " + "; ".join(f"{case.label}: {result['verdict']}"
                                                 for case, result in zip(cases, results)))


def _added(decided, record) -> float | None:
    """The share a case's pass added to the benchmark's own median (the same process, a moment before), or None when
    it compared no time."""
    if decided is None or decided.time is None or not record.median:
        return None
    return decided.time.median / record.median - 1
