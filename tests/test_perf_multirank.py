"""Multi-rank benchmarks under the gate (`gpu_benchmark.distributed`): pytester runs whose tests spawn two gloo ranks,
each timing its step on a fake GPU clock (tests/perf_fakes.py), so the samples, the spans and the memory are exact.
The ranks import lmsys as a fresh process does (Python 3.11's forkserver ignores the parent's sys.path): from a
worktree, run with PYTHONPATH set to it."""

import json

import pytest
from perf_fakes import INJECTION, INNER_CONFTEST

from lmsys.perf import multirank
from lmsys.perf.backend import MemoryReading

pytest_plugins = ["pytester"]

RUN_ARGS = (
    "--benchmark-max-time=0", "--benchmark-min-rounds=9", "-rfEs",
    "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
)
MIB = 2**20

# Rank r's step takes ms * (1 + r * skew) on its fake clock, a quarter of it inside the span "comm_wait", and
# allocates (r + 1) * memory bytes at its peak, and what the rank's backend holds beside (LMSYS_INJECT_MEMORY).
SUITE = '''
import os
import random

import pytest


def setup(ctx, ms, skew, memory, fail_rank=None, noise=0.0, launch=0.0, uncapturable_rank=None, hot_rank=None,
          spawns=None, slow_spawns=0):
    if ctx.rank == fail_rank:
        raise ValueError(f"rank {{ctx.rank}} cannot build its model")
    if hot_rank is not None and ctx.rank != hot_rank:
        ctx.backend.hot_readings = 0
    seconds = ms * 1e-3 * (1 + ctx.rank * skew)
    if spawns is not None:  # each rank counts the times it was spawned: the first slow_spawns are 20% slower
        with open(f"{{spawns}}.{{ctx.rank}}", "a") as counter:
            counter.write("x")
        if os.path.getsize(f"{{spawns}}.{{ctx.rank}}") <= slow_spawns:
            seconds *= 1.2
    rng = random.Random(ctx.rank)

    def step():
        if ctx.backend.capturing:  # recorded, not run
            if ctx.rank == uncapturable_rank:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            with ctx.span("comm_wait"):
                return ctx.rank
        if not (ctx.backend.queued or ctx.backend.replaying):  # the CPU's launch cost: queued ahead, or none
            ctx.backend.now += launch * 1e-3 * ctx.backend.cpu_slowdown
        hot = 1 + ctx.backend.thermal_slowdown * (ctx.backend.hot_readings > 0)
        ctx.backend.now += 0.75 * seconds * hot * (1 + noise * rng.gauss(0.0, 1.0))
        with ctx.span("comm_wait"):
            ctx.backend.now += 0.25 * seconds
        peak = (ctx.rank + 1) * memory + ctx.backend.held
        ctx.backend.allocated = max(ctx.backend.allocated, peak)
        ctx.backend.requested = max(ctx.backend.requested, peak)
        ctx.mark("after_step")
        return ctx.rank

    return step


@pytest.mark.parametrize("world_size", [2], ids=["ws2-gloo"])
def test_step(gpu_benchmark, world_size):
    out = gpu_benchmark.distributed(setup, world_size=world_size, timeout=60, ms={ms}, skew={skew},
                                    memory={memory}, fail_rank={fail_rank}, noise={noise}, launch={launch},
                                    uncapturable_rank={uncapturable_rank}, graph={graph}, hot_rank={hot_rank},
                                    spawns={spawns!r}, slow_spawns={slow_spawns}, flops=10**9)
    assert out == [0, 1]
'''


def write(pytester, ms=1.0, skew=0.0, memory=8 * MIB, fail_rank=None, noise=0.0, launch=0.0, graph=False,
          uncapturable_rank=None, hot_rank=None, spawns=None, slow_spawns=0):
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(INNER_CONFTEST.format(name="Fake GPU 80GB"))
    pytester.makepyfile(test_suite=SUITE.format(ms=ms, skew=skew, memory=memory, fail_rank=fail_rank, noise=noise,
                                                launch=launch, graph=graph, uncapturable_rank=uncapturable_rank,
                                                hot_rank=hot_rank, spawns=spawns, slow_spawns=slow_spawns))


def run(pytester, *args):
    return pytester.runpytest_inprocess(*RUN_ARGS, *args)


def only_benchmark(pytester) -> dict:
    """The one benchmark of the last run's --benchmark-json=out.json."""
    (bench,) = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    return bench


