"""pytest hooks and options of the regression gate (registered through the `pytest11` entry point).

State lives in one PerfSession in config.stash (session.py); the fixture is in fixture.py, the rule in verdict.py,
files in baselines.py, tables in report.py.

The plugin is installed for every pytest run in the environment, so it keeps out of the way of projects that do not
use `gpu_benchmark`: the gate switches on after collection, when a selected test uses the fixture; until then it
changes no option of pytest-benchmark's and writes nothing (pytest-benchmark's own loading of --benchmark-compare is
only held back until collection says whose it is).
"""

import argparse
import contextlib
import gc
import math
import os
import signal
import threading
import traceback
from pathlib import Path

import pytest
import torch
from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import load_timer, safe_dumps

from lmsys.perf import baselines, hookspecs, report, verdict
from lmsys.perf.backend import detect_backend
from lmsys.perf.fixture import gpu_benchmark, oom_reason
from lmsys.perf.session import RECORD_KEY, SESSION_KEY, PerfSession

__all__ = ["gpu_benchmark"]

KIB = 2**10
# pytest-benchmark's default --benchmark-storage; when it is unchanged the gate stores in rootdir/baselines.
PYTEST_BENCHMARK_DEFAULT_STORAGE = "file://./.benchmarks"
_REPORT_PATH_KEY = pytest.StashKey[Path]()
_WRITTEN_KEY = pytest.StashKey[Path]()
_MARKDOWN_KEY = pytest.StashKey[Path]()
# Reports that could not be written at the end ("NOT WRITTEN: ..."): the run fails.
_UNWRITTEN_KEY = pytest.StashKey[list[str]]()
# nodeid of each test that ran -> how it ended ("passed", "failed", "skipped (REASON)", "xfailed (REASON)").
_OUTCOMES_KEY = pytest.StashKey[dict[str, str]]()
# Regressions that a test's outcome hides (an xfail marker, a skip after measuring): the run fails all the same.
_HIDDEN_KEY = pytest.StashKey[list[str]]()
# Baseline entries of tests that ran and passed without measuring them: the run fails.
_UNMEASURED_KEY = pytest.StashKey[list[str]]()
# nodeid -> what its benchmark measured and the verdict, for the verbose progress line (pytest_report_teststatus)
_STATUS_KEY = pytest.StashKey[dict[str, str]]()
# How many points of the full grids this run deselected (no --perf-full-grid).
_FULL_GRID_KEY = pytest.StashKey[int]()
_FROZEN_KEY = pytest.StashKey[bool]()


def _number(convert, what: str, minimum: float = 0):
    """An argparse type: convert(text), finite and at least `minimum`, else an error saying it must be `what`."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


_fraction = _number(float, "a finite, non-negative fraction (0.05 is 5%)")
_byte_count = _number(int, "a non-negative whole number of bytes")
_seconds = _number(float, "a finite, non-negative number of seconds")


def _runs(text: str) -> int:
    from lmsys.perf.calibration import MIN_RUNS

    return _number(int, f"a whole number of runs, at least {MIN_RUNS} (a calibration needs them)", MIN_RUNS)(text)


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspecs)


class JsonReport(os.PathLike):
    """The file of pytest-benchmark's --benchmark-json. pytest-benchmark 5.2 declares the option as
    argparse.FileType('wb'), which empties the file while the command line is parsed: a run that then stops on a
    usage error, or is interrupted, leaves an empty file where the previous report (or a baseline) was. This type only
    names the path (5.3 opens it itself: `os.fspath`); the report is written atomically by _write_json_atomically,
    which replaces pytest-benchmark's save_json. A path named like a baseline file (NNNN_name.json) is refused here
    already; the rest of the guard (baselines.output_problem) runs once the storage folder is known."""

    def __init__(self, text: str):
        self.path = Path(text)
        if baselines.file_number(self.path) is not None:
            raise argparse.ArgumentTypeError(
                f"{text} is named like a baseline file (NNNN_name.json), which a JSON report would overwrite: "
                "baselines are written once, by --benchmark-save; name the report otherwise"
            )

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)


def pytest_plugin_registered(plugin, manager):
    """Once pytest-benchmark's options exist (this hook also replays the registrations before this plugin's), give
    --benchmark-json the JsonReport type before the command line is parsed."""
    # pytest's parser internals differ between versions; tests/test_perf_misuse.py fails if none of these applies
    # (and a version that has none of them still loads the plugin).
    with contextlib.suppress(AttributeError, TypeError):
        _use_json_report(manager.get_plugin("pytestconfig"))


def _use_json_report(config) -> None:
    """Make JsonReport the type of --benchmark-json in config's parser, if that option exists yet."""
    for group in getattr(getattr(config, "_parser", None), "_groups", ()):
        for option in getattr(group, "options", ()):
            if "--benchmark-json" not in option.names():
                continue
            action = getattr(option, "_action", None)
            if action is not None:  # pytest >= 9.2: the option wraps its argparse action
                action.type = JsonReport
            elif isinstance(getattr(option, "_attrs", None), dict):  # earlier: the attributes an action is built from
                option._attrs["type"] = option.type = JsonReport
        # pytest 9.0-9.1 also add each option to an argparse group at once: that action parses the value.
        for action in getattr(getattr(group, "_arggroup", None), "_group_actions", ()):
            if "--benchmark-json" in action.option_strings:
                action.type = JsonReport


