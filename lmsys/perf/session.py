"""The plugin's state for one pytest run, kept in config.stash: the backend, the options, the baselines it compares
against, every benchmark's record and the notes for the summary.

The gate switches on after collection, and only when a selected test uses `gpu_benchmark` (`activate`): a project
that does not use it keeps pytest-benchmark exactly as it is. Once on, pytest-benchmark's session is pointed at
this GPU: the machine id (the storage sub-folder) becomes the device's slug, saves go through BaselineStorage, and
--benchmark-compare loads only files recorded on the same device model, chosen by baselines.named and
baselines.newest_per_benchmark. Plain pytest-benchmark tests of the same run keep pytest-benchmark's storage: their
results are saved there, and --benchmark-compare loads theirs from there, as pytest-benchmark would.
"""

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from lmsys.perf import baselines, verdict
from lmsys.perf.backend import MemoryReading
from lmsys.perf.verdict import Tolerance, Verdict, format_bytes
from lmsys.perf.timing import Precision

# The adaptive rounds aim at a median known to within this share of the tolerance (95% interval, half-width).
PRECISION_SHARE = 0.25


class PerfWarning(pytest.PytestWarning):
    """A comparison that goes ahead with a caveat (a baseline from another software version)."""


@dataclass
class Record:
    """One benchmark's outcome, for the verdict, the summary table and the memory report."""

    name: str
    fullname: str
    median: float
    rounds: int
    memory: MemoryReading | None
    rates: dict[str, Any]
    baseline_median: float | None = None
    baseline_peak: int | None = None
    verdict: Verdict | None = None
    remeasured: bool = False
    timing: str = "eager"
    # the median of the LAUNCH rounds beside graph or queued ones (the host-set time), and the baseline's
    launch_median: float | None = None
    baseline_launch_median: float | None = None
    # what the summary says beside the verdict: the machine's state, a timing the baseline lacks, a failed capture
    notes: list[str] = field(default_factory=list)

    def compared_peaks(self) -> tuple[int | None, int | None]:
        """This run's and the baseline's peak above start as the verdict compared them (the requested bytes where
        both runs have them: baselines.gated_peaks), else the allocated ones."""
        compared = self.verdict.memory if self.verdict else None
        if compared is not None:
            return compared.peak, compared.baseline_peak
        return (None if self.memory is None else self.memory.peak_allocated_above_start), self.baseline_peak

    def failure_message(self) -> str:
        """What the failing test reports: the verdict's message, whether a re-measurement confirmed it, and the
        machine's state when it was not clean (a SLOWER taken under throttling says so)."""
        message = self.verdict.message(self.name)
        if self.remeasured and self.verdict.slower:
            message += "\n(confirmed: the time was re-measured once and was SLOWER again)"
        if self.notes:
            message += f"\n(measured with: {'; '.join(self.notes)})"
        return message