def test_round_time_is_the_slowest_rank_and_memory_the_largest_rank(pytester):
    write(pytester, ms=1.0, skew=0.5, memory=8 * MIB)
    result = run(pytester, "--benchmark-save=base", "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    bench = only_benchmark(pytester)
    # Rank 1 takes 1.5 ms a round: every round's time is its time.
    assert bench["stats"]["median"] == pytest.approx(1.5e-3)
    assert bench["stats"]["rounds"] == 9
    info = bench["extra_info"]
    assert (info["world_size"], info["dist_backend"]) == (2, "gloo")
    assert info["spans"]["comm_wait"]["seconds"] == pytest.approx(0.375e-3)
    assert info["spans"]["comm_wait"]["share"] == pytest.approx(0.25)
    assert [rank["peak_allocated_above_start_bytes"] for rank in info["per_rank_memory"]] == [8 * MIB, 16 * MIB]
    assert info["peak_allocated_above_start_bytes"] == 16 * MIB


HOST_NOTE = "the host's speed sets it: reported, not gated)"


def test_on_a_gpu_the_device_time_is_judged_and_the_launch_cost_reported_beside_it(pytester):
    # Queued rounds hold the device's time; the LAUNCH rounds, from an idle device, add the CPU's launch cost, a time
    # the host's speed sets: a slower launch path is reported beside a PASS, and a SLOWER-HOST where it is gated.
    write(pytester, ms=1.0, launch=0.5)
    run(pytester, "--benchmark-save=base", "--benchmark-json=out.json").assert_outcomes(passed=1)
    bench = only_benchmark(pytester)
    info = bench["extra_info"]
    assert (info["timing"], info["eager_timing"]) == ("queued", "launch")
    assert bench["stats"]["median"] == pytest.approx(1e-3)
    assert info["eager_median"] == pytest.approx(1.5e-3)
    write(pytester, ms=1.0, launch=1.0)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"test_step[[]ws2-gloo[]]: host time 2 ms vs baseline 1.5 ms (+33%; {HOST_NOTE}"])
    result = run(pytester, "--benchmark-compare", "--perf-host-tolerance=0.15")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SLOWER-HOST: test_step[[]ws2-gloo[]] host time 2 ms vs baseline 1.5 ms (+33.3%*"])


def test_graph_mode_times_every_ranks_replays_with_the_launch_rounds_beside(pytester):
    # A step whose CPU launch cost (2 ms) exceeds its device time (1 ms): the replays hold the device time; the
    # spans, not timed in a captured step, come from the LAUNCH rounds; a slower launch path is reported, a slower
    # device is SLOWER.
    write(pytester, ms=1.0, skew=0.5, launch=2.0, graph=True)
    run(pytester, "--benchmark-save=base", "--benchmark-json=out.json").assert_outcomes(passed=1)
    bench = only_benchmark(pytester)
    info = bench["extra_info"]
    assert (info["timing"], info["eager_timing"]) == ("graph", "launch")
    assert bench["stats"]["median"] == pytest.approx(1.5e-3)
    assert info["eager_median"] == pytest.approx(3.5e-3)
    assert info["spans"]["comm_wait"]["seconds"] == pytest.approx(0.375e-3)
    assert "notes" not in info
    write(pytester, ms=1.0, skew=0.5, launch=3.0, graph=True)
    result = run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"test_step[[]ws2-gloo[]]: host time 4.5 ms vs baseline 3.5 ms (+29%; {HOST_NOTE}"])
    assert only_benchmark(pytester)["extra_info"]["host_change"] == pytest.approx(1 / 3.5)
    write(pytester, ms=1.1, skew=0.5, launch=2.0, graph=True)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SLOWER: test_step[[]ws2-gloo[]] median 1.65 ms vs baseline 1.5 ms (+10.0%*"])


def test_a_cpu_slower_on_every_rank_moves_the_launch_rounds_only_and_fails_only_where_gated(pytester, monkeypatch):
    # The launch cost moves with the CPU's speed (on the H100 a bf16 DDP step's eager median read +27% in an A/A run,
    # its device time unchanged). Rank 1's LAUNCH round is the slowest: 1.5 ms of device time and 2 ms of launch
    # cost at full speed, 3 ms on a CPU 1.5 times slower.
    write(pytester, ms=1.0, skew=0.5, launch=2.0)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    monkeypatch.setenv("FAKE_CPU_SLOWDOWN", "1.5")  # every rank's CPU
    result = run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    info = only_benchmark(pytester)["extra_info"]
    assert (info["verdict"], info["remeasured"]) == ("PASS", False)
    assert info["time_change"] == pytest.approx(0.0, abs=1e-9)
    assert info["eager_median"] == pytest.approx(4.5e-3)
    assert info["host_change"] == pytest.approx(1 / 3.5)
    result = run(pytester, "--benchmark-compare", "--perf-host-tolerance=0.2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SLOWER-HOST: test_step[[]ws2-gloo[]] host time 4.5 ms vs baseline 3.5 ms (+28.6%, "
                                 "tolerance 20% (--perf-host-tolerance)*"])


