"""The plugin's state for one pytest run, kept in config.stash: the backend, the options, the baselines it compares
against, every benchmark's record and the notes for the summary.

It also wires pytest-benchmark's session to this GPU: the machine id (the storage sub-folder) becomes the device's
slug, saves go through BaselineStorage, and --benchmark-compare loads only files recorded on the same device model.
"""

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
from pytest_benchmark.storage.file import FileStorage

from lmsys.perf import baselines, environment
from lmsys.perf.backend import MemoryReading
from lmsys.perf.compare import SLOWER, Verdict
from lmsys.perf.storage import BaselineStorage

# pytest-benchmark's default --benchmark-storage; when it is unchanged the plugin stores in rootdir/baselines.
PYTEST_BENCHMARK_DEFAULT_STORAGE = "file://./.benchmarks"
NEWEST_GLOB = "[0-9][0-9][0-9][0-9]_"


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

    def failure_message(self) -> str:
        """What the failing test reports: the verdict's message and whether a re-measurement confirmed it."""
        message = self.verdict.message(self.name)
        if self.remeasured and self.verdict.time is not None and self.verdict.time.verdict == SLOWER:
            message += "\n(confirmed: the time was re-measured once and was SLOWER again)"
        return message


@dataclass
class PerfSession:
    """State of one pytest run. `compare` is the --benchmark-compare value (True: each benchmark's newest baseline)."""

    backend: Any
    rootpath: Path
    time_tolerance: float
    memory_tolerance: float
    memory_floor: int
    full_grid: bool
    memory_report: bool | str | None
    compare: bool | str | None
    disable_gc: bool = False
    max_time: float = 1.0
    min_rounds: int = 5
    notes: list[str] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    compared_files: list[Path] = field(default_factory=list)
    # fullname -> the benchmark's entry in the newest compared file that has it
    baseline_benchmarks: dict[str, dict] = field(default_factory=dict)
    storage_path: Path | None = None
    # storage_path / machine_id, once attach() has resolved the machine id (only when saving or comparing)
    folder: Path | None = None

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
        return environment.collect(self.backend, self.machine_id, self.rootpath)

    def baseline(self, fullname: str) -> dict | None:
        """The baseline entry of a benchmark, or None when it has none (NEW) or nothing is compared."""
        return self.baseline_benchmarks.get(fullname)

    def attach(self, bench_session, saving: bool) -> None:
        """Points pytest-benchmark's session at this device's folder and loads what --benchmark-compare asks for.

        Raises pytest.UsageError for a baseline file that cannot be used, naming it; nothing is written then.
        """
        if isinstance(bench_session.storage, FileStorage):
            self.storage_path = bench_session.storage.path
        if not (saving or self.comparing):
            return
        bench_session.machine_id = self.machine_id
        if self.storage_path is not None:
            self.folder = self.storage_path / self.machine_id
        if isinstance(bench_session.storage, FileStorage):
            bench_session.storage = BaselineStorage(
                bench_session.storage.path, logger=bench_session.logger, default_machine_id=self.machine_id
            )
            if self.comparing:
                self._load(bench_session)
        else:
            bench_session.storage.default_machine_id = self.machine_id
            bench_session.compare = self.compare
            bench_session.handle_loading()

    def _load(self, bench_session) -> None:
        storage = bench_session.storage
        try:
            files = storage.query(NEWEST_GLOB if self.compare is True else self.compare)
        except ValueError as exc:
            raise pytest.UsageError(f"--benchmark-compare={self.compare}: {exc}") from None
        docs = {}
        for path in files:
            try:
                doc = baselines.read_baseline(path)
            except baselines.BaselineError as exc:
                raise pytest.UsageError(
                    f"{exc}\nNothing was compared or overwritten: repair or remove the file, "
                    "or name another baseline with --benchmark-compare=NUM."
                ) from None
            recorded = baselines.recorded_machine_id(doc, path)
            if recorded != self.machine_id:
                self.notes.append(f"not compared: {path} was recorded on {recorded}, this run is on {self.machine_id}")
                continue
            docs[path] = doc
        if not docs:
            self.notes.append(
                f"no baseline for {self.machine_id} in {self.folder}: nothing compared, every benchmark is NEW "
                "(save one with --benchmark-save=NAME)"
            )
            bench_session.compared_mapping = {}
            return
        if self.compare is True:
            # A partial run (-k) saves only its own benchmarks, so each benchmark takes the newest file that has it
            # (docs go oldest to newest, so a later file's entry replaces an earlier one).
            newest = {bench["fullname"]: (path, bench) for path, doc in docs.items() for bench in doc["benchmarks"]}
            mapping = {path: {} for path in docs}
            for fullname, (path, bench) in newest.items():
                mapping[path][fullname] = bench
            self.compared_files = [path for path, benchmarks in mapping.items() if benchmarks]
            bench_session.compared_mapping = {
                _storage_key(path, storage.path): mapping[path] for path in self.compared_files
            }
        else:
            bench_session.compare = self.compare
            bench_session.handle_loading()
            keys = {_storage_key(path, storage.path): path for path in docs}
            bench_session.compared_mapping = {k: v for k, v in bench_session.compared_mapping.items() if k in keys}
            self.compared_files = [keys[key] for key in bench_session.compared_mapping]
        for benchmarks in bench_session.compared_mapping.values():
            self.baseline_benchmarks.update(benchmarks)
        for path in self.compared_files:
            differences = environment.version_differences(docs[path]["machine_info"], self.environment)
            if differences:
                text = f"{path} was recorded with other software ({'; '.join(differences)}); compared anyway"
                self.notes.append(text)
                bench_session.config.issue_config_time_warning(PerfWarning(text), stacklevel=2)


def _storage_key(path: Path, root: Path) -> Path:
    """The key pytest-benchmark's FileStorage.load gives a file in compared_mapping."""
    try:
        return path.relative_to(root)
    except ValueError:
        return path


# Where the plugin keeps its state: the session in config.stash, each benchmark's record in its item's stash.
SESSION_KEY = pytest.StashKey[PerfSession]()
RECORD_KEY = pytest.StashKey[Record]()
