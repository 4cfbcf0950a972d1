"""The lmsys.perf pytest plugin, end to end: pytester runs of tiny suites on a fake GPU (tests/perf_fakes.py) with a
deterministic clock and fake memory readings. A first run saves a baseline, a second run (other noise seed, maybe
slower or fatter) compares against it; the tests assert outcomes, output lines and the files on disk."""

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from perf_fakes import GPU, MACHINE, MIB, baseline_files, run, save_baseline, write_suite

pytest_plugins = ["pytester"]

def test_unchanged_run_passes(pytester):
    tests = {"test_a": {"ms": 1.0}, "test_b": {"ms": 3.0, "memory": 300 * MIB}}
    save_baseline(pytester, tests)
    write_suite(pytester, tests, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*compared with *0001_base.json", "*test_a*PASS*", "*test_b*PASS*"])


def test_twenty_percent_slower_fails_only_that_test(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}, "test_c": {"ms": 2.0}})
    write_suite(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.2}, "test_c": {"ms": 2.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*SLOWER: test_b median 1.[12]* ms vs baseline 1* ms (+*%, tolerance 2% (same machine start)*",
        "*confirmed: the time was re-measured once and was SLOWER again*",
        "FAILED test_suite.py::test_b - *SLOWER: test_b median*",
    ])
    change = float(re.search(r"SLOWER: test_b .*\(\+([0-9.]+)%", result.stdout.str()).group(1))
    assert 18 < change < 22


def test_three_percent_slower_within_five_percent_tolerance_passes(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 1.03}}, seed=2)
    result = run(pytester, "--benchmark-compare", "--perf-time-tolerance=0.05")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a*+[23].?%*PASS*"])


def test_same_distribution_with_large_noise_passes(pytester):
    tests = {f"test_{i}": {"ms": 1.0, "noise": 0.3} for i in range(4)}
    save_baseline(pytester, tests)
    write_suite(pytester, tests, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=4)


def test_memory_growth_of_ten_percent_fails(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0, "memory": 100 * MIB}, "test_b": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 1.0, "memory": 110 * MIB}, "test_b": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*MORE-MEMORY: test_a peak requested above start 110 MiB vs baseline 100 MiB (+10.0%, tolerance 0% and "
        "256 KiB)*",
        "*test_a*+10.0%*MORE-MEMORY*",
    ])


def test_no_baseline_means_new_and_passes(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*test_a*NEW*",
        f"*no baseline for {MACHINE} in *{MACHINE}: nothing compared, every benchmark is NEW*",
    ])


def test_a_benchmark_missing_from_the_baseline_is_new(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_a*PASS*", "*test_b*NEW*"])


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b'{"benchmarks": [', "is not valid JSON"), (b'{"machine_info": {}, "benchmarks": [{}]}', "has no 'fullname'")],
    ids=["truncated", "not-pytest-benchmark"],
)
def test_corrupt_baseline_is_a_clear_error_and_stays_untouched(pytester, content, problem):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    path.write_bytes(content)
    result = run(pytester, "--benchmark-compare", "--benchmark-save=again")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*baseline file {path}*{problem}*", "*Nothing was compared or overwritten*"])
    assert baseline_files(pytester) == [path]
    assert path.read_bytes() == content


PLAIN_TEST = "def test_plain(benchmark):\n    benchmark(sum, range(100))\n"


def test_plain_pytest_benchmark_tests_keep_pytest_benchmarks_storage(pytester):
    """In a run with both kinds, the gpu_benchmark results go to baselines/<GPU>/ and the plain pytest-benchmark ones
    to pytest-benchmark's own .benchmarks/<its machine id>/ (without raw data, as it saves them); a later
    --benchmark-compare compares each with its own file."""
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    pytester.makepyfile(test_plain=PLAIN_TEST)
    result = run(pytester, "--benchmark-save=x")
    assert result.ret == 0, result.stdout.str()
    [ours] = baseline_files(pytester)
    assert ours.name == "0001_x.json"
    assert [b["name"] for b in json.loads(ours.read_text())["benchmarks"]] == ["test_a"]
    [theirs] = (pytester.path / ".benchmarks").glob("*/0001_x.json")
    assert theirs.parent.name != MACHINE
    plain = json.loads(theirs.read_text())["benchmarks"]
    assert [b["name"] for b in plain] == ["test_plain"] and "data" not in plain[0]["stats"]

    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"*compared with *{MACHINE}*0001_x.json", "*test_a*PASS*"])
    result.stderr.fnmatch_lines([f"*Comparing against benchmarks from: {theirs.parent.name}*0001_x.json*"])
    for row in ("test_plain (*0001_x)*", "test_plain (NOW)*"):  # rows sorted by their times: either may be first
        result.stdout.fnmatch_lines([row])