def pytest_addoption(parser):
    group = parser.getgroup("lmsys perf", "lmsys perf regression gate (on top of pytest-benchmark)")
    group.addoption(
        "--perf-time-tolerance", type=_fraction, default=None, metavar="FRACTION",
        help="SLOWER only when the device time's median is slower than the baseline's by more than this fraction, "
        "with confidence (README, 'How a regression is decided'). Default: "
        f"{verdict.SAME_START:.1%} against a baseline saved in this machine start, {verdict.OTHER_START:.0%} against "
        "one from another start, or more where a calibration measured more noise",
    )
    group.addoption(
        "--perf-host-tolerance", type=_fraction, default=None, metavar="FRACTION",
        help="Gate the times the host's speed sets (host=True benchmarks, the launch cost beside graph replays) at "
        "this fraction. Default: they are reported and saved but fail no test, unless the test's "
        "@pytest.mark.perf_tolerance(host=...) gates them",
    )
    group.addoption(
        "--perf-max-time", type=_seconds, default=10.0, metavar="SECONDS",
        help="While a benchmark's median is known less precisely than a quarter of its tolerance, its rounds are "
        "doubled, up to this many seconds of timed rounds; 0 keeps the rounds --benchmark-max-time plans. "
        "Default: %(default)s",
    )
    group.addoption(
        "--perf-mem-tolerance", type=_fraction, default=0.0, metavar="FRACTION",
        help="MORE-MEMORY when the peak grows by more than this fraction of the baseline's and by more than "
        "--perf-mem-floor. Default: %(default)s",
    )
    group.addoption(
        "--perf-mem-floor", type=_byte_count, default=256 * KIB, metavar="BYTES",
        help="Memory growth up to this many bytes never fails. Default: %(default)s (256 KiB)",
    )
    group.addoption(
        "--perf-calibrate", type=_runs, default=None, metavar="N",
        help="Instead of running the selected benchmarks, rerun them N times in fresh processes and store each "
        "one's run-to-run spread of the median in calibration.json in this GPU's baselines folder: their time "
        "tolerances then follow from their own noise (README, 'How a regression is decided').",
    )
    group.addoption(
        "--perf-save-failing", action="store_true", default=False,
        help="With --benchmark-save/--benchmark-autosave, also save the results of tests that failed (a SLOWER "
        "verdict, an error after measuring). Without it they are left out of the saved baseline.",
    )
    group.addoption(
        "--perf-mem-report", "--gpu-mem-report", nargs="?", const=True, default=None, metavar="FILE",
        help="At the end, print every benchmark's memory high-water marks, largest first; with =FILE (.csv or "
        ".json) also write them there (a new file: see --perf-mem-report-overwrite). --gpu-mem-report is the "
        "same option.",
    )
    group.addoption(
        "--perf-mem-report-overwrite", action="store_true", default=False,
        help="Let --perf-mem-report=FILE replace an existing FILE (never a baseline).",
    )
    group.addoption(
        "--perf-report", default=None, metavar="md:FILE",
        help="At the end, write the results (verdicts first when comparing) as a GitHub markdown table to FILE, "
        "e.g. for a CI job summary. The file must not exist yet.",
    )
    group.addoption(
        "--perf-full-grid", action="store_true", default=False,
        help="Run the tests marked full_grid (points of the full perf grids), deselected otherwise.",
    )


