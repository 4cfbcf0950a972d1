"""The lmsys.perf plugin used the wrong way, as a hostile but realistic user would (issue 10): it never passes
silently, never loses or corrupts a baseline, and stays out of projects that do not use it. pytester runs of tiny
suites on the fake GPU of perf_fakes.py, like test_perf_plugin.py."""

import json
import math
import signal

import pytest
from lmsys.perf.baselines import TEMPORARY_PREFIX
from perf_fakes import INNER_CONFTEST, GPU, MACHINE, MIB, baseline_files, run, save_baseline, write_suite

pytest_plugins = ["pytester"]

USAGE_ERROR = pytest.ExitCode.USAGE_ERROR
# pytest-benchmark's own warning when it disables itself under xdist (in-process runs report it to this session).
XDIST_DISABLES_BENCHMARKS = pytest.mark.filterwarnings("ignore:Benchmarks are automatically disabled")
# Without pytest-xdist the option it adds is simulated, so that CI checks the refusal on any machine.
SIMULATED_XDIST = """

def pytest_addoption(parser):
    parser.addoption("--dist", default="no")
"""


def saved_names(path) -> list[str]:
    return [bench["name"] for bench in json.loads(path.read_text())["benchmarks"]]


@XDIST_DISABLES_BENCHMARKS
@pytest.mark.parametrize(
    "asked", [["--benchmark-compare"], ["--benchmark-save=ci"], ["--benchmark-autosave"], ["--perf-mem-report"]]
)
def test_comparing_or_saving_under_xdist_is_a_usage_error(pytester, asked):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 2.0}}, seed=2)
    pytester.makeconftest(INNER_CONFTEST.format(name=GPU) + SIMULATED_XDIST)
    result = run(pytester, "-p", "no:xdist", "--dist=load", *asked)
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([
        f"*{asked[0].split('=')[0]} under pytest-xdist (-n/--dist): pytest-benchmark times nothing in a distributed "
        "run, so nothing would be compared or saved and every test would pass. Run the benchmarks without -n*"
    ])
    assert len(baseline_files(pytester)) == 1
    # Without comparing or saving, a distributed run just runs the tests (untimed, as pytest-benchmark does).
    run(pytester, "-p", "no:xdist", "--dist=load").assert_outcomes(passed=1)


@XDIST_DISABLES_BENCHMARKS
def test_an_xdist_worker_refuses_as_well(pytester, monkeypatch):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    result = run(pytester, "--benchmark-compare")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark-compare under pytest-xdist*"])


@XDIST_DISABLES_BENCHMARKS
def test_real_xdist_run_with_compare_is_refused(pytester):
    pytest.importorskip("xdist")
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 2.0}}, seed=2)
    result = run(pytester, "-n", "2", "--benchmark-compare")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark-compare under pytest-xdist (-n/--dist)*"])


@pytest.mark.parametrize("value", ["NONEXISTENT", "9999", "first"])
def test_a_named_baseline_that_is_not_there_is_a_usage_error(pytester, value):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    result = run(pytester, f"--benchmark-compare={value}")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--benchmark-compare={value}: no baseline in *{MACHINE} is named by '{value}' *; it holds: 0001_base.json"]
    )
    result.assert_outcomes()


def test_a_named_baseline_in_a_folder_that_does_not_exist_says_so(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, "--benchmark-compare=3")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*no baseline in *{MACHINE} (which does not exist) is named by '3'*it holds: no baseline files"]
    )


@pytest.mark.parametrize("value", ["1", "0001", "0001_", "base"])
def test_a_baseline_is_named_by_number_file_name_or_saved_name(pytester, value):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    save_baseline(pytester, {"test_a": {"ms": 2.0}}, name="other")
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=2)
    result = run(pytester, f"--benchmark-compare={value}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["lmsys perf: comparing with *0001_base.json", "*test_a*PASS*"])


@pytest.mark.parametrize("path", ["sub", "test_suite.py", "test_suite.py::test_a"])
def test_a_test_path_swallowed_by_benchmark_compare_is_a_usage_error(pytester, path):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    pytester.mkdir("sub")
    result = run(pytester, "--benchmark-compare", path, "-k", "test_a")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([
        f"*--benchmark-compare took '{path}' as the baseline to compare with, but it is a path of the project: "
        "--benchmark-compare takes an optional value, so it swallowed the test path. Put --benchmark-compare after "
        f"the test paths (pytest * {path} -k test_a --benchmark-compare), or write --benchmark-compare=NUM*"
    ])


def test_a_failing_result_is_saved_only_when_asked(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.3}}, seed=2)
    result = run(pytester, "--benchmark-compare", "--benchmark-save=ci")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "left out of *0002_ci.json: 1 benchmark(s) whose test failed (test_suite.py::test_b); "
        "--perf-save-failing saves them anyway"
    ])
    assert saved_names(baseline_files(pytester)[1]) == ["test_a"]
    # The same slow code again: still compared with the good baseline, still SLOWER.
    result = run(pytester, "--benchmark-compare", "-v")  # -v: pytest-benchmark's table names each row's file
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_b*0001_base*"])

    result = run(pytester, "--benchmark-compare", "--benchmark-save=accepted", "--perf-save-failing")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["saved with failing results (--perf-save-failing): test_suite.py::test_b"])
    assert saved_names(baseline_files(pytester)[2]) == ["test_a", "test_b"]


