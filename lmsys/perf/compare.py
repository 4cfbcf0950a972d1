"""Verdicts: per-round samples and memory high-water marks of a run against its baseline -> PASS, SLOWER, ...

Pure (numpy only, no pytest, no torch) so the rule can be tested with plain numbers. The rule itself is written
once, in the README ("How a regression is decided"); this module implements it: `compare_time` (a bootstrap bound on
the ratio of the medians against a tolerance), `compare_memory` (growth against a floor and a fraction), `judge`
(the label), `median_interval` (how precisely a run knows its own median, for the adaptive rounds). The bootstrap's
seed is fixed, so the same numbers always give the same verdict.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
# Bounds the bootstrap's working memory: resamples are drawn in chunks of at most this many values.
_CHUNK_VALUES = 4_000_000

TOLERANCE_KEYS = ("time", "memory", "eager")

PASS, IMPROVED, SLOWER, MORE_MEMORY, NEW = "PASS", "IMPROVED", "SLOWER", "MORE-MEMORY", "NEW"
# The eager time (CPU launch cost included) of a benchmark timed in a CUDA graph, slower beyond its own tolerance.
SLOWER_EAGER = "SLOWER-EAGER"
# A baseline exists but its time cannot be compared with this run's (timed another way): a gate that passed here
# would pass without having compared.
UNCOMPARED = "UNCOMPARED"
FAILING = (SLOWER, SLOWER_EAGER, MORE_MEMORY, UNCOMPARED)


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
    # where the tolerance came from: "default", "--perf-time-tolerance", "marker", "calibrated from 20 runs", ...
    source: str = "default"

    @property
    def change(self) -> float:
        """Relative change of the median (+0.2 is 20% slower)."""
        return self.ratio - 1.0


@dataclass(frozen=True)
class MemoryComparison:
    """Current vs baseline peak memory (bytes) and the verdict."""

    peak: int
    baseline_peak: int
    tolerance: float
    floor: int
    verdict: str
    source: str = "default"
    # Which peaks: 'requested' (the bytes asked for) or 'allocated' (the allocator's blocks: baselines.gated_peaks).
    measure: str = "requested"

    @property
    def change(self) -> float | None:
        """Relative change of the peak; None when the baseline peak is 0."""
        return (self.peak - self.baseline_peak) / self.baseline_peak if self.baseline_peak else None


@dataclass(frozen=True)
class Verdict:
    """The outcome for one benchmark: a label (PASS, IMPROVED, SLOWER, SLOWER-EAGER, MORE-MEMORY, UNCOMPARED, NEW,
    or several joined by '+'), the time comparison (the graph replays' time in graph mode), the memory comparison, in
    graph mode the comparison of the eager time, and why the time could not be compared (UNCOMPARED)."""

    label: str
    time: TimeComparison | None = None
    memory: MemoryComparison | None = None
    eager: TimeComparison | None = None
    uncompared: str | None = None

    @property
    def failed(self) -> bool:
        """True when the benchmark's test must fail (SLOWER, SLOWER-EAGER and/or MORE-MEMORY)."""
        return any(part in FAILING for part in self.label.split("+"))

    def message(self, name: str) -> str:
        """The failure message naming the benchmark and each change, e.g. 'SLOWER: test_x median 1.23 ms vs ...'."""
        lines = []
        for label, what, t in ((SLOWER, "median", self.time), (SLOWER_EAGER, "eager median", self.eager)):
            if t is not None and t.verdict == SLOWER:
                lines.append(
                    f"{label}: {name} {what} {format_seconds(t.median)} vs baseline "
                    f"{format_seconds(t.baseline_median)} ({t.change:+.1%}, tolerance {format_tolerance(t)}; "
                    f"{CONFIDENCE:.0%} lower bound of the ratio {t.ratio_low:.3f} > {1 + t.tolerance:.3f})"
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


def at_cpu_speed(samples: Sequence[float], probes: Sequence[float], speed: float, device_time: float = 0.0
                 ) -> list[float]:
    """The samples as if the CPU had run at `speed` (the CPU probe's time at that speed): the part of each sample
    above device_time (the CPU's part: all of a host-timed round, what an eager round adds to the device's time) is
    scaled by speed over the probe's time before that round. A round without a positive probe time stays as it is."""
    return [
        device_time + max(sample - device_time, 0.0) * speed / probe if probe > 0 else sample
        for sample, probe in zip(samples, probes, strict=True)
    ]


# How much wider the CPU's part is judged per unit of |ln(probe now / probe at the baseline)| (cpu_speed_allowance).
CPU_SPEED_SLACK = 0.5


def cpu_speed_allowance(probe: float, baseline_probe: float) -> float:
    """What the tolerance of a CPU's part judged at the baseline's CPU speed (at_cpu_speed) gains when the CPU ran at
    another speed: CPU_SPEED_SLACK * |ln(probe / baseline_probe)| (medians of the probe's times), 0 when either is
    not positive. The probe's scaling is a proxy: on the H100 the CPU's part of launch-bound calls moved more than
    the probe, by up to half the log of the probes' ratio (a CPU probe +97% slower than the baseline's left an eager
    time +26% after scaling, one -36% a host time -23%), and the gate must not call that a regression."""
    if probe <= 0 or baseline_probe <= 0:
        return 0.0
    return CPU_SPEED_SLACK * abs(math.log(probe / baseline_probe))


def format_tolerance(comparison: TimeComparison) -> str:
    """'5% (default)', '2.1% (calibrated from 20 runs)': a time tolerance and where it came from."""
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
    chunk = max(1, _CHUNK_VALUES // samples.size)
    medians = []
    for start in range(0, resamples, chunk):
        rows = min(chunk, resamples - start)
        medians.append(np.median(samples[rng.integers(0, samples.size, size=(rows, samples.size))], axis=1))
    return np.concatenate(medians)


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


@dataclass(frozen=True)
class Reference:
    """What a series of rounds is judged against: the baseline's samples timed alike, the tolerance and where it came
    from, and, where the baseline's rounds were probed (the CPU's part of a round: timing.py), the median of its probe
    times (`speed`) and its samples taken at that speed (`at_speed`). Picklable: a multi-rank benchmark hands it to
    its ranks, which judge their gathered rounds."""

    samples: list[float]
    tolerance: float
    source: str = "default"
    speed: float | None = None
    at_speed: list[float] | None = None

    def judge(self, samples: Sequence[float], probes: Sequence[float] | None = None, device_time: float = 0.0
              ) -> TimeComparison:
        """compare_time of the samples with the baseline's. Where both were probed, the CPU's part of every round
        (above device_time) is taken at the baseline's CPU speed first (at_cpu_speed), and the tolerance gains
        cpu_speed_allowance for the distance between the CPU speeds (the source says so)."""
        now, then, value, source = samples, self.samples, self.tolerance, self.source
        if probes and self.speed is not None and self.at_speed is not None:
            now, then = at_cpu_speed(samples, probes, self.speed, device_time), self.at_speed
            probe = float(np.median(np.asarray(probes, dtype=np.float64)))
            allowance = cpu_speed_allowance(probe, self.speed)
            if allowance >= 0.001:
                value += allowance
                source += f"; +{allowance:.1%} for the CPU probe's {probe / self.speed - 1:+.0%}"
        return compare_time(now, then, value, source=source)


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
    eager: TimeComparison | None = None,
    uncompared: str | None = None,
) -> Verdict:
    """Combine the comparisons (any may be absent) into one verdict; none present is NEW. `eager` is the eager time
    of a benchmark timed in a CUDA graph: its SLOWER is labelled SLOWER-EAGER. `uncompared` says why a benchmark that
    has a baseline got no time comparison: UNCOMPARED, which fails."""
    if time is None and memory is None and eager is None and uncompared is None:
        return Verdict(NEW)
    parts = [c.verdict for c in (time, memory) if c is not None]
    if eager is not None:
        parts.append(SLOWER_EAGER if eager.verdict == SLOWER else eager.verdict)
    if uncompared is not None:
        parts.append(UNCOMPARED)
    failing = [p for p in parts if p in FAILING]
    if failing:
        label = "+".join(failing)
    elif IMPROVED in parts:
        label = IMPROVED
    else:
        label = PASS
    return Verdict(label, time, memory, eager, uncompared)


def check_tolerances(args: tuple, kwargs: dict) -> dict[str, float]:
    """Validates the arguments of a perf_tolerance marker: keywords time=, memory= and/or eager=, non-negative
    finite fractions."""
    if args:
        raise ValueError(f"takes keyword arguments only (time=..., memory=..., eager=...), got positional {args!r}")
    if not kwargs:
        raise ValueError("needs time=, memory= and/or eager=")
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