def test_baseline_of_another_gpu_is_never_compared(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}}, gpu="Fake GPU A")
    write_suite(pytester, {"test_a": {"ms": 2.0}}, seed=2, gpu="Fake GPU B")
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a*NEW*", "*no baseline for Fake_GPU_B in *Fake_GPU_B: nothing compared*"])

    # Named explicitly, it is an error: the user asked for a comparison that the gate never makes.
    (other,) = baseline_files(pytester, "Fake_GPU_A")
    result = run(pytester, f"--benchmark-compare={other}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        f"*--benchmark-compare={other}: {other} was recorded on Fake_GPU_A, this run is on Fake_GPU_B; a baseline of "
        "another GPU model is never compared*"
    ])


def test_compare_picks_the_newest_baseline_unless_one_is_named(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}}, name="fast")
    save_baseline(pytester, {"test_a": {"ms": 2.0}}, name="slow")
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.stdout.fnmatch_lines(["*compared with *0002_slow.json", "*test_a*-50.?%*IMPROVED*"])
    result = run(pytester, "--benchmark-compare=0001")
    result.stdout.fnmatch_lines(["*compared with *0001_fast.json", "*test_a*PASS*"])


@pytest.mark.parametrize(("b_ms", "verdict"), [(1.0, "PASS"), (1.2, "SLOWER")], ids=["unchanged", "b-slower"])
def test_each_benchmark_is_compared_with_the_newest_file_that_has_it(pytester, b_ms, verdict):
    save_baseline(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}}, name="full")
    # A partial run saves test_a alone, at a new speed: test_a's baseline is then 2 ms, test_b's stays in 0001.
    write_suite(pytester, {"test_a": {"ms": 2.0}, "test_b": {"ms": 1.0}}, seed=1)
    assert run(pytester, "-k", "test_a", "--benchmark-save=part").ret == 0
    assert [p.name for p in baseline_files(pytester)] == ["0001_full.json", "0002_part.json"]
    write_suite(pytester, {"test_a": {"ms": 2.0}, "test_b": {"ms": b_ms}}, seed=2)
    result = run(pytester, "--benchmark-compare", "-v")  # -v: pytest-benchmark's table too, with each row's file
    failed = int(verdict == "SLOWER")
    result.assert_outcomes(passed=2 - failed, failed=failed)
    result.stdout.fnmatch_lines([
        "lmsys perf: comparing with *0001_full.json",
        "lmsys perf: comparing with *0002_part.json",
        "*compared with *0001_full.json",
        "*compared with *0002_part.json",
        "*test_a*PASS*",
        f"*test_b*{verdict}*",
        "test_b (0001_full)*",
        "test_a (0002_part)*",
    ])
    if failed:
        result.stdout.fnmatch_lines(["SLOWER: test_b median 1.[12]* ms vs baseline 1.0* ms*"])