def _xdist_distributes(config) -> bool:
    """Whether pytest-xdist distributes this run: the test pytest-benchmark applies before it disables itself."""
    return (
        config.getoption("dist", "no") != "no"
        or bool(os.environ.get("PYTEST_XDIST_WORKER"))
        or hasattr(config, "workerinput")
    )


def _refuse_under_xdist(config, asked: list[str]) -> None:
    if asked and _xdist_distributes(config):
        raise pytest.UsageError(
            f"{', '.join(asked)} under pytest-xdist (-n/--dist): pytest-benchmark times nothing in a distributed "
            "run, so nothing would be compared or saved and every test would pass. Run the benchmarks without -n "
            "(or with -n 0)."
        )


def _test_path_problem(config, value) -> str | None:
    """Why a --benchmark-compare value is a test path that the option swallowed, or None."""
    if not isinstance(value, str):
        return None
    path = config.invocation_params.dir / value.split("::")[0]
    if not (path.is_dir() or (path.is_file() and (path.suffix == ".py" or "::" in value))):
        return None
    args = list(config.invocation_params.args)
    hint = "pytest PATHS ... --benchmark-compare"
    if "--benchmark-compare" in args and args.index("--benchmark-compare") + 1 < len(args):
        args.remove("--benchmark-compare")
        hint = "pytest " + " ".join([*args, "--benchmark-compare"])
    return (
        f"--benchmark-compare took {value!r} as the baseline to compare with, but it is a path of the project: "
        "--benchmark-compare takes an optional value, so it swallowed the test path. Put --benchmark-compare after "
        f"the test paths ({hint}), or write --benchmark-compare=NUM to name a baseline."
    )


def _asked(config) -> list[str]:
    """The options given that write or compare baselines or reports."""
    names = {
        "--benchmark-compare": config.getoption("benchmark_compare"),
        "--benchmark-save": config.getoption("benchmark_save"),
        "--benchmark-autosave": config.getoption("benchmark_autosave"),
        "--perf-mem-report": config.getoption("perf_mem_report"),
        "--perf-calibrate": config.getoption("perf_calibrate"),
    }
    return [name for name, value in names.items() if value]


@pytest.hookimpl(trylast=True)
def pytest_perf_backend(config):
    return detect_backend(load_timer(config.getoption("benchmark_timer")).target)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Runs before pytest-benchmark's pytest_configure (trylast), which loads --benchmark-compare at once.
    config.addinivalue_line("markers", "perf_tolerance(time=None, memory=None, host=None): per-test "
                            "regression tolerances; host= gates the host-set time")
    config.addinivalue_line("markers", "full_grid: a point of a full perf grid; runs only with --perf-full-grid")
    mem_report = config.getoption("perf_mem_report")
    if isinstance(mem_report, str):
        from lmsys.perf.memory_report import SUFFIXES
    if isinstance(mem_report, str) and Path(mem_report).suffix not in SUFFIXES:
        raise pytest.UsageError(
            f"--perf-mem-report={mem_report}: the file must end in {' or '.join(SUFFIXES)} "
            "(write --perf-mem-report=FILE, or put --perf-mem-report after the test paths)"
        )
    _check_markdown_report(config)
    if not config.pluginmanager.has_plugin("benchmark"):
        return  # pytest-benchmark is disabled (-p no:benchmark): so is the gate
    _refuse_under_xdist(config, _asked(config))
    _check_compare_value(config)
    compare_value = config.getoption("benchmark_compare") or None
    problem = _test_path_problem(config, compare_value)
    if problem:
        raise pytest.UsageError(problem)
    calibrate = config.getoption("perf_calibrate")
    others = [name for name in _asked(config) if name not in ("--perf-calibrate", "--perf-mem-report")]
    if calibrate and others:
        raise pytest.UsageError(
            f"--perf-calibrate runs the benchmarks in other processes and only writes the calibration: "
            f"leave out {', '.join(others)}"
        )
    config.stash[SESSION_KEY] = PerfSession(
        backend=config.hook.pytest_perf_backend(config=config),
        rootpath=config.rootpath,
        time_tolerance=config.getoption("perf_time_tolerance"),
        host_tolerance=config.getoption("perf_host_tolerance"),
        time_cap=config.getoption("perf_max_time"),
        calibrate=calibrate,
        memory_tolerance=config.getoption("perf_mem_tolerance"),
        memory_floor=config.getoption("perf_mem_floor"),
        memory_report=mem_report,
        compare=compare_value,
        save=config.getoption("benchmark_save") or config.getoption("benchmark_autosave"),
        save_failing=config.getoption("perf_save_failing"),
        disable_gc=config.getoption("benchmark_disable_gc"),
        min_rounds=config.getoption("benchmark_min_rounds"),
    )
    # Held back from pytest-benchmark's configure: collection decides who loads it (pytest_collection_finish).
    config.option.benchmark_compare = []
    _note_interrupts(config)