def test_graph_mode_falls_back_to_queued_rounds_on_every_rank_when_one_cannot_capture(pytester):
    # Rank 1 cannot capture its step: no rank times replays (its collectives would wait for the other's), and the
    # verdict compares like with like: queued rounds are not compared with a baseline of replays.
    write(pytester, ms=1.0, launch=0.5, graph=True)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    write(pytester, ms=1.0, launch=0.5, graph=True, uncapturable_rank=1)
    result = run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*UNCOMPARED*the baseline was timed graph, this run queued*",
        "*timed queued (device time): the CUDA graph capture failed on rank 1 (RuntimeError: CUDA error: "
        "operation not permitted when stream is capturing)*",
    ])
    bench = only_benchmark(pytester)
    assert bench["extra_info"]["timing"] == "queued"
    assert bench["stats"]["median"] == pytest.approx(1e-3)


def test_a_baseline_timed_eager_is_not_compared_silently(pytester):
    # Multi-rank baselines saved before the rounds were queued on a GPU hold eager rounds: the device time is not
    # compared with them, and the verdict says so.
    write(pytester)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    (path,) = (pytester.path / "baselines" / "Fake_GPU_80GB").glob("*.json")
    doc = json.loads(path.read_text())
    info = doc["benchmarks"][0]["extra_info"]
    info["timing"] = "eager"
    for key in ("eager_data", "eager_timing", "eager_median"):
        del info[key]
    path.write_text(json.dumps(doc))
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*UNCOMPARED*the baseline was timed eager, this run queued*"])


def test_a_slower_rank_fails_the_comparison_and_more_memory_on_one_rank_too(pytester):
    write(pytester, ms=1.0, skew=0.0, memory=8 * MIB)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    write(pytester, ms=1.0, skew=0.2, memory=9 * MIB)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*SLOWER: test_step[[]ws2-gloo[]] median 1.2 ms vs baseline 1 ms (+20.0%*",
        "*MORE-MEMORY: test_step[[]ws2-gloo[]] peak requested above start 18 MiB vs baseline 16 MiB*",
        "*confirmed: the time was re-measured once*",
    ])


@pytest.mark.parametrize(("slow_spawns", "outcome", "spawned"), [(0, "passed", 1), (1, "passed", 2), (2, "failed", 2)],
                         ids=["unchanged", "slow-once", "slow-twice"])
def test_a_slower_step_spawns_the_ranks_once_more_and_that_measurement_decides(pytester, slow_spawns, outcome,
                                                                                spawned):
    # Each rank counts its spawns in a file; the first `slow_spawns` of them take 20% longer. A SLOWER is measured
    # once more on ranks spawned again, and the second measurement decides; a PASS spawns them once.
    write(pytester, ms=1.0)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    spawns = pytester.path / "spawns"
    write(pytester, ms=1.0, spawns=str(spawns), slow_spawns=slow_spawns)
    result = run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(**{outcome: 1})
    assert [(spawns.parent / f"spawns.{rank}").read_text() for rank in (0, 1)] == ["x" * spawned] * 2
    info = only_benchmark(pytester)["extra_info"]
    assert info["remeasured"] == (spawned == 2)
    assert info["time_change"] == pytest.approx(0.2 if outcome == "failed" else 0.0)
    assert info["verdict"] == ("SLOWER" if outcome == "failed" else "PASS")
    if outcome == "failed":
        result.stdout.fnmatch_lines([
            "*SLOWER: test_step[[]ws2-gloo[]] median 1.2 ms vs baseline 1 ms (+20.0%*",
            "*confirmed: the time was re-measured once and was SLOWER again*",
        ])


def test_an_injected_delay_and_allocation_reach_every_rank(pytester, monkeypatch):
    # The delay is a fraction of the slowest rank's round (1.5 ms), queued on every rank: the judged round (rank 1's)
    # grows by that fraction; the bytes are held on every rank, so the largest rank's peak grows by them.
    write(pytester, ms=1.0, skew=0.5, memory=8 * MIB)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    monkeypatch.setenv("LMSYS_INJECT_DELAY", "0.2")
    monkeypatch.setenv("LMSYS_INJECT_MEMORY", str(MIB))
    result = run(pytester, *INJECTION, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*SLOWER: test_step[[]ws2-gloo[]] median 1.8 ms vs baseline 1.5 ms (+20.0%*",
        "*MORE-MEMORY: test_step[[]ws2-gloo[]] peak requested above start 17 MiB vs baseline 16 MiB*",
    ])
    bench = only_benchmark(pytester)
    info = bench["extra_info"]
    assert (info["injected_delay"], info["injected_memory"]) == (0.2, MIB)
    assert [rank["peak_requested_above_start_bytes"] for rank in info["per_rank_memory"]] == [9 * MIB, 17 * MIB]


