"""What the gate writes, reads and leaves unjudged (issue 61): no report or export ever lands in a baseline folder or
replaces a baseline or calibration, whatever path leads there; reports are written atomically and checked before
any test runs; a compare names every baseline entry it did not judge and every regression a test's outcome hides;
hostile or huge baseline files are refused with an error naming the file. pytester runs on the fake GPU of
perf_fakes.py, like test_perf_misuse.py, and unit tests of baselines.py and markdown.py."""

import errno
import json
import os
import tempfile

import pytest
from perf_fakes import MACHINE, MIB, baseline_files, run, save_baseline, write_suite

from lmsys.perf import baselines, calibration, markdown
from lmsys.perf.session import Record

pytest_plugins = ["pytester"]

USAGE_ERROR = pytest.ExitCode.USAGE_ERROR
TESTS_FAILED = pytest.ExitCode.TESTS_FAILED


def assert_nothing_ran(result) -> None:
    assert not [line for line in result.outlines if line.startswith("test_suite.py")]


def folder_state(pytester) -> dict:
    """Every file under the inner project's baselines/ and its bytes (symlinks as where they lead)."""
    root = pytester.path / "baselines"
    return {
        str(path.relative_to(root)): os.readlink(path) if path.is_symlink() else path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() or path.is_symlink()
    }


def with_calibration(pytester):
    """A saved baseline and a calibration of it in the GPU's folder."""
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    entry = {"runs": 2, "timing": "eager", "medians": [1e-3, 1e-3], "spread": 0.01}
    calibration.update(pytester.path / "baselines" / MACHINE, MACHINE, {"test_suite.py::test_a": entry})


# A baseline or the calibration is never destroyed.

@pytest.mark.parametrize(("link", "to", "where"), [
    ("baselines/link.json", "baseline", "baselines/link.json"),
    ("link.json", "baseline", "link.json"),
    ("link.json", "calibration", "link.json"),  # named like no baseline: only where it leads tells
    ("linked", "folder", "linked/report.json"),  # a file that does not exist yet, in a linked GPU folder
])
def test_benchmark_json_through_a_symlink_into_a_baseline_folder_is_refused(pytester, link, to, where):
    with_calibration(pytester)
    folder = pytester.path / "baselines" / MACHINE
    (baseline,) = baselines.baseline_files(folder)
    (pytester.path / link).symlink_to({"baseline": baseline, "calibration": folder / calibration.FILE_NAME,
                                       "folder": folder}[to])
    before = folder_state(pytester)
    result = run(pytester, f"--benchmark-json={where}")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--benchmark-json={where}: *checked before running any test*"])
    assert_nothing_ran(result)
    assert folder_state(pytester) == before


@pytest.mark.parametrize("option", ["--benchmark-json={}", "--perf-report=md:{}", "--perf-mem-report={}"])
@pytest.mark.parametrize("name", ["calibration.json", "0002_x.json", "notes.json"])
def test_no_report_lands_in_a_baseline_folder(pytester, option, name):
    with_calibration(pytester)
    before = folder_state(pytester)
    target = f"baselines/{MACHINE}/{name}"
    result = run(pytester, "--benchmark-compare", option.format(target))
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option.format(target).split('=')[0]}*{name}*"])
    assert_nothing_ran(result)
    assert folder_state(pytester) == before
    run(pytester, "--benchmark-compare").assert_outcomes(passed=1)  # the next compare still reads everything


