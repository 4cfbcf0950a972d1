"""The rule: a benchmark's samples and memory peak against its baseline -> PASS, IMPROVED, SLOWER, MORE-MEMORY, NEW.

Everything that decides whether a perf test fails is here, pure (numpy only: no pytest, no torch), so it can be
tested with plain numbers:

- **What fails.** The device time (per-round samples: CUDA events around a call or a CUDA graph's replay) and the
  device memory (the peak of bytes requested above the start). A time that the host's speed sets (host=True timing,
  the eager rounds beside graph replays: launch cost included) is compared and reported, and fails only where the
  test gates it (``@pytest.mark.perf_tolerance(host=...)`` or ``--perf-host-tolerance``).
- **The comparison.** SLOWER when the one-sided 95% bootstrap lower bound of (median now / median then) exceeds
  1 + tolerance; MORE-MEMORY when the peak grew by more than max(memory tolerance x baseline, memory floor)
  (`memory_tolerance`). A SLOWER is measured once more, and the second measurement decides (the fixture does that).
- **The tolerance** (`time_tolerance`): the marker's or the option's when given; else a floor for the case the
  comparison is in, raised by the benchmark's own noise where a calibration measured it. The case: a baseline saved
  in this start of this machine (the same boot) is compared at SAME_START; one saved on another start, or that does
  not say, at OTHER_START, because kernels at the power cap drift between machine starts by more than within one.
- **Resolution.** Every time comparison carries the smallest change it could have caught (`resolution`): its
  tolerance plus what the rounds' own spread took off the ratio's lower bound. The verdict line prints it.

The bootstrap's seed is fixed, so the same numbers always give the same verdict. docs/gate.md says where the
constants come from.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0

# Time tolerances without a marker, an option or a calibration (docs/gate.md, "Where the numbers come from").
SAME_START = 0.02
OTHER_START = 0.06
# A calibrated tolerance: SIGMAS standard deviations of the difference of two runs' medians (sqrt(2) x one run's).
SIGMAS = 3.0
# What a host-set time is labelled against when it is not gated: a change past this is noted beside the verdict.
HOST_NOTE = 0.25

PASS, IMPROVED, SLOWER, MORE_MEMORY, NEW = "PASS", "IMPROVED", "SLOWER", "MORE-MEMORY", "NEW"
# A host-set time (launch cost) slower beyond the tolerance its test gates it with.
SLOWER_HOST = "SLOWER-HOST"
# A baseline exists but its time cannot be compared with this run's (timed another way): a gate that passed here
# would pass without having compared.
UNCOMPARED = "UNCOMPARED"
FAILING = (SLOWER, SLOWER_HOST, MORE_MEMORY, UNCOMPARED)
TOLERANCE_KEYS = ("time", "memory", "host")


@dataclass(frozen=True)
class Tolerance:
    """A tolerance and where it came from ('same machine start', 'marker', 'calibrated from 20 runs', ...)."""

    value: float
    source: str


@dataclass(frozen=True)
class TimeComparison:
    """Current vs baseline time: medians (seconds), their ratio, its confidence bounds and the verdict."""

    median: float
    baseline_median: float
    ratio: float
    ratio_low: float
    ratio_high: float
    tolerance: float
    verdict: str
    source: str = "default"

    @property
    def change(self) -> float:
        """Relative change of the median (+0.2 is 20% slower)."""
        return self.ratio - 1.0

    @property
    def resolution(self) -> float:
        """The smallest slowdown this comparison could have caught: the tolerance plus the distance from the ratio to
        its lower bound (what the rounds' spread costs)."""
        return self.tolerance + max(self.ratio - self.ratio_low, 0.0)


@dataclass(frozen=True)
class MemoryComparison:
    """Current vs baseline peak memory (bytes) and the verdict."""

    peak: int
    baseline_peak: int
    tolerance: float
    floor: int
    verdict: str
    source: str = "default"
    # Which peaks: 'requested' (the bytes asked for) or 'allocated' (the allocator's blocks).
    measure: str = "requested"

    @property
    def change(self) -> float | None:
        """Relative change of the peak; None when the baseline peak is 0."""
        return (self.peak - self.baseline_peak) / self.baseline_peak if self.baseline_peak else None


@dataclass(frozen=True)
class Verdict:
    """The outcome for one benchmark: a label (PASS, IMPROVED, SLOWER, SLOWER-HOST, MORE-MEMORY, UNCOMPARED, NEW, or
    several joined by '+'), the device-time comparison, the memory comparison, the host-set time's comparison (the
    eager rounds beside graph replays, or a host-timed benchmark's time), whether the test gates that, and why the
    time could not be compared (UNCOMPARED)."""

    label: str
    time: TimeComparison | None = None
    memory: MemoryComparison | None = None
    host: TimeComparison | None = None
    host_gated: bool = False
    uncompared: str | None = None

    @property
    def failed(self) -> bool:
        """True when the benchmark's test must fail."""
        return any(part in FAILING for part in self.label.split("+"))

    @property
    def slower(self) -> bool:
        """True when a gated time was SLOWER (what the one re-measurement is for)."""
        return any(part in (SLOWER, SLOWER_HOST) for part in self.label.split("+"))

    def message(self, name: str) -> str:
        """The failure message naming the benchmark and each change, e.g. 'SLOWER: test_x median 1.23 ms vs ...'."""
        lines = []
        for label, what, t in ((SLOWER, "median", self.time), (SLOWER_HOST, "host time", self.host)):
            if t is not None and t.verdict == SLOWER and (label == SLOWER or self.host_gated):
                lines.append(
                    f"{label}: {name} {what} {format_seconds(t.median)} vs baseline "
                    f"{format_seconds(t.baseline_median)} ({t.change:+.1%}, tolerance {format_tolerance(t)}; "
                    f"{CONFIDENCE:.0%} lower bound of the ratio {t.ratio_low:.3f} > {1 + t.tolerance:.3f}; "
                    f"this comparison catches slowdowns past {t.resolution:.1%})"
                )
        if self.uncompared is not None:
            lines.append(
                f"{UNCOMPARED}: {name} time not compared: {self.uncompared}; save a baseline of this timing "
                "(--benchmark-save) to gate it"
            )
        if self.memory is not None and self.memory.verdict == MORE_MEMORY:
            m = self.memory
            change = "" if m.change is None else f"{m.change:+.1%}, "
            lines.append(
                f"MORE-MEMORY: {name} peak {m.measure} above start {format_bytes(m.peak)} vs baseline "
                f"{format_bytes(m.baseline_peak)} ({change}tolerance {m.tolerance:.0%} and {format_bytes(m.floor)}"
                f"{'' if m.source == 'default' else ', ' + m.source})"
            )
        return "\n".join(lines) if lines else f"{self.label}: {name}"


def time_tolerance(
    *, same_start: bool, marker: float | None = None, option: float | None = None, spread: float | None = None,
    runs: int | None = None,
) -> Tolerance:
    """The device-time tolerance of one comparison: the marker's, else the option's, else the floor of its case
    (SAME_START when the baseline was saved in this machine start, else OTHER_START) raised to SIGMAS x sqrt(2) x
    the benchmark's calibrated spread (the relative standard deviation of its median across fresh processes) when a
    calibration of `runs` runs measured one."""
    if marker is not None:
        return Tolerance(float(marker), "marker")
    if option is not None:
        return Tolerance(float(option), "--perf-time-tolerance")
    floor = Tolerance(SAME_START, "same machine start") if same_start else Tolerance(
        OTHER_START, "baseline from another machine start")
    if spread is not None and SIGMAS * math.sqrt(2) * spread > floor.value:
        return Tolerance(SIGMAS * math.sqrt(2) * spread, f"calibrated from {runs} runs")
    return floor


def memory_tolerance(marker: float | None, option: float, floor: int, moved: int = 0) -> tuple[float, int, str]:
    """The memory tolerance (a fraction of the baseline's peak: the marker's, else the option's), the floor (bytes: the
    option's, raised by the range `moved` a calibration saw the peak move over) and their source."""
    source = "default" if marker is None else "marker"
    if moved:
        source = f"{source}, floor raised by the {format_bytes(moved)} the calibration saw"
    return float(option if marker is None else marker), floor + moved, source


def host_tolerance(marker: float | None = None, option: float | None = None) -> Tolerance | None:
    """The tolerance of a host-set time when the test gates it (the marker's host=, else --perf-host-tolerance), or
    None: then it is compared against HOST_NOTE and reported, never failing."""
    if marker is not None:
        return Tolerance(float(marker), "marker")
    if option is not None:
        return Tolerance(float(option), "--perf-host-tolerance")
    return None


def format_tolerance(comparison: TimeComparison) -> str:
    """'2% (same machine start)': a time tolerance and where it came from."""
    return f"{comparison.tolerance * 100:.3g}% ({comparison.source})"


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free two-sided confidence interval of the median of samples, from order statistics (the
    normal approximation of the binomial); (-inf, inf) when there are too few samples for one."""
    values = np.sort(_as_samples(samples, "samples"))
    n = values.size
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    low = math.floor((n - z * math.sqrt(n)) / 2)  # 1-based rank of the lower bound
    high = math.ceil((n + z * math.sqrt(n)) / 2) + 1
    if low < 1 or high > n:
        return -math.inf, math.inf
    return float(values[low - 1]), float(values[high - 1])


def relative_half_width(samples: Sequence[float], confidence: float = CONFIDENCE) -> float:
    """Half the width of median_interval relative to the median: 0.01 means the median is known to +-1%."""
    low, high = median_interval(samples, confidence)
    median = float(np.median(np.asarray(samples, dtype=np.float64)))
    if not math.isfinite(high - low) or median <= 0:
        return math.inf
    return (high - low) / 2 / median


def _as_samples(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty sequence of seconds, got {values!r}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{what} must be finite and non-negative")
    return array


def _bootstrap_medians(samples: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """The medians of `resamples` bootstrap resamples (n of the n samples, drawn with replacement), drawn without
    drawing the resamples: a resample's k-th smallest value is the sorted samples' value at floor(n U), where U, the
    k-th smallest of n uniforms, is Beta(k, n + 1 - k); the next smallest uniform lies a Beta(1, n - k) share of the
    way from it to 1. The same distribution as the resamples' own medians, in O(n log n + resamples)."""
    values = np.sort(samples)
    n = values.size
    k = (n + 1) // 2  # the rank of the (lower) middle value
    lower = rng.beta(k, n + 1 - k, size=resamples)
    low = values[np.minimum((n * lower).astype(np.int64), n - 1)]
    if n % 2:
        return low
    upper = lower + (1 - lower) * rng.beta(1, n - k, size=resamples)
    return (low + values[np.minimum((n * upper).astype(np.int64), n - 1)]) / 2


def compare_time(
    samples: Sequence[float],
    baseline_samples: Sequence[float],
    tolerance: float,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    source: str = "default",
) -> TimeComparison:
    """Compare per-round times (seconds) with the baseline's. A baseline without rounds can be passed as [median]:
    then only the current run's spread is accounted for. `source` says where the tolerance came from."""
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite, non-negative fraction, got {tolerance!r}")
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    now = _as_samples(samples, "samples")
    base = _as_samples(baseline_samples, "baseline samples")
    base_median = float(np.median(base))
    if base_median <= 0:
        raise ValueError("the baseline median is 0 s: nothing to compare a time with")
    median = float(np.median(now))
    rng = np.random.default_rng(SEED)
    ratios = _bootstrap_medians(now, rng, resamples) / _bootstrap_medians(base, rng, resamples)
    low, high = (float(x) for x in np.quantile(ratios, [1 - confidence, confidence]))
    if low > 1 + tolerance:
        verdict = SLOWER
    elif high < 1 - tolerance:
        verdict = IMPROVED
    else:
        verdict = PASS
    return TimeComparison(median, base_median, median / base_median, low, high, tolerance, verdict, source)


def compare_memory(
    peak: int, baseline_peak: int, tolerance: float, floor: int, source: str = "default", measure: str = "requested"
) -> MemoryComparison:
    """Compare peak bytes with the baseline's: MORE-MEMORY when the growth exceeds tolerance * baseline and floor."""
    if peak < 0 or baseline_peak < 0:
        raise ValueError(f"peaks must be non-negative byte counts, got {peak!r} and {baseline_peak!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0 and floor >= 0):
        raise ValueError(f"tolerance and floor must be finite and non-negative, got {tolerance!r} and {floor!r}")
    allowed = max(tolerance * baseline_peak, floor)
    if peak - baseline_peak > allowed:
        verdict = MORE_MEMORY
    elif baseline_peak - peak > allowed:
        verdict = IMPROVED
    else:
        verdict = PASS
    return MemoryComparison(peak, baseline_peak, tolerance, floor, verdict, source, measure)


def judge(
    time: TimeComparison | None,
    memory: MemoryComparison | None,
    host: TimeComparison | None = None,
    uncompared: str | None = None,
    host_gated: bool = False,
) -> Verdict:
    """Combine the comparisons (any may be absent) into one verdict; none present is NEW. `host` is the host-set time
    (the eager rounds beside graph replays, or a host-timed benchmark's time): its SLOWER is SLOWER-HOST and fails
    only with host_gated. `uncompared` says why a benchmark that has a baseline got no time comparison: UNCOMPARED,
    which fails."""
    if time is None and memory is None and host is None and uncompared is None:
        return Verdict(NEW)
    parts = [c.verdict for c in (time, memory) if c is not None]
    if host is not None and host_gated:
        parts.append(SLOWER_HOST if host.verdict == SLOWER else host.verdict)
    if uncompared is not None:
        parts.append(UNCOMPARED)
    failing = [p for p in parts if p in FAILING]
    if failing:
        label = "+".join(failing)
    elif IMPROVED in parts:
        label = IMPROVED
    else:
        label = PASS
    return Verdict(label, time, memory, host, host_gated, uncompared)


def host_note(host: TimeComparison | None, gated: bool) -> str | None:
    """The line said beside a verdict about an ungated host-set time that moved past HOST_NOTE, else None."""
    if host is None or gated or abs(host.change) <= HOST_NOTE:
        return None
    return (f"host time {format_seconds(host.median)} vs baseline {format_seconds(host.baseline_median)} "
            f"({host.change:+.0%}; the host's speed sets it: reported, not gated)")


def check_tolerances(args: tuple, kwargs: dict) -> dict[str, float]:
    """Validates the arguments of a perf_tolerance marker: keywords time=, memory= and/or host=, non-negative finite
    fractions."""
    if args:
        raise ValueError(f"takes keyword arguments only (time=..., memory=..., host=...), got positional {args!r}")
    if not kwargs:
        raise ValueError("needs time=, memory= and/or host=")
    unknown = sorted(set(kwargs) - set(TOLERANCE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(TOLERANCE_KEYS)}")
    for key, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{key}={value!r} must be a non-negative number, a fraction (0.10 is 10%)")
    return {key: float(value) for key, value in kwargs.items()}


def format_seconds(seconds: float) -> str:
    """A time with a unit that keeps 3-4 significant digits: '178.6 us', '1.23 ms'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def format_bytes(nbytes: float) -> str:
    """A byte count in binary units: '1.0 MiB', '17.70 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{int(nbytes)} B"
