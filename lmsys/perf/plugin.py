"""pytest hooks and options of the regression gate (registered through the `pytest11` entry point).

State lives in one PerfSession in config.stash (session.py); the fixture is in fixture.py, verdicts in compare.py,
files in baselines.py, tables in report.py.
"""

import argparse
import traceback
from pathlib import Path

import pytest
import torch
from pytest_benchmark.utils import load_timer

from lmsys.perf import compare, hookspecs
from lmsys.perf.backend import detect_backend
from lmsys.perf.fixture import gpu_benchmark, oom_reason
from lmsys.perf.report import (
    MEMORY_REPORT_SUFFIXES,
    memory_frame,
    memory_report_lines,
    parse_report_option,
    session_markdown,
    summary_lines,
    write_memory_report,
    write_new_file,
)
from lmsys.perf.session import PYTEST_BENCHMARK_DEFAULT_STORAGE, RECORD_KEY, SESSION_KEY, PerfSession

__all__ = ["gpu_benchmark"]

MIB = 2**20
_WRITTEN_KEY = pytest.StashKey[Path]()
_MARKDOWN_KEY = pytest.StashKey[Path]()


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (a fraction: 0.05 is 5%)") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite, non-negative fraction")
    return value


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser):
    group = parser.getgroup("lmsys perf", "lmsys perf regression gate (on top of pytest-benchmark)")
    group.addoption(
        "--perf-time-tolerance", type=_fraction, default=0.05, metavar="FRACTION",
        help="SLOWER only when the median is slower than the baseline by more than this fraction, with confidence "
        "(see README, 'How a regression is decided'). Default: %(default)s",
    )
    group.addoption(
        "--perf-mem-tolerance", type=_fraction, default=0.01, metavar="FRACTION",
        help="MORE-MEMORY when the peak grows by more than this fraction and by more than --perf-mem-floor. "
        "Default: %(default)s",
    )
    group.addoption(
        "--perf-mem-floor", type=_byte_count, default=MIB, metavar="BYTES",
        help="Memory growth below this many bytes never fails. Default: %(default)s (1 MiB)",
    )
    group.addoption(
        "--gpu-mem-report", nargs="?", const=True, default=None, metavar="FILE",
        help="At the end, print every benchmark's memory high-water marks, largest first; with =FILE (.csv or "
        ".json) also write them there.",
    )
    group.addoption(
        "--perf-report", default=None, metavar="md:FILE",
        help="At the end, write the results (verdicts first when comparing) as a GitHub markdown table to FILE, "
        "e.g. for a CI job summary. The file must not exist yet.",
    )
    group.addoption(
        "--full-grid", action="store_true", default=False,
        help="Run the tests marked full_grid (points of the full perf grids), skipped otherwise.",
    )


def _saving(config) -> bool:
    return bool(config.getoption("benchmark_save") or config.getoption("benchmark_autosave"))


@pytest.hookimpl(trylast=True)
def pytest_perf_backend(config):
    return detect_backend(load_timer(config.getoption("benchmark_timer")).target)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Runs before pytest-benchmark's pytest_configure (trylast), which builds its session from these options.
    if config.getoption("benchmark_storage") == PYTEST_BENCHMARK_DEFAULT_STORAGE:
        config.option.benchmark_storage = str(config.rootpath / "baselines")
    if _saving(config):
        config.option.benchmark_save_data = True
    report = config.getoption("gpu_mem_report")
    if isinstance(report, str) and Path(report).suffix not in MEMORY_REPORT_SUFFIXES:
        raise pytest.UsageError(
            f"--gpu-mem-report={report}: the file must end in {' or '.join(MEMORY_REPORT_SUFFIXES)} "
            "(write --gpu-mem-report=FILE, or put --gpu-mem-report after the test paths)"
        )
    _check_markdown_report(config)
    config.addinivalue_line("markers", "perf_tolerance(time=None, memory=None): per-test regression tolerances")
    config.addinivalue_line("markers", "full_grid: a point of a full perf grid; runs only with --full-grid")
    config.stash[SESSION_KEY] = PerfSession(
        backend=config.hook.pytest_perf_backend(config=config),
        rootpath=config.rootpath,
        time_tolerance=config.getoption("perf_time_tolerance"),
        memory_tolerance=config.getoption("perf_mem_tolerance"),
        memory_floor=config.getoption("perf_mem_floor"),
        full_grid=config.getoption("full_grid"),
        memory_report=report,
        compare=config.getoption("benchmark_compare") or None,
        disable_gc=config.getoption("benchmark_disable_gc"),
        max_time=float(config.getoption("benchmark_max_time")),
        min_rounds=config.getoption("benchmark_min_rounds"),
    )
    # pytest-benchmark would load the baseline now, from a folder named after the OS and Python; the session
    # loads it at session start instead, from this device's folder.
    config.option.benchmark_compare = []