def _cut_off_save_json(self, output_json):
    """pytest-benchmark 5.3.1's save_json on a full disk: it opens the path and writes into it, so the disk filling
    up leaves 4096 bytes of cut-off JSON in place of the earlier report."""
    with open(os.fspath(self.json), "wb") as fh:
        fh.write(json.dumps(output_json, indent=4).encode()[:4096])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_benchmark_json_is_written_atomically(pytester, monkeypatch):
    from pytest_benchmark.session import BenchmarkSession

    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    json_file = pytester.path / "report.json"
    json_file.write_text('{"earlier": "report"}')
    # pytest-benchmark's own writer is never the one that writes the report.
    monkeypatch.setattr(BenchmarkSession, "save_json", _cut_off_save_json)
    result = run(pytester, f"--benchmark-json={json_file}")
    result.assert_outcomes(passed=1)
    assert [bench["name"] for bench in json.loads(json_file.read_text())["benchmarks"]] == ["test_a"]

    # A disk that fills up while the report is written: the earlier report stays whole, the run says so and fails.
    json_file.write_text('{"earlier": "report"}')

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    result = run(pytester, f"--benchmark-json={json_file}")
    monkeypatch.undo()
    assert result.ret == TESTS_FAILED
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"NOT WRITTEN: the --benchmark-json report {json_file}: OSError: *No space left*"])
    assert json_file.read_text() == '{"earlier": "report"}'
    assert not list(pytester.path.glob(f"{baselines.TEMPORARY_PREFIX}*"))  # no temporary file left


@pytest.mark.parametrize("name", ["a\nb", "a\x1b[2Jb", "a\tb", "a\u200bb"])
def test_a_save_name_with_control_characters_is_refused_before_any_test(pytester, name):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, f"--benchmark-save={name}")
    assert result.ret == USAGE_ERROR
    assert "must not hold control or unprintable characters" in result.stderr.str()
    assert "\x1b" not in result.stderr.str() + result.stdout.str()
    assert_nothing_ran(result)
    assert not (pytester.path / "baselines").exists()


# A compare that passes without comparing.

def test_an_empty_benchmark_compare_is_a_usage_error(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    result = run(pytester, "--benchmark-compare=")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark-compare=: the value is empty*"])
    assert_nothing_ran(result)


def test_a_regression_an_xfail_marker_hides_still_fails_the_run(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}})
    write_suite(pytester, {"test_a": {"ms": 1.3, "marker": "xfail(reason='flaky')"}, "test_b": {"ms": 1.0}}, seed=2)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1, xfailed=1)
    assert result.ret == TESTS_FAILED
    result.stdout.fnmatch_lines([
        "NOT PASSED: test_suite.py::test_a: SLOWER*, a regression that its xfail marker hides; it fails the run all "
        "the same (SLOWER: test_a median *"
    ])


def test_a_regression_a_skip_after_measuring_hides_still_fails_the_run(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    pytester.makepyfile(test_suite="""
        import pytest

        def test_a(gpu_benchmark, fake):
            gpu_benchmark(fake.work(1.3, noise=0.01, seed=3))
            pytest.skip("decided afterwards")
    """)
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(skipped=1)
    assert result.ret == TESTS_FAILED
    result.stdout.fnmatch_lines(["NOT PASSED: test_suite.py::test_a: SLOWER*a regression that a skip after measuring*"])


UNJUDGED_SUITE = """
import pytest

def test_a(gpu_benchmark, fake):
    gpu_benchmark(fake.work(1.0, noise=0.01, memory=64 * 2**20, seed=3))

def test_b(gpu_benchmark, fake):
    pass  # no longer measures

def test_c(gpu_benchmark, fake):
    pytest.skip("no GPU here")

def test_d(gpu_benchmark, fake):
    gpu_benchmark(fake.work(1.0, noise=0.01, memory=64 * 2**20, seed=4))
"""


def test_a_compare_names_every_baseline_entry_it_did_not_judge(pytester):
    save_baseline(pytester, {name: {"ms": 1.0} for name in ("test_a", "test_b", "test_c", "test_d")})
    pytester.makepyfile(test_suite=UNJUDGED_SUITE)
    result = run(pytester, "--benchmark-compare", "-k", "not test_d")
    result.assert_outcomes(passed=2, skipped=1)
    assert result.ret == TESTS_FAILED  # test_b passed without measuring its baselined benchmark
    result.stdout.fnmatch_lines([
        "NOT JUDGED: 1 baseline entry of the selected tests, NOT MEASURED: the test passed without measuring it (no "
        "gpu_benchmark call): the run fails: test_suite.py::test_b",
        "not judged: 1 baseline entry of the selected tests, skipped (no GPU here): test_suite.py::test_c",
    ])
    assert "test_d" not in result.stdout.str().split("lmsys perf")[-1]  # deselected: not listed

    # A skipped test alone does not fail the run, but is named.
    result = run(pytester, "--benchmark-compare", "-k", "test_a or test_c")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["not judged: 1 baseline entry of the selected tests, skipped (no GPU here)*"])


