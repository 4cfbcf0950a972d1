"""What each measurement of an in-process detection run costs, counted on the fake GPU (perf_fakes.CountingGpu): the
A/A pass, which is what an ordinary perf run measures, and the passes of the injected cases (LMSYS_INJECT_CASES).
docs/gate-measurements.md ("The acceptance campaign on the H200") tabulates these counts."""

import json

import pytest
from perf_fakes import INJECTION, MIB, run, save_baseline, write_suite

from lmsys.perf import timing

pytest_plugins = ["pytester"]

# The fake's calls take no wall time, so a benchmark plans timing.MAX_ROUNDS rounds and MAX_WARMUP_ROUNDS warm-up
# rounds, its LAUNCH rounds LAUNCH_SHARE of them; --perf-max-time=0 keeps the rounds planned (no adapting).
R, W = timing.MAX_ROUNDS, timing.MAX_WARMUP_ROUNDS
L = int(timing.LAUNCH_SHARE * R)
COUNTED = ("--benchmark-max-time=1", "--perf-max-time=0")
TESTS = {
    "test_eager": {"ms": 2.0, "noise": 0.002},
    "test_graph": {"ms": 2.0, "noise": 0.002, "launch_ms": 3.0, "call": ", graph=True"},
    "test_queued": {"ms": 2.0, "noise": 0.002, "launch_ms": 3.0, "capturable": False, "call": ", graph=True"},
    "test_host": {"ms": 2.0, "noise": 0.002, "launch_ms": 0.5, "launch_noise": 0.002, "call": ", host=True"},
}


def nonzero(counts: dict) -> dict:
    return {kind: count for kind, count in counts.items() if count}


@pytest.fixture
def passes(monkeypatch):
    """Each timing.run of the inner runs: (its injection's label, or 'A/A'; its timing; what it asked of the fake)."""
    measured = []
    real = timing.run

    def counted(backend, call, **kwargs):
        before = dict(backend.counts)
        measurement = real(backend, call, **kwargs)
        inject = kwargs.get("inject")
        measured.append(("A/A" if inject is None else inject.label, measurement.timing,
                         nonzero({kind: backend.counts[kind] - before[kind] for kind in before})))
        return measurement

    monkeypatch.setattr(timing, "run", counted)
    return measured


def counted_run(pytester, monkeypatch, passes, tests: dict, *args, injection: bool = True):
    """A baseline of `tests` on the counting fake GPU, then a compare run with `args` (and the injection plugin); the
    passes of the compare run (into `passes`) and its benchmarks' extra_info by name."""
    monkeypatch.setenv("FAKE_GPU_CLASS", "CountingGpu")
    save_baseline(pytester, tests)
    write_suite(pytester, tests, seed=2)
    passes.clear()
    result = run(pytester, *INJECTION * injection, *COUNTED, "--benchmark-compare", "--benchmark-json=out.json", *args)
    result.assert_outcomes(passed=len(tests))
    benches = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    return {bench["name"]: bench["extra_info"] for bench in benches}


# A pass of an ordinary run, by timing: the warm-up's first call (and the replays' own), W warm-up rounds (the first
# of them the calibration round), the timed rounds (R replays behind W of their own warm-up for graph; behind one
# eager round that sizes the lead for queued and host), the LAUNCH rounds beside graph and queued ones, one memory
# reading.
ORDINARY = {
    "eager": {"first calls": 1, "eager rounds": W + R, "memory readings": 1},
    "graph": {"first calls": 2, "eager rounds": W, "replays": W + R, "launch rounds": L, "captures": 1,
              "memory readings": 1},
    "queued": {"first calls": 1, "eager rounds": W + 1, "queued rounds": R, "launch rounds": L, "memory readings": 1},
    "host": {"first calls": 1, "eager rounds": W + 1, "host rounds": R, "memory readings": 1},
}


def test_an_ordinary_pass_takes_its_warm_up_rounds_launch_rounds_and_memory_reading(pytester, monkeypatch, passes):
    """What an ordinary perf run measures, pass by pass: the injection leaves it as it is, the A/A pass of an
    in-process detection run included."""
    counted_run(pytester, monkeypatch, passes, TESTS, injection=False)
    assert passes == [("A/A", timing, ORDINARY[timing]) for timing in ("eager", "graph", "queued", "host")]
    monkeypatch.setenv("LMSYS_INJECT_CASES", "0.05:1048576,0:1048576")
    counted_run(pytester, monkeypatch, passes, TESTS)
    assert [aa for aa in passes if aa[0] == "A/A"] == [("A/A", timing, ORDINARY[timing])
                                                       for timing in ("eager", "graph", "queued", "host")]