_PREVIOUS_SIGINT_KEY = pytest.StashKey[object]()


def _note_interrupts(config) -> None:
    """Wraps the SIGINT handler so that a Ctrl-C (or `timeout -s INT`) always marks the perf session as signalled.
    Python turns SIGINT into a KeyboardInterrupt wherever the main thread is; raised inside a callback (a weakref
    finalizer in torch.compile's caches) it is only printed, and pytest would go on running and then save a baseline
    of a run cut short. The previous handler still runs (the KeyboardInterrupt, when it is not swallowed)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):  # a process told to ignore Ctrl-C (or a handler set outside Python)
        return
    perf = config.stash[SESSION_KEY]

    def noted(signum, frame):
        perf.signalled = True
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, noted)
    config.stash[_PREVIOUS_SIGINT_KEY] = previous


def _check_compare_value(config) -> None:
    """--benchmark-compare= with an empty value (an unset variable: --benchmark-compare=$UNSET) would compare nothing
    and pass: a usage error."""
    if config.getoption("benchmark_compare") == "":
        raise pytest.UsageError(
            "--benchmark-compare=: the value is empty (an unset variable, as in --benchmark-compare=$UNSET?), so "
            "nothing would be compared and every test would pass. Name a baseline (--benchmark-compare=NUM, a saved "
            "name, a file) or write --benchmark-compare alone for each benchmark's newest baseline."
        )


def _check_markdown_report(config) -> None:
    """Validates --perf-report before any test runs: a known format and a file that does not exist yet."""
    value = config.getoption("perf_report")
    if value is None:
        return
    from lmsys.perf import markdown

    try:
        _, path = markdown.parse_report_option(value)
    except ValueError as exc:
        raise pytest.UsageError(f"--perf-report={value}: {exc}") from None
    path = config.invocation_params.dir / path
    if path.exists():
        raise pytest.UsageError(f"--perf-report={value}: {path} already exists; remove it or name another file")
    config.stash[_MARKDOWN_KEY] = path


def _max_time(config) -> float:
    text = config.getoption("benchmark_max_time")
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise pytest.UsageError(f"--benchmark-max-time={text}: must be a finite, non-negative number of seconds")
    return value


def _storage_path(config, bench_session) -> Path:
    if config.getoption("benchmark_storage") == PYTEST_BENCHMARK_DEFAULT_STORAGE:
        return config.rootpath / "baselines"
    if not isinstance(bench_session.storage, FileStorage):
        raise pytest.UsageError(
            f"--benchmark-storage={config.getoption('benchmark_storage')}: the lmsys gate keeps baselines in a "
            "folder (a path or file://path)"
        )
    return bench_session.storage.path


def _protected(config, perf: PerfSession) -> list[Path]:
    """The folders nothing but a baseline save or a calibration writes into: the storage root (every GPU folder, its
    baselines and calibration.json) and the project's own baselines/."""
    return list(dict.fromkeys([perf.storage_path, config.rootpath / "baselines"]))


def _output_problem(config, perf: PerfSession, option: str, path: Path, overwrite: bool, hint: str = "") -> None:
    """Raises a UsageError naming the option and the path when baselines.output_problem refuses it."""
    problem = baselines.output_problem(path, overwrite=overwrite, protected=_protected(config, perf))
    if problem:
        raise pytest.UsageError(f"{option}: {problem} ({hint}checked before running any test; nothing was written)")


