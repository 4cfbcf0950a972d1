"""The verdict rule of lmsys.perf.verdict, with plain numbers."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmsys.perf import verdict as compare


def rounds(median_ms: float, noise: float, n: int = 30, seed: int = 0) -> list[float]:
    """n per-round times around median_ms with relative Gaussian noise."""
    rng = np.random.default_rng(seed)
    return list(median_ms * 1e-3 * (1 + noise * rng.standard_normal(n)))


def test_identical_runs_pass():
    base = rounds(1.0, 0.01)
    result = compare.compare_time(base, base, tolerance=0.05)
    assert result.verdict == compare.PASS
    assert result.ratio == 1.0
    assert result.ratio_low <= 1.0 <= result.ratio_high


def test_twenty_percent_slower_is_slower():
    result = compare.compare_time(rounds(1.2, 0.01, seed=1), rounds(1.0, 0.01, seed=2), tolerance=0.05)
    assert result.verdict == compare.SLOWER
    assert result.change == pytest.approx(0.2, abs=0.01)
    assert result.ratio_low > 1.05


def test_three_percent_slower_within_five_percent_passes():
    result = compare.compare_time(rounds(1.03, 0.01, seed=1), rounds(1.0, 0.01, seed=2), tolerance=0.05)
    assert result.verdict == compare.PASS


def test_twenty_percent_faster_is_improved():
    result = compare.compare_time(rounds(0.8, 0.01, seed=1), rounds(1.0, 0.01, seed=2), tolerance=0.05)
    assert result.verdict == compare.IMPROVED


def test_median_beyond_tolerance_is_not_enough_when_the_spread_is_large():
    # Same distribution, 30% round-to-round noise: the medians differ by more than 5% by chance alone.
    now, base = rounds(1.0, 0.3, n=15, seed=15), rounds(1.0, 0.3, n=15, seed=115)
    result = compare.compare_time(now, base, tolerance=0.05)
    assert result.ratio > 1.2
    assert result.verdict == compare.PASS


@pytest.mark.parametrize("noise", [0.01, 0.1, 0.3])
def test_no_false_alarms_between_runs_of_one_distribution(noise):
    verdicts = {compare.compare_time(rounds(1.0, noise, seed=s), rounds(1.0, noise, seed=s + 100), 0.05).verdict
                for s in range(20)}
    assert verdicts == {compare.PASS}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 9, 10, 57, 400])
def test_the_bootstrap_medians_are_distributed_as_the_medians_of_drawn_resamples(n):
    """Drawn through the order statistics, the medians of a bootstrap have the distribution of the medians of resamples
    drawn one value at a time: odd and even counts, ties included (Kolmogorov distance of 20 000 draws each)."""
    values = np.round(np.random.default_rng(n).lognormal(0.0, 0.1, n), 2)
    drawn = np.median(values[np.random.default_rng(1).integers(0, n, size=(20_000, n))], axis=1)
    ours = compare._bootstrap_medians(values, np.random.default_rng(2), 20_000)
    grid = np.union1d(drawn, ours)
    distance = np.max(np.abs(np.searchsorted(np.sort(drawn), grid, side="right")
                             - np.searchsorted(np.sort(ours), grid, side="right"))) / 20_000
    assert distance < 0.02
    assert set(np.unique(ours)) <= set(np.unique(drawn)) | set((values[:, None] + values[None, :]).ravel() / 2)


def test_baseline_without_rounds_uses_the_current_spread_only():
    result = compare.compare_time(rounds(1.2, 0.01), [1e-3], tolerance=0.05)
    assert result.verdict == compare.SLOWER
    assert compare.compare_time(rounds(1.0, 0.01), [1e-3], tolerance=0.05).verdict == compare.PASS


def test_the_same_numbers_always_give_the_same_bounds():
    now, base = rounds(1.04, 0.05, seed=3), rounds(1.0, 0.05, seed=4)
    assert compare.compare_time(now, base, 0.05) == compare.compare_time(now, base, 0.05)


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(1e-7, 1e2), seed=st.integers(0, 1000))
def test_the_verdict_does_not_depend_on_the_unit(scale, seed):
    now, base = np.array(rounds(1.1, 0.05, seed=seed)), np.array(rounds(1.0, 0.05, seed=seed + 1))
    reference = compare.compare_time(now, base, 0.05)
    scaled = compare.compare_time(now * scale, base * scale, 0.05)
    assert scaled.verdict == reference.verdict
    assert scaled.ratio == pytest.approx(reference.ratio)


@pytest.mark.parametrize(
    ("now", "base", "tolerance"),
    [([], [1.0], 0.05), ([1.0], [], 0.05), ([float("nan")], [1.0], 0.05), ([-1.0], [1.0], 0.05),
     ([1.0], [0.0], 0.05), ([1.0], [1.0], -0.1), ([1.0], [1.0], float("inf")), ([1.0], [1.0], float("nan"))],
)
def test_bad_time_inputs_are_rejected(now, base, tolerance):
    with pytest.raises(ValueError):
        compare.compare_time(now, base, tolerance)


MIB = 2**20


@pytest.mark.parametrize(
    ("peak", "baseline", "verdict"),
    [
        (110 * MIB, 100 * MIB, compare.MORE_MEMORY),  # +10%: over 1% and over 1 MiB
        (int(100.5 * MIB), 100 * MIB, compare.PASS),  # +0.5%: within 1%
        (110 * 2**10, 100 * 2**10, compare.PASS),  # +10% of 100 KiB: under the 1 MiB floor
        (int(1.9 * MIB), 1 * MIB, compare.PASS),  # +90% but only 0.9 MiB
        (90 * MIB, 100 * MIB, compare.IMPROVED),
        (100 * MIB, 100 * MIB, compare.PASS),
    ],
)
def test_memory_needs_both_the_relative_tolerance_and_the_floor(peak, baseline, verdict):
    assert compare.compare_memory(peak, baseline, tolerance=0.01, floor=MIB).verdict == verdict


@pytest.mark.parametrize(("tolerance", "floor"), [(float("inf"), MIB), (float("nan"), MIB), (0.01, -1)])
def test_bad_memory_tolerances_are_rejected(tolerance, floor):
    with pytest.raises(ValueError, match="tolerance and floor must be finite and non-negative"):
        compare.compare_memory(MIB, MIB, tolerance, floor)


def test_memory_change_is_relative_and_absent_for_a_zero_baseline():
    assert compare.compare_memory(110, 100, 0.01, 0).change == pytest.approx(0.1)
    assert compare.compare_memory(2 * MIB, 0, 0.01, MIB).change is None


def test_judge_combines_time_and_memory():
    slower = compare.compare_time(rounds(1.2, 0.01), rounds(1.0, 0.01, seed=9), 0.05)
    faster = compare.compare_time(rounds(0.8, 0.01), rounds(1.0, 0.01, seed=9), 0.05)
    fatter = compare.compare_memory(110 * MIB, 100 * MIB, 0.01, MIB)
    same = compare.compare_memory(100 * MIB, 100 * MIB, 0.01, MIB)
    assert compare.judge(None, None).label == compare.NEW
    assert not compare.judge(None, None).failed
    assert compare.judge(slower, same).label == compare.SLOWER
    assert compare.judge(faster, fatter).label == compare.MORE_MEMORY
    assert compare.judge(slower, fatter).label == "SLOWER+MORE-MEMORY"
    assert compare.judge(faster, same).label == compare.IMPROVED
    assert compare.judge(faster, same).failed is False
    assert compare.judge(slower, None).failed is True


def test_a_baseline_whose_time_could_not_be_compared_fails_uncompared():
    same = compare.compare_memory(100 * MIB, 100 * MIB, 0.01, MIB)
    why = "the baseline was timed eager, this run graph"
    alone = compare.judge(None, None, uncompared=why)
    assert alone.label == compare.UNCOMPARED and alone.failed
    assert compare.judge(None, same, uncompared=why).label == compare.UNCOMPARED
    assert alone.message("test_x") == (
        f"UNCOMPARED: test_x time not compared: {why}; save a baseline of this timing (--benchmark-save) to gate it"
    )


def test_failure_message_names_the_benchmark_and_the_change():
    slower = compare.compare_time([1.23e-3] * 5, [1.02e-3] * 5, 0.05)
    fatter = compare.compare_memory(110 * MIB, 100 * MIB, 0.01, MIB)
    message = compare.judge(slower, fatter).message("test_x[bf16]")
    assert message.startswith("SLOWER: test_x[bf16] median 1.23 ms vs baseline 1.02 ms (+20.6%, tolerance 5%")
    assert "MORE-MEMORY: test_x[bf16] peak requested above start 110 MiB vs baseline 100 MiB (+10.0%" in message


@pytest.mark.parametrize(
    ("args", "kwargs", "problem"),
    [((), {}, "needs time="), ((0.1,), {}, "keyword arguments only"), ((), {"tme": 0.1}, "unknown key(s) tme"),
     ((), {"time": "x"}, "time='x'"), ((), {"memory": -1}, "memory=-1"), ((), {"time": True}, "time=True"),
     ((), {"time": float("inf")}, "time=inf")],
)
def test_bad_tolerance_marker_arguments(args, kwargs, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        compare.check_tolerances(args, kwargs)


def test_good_tolerance_marker_arguments():
    assert compare.check_tolerances((), {"time": 0.1, "memory": 0}) == {"time": 0.1, "memory": 0.0}


@pytest.mark.parametrize(
    ("seconds", "text"), [(1.5, "1.5 s"), (1.23e-3, "1.23 ms"), (178.6e-6, "178.6 us"), (5e-9, "5 ns")]
)
def test_format_seconds(seconds, text):
    assert compare.format_seconds(seconds) == text


@pytest.mark.parametrize(("nbytes", "text"), [(512, "512 B"), (2**20, "1 MiB"), (int(17.7 * 2**30), "17.7 GiB")])
def test_format_bytes(nbytes, text):
    assert compare.format_bytes(nbytes) == text


def test_the_tolerance_follows_the_case_the_comparison_is_in():
    same = compare.time_tolerance(same_start=True)
    other = compare.time_tolerance(same_start=False)
    assert (same.value, same.source) == (compare.SAME_START, "same machine start")
    assert (other.value, other.source) == (compare.OTHER_START, "baseline from another machine start")
    assert same.value < other.value


def test_a_calibrated_spread_raises_the_floor_but_never_lowers_it():
    quiet = compare.time_tolerance(same_start=True, spread=0.001, runs=10)
    noisy = compare.time_tolerance(same_start=True, spread=0.02, runs=10)
    assert quiet.value == compare.SAME_START
    assert noisy.value == pytest.approx(compare.SIGMAS * math.sqrt(2) * 0.02)
    assert noisy.source == "calibrated from 10 runs"
    assert compare.time_tolerance(same_start=False, spread=0.01, runs=3).value == compare.OTHER_START


def test_a_marker_or_an_option_overrides_the_case():
    assert compare.time_tolerance(same_start=False, marker=0.01, option=0.2) == compare.Tolerance(0.01, "marker")
    assert compare.time_tolerance(same_start=False, option=0.2, spread=0.5) == compare.Tolerance(
        0.2, "--perf-time-tolerance")


def test_a_host_set_time_is_gated_only_when_asked():
    assert compare.host_tolerance() is None
    assert compare.host_tolerance(marker=0.5, option=0.1) == compare.Tolerance(0.5, "marker")
    assert compare.host_tolerance(option=0.1) == compare.Tolerance(0.1, "--perf-host-tolerance")
    base = [1e-3] * 11
    twice = compare.compare_time([2e-3] * 11, base, compare.HOST_NOTE)
    assert twice.verdict == compare.SLOWER
    ungated = compare.judge(compare.compare_time(base, base, 0.025), None, host=twice)
    assert (ungated.label, ungated.failed) == (compare.PASS, False)
    assert "not gated" in compare.host_note(twice, gated=False)
    gated = compare.judge(compare.compare_time(base, base, 0.025), None, host=twice, host_gated=True)
    assert (gated.label, gated.failed, gated.slower) == (compare.SLOWER_HOST, True, True)
    assert "SLOWER-HOST: t host time 2 ms" in gated.message("t")
    assert compare.host_note(twice, gated=True) is None


def test_the_resolution_is_the_tolerance_plus_what_the_spread_costs():
    rng = np.random.default_rng(0)
    base = list(1e-3 * (1 + 0.001 * rng.standard_normal(200)))
    tight = compare.compare_time(list(1e-3 * (1 + 0.001 * rng.standard_normal(200))), base, 0.025)
    loose = compare.compare_time(list(1e-3 * (1 + 0.05 * rng.standard_normal(200))), base, 0.025)
    assert 0.025 <= tight.resolution < 0.027
    assert loose.resolution > tight.resolution + 0.002
    assert tight.resolution == pytest.approx(0.025 + tight.ratio - tight.ratio_low)


def test_the_memory_allowance_comes_from_the_marker_or_the_option_and_a_calibration_raises_its_floor():
    assert compare.memory_tolerance(None, 0.0, 256 * 2**10) == (0.0, 256 * 2**10, "default")
    assert compare.memory_tolerance(0.1, 0.0, 256 * 2**10) == (0.1, 256 * 2**10, "marker")
    tolerance, floor, source = compare.memory_tolerance(None, 0.0, 256 * 2**10, moved=2**20)
    assert (tolerance, floor) == (0.0, 256 * 2**10 + 2**20)
    assert source == "default, floor raised by the 1 MiB the calibration saw"