def test_benchmark_skip_with_a_compare_names_what_it_did_not_judge(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    result = run(pytester, "--benchmark-compare", "--benchmark-skip")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["not judged: 1 baseline entry of the selected tests, skipped (*): test_suite.py::test_a"]
    )


def test_a_baseline_without_benchmarks_is_said(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    empty = pytester.path / "baselines" / MACHINE / "0002_empty.json"
    doc = json.loads(baseline_files(pytester)[0].read_text())
    empty.write_text(json.dumps({**doc, "benchmarks": []}))
    result = run(pytester, "--benchmark-compare=2")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--benchmark-compare=2: {empty} holds no benchmarks*"])
    result = run(pytester, "--benchmark-compare")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_a*PASS*", f"not compared: {empty} holds no benchmarks*"])


# Hostile or huge files.

def _edited_baseline(pytester, edit) -> str:
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    doc = json.loads(path.read_text())
    edit(doc["benchmarks"][0])
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda bench: bench["stats"].update(rounds=10**400), "lacks numeric stats ['rounds']"),
    (lambda bench: bench["extra_info"].update(peak_allocated_above_start_bytes=10**400),
     "has a peak_allocated_above_start_bytes that is not a non-negative number"),
    (lambda bench: bench["stats"].update(median=bench["stats"]["median"] * 3000),
     "has a stats.median (* s) that is not the median of its per-round data (* s)"),
])
def test_a_baseline_with_impossible_numbers_is_named(pytester, edit, problem):
    path = _edited_baseline(pytester, edit)
    result = run(pytester, "--benchmark-compare")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*baseline file {path} is not a pytest-benchmark result: benchmark 'test_suite.py::test_a' "
         f"{problem.replace('[', '[[]')}*"]
    )
    assert_nothing_ran(result)


def test_a_deeply_nested_baseline_is_named(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    path.write_text("[" * 100_000 + "]" * 100_000)
    result = run(pytester, "--benchmark-compare")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"*baseline file {path} is not usable JSON: it is nested too deeply to read*"])