def _json_report_path(value) -> Path | None:
    """The path of --benchmark-json (a JsonReport; a file object where its type could not be replaced), or None."""
    if not value:
        return None
    return getattr(value, "path", None) or Path(getattr(value, "name", value))


def _check_outputs(config, perf: PerfSession) -> None:
    """Every file the run will write on the user's behalf goes through one guard (baselines.output_problem), before
    any test runs: --benchmark-json, --perf-report, --perf-mem-report, and pytest-benchmark's --benchmark-csv,
    --benchmark-histogram and --benchmark-cprofile-dump (their folders: they add suffixes to the name)."""
    here = config.invocation_params.dir
    if isinstance(perf.memory_report, str):
        path = here / perf.memory_report
        _output_problem(config, perf, f"--perf-mem-report={perf.memory_report}", path,
                        overwrite=config.getoption("perf_mem_report_overwrite"),
                        hint="--perf-mem-report-overwrite replaces a file that is not a baseline; ")
        config.stash[_REPORT_PATH_KEY] = path
    markdown = config.stash.get(_MARKDOWN_KEY, None)
    if markdown is not None:
        _output_problem(config, perf, f"--perf-report={config.getoption('perf_report')}", markdown, overwrite=False)
    json_report = _json_report_path(config.getoption("benchmark_json", None))
    if json_report is not None:
        _output_problem(config, perf, f"--benchmark-json={json_report}", here / json_report, overwrite=True)
    for option in ("csv", "histogram", "cprofile_dump"):
        for prefix in config.getoption(f"benchmark_{option}", None) or ():
            if isinstance(prefix, str):
                name = f"--benchmark-{option.replace('_', '-')}={prefix}"
                _output_problem(config, perf, name, here / f"{prefix}-report", overwrite=True)


def _write_json_atomically(config, bench_session, perf: PerfSession | None) -> None:
    """Replaces pytest-benchmark's save_json (which opens --benchmark-json and writes into it, so a full disk leaves a
    cut-off file in place of the previous report) with an atomic write: a temporary file in the same folder, renamed
    over the report (baselines.replace_file). In a run of the gate a write that fails is said in the summary and
    fails the run."""
    path = _json_report_path(bench_session.json)
    if path is None:
        return
    path = config.invocation_params.dir / path

    def save_json(output_json: dict) -> None:
        text = safe_dumps(output_json, ensure_ascii=True, indent=4)
        try:
            baselines.replace_file(path, text)
        except OSError as exc:
            if perf is None or not perf.active:
                raise
            line = f"NOT WRITTEN: the --benchmark-json report {path}: {type(exc).__name__}: {exc}"
            config.stash.setdefault(_UNWRITTEN_KEY, []).append(line)
            perf.note(line)
            return
        bench_session.logger.info(f"Wrote benchmark data in: {path}", purple=True)

    bench_session.save_json = save_json