def test_saving_keeps_samples_environment_and_never_overwrites(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (first,) = baseline_files(pytester)
    before = first.read_bytes()
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    assert [p.name for p in baseline_files(pytester)] == ["0001_base.json", "0002_base.json"]
    assert first.read_bytes() == before
    assert not list((pytester.path / "baselines" / MACHINE).glob(".tmp-*"))
    doc = json.loads(first.read_text())
    (bench,) = doc["benchmarks"]
    # At least the planned rounds; more where the median was not yet known to a quarter of its 2% tolerance.
    assert len(bench["stats"]["data"]) >= 21 and len(bench["stats"]["data"]) == bench["stats"]["rounds"]
    assert bench["extra_info"]["peak_allocated_above_start_bytes"] == 64 * MIB
    assert doc["machine_info"]["lmsys"]["machine_id"] == MACHINE
    assert doc["machine_info"]["lmsys"]["device"]["name"] == GPU
    assert set(doc["machine_info"]["lmsys"]["software"]) >= {"torch", "triton", "cuda", "cudnn", "nccl", "driver"}


# pytest-benchmark warns on its own that the machine_info differs; the plugin's warning is the one asserted.
@pytest.mark.filterwarnings("ignore:Benchmark machine_info is different")
def test_baseline_from_other_software_is_compared_with_a_warning(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    doc = json.loads(path.read_text())
    doc["machine_info"]["lmsys"]["software"]["torch"] = "0.0.1"
    path.write_text(json.dumps(doc))
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*test_a*PASS*", f"*{path} was recorded with other software (torch 0.0.1 -> *); compared anyway*"]
    )


def test_transient_slowdown_is_remeasured_and_passes(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    # Slow for the untimed call, the calibration round and the 21 timed rounds; back to normal for the re-measurement.
    write_suite(pytester, {"test_a": {"ms": 1.0, "slow_calls": 23, "slow_ms": 1.5}}, seed=2)
    result = run(pytester, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a*PASS (re-measured)*"])
    (bench,) = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    assert bench["extra_info"]["remeasured"] is True
    assert bench["stats"]["median"] == pytest.approx(1e-3, rel=0.02)


def test_tolerance_marker_overrides_the_defaults(pytester):
    save_baseline(pytester, {
        "test_time_default": {"ms": 1.0}, "test_time_marked": {"ms": 1.0},
        "test_memory_default": {"ms": 1.0, "memory": 100 * MIB}, "test_memory_marked": {"ms": 1.0, "memory": 100 * MIB},
    })
    write_suite(pytester, {
        "test_time_default": {"ms": 1.08},
        "test_time_marked": {"ms": 1.08, "marker": "perf_tolerance(time=0.10)"},
        "test_memory_default": {"ms": 1.0, "memory": 105 * MIB},
        "test_memory_marked": {"ms": 1.0, "memory": 105 * MIB, "marker": "perf_tolerance(memory=0.10)"},
    }, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["FAILED *test_time_default - *SLOWER*", "FAILED *test_memory_default - *MORE-MEMORY*"])


@pytest.mark.parametrize(
    ("marker", "problem"),
    [
        ("perf_tolerance(tme=0.1)", "unknown key(s) tme; allowed: time, memory, host"),
        ("perf_tolerance(time='fast')", "time='fast' must be a non-negative number"),
        ("perf_tolerance(memory=-0.01)", "memory=-0.01 must be a non-negative number"),
        ("perf_tolerance(0.1)", "takes keyword arguments only"),
    ],
)
def test_bad_tolerance_marker_is_a_usage_error_naming_the_test(pytester, marker, problem):
    write_suite(pytester, {"test_ok": {"ms": 1.0}, "test_marked": {"ms": 1.0, "marker": marker}}, seed=1)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*test_suite.py::test_marked: bad @pytest.mark.perf_tolerance: {problem}*"])


def test_perf_mem_report_prints_largest_first_and_writes_csv_and_json(pytester):
    tests = {"test_small": {"ms": 1.0, "memory": 10 * MIB}, "test_big": {"ms": 1.0, "memory": 300 * MIB},
             "test_mid": {"ms": 1.0, "memory": 20 * MIB}}
    save_baseline(pytester, tests)
    tests["test_big"]["memory"] = 303 * MIB
    write_suite(pytester, tests, seed=2)
    result = run(pytester, "--benchmark-compare", "--perf-mem-report=reports/mem.csv", "--perf-mem-tolerance=0.05")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*GPU memory high-water marks (largest first)*",
        "*test_big*815 MiB*303 MiB*1.092 GiB*300 MiB*+1.0%*",
        "*test_mid*532 MiB*20 MiB*",
        "*test_small*522 MiB*10 MiB*",
        "*memory report written to *mem.csv",
    ])
    table = pd.read_csv(pytester.path / "reports" / "mem.csv")
    assert list(table["benchmark"]) == [f"test_suite.py::test_{size}" for size in ("big", "mid", "small")]
    assert list(table["peak_allocated_above_start_bytes"]) == [303 * MIB, 20 * MIB, 10 * MIB]
    assert table["change"][0] == pytest.approx(0.01)

    run(pytester, "--perf-mem-report=mem.json").assert_outcomes(passed=3)
    rows = json.loads((pytester.path / "mem.json").read_text())
    assert [row["peak_reserved_above_start_bytes"] for row in rows] == [606 * MIB, 40 * MIB, 20 * MIB]


def test_perf_mem_report_without_a_gpu_says_so_and_passes(pytester):
    pytester.makeini("[pytest]\n")
    # The real CPU backend, also on a machine that has a GPU.
    pytester.makeconftest("""
        from lmsys.perf.backend import CpuBackend

        def pytest_perf_backend(config):
            return CpuBackend()
    """)
    pytester.makepyfile(test_cpu="def test_noop(gpu_benchmark):\n    gpu_benchmark(lambda: None)\n")
    result = run(pytester, "--perf-mem-report=mem.csv")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*no GPU memory readings: this run has no CUDA device (CPU timings only)*"])
    table = pd.read_csv(pytester.path / "mem.csv")
    assert list(table["benchmark"]) == ["test_cpu.py::test_noop"]
    assert table["peak_allocated_bytes"].isna().all()


def test_without_a_gpu_the_failed_graph_capture_is_said_once(pytester):
    pytester.makeini("[pytest]\n")
    pytester.makeconftest("""
        from lmsys.perf.backend import CpuBackend

        def pytest_perf_backend(config):
            return CpuBackend()
    """)
    pytester.makepyfile(test_cpu="""
        def test_one(gpu_benchmark):
            gpu_benchmark(lambda: None, graph=True)

        def test_two(gpu_benchmark):
            gpu_benchmark(lambda: None, graph=True)
    """)
    result = run(pytester)
    result.assert_outcomes(passed=2)
    assert result.outlines.count("no CUDA device: graph=True benchmarks are timed eagerly") == 1
    assert "capture failed" not in result.stdout.str()


def test_a_note_every_benchmark_has_is_said_once(pytester):
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite="""
        def test_a(gpu_benchmark, fake):
            fake.machine.update(other_processes=1)
            gpu_benchmark(fake.work(1.0, noise=0.01, seed=1))

        def test_b(gpu_benchmark, fake):
            gpu_benchmark(fake.work(1.0, noise=0.01, seed=2))

        def test_c(gpu_benchmark, fake):
            fake.machine.update(throttle=["sw_power_cap"])
            gpu_benchmark(fake.work(1.0, noise=0.01, seed=3))
    """)
    result = run(pytester)
    result.assert_outcomes(passed=3)
    assert [line for line in result.outlines if "other process" in line] == [
        "every benchmark: 1 other process(es) on the GPU"]
    assert "test_c: throttled (sw_power_cap)" in result.outlines


