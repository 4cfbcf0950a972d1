"""--perf-report=md:FILE: the markdown report of a run, through pytester runs on the fake GPU (tests/perf_fakes.py),
and markdown_table on its own."""

import re

import pandas as pd
import pytest
from test_perf_plugin import GPU, MIB, run, save_baseline, write_suite

from lmsys.perf.report import markdown_table

pytest_plugins = ["pytester"]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row after the header and its rule."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def test_regressions_come_first_with_device_commit_and_baseline(pytester):
    tests = {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}, "test_c": {"ms": 2.0, "memory": 100 * MIB}}
    save_baseline(pytester, tests)
    write_suite(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 1.0}, "test_c": {"ms": 2.4, "memory": 120 * MIB}},
                seed=2)
    result = run(pytester, "--benchmark-compare", "--perf-report=md:out/perf.md")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*markdown report written to *out/perf.md"])
    text = (pytester.path / "out" / "perf.md").read_text()
    assert text.startswith("## lmsys perf: 1 of 3 benchmarks regressed\n")
    assert f"- GPU: {GPU}" in text
    assert "- commit: unknown (not a git checkout)" in text
    assert "- baselines compared: `baselines/Fake_GPU_80GB/0001_base.json`" in text
    rows = table_rows(text)
    assert [row[1] for row in rows] == ["`test_c`", "`test_a`", "`test_b`"]
    verdict, _, median, time_change, peak, memory_change, _ = rows[0]
    assert verdict == "**SLOWER+MORE-MEMORY (re-measured)**"
    assert median.endswith(" ms")
    change, baseline = re.fullmatch(r"\+([0-9.]+)% vs (.*)", time_change).groups()
    assert 18 < float(change) < 22 and baseline.endswith(" ms")
    assert (peak, memory_change) == ("120 MiB", "+20.0%")
    assert [row[0] for row in rows[1:]] == ["PASS", "PASS"]


def test_without_comparison_the_report_says_so(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0, "call": ", flops=2 * 10**12"}}, seed=1)
    result = run(pytester, "--perf-report=md:perf.md")
    result.assert_outcomes(passed=1)
    text = (pytester.path / "perf.md").read_text()
    assert text.startswith("## lmsys perf: 1 benchmark, not compared with a baseline\n")
    [row] = table_rows(text)
    assert row[0] == "not compared" and row[1] == "`test_a`"
    # 2 TFLOP in about 1 ms; the fake GPU is not in the peak table, so no fraction of peak.
    assert 1800 < float(row[-1]) < 2200


def test_new_benchmarks_and_notes_are_reported(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, "--benchmark-compare", "--perf-report=md:perf.md")
    result.assert_outcomes(passed=1)
    text = (pytester.path / "perf.md").read_text()
    assert "- verdicts: 1 NEW" in text
    assert "> no baseline for Fake\\_GPU\\_80GB" in text  # markup characters escaped: it renders literally
    assert table_rows(text)[0][0] == "NEW"


def test_an_existing_file_is_never_overwritten(pytester):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    (pytester.path / "perf.md").write_text("keep me")
    result = run(pytester, "--perf-report=md:perf.md")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-report=md:perf.md: *perf.md already exists; remove it or name another file"])
    assert (pytester.path / "perf.md").read_text() == "keep me"


@pytest.mark.parametrize("value", ["perf.md", "html:perf.html", "md:"])
def test_unknown_format_is_a_usage_error(pytester, value):
    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    result = run(pytester, f"--perf-report={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--perf-report={value}: expected FORMAT:FILE with FORMAT one of md*"])


def test_markdown_table_escapes_pipes_and_leaves_missing_cells_empty():
    frame = pd.DataFrame({"name": ["a|b", "c"], "value": [1.5, None]})
    assert markdown_table(frame) == "| name | value |\n|---|---|\n| a\\|b | 1.5 |\n| c |  |\n"