def injected(passes, timing: str) -> list[tuple[str, dict]]:
    """The injected passes of the benchmark timed `timing`: (label, counts)."""
    return [(label, counts) for label, timed, counts in passes if label != "A/A" and timed == timing]


def sizing_rounds(extra_info: dict) -> int:
    """The rounds in which a benchmark's delays were sized: two turns of three blocks (the call alone and followed by
    two works), each its settling and its timed rounds."""
    from lmsys.perf import injection

    return 2 * 3 * sum(injection.block_rounds(extra_info["injected_sizing"]["typical"]))


def test_an_injected_case_takes_no_launch_rounds_unless_its_test_gates_the_host_time(pytester, monkeypatch, passes):
    """The LAUNCH rounds beside graph replays and queued rounds are reported, never gated unless the test says so: an
    injected case's verdict does not read them, and its passes leave them out. A captured call's eager warm-up is
    its first call and the calibration round (the replays keep their W rounds of warm-up); a queued one keeps its W
    rounds, which its queued rounds follow. Each caught delay is measured twice, as the gate re-measures a SLOWER;
    the first pass also sizes the benchmark's delays (Sizing: two turns of three blocks, and for graph three
    captures)."""
    monkeypatch.setenv("LMSYS_INJECT_CASES", "0.05:1048576,0.1")
    infos = counted_run(pytester, monkeypatch, passes, TESTS)
    graph = {"first calls": 2, "eager rounds": 1, "replays": W + R, "captures": 1, "memory readings": 1}
    sizing = {"replays": sizing_rounds(infos["test_graph"]), "captures": 3, "works": 3}
    assert injected(passes, "graph") == [
        ("+5.0% and 1 MiB held", {**graph, **{kind: graph.get(kind, 0) + n for kind, n in sizing.items()}}),
        ("+5.0% and 1 MiB held", graph), ("+10.0%", {**graph, "works": 1}), ("+10.0%", graph)]
    queued = {"first calls": 1, "eager rounds": W + 1, "queued rounds": R, "memory readings": 1}
    assert injected(passes, "queued") == [
        ("+5.0% and 1 MiB held", {**queued, "eager rounds": W + 2,
                                  "queued rounds": R + sizing_rounds(infos["test_queued"]), "works": 3}),
        ("+5.0% and 1 MiB held", queued), ("+10.0%", {**queued, "works": 1}), ("+10.0%", queued)]
    for name in ("test_graph", "test_queued"):
        assert [case["verdict"] for case in infos[name]["injected_cases"]] == ["SLOWER+MORE-MEMORY", "SLOWER"]
    # A test that gates its host-set time reads the LAUNCH rounds in every verdict, an injected case's too.
    gated = {name: {**spec, "marker": "perf_tolerance(host=0.5)"} for name, spec in TESTS.items()}
    counted_run(pytester, monkeypatch, passes, gated)
    assert all(counts["launch rounds"] == L for _, counts in injected(passes, "graph") + injected(passes, "queued"))
    assert [counts["eager rounds"] for _, counts in injected(passes, "graph")] == [1] * 4


@pytest.mark.parametrize("cases", ["0:1048576", "0.05:1048576,0.1"], ids=["memory-apart", "delays-from"])
def test_a_case_of_memory_alone_is_one_call_under_the_memory_reading(pytester, monkeypatch, passes, cases):
    """A case that only holds memory is judged on the memory alone: no rounds, no time to compare (time_change None),
    never re-measured; so are the benchmarks below LMSYS_INJECT_DELAYS_FROM."""
    monkeypatch.setenv("LMSYS_INJECT_CASES", cases)
    if cases != "0:1048576":
        monkeypatch.setenv("LMSYS_INJECT_DELAYS_FROM", "1")  # every benchmark below 1 s: the memory alone
    infos = counted_run(pytester, monkeypatch, passes, TESTS)
    assert [(label, timed, counts) for label, timed, counts in passes if label != "A/A"] == [
        ("1 MiB held", timing.MEMORY, {"memory readings": 1})] * len(TESTS)
    for info in infos.values():
        assert info["injected_cases"] == [{"delay": 0.0, "memory": MIB, "verdict": "MORE-MEMORY", "time_change": None,
                                          "time_resolution": None}]