def pytest_collection_finish(session):
    config = session.config
    perf = config.stash.get(SESSION_KEY, None)
    gated = [item for item in session.items if "gpu_benchmark" in getattr(item, "fixturenames", ())]
    if perf is None:
        if gated:
            raise pytest.UsageError(
                f"{len(gated)} selected test(s) use gpu_benchmark, which needs pytest-benchmark; this run disabled "
                "it (-p no:benchmark)"
            )
        return
    bench_session = config._benchmarksession
    _write_json_atomically(config, bench_session, perf)
    config.option.benchmark_compare = perf.compare or []
    if not gated and perf.calibrate:
        raise pytest.UsageError("--perf-calibrate: no selected test uses gpu_benchmark: nothing to calibrate")
    if not gated:
        # Not a run of the gate: --benchmark-compare is pytest-benchmark's own business, as if the gate were absent.
        bench_session.compare = config.option.benchmark_compare
        bench_session.handle_loading()
        return
    perf.max_time = _max_time(config)
    perf.storage_path = _storage_path(config, bench_session)
    _check_outputs(config, perf)
    perf.gated = {item.nodeid for item in gated}
    bench_session.compare = config.option.benchmark_compare
    plain = any("benchmark" in getattr(item, "fixturenames", ()) for item in session.items if item not in gated)
    perf.activate(bench_session, plain=plain)
    # Each memory measurement starts with a full collection (backend.measure_memory), which would walk every object
    # that torch, triton and the collected modules hold (0.2 s a benchmark on an H200 host); frozen, they are skipped.
    gc.collect()
    gc.freeze()
    config.stash[_FROZEN_KEY] = True
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in perf.header_lines():
            reporter.write_line(baselines.printable(line))
        if config.stash.get(_FULL_GRID_KEY, 0):
            reporter.write_line(f"lmsys perf: {config.stash[_FULL_GRID_KEY]} full-grid points deselected "
                                "(--perf-full-grid runs them)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    # --perf-calibrate replaces the run: the selected benchmarks run in fresh processes, not in this one.
    perf = session.config.stash.get(SESSION_KEY, None)
    if perf is None or not perf.active or not perf.calibrate or session.config.option.collectonly:
        return None
    from lmsys.perf import calibration

    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    try:
        calibration.calibrate(perf, config.invocation_params.args, config.invocation_params.dir,
                              say=None if reporter is None else reporter.write_line)
    except calibration.CalibrationError as exc:
        raise pytest.UsageError(str(exc)) from None
    return True


@pytest.hookimpl(optionalhook=True)  # a pytest-benchmark hook: absent under -p no:benchmark
def pytest_benchmark_update_machine_info(config, machine_info):
    perf = config.stash.get(SESSION_KEY, None)
    if perf is None or not perf.active:
        return
    machine_info["lmsys"] = perf.environment
    # The CPU's momentary clock says nothing about the machine, but made every comparison warn that it differs.
    for volatile in ("hz_actual", "hz_actual_friendly"):
        (machine_info.get("cpu") or {}).pop(volatile, None)


@pytest.hookimpl(optionalhook=True)  # a pytest-benchmark hook: absent under -p no:benchmark
def pytest_benchmark_update_commit_info(config, commit_info):
    # pytest-benchmark reads the commit from .git; a copied tree names it in $LMSYS_GIT_COMMIT, which wins: a copy may
    # carry a .git that is not the measured commit's, so that .git's time, branch and dirty flag go with its id.
    perf = config.stash.get(SESSION_KEY, None)
    if perf is None or not perf.active:
        return
    from lmsys.perf.environment import COMMIT_VARIABLE

    commit = perf.environment["git_commit"]
    if commit and (os.environ.get(COMMIT_VARIABLE) or commit_info.get("id") in (None, "unversioned", "unknown")):
        if commit_info.get("id") != commit:
            for field in ("time", "author_time", "dirty", "branch"):
                commit_info.pop(field, None)
        commit_info["id"] = commit


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in item.iter_markers("perf_tolerance"):
            try:
                verdict.check_tolerances(marker.args, marker.kwargs)
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: bad @pytest.mark.perf_tolerance: {exc}") from None
    if config.getoption("perf_full_grid"):
        return
    # Points of the full grids are deselected, not skipped: thousands of skipped items cost seconds of pytest's
    # per-test protocol, and a deselected test is no baseline entry the run fails to judge.
    kept, grid = [], []
    for item in items:
        (grid if item.get_closest_marker("full_grid") else kept).append(item)
    if grid:
        config.hook.pytest_deselected(items=grid)
        items[:] = kept
        config.stash[_FULL_GRID_KEY] = len(grid)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    perf = item.config.stash.get(SESSION_KEY, None)
    if perf is not None and (report.failed or (report.skipped and hasattr(report, "wasxfail"))):
        perf.failed.add(item.nodeid)
    if perf is not None and perf.active:
        _note_outcome(item, report, perf)
        record = item.stash.get(RECORD_KEY, None)
        if record is not None and report.when == "call":
            item.config.stash.setdefault(_STATUS_KEY, {})[item.nodeid] = _status(record)
    if perf is not None and perf.signalled:
        item.session.shouldstop = "interrupted by SIGINT (a KeyboardInterrupt that the test's code swallowed)"
    return report


def _status(record) -> str:
    """'1.234 ms, -0.4%, PASS': a benchmark's median, its change against the baseline and the verdict, as known."""
    parts = [verdict.format_seconds(record.median)]
    judged = record.verdict
    if judged is not None and judged.time is not None:
        parts.append(f"{judged.time.change:+.1%}")
    if judged is not None:
        parts.append(judged.label)
    return ", ".join(parts)


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
    """With -v, a passing benchmark's line says what it measured and the verdict as soon as it finishes (`_status`):
    the progress of a long run, one benchmark at a time. (A failing one keeps pytest's word: its message, in the
    summary, says the rest, and the summary's lines stay "FAILED <test id> - ...".)"""
    line = config.stash.get(_STATUS_KEY, {}).get(report.nodeid)
    if report.when != "call" or not report.passed or line is None or config.get_verbosity() < 1:
        return None
    return "passed", ".", (f"PASSED ({line})", {"green": True})


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _note_outcome(item, report, perf: PerfSession) -> None:
    """Keeps how a test ended, for the baseline entries the run did not judge (_note_unjudged; a test that no longer
    uses gpu_benchmark keeps its baseline entry), and notes a regression that the test's outcome hides: a failing
    verdict whose test xfailed (the xfail marker turns the failure into an expected one) or skipped after measuring.
    Such a regression is still one: the summary names it and the run fails."""
    outcomes = item.config.stash.setdefault(_OUTCOMES_KEY, {})
    if report.skipped:
        xfail = hasattr(report, "wasxfail")
        reason = report.wasxfail if xfail else _skip_reason(report)
        outcomes.setdefault(item.nodeid, ("xfailed" if xfail else "skipped") + (f" ({reason})" if reason else ""))
    elif report.failed:
        outcomes[item.nodeid] = "failed"
    elif report.when == "call":
        outcomes.setdefault(item.nodeid, "passed")
    record = item.stash.get(RECORD_KEY, None)
    if report.when != "call" or not report.skipped or record is None or not (record.verdict and record.verdict.failed):
        return
    how = "its xfail marker" if hasattr(report, "wasxfail") else "a skip after measuring"
    line = (f"NOT PASSED: {item.nodeid}: {record.verdict.label}, a regression that {how} hides; it fails the run "
            f"all the same ({record.verdict.message(record.name).splitlines()[0]})")
    item.config.stash.setdefault(_HIDDEN_KEY, []).append(line)
    perf.note(line)


def _note_unjudged(config, perf: PerfSession, disabled: bool) -> None:
    """Names, in the notes, every baseline entry of a test that ran (or skipped) in this compare run and was not
    judged, grouped by why. A skipped or xfailed test does not fail the run (no GPU, OOM, a full-grid point); a test
    that failed already fails it; a test that passed without measuring its baselined benchmark (it no longer calls
    gpu_benchmark) fails it: a gate that passes without comparing. Under --benchmark-disable (nothing is timed, and a
    note says so) the entries are listed as not measured without failing the run. Deselected tests are not listed."""
    if not (perf.comparing and perf.baseline_benchmarks):
        return
    judged = {record.fullname for record in perf.records}
    why = {}
    for nodeid, outcome in config.stash.get(_OUTCOMES_KEY, {}).items():
        if perf.baseline(nodeid) is None or nodeid in judged:
            continue
        if outcome == "passed":
            outcome = ("not measured: benchmarks are disabled (--benchmark-disable)" if disabled else
                       "NOT MEASURED: the test passed without measuring it (no gpu_benchmark call): the run fails")
        elif outcome == "failed":
            outcome = "not measured: the test failed before measuring"
        why.setdefault(outcome, []).append(nodeid)
    for outcome, nodeids in sorted(why.items(), key=lambda item: not item[0].startswith("NOT")):
        prefix = "NOT JUDGED" if outcome.startswith("NOT MEASURED") else "not judged"
        perf.note(f"{prefix}: {len(nodeids)} baseline entr{'y' if len(nodeids) == 1 else 'ies'} of the selected "
                  f"tests, {outcome}: {', '.join(nodeids)}")
        if prefix == "NOT JUDGED":
            config.stash.setdefault(_UNMEASURED_KEY, []).extend(nodeids)


@pytest.hookimpl(specname="pytest_sessionfinish", wrapper=True, tryfirst=True)
def pytest_sessionfinish_before_saving(session, exitstatus):
    # Wraps pytest-benchmark's own sessionfinish, which saves before its yield.
    perf = session.config.stash.get(SESSION_KEY, None)
    stopped = exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR)
    if perf is not None and perf.active and (stopped or perf.signalled):
        # A partial run is never saved as a baseline; after a usage error nothing ran.
        perf.interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or perf.signalled
        session.config._benchmarksession.save = session.config._benchmarksession.autosave = None
        if perf.signalled:
            session.exitstatus = pytest.ExitCode.INTERRUPTED
    return (yield)