def test_a_test_that_failed_after_measuring_is_not_saved(pytester):
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite="""
        def test_twice(gpu_benchmark, fake):
            gpu_benchmark(fake.work(1.0))
            gpu_benchmark(fake.work(1.0))

        def test_wrong_result(gpu_benchmark, fake):
            assert gpu_benchmark(fake.work(1.0)) == -1

        def test_ok(gpu_benchmark, fake):
            gpu_benchmark(fake.work(1.0))
    """)
    result = run(pytester, "--benchmark-save=x")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*FixtureAlreadyUsed*", "left out of *0001_x.json: 2 benchmark(s) whose test failed*"])
    (path,) = baseline_files(pytester)
    assert saved_names(path) == ["test_ok"]

    result = run(pytester, "--benchmark-save=y", "-k", "not test_ok")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["nothing saved: 2 benchmark(s) whose test failed*"])
    assert baseline_files(pytester) == [path]


INTERRUPTIONS = {
    "raised": "raise KeyboardInterrupt",
    # A SIGINT turns into a KeyboardInterrupt wherever Python is; inside a weakref callback (torch.compile's caches)
    # it is only printed and the run would go on. The plugin notes the signal itself.
    "swallowed": "try:\n        os.kill(os.getpid(), signal.SIGINT)\n    except KeyboardInterrupt:\n        pass",
}


@pytest.mark.parametrize("how", INTERRUPTIONS)
def test_an_interrupted_run_stops_and_saves_nothing(pytester, how):
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite=f"""
import os
import signal

def test_a(gpu_benchmark, fake):
    gpu_benchmark(fake.work(1.0))

def test_b(gpu_benchmark, fake):
    {INTERRUPTIONS[how]}

def test_c(gpu_benchmark, fake):
    gpu_benchmark(fake.work(1.0))
""")
    # The inner run's handler passes the signal on to the one it found: let that be Python's, not this session's.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = run(pytester, "--benchmark-save=partial", no_reraise_ctrlc=True)
    finally:
        signal.signal(signal.SIGINT, outer)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["NOT SAVED: the run was interrupted, so no baseline was written*"])
    assert baseline_files(pytester) == []
    ran = {report.nodeid.split("::")[-1] for report in result.reprec.getreports("pytest_runtest_logreport")}
    assert ran == {"test_a", "test_b"}  # test_c never ran


def test_the_sigint_handler_is_restored_after_the_run(pytester):
    before = signal.getsignal(signal.SIGINT)
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    run(pytester).assert_outcomes(passed=1)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_save_that_fails_at_the_end_says_so_and_fails_the_run(pytester):
    write_suite(pytester, {}, seed=1)
    pytester.makepyfile(test_suite=f"""
        import pathlib

        def test_a(gpu_benchmark, fake):
            gpu_benchmark(fake.work(1.0))
            # After the check before the run: a file appears where the GPU's folder would be created.
            pathlib.Path("baselines").mkdir()
            pathlib.Path("baselines", "{MACHINE}").write_text("")
    """)
    result = run(pytester, "--benchmark-save=x")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["NOT SAVED: FileExistsError: *"])


def test_a_memory_report_never_replaces_a_baseline_or_an_existing_file(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (baseline,) = baseline_files(pytester)
    before = baseline.read_bytes()
    result = run(pytester, "--benchmark-compare", f"--perf-mem-report={baseline}", "--perf-mem-report-overwrite")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--perf-mem-report={baseline}: * is inside *baselines, which holds baselines (and calibrations)*"]
    )
    assert baseline.read_bytes() == before

    (pytester.path / "mem.csv").write_text("mine\n")
    result = run(pytester, "--perf-mem-report=mem.csv")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-mem-report=mem.csv: *mem.csv exists: choose another name*"])
    assert (pytester.path / "mem.csv").read_text() == "mine\n"
    run(pytester, "--perf-mem-report=mem.csv", "--perf-mem-report-overwrite").assert_outcomes(passed=1)
    assert (pytester.path / "mem.csv").read_text().startswith("benchmark,")