def test_pytest_benchmarks_table_only_when_asked(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a*1.0* ms*"])
    assert "Legend:" not in result.stdout.str()
    for asked in ("-v", "--benchmark-columns=min,max", "--benchmark-sort=max", "--benchmark-group-by=func"):
        run(pytester, asked).stdout.fnmatch_lines(["*benchmark*: 1 tests*", "*test_a*", "Legend:"])
    pytester.makepyfile(test_plain=PLAIN_TEST)  # plain pytest-benchmark tests keep their table, without ours
    out = run(pytester).stdout
    out.fnmatch_lines(["*benchmark: 1 tests*", "test_plain *", "Legend:"])
    assert not [line for line in out.lines if line.startswith("test_a ")]


def test_perf_mem_report_file_needs_a_known_extension(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, "--perf-mem-report=mem.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-mem-report=mem.txt: the file must end in .csv or .json*"])


def test_out_of_memory_skips_with_the_amount_and_the_session_goes_on(pytester):
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite="""
        import torch

        def test_oom(gpu_benchmark):
            def fn():
                raise torch.cuda.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB")
            gpu_benchmark(fn)

        def test_after(gpu_benchmark, fake):
            assert fake.released == 1
            gpu_benchmark(fake.work(1.0))
    """)
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*CUDA out of memory on Fake GPU 80GB: tried to allocate 20.00 GiB"])