def pytest_sessionfinish(session):
    # Runs after pytest-benchmark saved and before the terminal summary (printed after every sessionfinish).
    config = session.config
    perf = config.stash.get(SESSION_KEY, None)
    if perf is None or not perf.active:
        return
    _note_unjudged(config, perf, config._benchmarksession.disabled)
    path = config.stash.get(_REPORT_PATH_KEY, None)
    if path is not None:
        try:
            from lmsys.perf import memory_report

            overwrite = config.getoption("perf_mem_report_overwrite")
            memory_report.write(memory_report.table(perf), path, overwrite=overwrite)
        except OSError as exc:
            perf.report_error = f"NOT WRITTEN: the memory report {path}: {exc}"
        else:
            config.stash[_WRITTEN_KEY] = path
    markdown = config.stash.get(_MARKDOWN_KEY, None)
    if markdown is not None:
        try:
            from lmsys.perf.markdown import session_markdown

            baselines.write_new_file(markdown, session_markdown(perf))
        except FileExistsError:
            perf.notes.append(f"markdown report NOT written: {markdown} appeared during the run")
        except OSError as exc:
            line = f"NOT WRITTEN: the markdown report {markdown}: {type(exc).__name__}: {exc}"
            config.stash.setdefault(_UNWRITTEN_KEY, []).append(line)
            perf.note(line)
        else:
            perf.notes.append(f"markdown report written to {markdown}")
    failing = perf.unwritten() or any(config.stash.get(key, None) for key in (_UNWRITTEN_KEY, _HIDDEN_KEY,
                                                                               _UNMEASURED_KEY))
    if failing and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# pytest-benchmark's options that shape its own table: given any of them (or -v), a run of the gate shows that table.