@dataclass
class PerfSession:
    """State of one pytest run. `compare` is the --benchmark-compare value (True: each benchmark's newest baseline),
    `save` the name a save will use (--benchmark-save or --benchmark-autosave), `storage_path` the storage root."""

    backend: Any
    rootpath: Path
    time_tolerance: float | None
    memory_tolerance: float
    memory_floor: int
    memory_report: bool | str | None
    compare: bool | str | None
    save: str | None = None
    save_failing: bool = False
    disable_gc: bool = False
    max_time: float = 1.0
    min_rounds: int = 5
    # --perf-host-tolerance: gates every host-set time (None: reported, not gated, unless a marker gates it)
    host_tolerance: float | None = None
    # seconds of timed rounds a benchmark may spend on adaptive rounds (0: the planned rounds only)
    time_cap: float = 0.0
    # the regression injected into every benchmarked call when the gate is measured (lmsys.perf.injection)
    injection: Any = None
    # --perf-calibrate=N: rerun the selected benchmarks N times in fresh processes instead of running them
    calibrate: int | None = None
    # fullname -> calibration entry (calibration.py), from the GPU's folder
    calibration: dict[str, dict] = field(default_factory=dict)
    storage_path: Path | None = None
    # Set by activate(): a selected test uses gpu_benchmark.
    active: bool = False
    # nodeids of the selected tests that use gpu_benchmark (their benchmarks are the gate's; the others are plain
    # pytest-benchmark ones)
    gated: set[str] = field(default_factory=set)
    interrupted: bool = False
    # A SIGINT reached the process during the run (set by the plugin's handler even when the KeyboardInterrupt it
    # raises is swallowed, e.g. by a weakref callback inside torch.compile): the run stops and nothing is saved.
    signalled: bool = False
    # nodeids of tests that failed (or xfailed): their benchmarks are not saved unless save_failing
    failed: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    compared_files: list[Path] = field(default_factory=list)
    # fullname -> the benchmark's entry in the newest compared file that has it
    baseline_benchmarks: dict[str, dict] = field(default_factory=dict)
    # fullname -> the machine start (environment.machine_start) its baseline was recorded on, None when unrecorded
    baseline_starts: dict[str, str | None] = field(default_factory=dict)
    # storage_path / machine_id, once activate() has resolved the machine id (only when saving or comparing)
    folder: Path | None = None
    # storage.BaselineStorage, where activate() points pytest-benchmark's saves (only when saving or comparing)
    storage: Any = None
    # why --perf-mem-report=FILE could not be written at the end, if it could not
    report_error: str | None = None

    @property
    def comparing(self) -> bool:
        """Whether --benchmark-compare was given (benchmarks without a baseline are then NEW)."""
        return bool(self.compare)

    @cached_property
    def machine_id(self) -> str:
        """The storage folder of this device (initializes CUDA on a GPU)."""
        return baselines.machine_id(self.backend.name, self.backend.is_gpu)

    @cached_property
    def environment(self) -> dict[str, Any]:
        """machine_info['lmsys']: device, software versions, git commit."""
        from lmsys.perf.environment import collect  # read when a run saves or compares

        return collect(self.backend, self.machine_id, self.rootpath)

    def baseline(self, fullname: str) -> dict | None:
        """The baseline entry of a benchmark, or None when it has none (NEW) or nothing is compared."""
        return self.baseline_benchmarks.get(fullname)

    def note(self, text: str) -> None:
        """Adds a line to the summary's notes, once."""
        if text not in self.notes:
            self.notes.append(text)

    def tolerance_for(self, fullname: str, marker: dict) -> Tolerance:
        """The device-time tolerance of a benchmark (verdict.time_tolerance): the marker's, the option's, else the
        floor of its case (its baseline saved in this machine start or not) raised by its calibrated noise."""
        entry = self.calibration.get(fullname)
        spread = None if entry is None else _calibration().device_spread(entry)
        return verdict.time_tolerance(
            same_start=not self.other_start(fullname), marker=marker.get("time"), option=self.time_tolerance,
            spread=spread, runs=None if entry is None else entry["runs"],
        )

    def host_gate(self, marker: dict) -> Tolerance | None:
        """The tolerance a benchmark's host-set time is gated with (the marker's host=, else --perf-host-tolerance),
        or None: not gated (verdict.host_tolerance)."""
        return verdict.host_tolerance(marker.get("host"), self.host_tolerance)

    def other_start(self, fullname: str) -> bool:
        """Whether a benchmark has a baseline and it was not recorded on this start of this machine (or does not say);
        a benchmark without one (NEW) is timed as precisely as a comparison in this start needs."""
        if fullname not in self.baseline_starts:
            return False
        start = self.baseline_starts[fullname]
        return start is None or start != self.environment.get("machine_start")

    def memory_allowance(self, fullname: str, marker: dict) -> tuple[float, int, str]:
        """The memory tolerance (a fraction), floor (bytes) and their source (verdict.memory_tolerance)."""
        entry = self.calibration.get(fullname)
        moved = 0 if entry is None else _calibration().memory_range(entry)
        return verdict.memory_tolerance(marker.get("memory"), self.memory_tolerance, self.memory_floor, moved)

    def precision(self, tolerance: Tolerance) -> Precision:
        """How precisely the adaptive rounds should pin a median judged with this tolerance."""
        if self.time_cap <= 0:
            return Precision()
        return Precision(target=PRECISION_SHARE * tolerance.value, time_cap=self.time_cap)

    def leaves_out(self, fullname: str) -> bool:
        """Whether a save leaves this benchmark out: its test failed and --perf-save-failing was not given."""
        return fullname in self.failed and not self.save_failing

    def activate(self, bench_session, plain: bool = False) -> None:
        """Points pytest-benchmark's session at this device's folder and loads what --benchmark-compare asks for;
        checks that a save can be written. Runs before the first test. `plain`: the run also has plain
        pytest-benchmark tests, which keep pytest-benchmark's storage (their comparison is loaded from it too).

        Raises pytest.UsageError for a baseline that is not there or cannot be used, naming it; nothing is written.
        """
        self.active = True
        if not (self.save or self.comparing or self.calibrate):
            return
        from lmsys.perf.storage import BaselineStorage

        self.folder = self.storage_path / self.machine_id
        own_storage, own_data = bench_session.storage, bench_session.save_data
        plain_compared = _plain_comparison(bench_session) if plain and self.comparing else {}
        bench_session.machine_id = self.machine_id
        bench_session.save_data = True
        bench_session.storage = self.storage = BaselineStorage(
            self.storage_path, bench_session.logger, self.machine_id, self.leaves_out,
            gated=lambda fullname: fullname in self.gated, plain=own_storage, plain_data=own_data,
        )
        if self.save:
            problem = baselines.save_problem(self.folder, self.save)
            if problem:
                raise pytest.UsageError(
                    f"--benchmark-save={baselines.printable(self.save)}: {problem} (checked before running any test)"
                )
        if self.calibrate:
            problem = baselines.save_problem(self.folder, "calibration")
            if problem:
                raise pytest.UsageError(f"--perf-calibrate={self.calibrate}: {problem}")
        if (self.folder / baselines.CALIBRATION_FILE).exists():
            calibration = _calibration()
            try:
                self.calibration = calibration.read(self.folder)
            except calibration.CalibrationError as exc:
                message = f"{exc}\nRepair or remove it, or calibrate again (--perf-calibrate=N)."
                raise pytest.UsageError(message) from None
        if self.comparing:
            self._load(bench_session)
            bench_session.compared_mapping = {**bench_session.compared_mapping, **plain_compared}
        if bench_session.disabled and self.comparing:
            self.notes.append("benchmarks are disabled (--benchmark-disable): nothing was timed or compared")

    def _load(self, bench_session) -> None:
        from lmsys.perf.environment import version_differences

        try:
            if self.compare is True:
                files = baselines.baseline_files(self.folder)
            else:
                files = baselines.named(self.folder, self.compare)
        except baselines.NoSuchBaseline as exc:
            raise pytest.UsageError(str(exc)) from None
        docs = []
        for path in files:
            try:
                doc = baselines.read_baseline(path)
            except baselines.BaselineError as exc:
                raise pytest.UsageError(
                    f"{exc}\nNothing was compared or overwritten: repair or remove the file, "
                    "or name another baseline with --benchmark-compare=NUM."
                ) from None
            if not doc["benchmarks"]:
                self._empty_baseline(path)
                continue
            recorded = baselines.recorded_machine_id(doc, path)
            if recorded != self.machine_id:
                if self.compare is not True:
                    raise pytest.UsageError(
                        f"--benchmark-compare={self.compare}: {path} was recorded on {recorded}, this run is on "
                        f"{self.machine_id}; a baseline of another GPU model is never compared"
                    )
                self.notes.append(f"not compared: {path} was recorded on {recorded}, this run is on {self.machine_id}")
                continue
            docs.append((path, doc))
        if not docs:
            self.notes.append(
                f"no baseline for {self.machine_id} in {self.folder}: nothing compared, every benchmark is NEW "
                "(save one with --benchmark-save=NAME)"
            )
            bench_session.compared_mapping = {}
            return
        chosen = baselines.newest_per_benchmark(docs)
        self.compared_files = list(chosen)
        bench_session.compared_mapping = {_storage_key(path, self.storage_path): chosen[path] for path in chosen}
        recorded = dict(docs)
        for path, benchmarks in chosen.items():
            self.baseline_benchmarks.update(benchmarks)
            start = (recorded[path]["machine_info"].get("lmsys") or {}).get("machine_start")
            self.baseline_starts.update(dict.fromkeys(benchmarks, start))
        for path in self.compared_files:
            differences = version_differences(recorded[path]["machine_info"], self.environment)
            if differences:
                text = f"{path} was recorded with other software ({'; '.join(differences)}); compared anyway"
                self.notes.append(text)
                bench_session.config.issue_config_time_warning(PerfWarning(text), stacklevel=2)

    def _empty_baseline(self, path: Path) -> None:
        """A baseline file that holds no benchmarks ("benchmarks": []): named with --benchmark-compare=VALUE it is a
        usage error (the run would compare nothing); among the files of --benchmark-compare it is noted and skipped."""
        if self.compare is not True:
            raise pytest.UsageError(
                f"--benchmark-compare={self.compare}: {path} holds no benchmarks ('benchmarks' is empty), so nothing "
                "would be compared; name another baseline"
            )
        self.note(f"not compared: {path} holds no benchmarks ('benchmarks' is empty)")

    def header_lines(self) -> list[str]:
        """Printed after collection: where baselines are, the tolerances, and the files compared with."""
        if self.time_tolerance is None:
            time = (f"{verdict.SAME_START:.1%} against a baseline of this machine start, {verdict.OTHER_START:.0%} "
                    "of another (or calibrated)")
        else:
            time = f"{self.time_tolerance * 100:.3g}%"
        host = "not gated" if self.host_tolerance is None else f"{self.host_tolerance * 100:.3g}%"
        tolerances = (f"time {time}; host-set times {host}; memory {self.memory_tolerance:.0%} and "
                      f"{format_bytes(self.memory_floor)}")
        lines = [f"lmsys perf: baselines in {self.folder or self.storage_path}; tolerances: {tolerances}"]
        if self.calibration:
            lines.append(
                f"lmsys perf: noise calibration of {len(self.calibration)} benchmark(s) in "
                f"{self.folder / baselines.CALIBRATION_FILE}"
            )
        return lines + [f"lmsys perf: comparing with {path}" for path in self.compared_files]

    def unwritten(self) -> bool:
        """Whether something that was asked for could not be written (a save, the memory report)."""
        return bool(self.storage is not None and self.storage.error) or self.report_error is not None

    def saving_notes(self) -> list[str]:
        """What happened to the save that was asked for: the file, what was left out, or why nothing was written."""
        if not (self.save and self.active):
            return []
        if self.interrupted:
            return ["NOT SAVED: the run was interrupted, so no baseline was written (a partial run is never saved)"]
        storage = self.storage
        lines = []
        if storage.error:
            lines.append(f"NOT SAVED: {storage.error}")
        if storage.left_out:
            where = f"left out of {storage.saved}" if storage.saved else "nothing saved"
            lines.append(
                f"{where}: {len(storage.left_out)} benchmark(s) whose test failed ({', '.join(storage.left_out)}); "
                "--perf-save-failing saves them anyway"
            )
        failing = sorted(record.fullname for record in self.records if record.fullname in self.failed)
        if storage.saved and self.save_failing and failing:
            lines.append(f"saved with failing results (--perf-save-failing): {', '.join(failing)}")
        return lines


def _calibration():
    """calibration.py, imported where a GPU folder has a calibration or --perf-calibrate writes one."""
    from lmsys.perf import calibration

    return calibration


def _plain_comparison(bench_session) -> dict:
    """What pytest-benchmark's own loading of --benchmark-compare finds in its own storage (for the plain tests of a
    run of the gate), with its own messages."""
    bench_session.handle_loading()
    return bench_session.compared_mapping


def _storage_key(path: Path, root: Path) -> Path:
    """The key pytest-benchmark's FileStorage.load gives a file in compared_mapping (its table's source column), with
    unprintable characters escaped (baselines.printable): pytest-benchmark prints it as it is."""
    try:
        key = path.relative_to(root)
    except ValueError:
        key = path
    return Path(baselines.printable(key))


# Where the plugin keeps its state: the session in config.stash, each benchmark's record in its item's stash.
SESSION_KEY = pytest.StashKey[PerfSession]()
RECORD_KEY = pytest.StashKey[Record]()