def test_full_grid_tests_run_only_with_the_option(pytester):
    write_suite(pytester, {"test_point": {"ms": 1.0, "marker": "full_grid"}, "test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester)
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["lmsys perf: 1 full-grid points deselected (--perf-full-grid runs them)"])
    run(pytester, "--perf-full-grid").assert_outcomes(passed=2)


def test_the_plugins_options_share_the_perf_prefix_and_gpu_mem_report_stays_an_alias(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, "--gpu-mem-report=mem.csv")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*GPU memory high-water marks (largest first)*", "*memory report written to *mem.csv"])
    assert list(pd.read_csv(pytester.path / "mem.csv")["benchmark"]) == ["test_suite.py::test_a"]
    for old in ("--benchmark-calibrate=5", "--benchmark-save-failing", "--full-grid", "--gpu-mem-report-overwrite"):
        result = run(pytester, old)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*unrecognized arguments: {old}*"])


def test_throughput_against_the_device_peak_and_cold_l2(pytester):
    flops = 494_700_000_000  # per call of 1 ms: 494.7 TFLOP/s, half the H100's dense bf16 peak
    nbytes = 1_675_000_000  # per 1 ms: 1675 GB/s, half its HBM3 bandwidth
    call = f", flops={flops}, bytes={nbytes}, cold_l2=True"
    write_suite(pytester, {"test_a": {"ms": 1.0, "noise": 0.0, "call": call}}, seed=1, gpu="NVIDIA H100 80GB HBM3")
    result = run(pytester, "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a*494.7*1675*50.0% / 50.0%*"])
    (bench,) = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    info = bench["extra_info"]
    # The fake flush costs a whole second of clock time: it must not be in any sample.
    assert bench["stats"]["max"] == pytest.approx(1e-3)
    assert info["cold_l2"] is True
    assert info["precision"] == "bf16"
    assert info["tflops"] == pytest.approx(494.7)
    assert info["fraction_of_peak_tflops"] == pytest.approx(0.5)
    assert info["fraction_of_peak_gbps"] == pytest.approx(0.5)
    assert info["peak_allocated_bytes"] == info["allocated_before_bytes"] + 64 * MIB


def test_unknown_gpu_shows_rates_without_a_fraction_of_peak(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0, "noise": 0.0, "call": ", flops=10**12"}}, seed=1)
    result = run(pytester, "--benchmark-json=out.json")
    result.assert_outcomes(passed=1)
    (bench,) = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    assert bench["extra_info"]["tflops"] == pytest.approx(1000.0)
    assert "fraction_of_peak_tflops" not in bench["extra_info"]


def test_fixture_returns_the_last_result_checks_its_arguments_and_is_single_use(pytester):
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite="""
        import pytest
        from pytest_benchmark.fixture import FixtureAlreadyUsed

        def test_result(gpu_benchmark, fake):
            # untimed call, calibration round, 21 timed rounds, memory call: the last result is the 24th call's
            assert gpu_benchmark(fake.work(1.0)) == 24
            with pytest.raises(FixtureAlreadyUsed):
                gpu_benchmark(fake.work(1.0))

        @pytest.mark.parametrize("bad", [{"flops": -1}, {"bytes": 1.5}, {"warmup_rounds": True}, {"precision": "int8"}])
        def test_bad_arguments(gpu_benchmark, fake, bad):
            with pytest.raises(ValueError, match="gpu_benchmark: "):
                gpu_benchmark(fake.work(1.0), **bad)

        def test_warmup_rounds(gpu_benchmark, fake):
            # untimed call, calibration round plus 9 more warmup rounds, 21 timed rounds, memory call
            assert gpu_benchmark(fake.work(1.0), warmup_rounds=10) == 33
    """)
    run(pytester).assert_outcomes(passed=6)


def test_disabled_benchmarks_call_once_and_judge_nothing(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite="""
        def test_a(gpu_benchmark, fake):
            assert gpu_benchmark(fake.work(5.0)) == 1
    """)
    result = run(pytester, "--benchmark-disable", "--benchmark-compare")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*SLOWER*")