TABLE_OPTIONS = ("benchmark_columns", "benchmark_sort", "benchmark_group_by", "benchmark_name", "benchmark_histogram",
                 "benchmark_cprofile", "benchmark_verbose")


def _table_asked(config) -> bool:
    """Whether this run asks for pytest-benchmark's table: -v, or one of its TABLE_OPTIONS set to other than its
    default."""
    if config.get_verbosity() >= 1:
        return True
    try:
        defaults = vars(config._parser.parse_known_args([]))
    except Exception:  # pytest's parser is internal: without its defaults, show the table as pytest-benchmark would
        return True
    return any(config.getoption(name, None) != defaults.get(name) for name in TABLE_OPTIONS)


def _hide_gate_rows(config, perf: PerfSession) -> None:
    """Our table has the gate's benchmarks, so pytest-benchmark's wide table (printed after ours) only shows when
    asked (_table_asked); unasked, it keeps the plain pytest-benchmark tests' rows, and is not printed when there are
    none. Its --benchmark-compare-fail check runs either way (BenchmarkSession.display runs it when quiet)."""
    bench_session = config._benchmarksession
    if not bench_session.groups or _table_asked(config):
        return
    groups = [(name, [row for row in rows if row["fullname"] not in perf.gated])
              for name, rows in bench_session.groups]
    groups = [(name, rows) for name, rows in groups if rows]
    if groups:
        bench_session.groups = groups
    else:
        bench_session.quiet = True


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, config):
    perf = config.stash.get(SESSION_KEY, None)
    if perf is None or not perf.active:
        return
    _hide_gate_rows(config, perf)
    lines = report.summary_lines(perf)
    if lines:
        terminalreporter.write_sep("-", "lmsys perf")
        for line in lines:
            terminalreporter.write_line(line, red=line.startswith("NOT "))
    if perf.memory_report:
        terminalreporter.write_sep("-", "GPU memory high-water marks (largest first)")
        from lmsys.perf import memory_report

        for line in memory_report.summary(perf, config.stash.get(_WRITTEN_KEY, None)):
            terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if config.stash.get(_FROZEN_KEY, False):
        gc.unfreeze()
    previous = config.stash.get(_PREVIOUS_SIGINT_KEY, None)
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