def _check_markdown_report(config) -> None:
    """Validates --perf-report before any test runs: a known format and a file that does not exist yet."""
    value = config.getoption("perf_report")
    if value is None:
        return
    try:
        _, path = parse_report_option(value)
    except ValueError as exc:
        raise pytest.UsageError(f"--perf-report={value}: {exc}") from None
    path = config.invocation_params.dir / path
    if path.exists():
        raise pytest.UsageError(f"--perf-report={value}: {path} already exists; remove it or name another file")
    config.stash[_MARKDOWN_KEY] = path


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    perf = session.config.stash[SESSION_KEY]
    session.config.option.benchmark_compare = perf.compare or []
    perf.attach(session.config._benchmarksession, _saving(session.config))


def pytest_report_header(config):
    session = config.stash[SESSION_KEY]
    tolerances = (
        f"time {session.time_tolerance:.0%}, memory {session.memory_tolerance:.0%} "
        f"and {compare.format_bytes(session.memory_floor)}"
    )
    lines = [f"lmsys perf: baselines in {session.folder or session.storage_path}; tolerances: {tolerances}"]
    lines += [f"lmsys perf: comparing with {path}" for path in session.compared_files]
    return lines


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["lmsys"] = config.stash[SESSION_KEY].environment
    # The CPU's momentary clock says nothing about the machine, but made every comparison warn that it differs.
    for volatile in ("hz_actual", "hz_actual_friendly"):
        (machine_info.get("cpu") or {}).pop(volatile, None)


def pytest_benchmark_update_commit_info(config, commit_info):
    # pytest-benchmark reads the commit from .git; a tree copied without it names the commit in $LMSYS_GIT_COMMIT.
    commit = config.stash[SESSION_KEY].environment["git_commit"]
    if commit and commit_info.get("id") in (None, "unversioned", "unknown"):
        commit_info["id"] = commit


def pytest_collection_modifyitems(config, items):
    session = config.stash[SESSION_KEY]
    skip_grid = pytest.mark.skip(reason="a point of the full grid: run with --full-grid to include it")
    for item in items:
        for marker in item.iter_markers("perf_tolerance"):
            try:
                compare.check_tolerances(marker.args, marker.kwargs)
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: bad @pytest.mark.perf_tolerance: {exc}") from None
        if not session.full_grid and item.get_closest_marker("full_grid"):
            item.add_marker(skip_grid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if "gpu_benchmark" not in getattr(item, "fixturenames", ()):
        return (yield)
    session = item.config.stash[SESSION_KEY]
    try:
        result = yield
    except torch.cuda.OutOfMemoryError as exc:
        reason = oom_reason(str(exc), session.backend.name)
        # The traceback's frames hold the test's tensors; clear them so the memory can actually be released.
        traceback.clear_frames(exc.__traceback__)
    else:
        record = item.stash.get(RECORD_KEY, None)
        if record is not None and record.verdict is not None and record.verdict.failed:
            pytest.fail(record.failure_message(), pytrace=False)
        return result
    session.backend.release_memory()
    pytest.skip(reason)


def pytest_sessionfinish(session):
    perf = session.config.stash.get(SESSION_KEY, None)
    if perf is not None and isinstance(perf.memory_report, str):
        path = session.config.invocation_params.dir / perf.memory_report
        write_memory_report(memory_frame(perf), path)
        session.config.stash[_WRITTEN_KEY] = path
    markdown = session.config.stash.get(_MARKDOWN_KEY, None)
    if perf is not None and markdown is not None:
        try:
            write_new_file(markdown, session_markdown(perf))
        except FileExistsError:
            perf.notes.append(f"markdown report NOT written: {markdown} appeared during the run")
        else:
            perf.notes.append(f"markdown report written to {markdown}")


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, config):
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return
    lines = summary_lines(session)
    if lines:
        terminalreporter.write_sep("-", "lmsys perf")
        for line in lines:
            terminalreporter.write_line(line)
    if session.memory_report:
        terminalreporter.write_sep("-", "GPU memory high-water marks (largest first)")
        for line in memory_report_lines(session, config.stash.get(_WRITTEN_KEY, None)):
            terminalreporter.write_line(line)