def _bench(rounds: int) -> dict:
    data = [1e-3 * (1 + (k % 7) / 100) for k in range(rounds)]
    ordered = sorted(data)
    median = (ordered[(rounds - 1) // 2] + ordered[rounds // 2]) / 2
    stats = {"min": ordered[0], "max": ordered[-1], "mean": median, "stddev": 0.0, "median": median, "iqr": 0.0,
             "rounds": rounds, "iterations": 1, "data": data}
    info = {"eager_data": [2 * x for x in data], "eager_timing": "launch"}
    return {"fullname": "t::a", "name": "a", "stats": stats, "extra_info": info}


def test_a_baseline_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "0001_big.json"
    path.write_text(json.dumps({"machine_info": {}, "benchmarks": [_bench(2000)]}))
    monkeypatch.setattr(baselines, "MAX_FILE_BYTES", 1000)
    with pytest.raises(baselines.BaselineError, match=f"baseline file {path} is .* bytes, more than the 1000 bytes"):
        baselines.read_baseline(path)


def test_a_baseline_with_many_rounds_keeps_a_bounded_evenly_spaced_part(tmp_path):
    path = tmp_path / "0001_many.json"
    path.write_text(json.dumps({"machine_info": {"lmsys": {"schema": baselines.SCHEMA}}, "benchmarks": [_bench(25_001)]}))
    [bench] = baselines.read_baseline(path)["benchmarks"]
    data, launch = bench["stats"]["data"], bench["extra_info"]["eager_data"]
    assert len(data) == len(launch) == baselines.MAX_SAMPLES
    assert launch == [2 * x for x in data]  # both series thinned alike
    assert data[0] == _bench(25_001)["stats"]["data"][0] and data[-1] == _bench(25_001)["stats"]["data"][-1]
    assert bench["stats"]["rounds"] == 25_001


# Markdown and terminal injection.

HOSTILE = "x`](https://evil.example)![i](https://evil.example/i.png)<img src=x>``|\x1b[2J"


def test_the_markdown_report_renders_any_text_literally():
    record = Record(name=HOSTILE, fullname=HOSTILE, median=1e-3, rounds=5, memory=None, rates={})
    text = markdown.markdown_report(markdown.report_frame([record], False), "GPU: *bold*", "abc", [f"b/{HOSTILE}.json"],
                           [f"note {HOSTILE}"], [""])
    cell = text.splitlines()[-3].split(" | ")[1]
    fence = "`" * 3  # one more than the longest run of backticks in the name
    assert cell == f"{fence}{HOSTILE.replace('|', chr(92) + '|').replace(chr(27), chr(92) + 'x1b')}{fence}"
    assert f"- baselines compared: {fence}b/" in text
    assert "\x1b" not in text
    note = text.splitlines()[-1]
    assert note == "> note " + markdown.markdown_text(HOSTILE)
    # Every markup character of the note is escaped: no link, image, HTML or code span can start.
    body = note.removeprefix("> ")
    for char in "`[]!<>|":
        assert all(body[k - 1] == "\\" for k, c in enumerate(body) if c == char)
    assert "- GPU: \\*bold\\*" in text


@pytest.mark.parametrize(
    ("text", "span"), [("a", "`a`"), ("a`b", "``a`b``"), ("`a", "`` `a ``"), ("a``", "``` a`` ```")]
)
def test_a_code_span_is_fenced_longer_than_any_run_of_backticks(text, span):
    assert markdown.code_span(text) == span


def test_terminal_escapes_in_paths_never_reach_the_terminal_raw(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    (path,) = baseline_files(pytester)
    hostile = path.with_name("b\x1b[31m.json")
    hostile.write_bytes(path.read_bytes())
    result = run(pytester, f"--benchmark-compare={hostile}")
    result.assert_outcomes(passed=1)
    assert "\x1b" not in result.stdout.str()
    result.stdout.fnmatch_lines(["compared with *b\\x1b[[]31m.json"])


# Errors found before the first test.

@pytest.mark.parametrize("option", ["--benchmark-json=afile/report.json", "--perf-report=md:afile/perf.md",
                                    "--benchmark-json=ro/report.json", "--perf-report=md:ro/perf.md"])
def test_a_report_that_cannot_be_written_is_a_usage_error_before_any_test(pytester, monkeypatch, option):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    (pytester.path / "afile").write_text("a file where a folder should be")
    read_only = pytester.mkdir("ro")
    mkstemp = tempfile.mkstemp

    def refused(*args, dir=None, **kwargs):  # a read-only folder (root writes into a chmod 555 one)
        if dir is not None and os.path.samefile(dir, read_only):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    result = run(pytester, option)
    monkeypatch.undo()
    assert result.ret == USAGE_ERROR
    folder = "afile is not a folder" if "afile" in option else "ro is not writable"
    result.stderr.fnmatch_lines([f"*{option}: *{folder}*(checked before running any test; nothing was written)"])
    assert_nothing_ran(result)


def test_a_memory_report_is_written_atomically(pytester, monkeypatch):
    write_suite(pytester, {"test_a": {"ms": 1.0, "memory": 8 * MIB}}, seed=1)
    mem_file = pytester.path / "mem.csv"
    mem_file.write_text("earlier\n")

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    result = run(pytester, "--perf-mem-report=mem.csv", "--perf-mem-report-overwrite")
    monkeypatch.undo()
    assert result.ret == TESTS_FAILED
    result.stdout.fnmatch_lines(["NOT WRITTEN: the memory report *mem.csv: *No space left*"])
    assert mem_file.read_text() == "earlier\n"