def test_unwritable_outputs_stop_the_run_before_any_test(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    (pytester.path / "store").write_text("a file where the baselines folder should be")
    result = run(pytester, "--benchmark-storage=store", "--benchmark-save=x")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark-save=x: baselines cannot be saved into *store*: *store is not a folder*"])
    result.assert_outcomes()

    result = run(pytester, f"--benchmark-save={'x' * 300}")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*is longer than the * bytes the file system allows: use a shorter name*"])

    pytester.mkdir("report.csv")
    result = run(pytester, "--perf-mem-report=report.csv")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-mem-report=report.csv: *report.csv is a folder*"])


def test_a_project_that_does_not_use_gpu_benchmark_is_left_alone(pytester):
    pytester.makeini("[pytest]\n")
    # pytest-benchmark's probe of the CPU (py-cpuinfo) takes a second per run.
    pytester.makeconftest("""
        import pytest

        @pytest.hookimpl(optionalhook=True)
        def pytest_benchmark_generate_machine_info(config):
            return {"node": "n"}
    """)
    pytester.makepyfile(test_plain="""
        def test_plain():
            pass

        def test_timed(benchmark):
            benchmark(lambda: None)
    """)
    base = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--benchmark-max-time=0")
    for args in ([], ["--benchmark-save=mine"], ["--benchmark-compare"]):
        result = pytester.runpytest_inprocess(*base, *args)
        result.assert_outcomes(passed=2)
        assert not [line for line in result.outlines if line.startswith("lmsys perf")]
    assert not (pytester.path / "baselines").exists()
    # pytest-benchmark's own save, where and as it makes it.
    (saved,) = (pytester.path / ".benchmarks").glob("*/0001_mine.json")
    assert "lmsys" not in json.loads(saved.read_text())["machine_info"]
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark",
                                          "test_plain.py::test_plain")
    result.assert_outcomes(passed=1)


def test_gpu_benchmark_without_pytest_benchmark_is_a_usage_error(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*1 selected test(s) use gpu_benchmark, which needs pytest-benchmark; this run disabled it (-p no:benchmark)"]
    )


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("median", 0.0, "has a median time of 0 s"),
        ("min", -1e-3, "has negative times ['min']"),
        ("data", [0.0] * 21, "has per-round data whose median is 0 s"),
        ("data", [1e-3, -1e-3], "has malformed per-round data"),
        ("median", math.nan, "lacks numeric stats ['median']"),
        ("rounds", 0, "has rounds or iterations that are not positive whole numbers"),
    ],
)
def test_a_baseline_with_impossible_times_stops_the_run_before_any_test(pytester, key, value, problem):
    save_baseline(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    doc = json.loads(path.read_text())
    doc["benchmarks"][1]["stats"][key] = value
    path.write_text(json.dumps(doc))
    result = run(pytester, "--benchmark-compare")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*baseline file {path} is not a pytest-benchmark result: benchmark 'test_suite.py::test_b' "
         f"{problem.replace('[', '[[]')}*"]
    )
    result.assert_outcomes()


def test_a_baseline_with_negative_memory_stops_the_run(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    doc = json.loads(path.read_text())
    doc["benchmarks"][0]["extra_info"]["peak_allocated_above_start_bytes"] = -MIB
    path.write_text(json.dumps(doc))
    result = run(pytester, "--benchmark-compare")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{path}*peak_allocated_above_start_bytes that is not a non-negative number*"])


@pytest.mark.parametrize(("value", "shown"), [("nan", "NaN"), ("inf", "Infinity"), ("-1", "-1")])
def test_a_non_finite_or_negative_max_time_is_a_usage_error(pytester, value, shown):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                                          f"--benchmark-max-time={value}")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--benchmark-max-time={shown}: must be a finite, non-negative number of seconds*"]
    )


def test_benchmark_json_is_not_truncated_by_a_run_that_stops_early(pytester):
    """pytest-benchmark 5.2 opens --benchmark-json for writing while the command line is parsed: a run that then
    stopped on a usage error used to leave the file empty. Now the file is written only with the report."""
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    report = pytester.path / "report.json"
    report.write_text('{"earlier": "report"}')
    result = run(pytester, f"--benchmark-json={report}", "--perf-report=nonsense:x")
    assert result.ret == USAGE_ERROR
    assert report.read_text() == '{"earlier": "report"}'
    result = run(pytester, f"--benchmark-json={report}")
    result.assert_outcomes(passed=1)
    assert saved_names(report) == ["test_a"]
    assert not list(pytester.path.glob(f"{TEMPORARY_PREFIX}*"))  # no temporary file left


def test_benchmark_json_refuses_a_baseline_file(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (baseline,) = baseline_files(pytester)
    before = baseline.read_text()
    result = run(pytester, f"--benchmark-json={baseline}")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark-json*is named like a baseline file (NNNN_name.json)*--benchmark-save*"])
    assert baseline.read_text() == before


def test_the_perf_suite_stops_at_once_without_its_plugin():
    """`pytest perf_tests` with the plugin not loaded (lmsys not installed, `-p no:lmsys_perf`) stops before any test
    with one usage error that says how to load it, rather than an error per test; with `-p lmsys.perf.plugin` it
    collects."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "perf_tests", "--collect-only", "-q", "-p", "no:cacheprovider",
               "-p", "no:lmsys_perf"]
    stopped = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert stopped.returncode == USAGE_ERROR, stopped.stdout + stopped.stderr
    assert "pass -p lmsys.perf.plugin" in stopped.stderr
    loaded = subprocess.run([*command, "-p", "lmsys.perf.plugin"], cwd=root, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
