"""Verdicts: per-round samples and memory high-water marks of a run against its baseline -> PASS, SLOWER, ...

Pure (numpy only, no pytest, no torch) so the rule can be tested with plain numbers.

The rule, as the README states it:

- Time. r = median(now) / median(baseline). A bootstrap over both runs' rounds (resample each run's rounds with
  replacement, take the ratio of the two medians, repeat) gives a one-sided confidence bound on r at `CONFIDENCE`.
  SLOWER when the *lower* bound exceeds 1 + tolerance: the run is slower by more than the tolerance even after
  allowing for the round-to-round spread of both runs. IMPROVED when the *upper* bound is below 1 - tolerance.
  Otherwise PASS. (The plugin re-measures once before a SLOWER fails a test; see fixture.py.)
  A bootstrap rather than a rank test (Mann-Whitney) because it answers the question the tolerance asks, "by how
  much is the median slower", not merely "are the two runs different".
  The resampling seed is fixed, so the same numbers always give the same verdict.
- Memory (the peak allocated above what was allocated before the call; near-deterministic). MORE-MEMORY when the
  growth exceeds both tolerance * baseline and an absolute floor; less memory by as much counts as IMPROVED.
- A benchmark without a baseline is NEW. Verdicts that fail a test: SLOWER and MORE-MEMORY.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
# Bounds the bootstrap's working memory: resamples are drawn in chunks of at most this many values.
_CHUNK_VALUES = 4_000_000

TOLERANCE_KEYS = ("time", "memory")

PASS, IMPROVED, SLOWER, MORE_MEMORY, NEW = "PASS", "IMPROVED", "SLOWER", "MORE-MEMORY", "NEW"
FAILING = (SLOWER, MORE_MEMORY)


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

    @property
    def change(self) -> float | None:
        """Relative change of the peak; None when the baseline peak is 0."""
        return (self.peak - self.baseline_peak) / self.baseline_peak if self.baseline_peak else None


@dataclass(frozen=True)
class Verdict:
    """The outcome for one benchmark: a label (TOLERANCE_KEYS = ("time", "memory")

PASS, IMPROVED, SLOWER, MORE-MEMORY, NEW, or several joined by '+')."""

    label: str
    time: TimeComparison | None = None
    memory: MemoryComparison | None = None

    @property
    def failed(self) -> bool:
        """True when the benchmark's test must fail (SLOWER and/or MORE-MEMORY)."""
        return any(part in FAILING for part in self.label.split("+"))

    def message(self, name: str) -> str:
        """The failure message naming the benchmark and each change, e.g. 'SLOWER: test_x median 1.23 ms vs ...'."""
        lines = []
        if self.time is not None and self.time.verdict == SLOWER:
            t = self.time
            lines.append(
                f"SLOWER: {name} median {format_seconds(t.median)} vs baseline {format_seconds(t.baseline_median)} "
                f"({t.change:+.1%}, tolerance {t.tolerance:.0%}; {CONFIDENCE:.0%} lower bound of the ratio "
                f"{t.ratio_low:.3f} > {1 + t.tolerance:.3f})"
            )
        if self.memory is not None and self.memory.verdict == MORE_MEMORY:
            m = self.memory
            change = "" if m.change is None else f"{m.change:+.1%}, "
            lines.append(
                f"MORE-MEMORY: {name} peak allocated above start {format_bytes(m.peak)} vs baseline "
                f"{format_bytes(m.baseline_peak)} ({change}tolerance {m.tolerance:.0%} and {format_bytes(m.floor)})"
            )
        return "\n".join(lines) if lines else f"{self.label}: {name}"


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
) -> TimeComparison:
    """Compare per-round times (seconds) with the baseline's. A baseline without rounds can be passed as [median]:
    then only the current run's spread is accounted for."""
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
    return TimeComparison(median, base_median, median / base_median, low, high, tolerance, verdict)


def compare_memory(peak: int, baseline_peak: int, tolerance: float, floor: int) -> MemoryComparison:
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
    return MemoryComparison(peak, baseline_peak, tolerance, floor, verdict)


def judge(time: TimeComparison | None, memory: MemoryComparison | None) -> Verdict:
    """Combine the time and memory comparisons (either may be absent) into one verdict; neither present is NEW."""
    if time is None and memory is None:
        return Verdict(NEW)
    parts = [c.verdict for c in (time, memory) if c is not None]
    failing = [p for p in parts if p in FAILING]
    if failing:
        label = "+".join(failing)
    elif IMPROVED in parts:
        label = IMPROVED
    else:
        label = PASS
    return Verdict(label, time, memory)


def check_tolerances(args: tuple, kwargs: dict) -> dict[str, float]:
    """Validates the arguments of a perf_tolerance marker: keywords time= and/or memory=, non-negative fractions."""
    if args:
        raise ValueError(f"takes keyword arguments only (time=..., memory=...), got positional {args!r}")
    if not kwargs:
        raise ValueError("needs time= and/or memory=")
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