def test_kept_detection_runs_in_the_gpu_folder_are_never_baselines(pytester):
    """The detection runs committed compact under baselines/<GPU>/detection/<gate>/ (python -m lmsys.perf.detection
    --compact) are no baselines: --benchmark-compare's newest file, the next save's number and pytest-benchmark's own
    FileStorage see only the numbered files of the GPU's folder, even one named like a baseline down there."""
    import logging

    from pytest_benchmark.storage.file import FileStorage

    from lmsys.perf import baselines, detection

    save_baseline(pytester, {"test_a": {"ms": 1.0}}, name="fast")
    save_baseline(pytester, {"test_a": {"ms": 2.0}}, name="slow")
    storage = pytester.path / "baselines"
    kept = storage / MACHINE / "detection" / "abc1234"
    (kept / "runs").mkdir(parents=True)
    (kept / detection.MANIFEST).write_text(json.dumps({"pytest_args": ["perf_tests"], "in_process": True}))
    faster = json.loads((storage / MACHINE / "0001_fast.json").read_text())
    for bench in faster["benchmarks"]:
        bench["stats"] = {**bench["stats"], "median": bench["stats"]["median"] / 4}
    for path in (kept / "runs" / "runs-run-0.json", kept / "0099_run.json"):
        path.write_text(json.dumps(faster))
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1)  # against 0002_slow's 2 ms, not the quarter of 1 ms kept down there
    result.stdout.fnmatch_lines(["*compared with *0002_slow.json", "*test_a*-50.?%*IMPROVED*"])
    assert "abc1234" not in result.stdout.str()
    assert run(pytester, "--benchmark-save=next").ret == 0
    assert [p.name for p in baseline_files(pytester)] == ["0001_fast.json", "0002_slow.json", "0003_next.json"]
    assert baselines.next_number(storage / MACHINE) == 4
    own = FileStorage(storage, logging.getLogger(__name__), MACHINE)
    assert own._next_num == "0004"
    assert [str(path) for path, _ in own.load()] == [f"{MACHINE}/000{n}_{name}.json"
                                                     for n, name in ((1, "fast"), (2, "slow"), (3, "next"))]
    assert not any("detection" in name for name in detection.gate_files(storage))  # nor part of the gate


# What a plain `pytest perf_tests` may load of lmsys.perf, in lines: the gate itself. The tools around it (the
# gate's measurement and its injected regressions, calibration, reruns, the memory and markdown reports, baseline
# storage) are imported where their options or commands are used.
MAX_GATE_LINES = 3500
ROOT = Path(__file__).resolve().parents[1]
GATE_MODULES = """
import json, sys
import pytest
pytest.main(["perf_tests", "--collect-only", "-q", "-p", "no:cacheprovider"])
modules = {name: module.__file__ for name, module in list(sys.modules.items())
           if (name == "lmsys.perf" or name.startswith("lmsys.perf.")) and getattr(module, "__file__", None)}
print("GATE_MODULES " + json.dumps(modules))
"""


def gate_lines() -> dict[str, int]:
    """Lines of each lmsys.perf module that `pytest perf_tests --collect-only` imports, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", GATE_MODULES], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    found = [line for line in done.stdout.splitlines() if line.startswith("GATE_MODULES ")]
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    files = json.loads(found[-1].removeprefix("GATE_MODULES "))
    return {name: len(Path(path).read_text(encoding="utf-8").splitlines()) for name, path in files.items()}


def test_a_plain_perf_run_loads_at_most_3500_lines_of_the_gate_and_none_of_its_measurement():
    lines = gate_lines()
    assert "lmsys.perf.plugin" in lines and "lmsys.perf.fixture" in lines
    assert not {"lmsys.perf.injection", "lmsys.perf.detection", "lmsys.perf.reruns"} & set(lines)
    assert sum(lines.values()) <= MAX_GATE_LINES, (
        f"a plain `pytest perf_tests` loads {sum(lines.values())} lines of lmsys.perf, more than {MAX_GATE_LINES}: "
        + ", ".join(f"{name} {n}" for name, n in sorted(lines.items(), key=lambda item: -item[1]))
    )


def test_verbose_lines_give_each_passing_benchmark_s_median_change_and_verdict_as_it_finishes(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.3}}, seed=2)
    result = run(pytester, "--benchmark-compare", "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "test_suite.py::test_a PASSED (1.0* ms, [+-]*%, PASS)*",
        "test_suite.py::test_b FAILED*",
        "FAILED test_suite.py::test_b - *SLOWER: test_b median*",
    ])
    quiet = run(pytester, "--benchmark-compare")
    assert "PASSED (" not in quiet.stdout.str()


def test_the_objects_alive_after_collection_are_frozen_while_the_gate_runs_and_thawed_after(pytester):
    # Frozen, they are left out of the full collection before each memory measurement (its cost on a GPU host).
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    pytester.makepyfile(test_frozen="import gc\n\n\ndef test_frozen():\n    assert gc.get_freeze_count() > 0\n")
    assert gc.get_freeze_count() == 0
    run(pytester).assert_outcomes(passed=2)
    assert gc.get_freeze_count() == 0