def test_injected_cases_spawn_the_ranks_again_and_fail_nothing(pytester, monkeypatch):
    # lmsys.perf.detection --in-process: the unchanged step is judged, then each case on ranks spawned for it.
    write(pytester, ms=1.0, skew=0.5, memory=8 * MIB)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    monkeypatch.setenv("LMSYS_INJECT_CASES", "0.1:1048576,0.12")
    result = run(pytester, *INJECTION, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*injected: +10.0% and 1 MiB held: SLOWER+MORE-MEMORY; +12.0%: SLOWER*"])
    bench = only_benchmark(pytester)
    info = bench["extra_info"]
    assert info["verdict"] == "PASS" and "injected_delay" not in info
    cases = info["injected_cases"]
    assert [(c["delay"], c["memory"], c["verdict"]) for c in cases] == [(0.1, MIB, "SLOWER+MORE-MEMORY"),
                                                                         (0.12, 0, "SLOWER")]
    assert [c["time_change"] for c in cases] == [pytest.approx(0.1), pytest.approx(0.12)]


def test_a_slower_verdict_taken_hot_is_re_measured_on_every_rank_once_they_have_cooled(pytester, monkeypatch):
    # Each rank's GPU reads sw_thermal_slowdown for its next 2 readings (a second apart) and its step is 20% slower
    # meanwhile: the rounds say SLOWER, every rank waits for its GPU to read cool, and the rounds timed then decide.
    write(pytester, ms=1.0)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    monkeypatch.setenv("FAKE_THERMAL_SLOWDOWN", "0.2")
    monkeypatch.setenv("FAKE_HOT_READINGS", "2")
    result = run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*thermally throttled (sw_thermal_slowdown at 80 C): re-measured after 2 s idle, at "
                                 "40 C*"])
    assert "rank 1: thermally" not in result.stdout.str()  # rank 1's note is rank 0's: said once
    info = only_benchmark(pytester)["extra_info"]
    assert info["remeasured"] and info["verdict"] == "PASS"
    # Only rank 1's GPU hot: its note, named by rank.
    write(pytester, ms=1.0, hot_rank=1)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*rank 1: thermally throttled (sw_thermal_slowdown at 80 C): re-measured after 2 s "
                                 "idle, at 40 C*"])


def test_a_failing_rank_fails_the_test_with_its_traceback(pytester):
    write(pytester, fail_rank=1)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1*", "*ValueError: rank 1 cannot build its model*"])


def test_a_baseline_of_another_world_size_is_refused(pytester):
    write(pytester)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    (path,) = (pytester.path / "baselines" / "Fake_GPU_80GB").glob("*.json")
    doc = json.loads(path.read_text())
    doc["benchmarks"][0]["extra_info"]["world_size"] = 4
    path.write_text(json.dumps(doc))
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the baseline was measured with world size and transport (4, 'gloo')*"])


def test_noisy_rounds_are_added_on_every_rank_until_the_median_is_known(pytester):
    write(pytester, noise=0.2)
    result = run(pytester, "--benchmark-json=out.json", "--perf-max-time=30")
    result.assert_outcomes(passed=1)
    bench = only_benchmark(pytester)
    # 9 planned rounds cannot pin the median of a 20% noise to a quarter of the 5% tolerance: the rounds doubled.
    assert bench["stats"]["rounds"] > 9
    assert bench["stats"]["rounds"] % 9 == 0


def test_the_verdict_names_the_tolerance_that_applied(pytester):
    write(pytester, ms=1.0, skew=0.0)
    run(pytester, "--benchmark-save=base").assert_outcomes(passed=1)
    write(pytester, ms=1.0, skew=0.2)
    result = run(pytester, "--benchmark-compare", "--perf-time-tolerance=0.1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SLOWER: test_step*tolerance 10% (--perf-time-tolerance)*"])


def test_the_largest_rank_is_the_one_with_the_largest_peak_the_gate_compares():
    # Rank 0 got a larger block from its allocator, rank 1 asked for more: the gate judges rank 1's request.
    blocks = MemoryReading(allocated_before=0, reserved_before=0, peak_allocated=20 * MIB, peak_reserved=20 * MIB,
                           requested_before=0, peak_requested=10 * MIB)
    asked = MemoryReading(allocated_before=0, reserved_before=0, peak_allocated=12 * MIB, peak_reserved=12 * MIB,
                          requested_before=0, peak_requested=12 * MIB)
    assert multirank._largest([(blocks, {}), (asked, {}), (None, {})]) is asked
    old = MemoryReading(allocated_before=0, reserved_before=0, peak_allocated=20 * MIB, peak_reserved=20 * MIB)
    assert multirank._largest([(old, {}), (None, {})]) is old
