"""Where a baseline for this GPU lives; reading, validating, choosing and writing baseline files.

Pure (no pytest, no torch). Layout, in pytest-benchmark's own storage format:

    baselines/                          the storage root (rootdir/baselines unless --benchmark-storage says otherwise)
      NVIDIA_H100_80GB_HBM3/            one folder per GPU model: the machine id, a slug of the CUDA device name
        0001_<name>.json                pytest-benchmark JSON, per-round samples kept (stats.data)
        0002_<name>.json                the highest number is the newest
      cpu-Intel_R_Xeon_R_CPU_2.20GHz/   CPU runs: 'cpu-' and a slug of the processor model

A run only looks into its own folder, so an H100 run never compares against an A100, an H200 or a CPU run; files
also record their machine id (machine_info.lmsys.machine_id) so a file named explicitly is checked as well.
Files are written once, atomically and under a fresh number; an existing file is never replaced. Any other file in
the folder (a temporary file of a save that was killed, a README) is not a baseline and is never read as one.
"""

import contextlib
import json
import math
import os
import re
import signal
import tempfile
import threading
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from lmsys.perf.timing import EAGER, GRAPH, HOST, LAUNCH, QUEUED

try:
    import fcntl
except ImportError:  # not on Windows: saves there rely on the never-replacing link alone
    fcntl = None

# The one definition of a baseline file name: a four-digit number, '_', the name given to --benchmark-save.
FILE_NAME = re.compile(r"(?P<number>[0-9]{4})_(?P<name>.+)\.json")
MAX_NUMBER = 9999
# What a save writes first; such a file left behind by a killed save is removed by the next save into the folder.
TEMPORARY_PREFIX = ".tmp-"
# The stats pytest-benchmark's comparison table reads from a loaded baseline.
REQUIRED_STATS = ("min", "max", "mean", "stddev", "median", "iqr", "rounds", "iterations")
MEMORY_KEY = "peak_allocated_above_start_bytes"
# The gated peak where both runs have it: the bytes asked for, not the allocator's blocks (backend.MemoryReading).
REQUESTED_KEY = "peak_requested_above_start_bytes"
# The peaks the gate compares, in order of preference, and what each measures.
PEAK_KEYS = ((REQUESTED_KEY, "requested"), (MEMORY_KEY, "allocated"))
# The LAUNCH rounds beside a benchmark timed in a CUDA graph or queued (its stats are the replays or queued rounds),
# and how they were timed (EAGER_TIMING_KEY: LAUNCH, from an idle device); rounds saved without it are not compared.
EAGER_KEY = "eager_data"
EAGER_TIMING_KEY = "eager_timing"
TIMINGS = (EAGER, GRAPH, QUEUED, HOST)
# The noise calibration beside a GPU's baselines (calibration.py).
CALIBRATION_FILE = "calibration.json"
# The format the gate reads, in machine_info["lmsys"]["schema"]; files of earlier versions: python -m lmsys.perf.migrate.
SCHEMA = 2
FORBIDDEN_NAME_CHARACTERS = '\\/:*?<>|'
# A baseline file larger than this is refused before it is parsed: reading it would take unbounded time and memory
# (the largest saved baseline, a full grid with every round, is a few MiB).
MAX_FILE_BYTES = 64 * 2**20
# The rounds a benchmark keeps when read: more are thinned to this many evenly spaced ones (each series of rounds and
# the CPU probe times beside it alike), which bounds the time and memory of a comparison.
MAX_SAMPLES = 10_000
# How far the median of a benchmark's stored rounds may be from its stored median (relative): further, the file's
# statistics are not those of its rounds, and the table (median) and the verdict (rounds) would disagree.
MEDIAN_AGREEMENT = 1e-6
# The largest count a baseline or a calibration may hold (bytes of memory, rounds): a value past it is not a
# measurement, and numbers past float range break every computation with it.
MAX_COUNT = 2**63


class BaselineError(ValueError):
    """A baseline file that cannot be read or is not a pytest-benchmark JSON file; the message names the file."""


class NoSuchBaseline(LookupError):
    """A baseline named with --benchmark-compare=VALUE that is not there; the message says what there is."""


def printable(text) -> str:
    """text with each control or other unprintable character (Unicode category C: ESC, a newline, a carriage return)
    written as its Python escape (\\x1b, \\n): a name, a test id or a path never reaches the terminal or a report
    raw."""
    return "".join(ascii(c)[1:-1] if unicodedata.category(c).startswith("C") else c for c in str(text))


def slug(text: str) -> str:
    """A file-name-safe form of a device name: runs of other characters than letters, digits, '.' and '-' become '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_")


def machine_id(device_name: str, is_gpu: bool) -> str:
    """The storage folder of a device: 'NVIDIA_H100_80GB_HBM3' for a GPU, 'cpu-<model>' for a CPU."""
    if not device_name.strip():
        raise ValueError("device_name must not be empty")
    return slug(device_name) if is_gpu else f"cpu-{slug(device_name)}"


def file_name(number: int, name: str) -> str:
    """The file name of baseline `number` saved as `name`: 0003_name.json."""
    return f"{number:04d}_{name}.json"


def file_number(path: Path) -> int | None:
    """The number of a baseline file (3 for 0003_x.json), or None for a file that is not named like a baseline."""
    match = FILE_NAME.fullmatch(Path(path).name)
    return int(match["number"]) if match else None


def baseline_files(folder: Path) -> list[Path]:
    """The baseline files in folder, oldest first (by number, then name); [] when the folder does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = [path for path in folder.iterdir() if file_number(path) is not None and path.is_file()]
    return sorted(files, key=lambda path: (file_number(path), path.name))


def is_number(value) -> bool:
    """A finite int or float; an int too large for a float (10**400) is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return abs(value) < MAX_COUNT
    return math.isfinite(value)


def _is_count(value) -> bool:
    return is_number(value) and value >= 1 and value == int(value)


def _stats_problem(stats: dict) -> str | None:
    missing = [key for key in REQUIRED_STATS if not is_number(stats.get(key))]
    if missing:
        return f"lacks numeric stats {missing}"
    negative = [key for key in ("min", "max", "mean", "stddev", "median", "iqr") if stats[key] < 0]
    if negative:
        return f"has negative times {negative}"
    if stats["median"] <= 0:
        return "has a median time of 0 s (nothing to compare a time with)"
    if not (_is_count(stats["rounds"]) and _is_count(stats["iterations"])):
        return "has rounds or iterations that are not positive whole numbers"
    data = stats.get("data")
    if data is not None:
        if not (isinstance(data, list) and data and all(is_number(x) and x >= 0 for x in data)):
            return "has malformed per-round data (not a non-empty list of finite, non-negative seconds)"
        median = float(np.median(np.asarray(data, dtype=np.float64)))
        if median <= 0:
            return "has per-round data whose median is 0 s"
        if abs(median - stats["median"]) > MEDIAN_AGREEMENT * stats["median"]:
            return (f"has a stats.median ({stats['median']!r} s) that is not the median of its per-round data "
                    f"({median!r} s): the file's statistics are not those of its rounds")
    return None


def _problem(doc) -> str | None:
    """What makes a parsed document unusable as a baseline, or None."""
    if not isinstance(doc, dict):
        return "the top level is not a JSON object"
    if not isinstance(doc.get("machine_info"), dict):
        return "'machine_info' is missing or not an object"
    benchmarks = doc.get("benchmarks")
    if not isinstance(benchmarks, list):
        return "'benchmarks' is missing or not a list"
    for position, bench in enumerate(benchmarks):
        if not isinstance(bench, dict) or not isinstance(bench.get("fullname"), str):
            return f"benchmark #{position} has no 'fullname'"
        stats = bench.get("stats")
        if not isinstance(stats, dict):
            return f"benchmark {bench['fullname']!r} has no 'stats'"
        problem = _stats_problem(stats)
        if problem:
            return f"benchmark {bench['fullname']!r} {problem}"
        extra = bench.get("extra_info", {})
        if not isinstance(extra, dict):
            return f"benchmark {bench['fullname']!r} has an 'extra_info' that is not an object"
        for key in (MEMORY_KEY, REQUESTED_KEY):
            if key in extra and not (is_number(extra[key]) and extra[key] >= 0):
                return f"benchmark {bench['fullname']!r} has a {key} that is not a non-negative number"
        if extra.get("timing", "eager") not in TIMINGS:
            return f"benchmark {bench['fullname']!r} has a timing that is not one of {TIMINGS}"
        eager = extra.get(EAGER_KEY)
        if eager is not None:
            if not (isinstance(eager, list) and eager and all(is_number(x) and x >= 0 for x in eager)):
                return f"benchmark {bench['fullname']!r} has malformed eager rounds ({EAGER_KEY})"
            if sorted(eager)[(len(eager) - 1) // 2] <= 0:
                return f"benchmark {bench['fullname']!r} has eager rounds whose median is 0 s"
    return None


def read_json(path: Path, what: str, error=ValueError):
    """The parsed JSON of a file the gate reads (a baseline, a calibration), or `error` naming the file: one larger
    than MAX_FILE_BYTES is refused before it is read, and numbers or nesting Python cannot hold are refused too."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise error(f"{what} {path} is {size} bytes, more than the {MAX_FILE_BYTES} bytes (64 MiB) a file the "
                        "gate reads may have; it is not read")
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{what} {path} is not usable JSON: it is nested too deeply to read") from None
    except ValueError as exc:  # not JSON, or numbers Python cannot hold, such as 1e999999
        raise error(f"{what} {path} is not valid JSON: {exc}") from None


def _evenly_spaced(count: int) -> np.ndarray | None:
    """The indices of MAX_SAMPLES evenly spaced rounds out of `count`, or None when there are not more than that."""
    if count <= MAX_SAMPLES:
        return None
    return np.linspace(0, count - 1, MAX_SAMPLES).round().astype(np.int64)


def _thinned(bench: dict) -> None:
    """Thins a benchmark's rounds (stats.data, and the LAUNCH rounds beside them) to MAX_SAMPLES evenly spaced ones.
    Its stats (median, rounds) stay those of all its rounds."""
    for rounds, key in ((bench["stats"], "data"), (bench.get("extra_info") or {}, EAGER_KEY)):
        values = rounds.get(key)
        chosen = None if values is None else _evenly_spaced(len(values))
        if chosen is not None:
            rounds[key] = [values[i] for i in chosen]


def read_baseline(path: Path, any_schema: bool = False) -> dict:
    """Read and validate one baseline file; raises BaselineError naming the file and what is wrong with it, or that it
    is of an earlier format (SCHEMA) unless any_schema (what the migration reads).

    A file over MAX_FILE_BYTES is refused unread; a benchmark with more than MAX_SAMPLES rounds keeps MAX_SAMPLES
    evenly spaced ones (_thinned), so that a comparison takes bounded time and memory.
    """
    doc = read_json(path, "baseline file", BaselineError)
    problem = _problem(doc)
    if problem:
        raise BaselineError(f"baseline file {path} is not a pytest-benchmark result: {problem}")
    schema = (doc["machine_info"].get("lmsys") or {}).get("schema")
    if not any_schema and schema != SCHEMA:
        raise BaselineError(
            f"baseline file {path} is of an earlier format of the gate (schema {schema or 1}, this version reads "
            f"{SCHEMA}): run python -m lmsys.perf.migrate {Path(path).parent} --write"
        )
    for bench in doc["benchmarks"]:
        _thinned(bench)
    return doc


def recorded_machine_id(doc: dict, path: Path) -> str:
    """The machine id a baseline was recorded on: the one it stores, else the name of its folder."""
    recorded = (doc.get("machine_info", {}).get("lmsys") or {}).get("machine_id")
    return recorded if isinstance(recorded, str) else Path(path).parent.name


def named(folder: Path, value: str) -> list[Path]:
    """The baseline files of folder that --benchmark-compare=value names, oldest first.

    value is a number (3 or 0003: that file), the start of a file name (0003_, 0003_h100), a name given to
    --benchmark-save (h100-attn: every file saved under it), or the path of a file. Raises NoSuchBaseline, saying
    what the folder holds, when nothing matches.
    """
    candidate = Path(value)
    if candidate.is_file():
        return [candidate]
    files = baseline_files(folder)
    if value.isdigit():
        chosen = [path for path in files if file_number(path) == int(value)]
    else:
        chosen = [
            path for path in files if path.name.startswith(value) or FILE_NAME.fullmatch(path.name)["name"] == value
        ]
    if chosen:
        return chosen
    there = ", ".join(path.name for path in files) if files else "no baseline files"
    where = folder if Path(folder).is_dir() else f"{folder} (which does not exist)"
    raise NoSuchBaseline(
        f"--benchmark-compare={value}: no baseline in {where} is named by {value!r} (a number such as 3, the start "
        f"of a file name such as 0003_, a saved name, or the path of a file); it holds: {there}"
    )


def newest_per_benchmark(docs: Iterable[tuple[Path, dict]]) -> dict[Path, dict[str, dict]]:
    """For each benchmark, its entry in the newest of the given (path, document) pairs that has it.

    docs go oldest to newest. Returns {path: {fullname: entry}} for the files that provide at least one benchmark,
    in the order given: a partial run (-k) saves only its own benchmarks, so each benchmark takes the newest file
    that has it and the others keep theirs.
    """
    newest = {}
    order = []
    for path, doc in docs:
        order.append(path)
        for bench in doc["benchmarks"]:
            newest[bench["fullname"]] = (path, bench)
    chosen = {path: {} for path in order}
    for fullname, (path, bench) in newest.items():
        chosen[path][fullname] = bench
    return {path: benchmarks for path, benchmarks in chosen.items() if benchmarks}


def timing(bench: dict) -> str:
    """How a baseline benchmark's stats were timed: 'eager' calls, 'graph' replays of a CUDA graph, 'queued' calls
    (graph mode when the capture failed) or 'host' (the CPU's time to issue a call)."""
    return (bench.get("extra_info") or {}).get("timing", "eager")


def samples(bench: dict, timed: str = EAGER) -> list[float] | None:
    """A baseline benchmark's per-round times in seconds as timed `timed` (a TIMINGS value, or LAUNCH: the eager rounds
    of graph and queued mode): its stats when it was timed that way ([median] when saved without rounds), the eager
    rounds a graph- or queued-timed benchmark keeps beside its stats when they were timed from an idle device, or
    None when it has no such times."""
    if timing(bench) == timed:
        stats = bench["stats"]
        return list(stats.get("data") or [stats["median"]])
    info = bench.get("extra_info") or {}
    if timed == LAUNCH and info.get(EAGER_TIMING_KEY) == LAUNCH:
        return info.get(EAGER_KEY)
    return None


def allocated_peak(extra_info: dict) -> int | None:
    """The allocated peak above start of a benchmark's extra_info (what the memory report shows), or None."""
    value = extra_info.get(MEMORY_KEY)
    return int(value) if is_number(value) else None


def gated_peaks(now: dict, baseline: dict) -> tuple[int, int, str] | None:
    """The peaks above start that the gate compares, from this run's and the baseline's extra_info: (now, baseline,
    'requested') where both have the requested bytes, else (now, baseline, 'allocated') from the allocated ones (a
    baseline without the requested bytes); None when either has no memory reading."""
    for key, measure in PEAK_KEYS:
        values = now.get(key), baseline.get(key)
        if all(is_number(value) for value in values):
            return int(values[0]), int(values[1]), measure
    return None


def next_number(folder: Path) -> int:
    """One more than the highest number among the baseline files in folder (1 in an empty folder)."""
    return max((file_number(path) for path in baseline_files(folder)), default=0) + 1


def check_name(name: str) -> None:
    """Raises ValueError unless name can be a baseline name (--benchmark-save=NAME): not empty, none of
    FORBIDDEN_NAME_CHARACTERS, and no control or other unprintable character (Unicode category C): a file named with
    a newline is never read as a baseline (FILE_NAME), and an ESC would reach the terminal."""
    if not name or any(c in name for c in FORBIDDEN_NAME_CHARACTERS):
        raise ValueError(f"baseline name must be non-empty without any of {FORBIDDEN_NAME_CHARACTERS}, got {name!r}")
    unprintable = sorted({c for c in name if unicodedata.category(c).startswith("C")})
    if unprintable:
        shown = ", ".join(ascii(c) for c in unprintable)
        raise ValueError(f"baseline name must not hold control or unprintable characters ({shown}), got {name!r}")


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def save_problem(folder: Path, name: str) -> str | None:
    """Why a baseline named `name` could not be saved into folder, or None when it can (checked before a run).

    Nothing is left behind: an existing folder is probed with a temporary file that is removed at once; a folder
    that does not exist yet is not created here.
    """
    try:
        check_name(name)
    except ValueError as exc:
        return str(exc)
    problem = _writable_folder_problem(folder)
    if problem:
        return f"baselines cannot be saved into {folder}: {problem}"
    longest = file_name(MAX_NUMBER, name)
    try:
        limit = os.pathconf(_existing_ancestor(folder), "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        limit = 255
    if len(longest.encode()) > limit:
        return f"the file name {longest!r} is longer than the {limit} bytes the file system allows: use a shorter name"
    return None


def _writable_folder_problem(folder: Path) -> str | None:
    """Why a file cannot be created in folder (or in the folder it would be made in), or None. An existing folder is
    probed with a temporary file removed at once (os.access says yes to root even on a read-only file system)."""
    ancestor = _existing_ancestor(folder)
    if not ancestor.is_dir():
        return f"{ancestor} is not a folder"
    if ancestor != Path(folder).absolute():  # the folder is created inside ancestor when the file is written
        return None if os.access(ancestor, os.W_OK | os.X_OK) else f"cannot create {folder}: {ancestor} is not writable"
    try:
        handle, probe = tempfile.mkstemp(dir=ancestor, prefix=TEMPORARY_PREFIX, suffix=".probe")
    except OSError as exc:
        return f"{ancestor} is not writable ({exc.strerror or exc})"
    os.close(handle)
    with contextlib.suppress(OSError):  # a save running at the same time may have removed it already
        os.unlink(probe)
    return None


def output_problem(path: Path, overwrite: bool, protected: Iterable[Path] = ()) -> str | None:
    """Why a report or export (--benchmark-json, --perf-report, --perf-mem-report) may not be written to path, or
    None. The one guard of every file the gate writes on a user's behalf, checked before any test runs:

    - a baseline is never replaced or written beside: the path as given and the real path it leads to (symlinks
      resolved) must both lie outside every protected folder (the storage root: every GPU folder, its baselines and
      its calibration.json), and neither may be named like a baseline file (NNNN_name.json);
    - a folder, an existing file unless overwrite, and a place that cannot be written are refused too.

    Reports are then written atomically (replace_file, write_new_file): a temporary file in the same folder, moved
    into place, so a write that fails (a full disk) leaves the earlier file as it was.
    """
    given = Path(os.path.abspath(path))
    real = given.resolve()
    if real.is_dir():
        return f"{path} is a folder"
    for kept in protected:
        for root in dict.fromkeys((Path(os.path.abspath(kept)), Path(kept).resolve())):
            for candidate, how in ((given, ""), (real, f" (it leads to {real})")):
                if candidate.is_relative_to(root):
                    where = "is" if candidate == root else "is inside"
                    return (f"{path}{how} {where} {kept}, which holds baselines (and calibrations): nothing but a "
                            "baseline save or a calibration writes there")
    if file_number(given) is not None or file_number(real) is not None:
        return f"{path} is named like a baseline file (NNNN_name.json, or leads to one): name the report otherwise"
    if real.exists() and not overwrite:
        return f"{path} exists: choose another name, or ask to overwrite it"
    if real.exists() and not real.is_file():
        return f"{path} is not a regular file"
    return _writable_folder_problem(given.parent)


@contextlib.contextmanager
def _locked(folder: Path):
    """Holds an exclusive lock on the folder itself (flock on its descriptor): saves into it happen one at a time,
    across processes, and nothing is left in the folder."""
    if fcntl is None:
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


@contextlib.contextmanager
def _terminate_as_exit():
    """Inside the block, SIGTERM raises SystemExit (so `finally` clauses run) instead of killing the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _remove_stale_temporaries(folder: Path) -> None:
    # Called under the folder's lock: no live save has a temporary file here, so any is left from a killed one.
    for path in folder.glob(f"{TEMPORARY_PREFIX}*"):
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def _holding(folder: Path):
    """The folder's lock, with SIGTERM turned into an exit so that cleanups run; temporary files a harder kill left
    behind are removed first."""
    with _terminate_as_exit(), _locked(folder):
        _remove_stale_temporaries(folder)
        yield


@contextlib.contextmanager
def _staged(folder: Path, text: str, prefix: str = TEMPORARY_PREFIX, suffix: str = ".json"):
    """A hidden temporary file in folder holding text, flushed to disk, for the caller to link or move into place;
    removed at the end unless moved. It gets the permissions a file created by open() would get (mkstemp's are
    0600): a baseline or report readable only by its writer is not what a shared checkout or a CI cache expects."""
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            mask = os.umask(0o022)
            os.umask(mask)
            os.fchmod(fh.fileno(), 0o666 & ~mask)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        yield Path(temporary)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def replace_file(path: Path, text: str) -> Path:
    """Writes text to path atomically (a temporary file renamed over it), under the folder's lock: for the files
    that are meant to be updated (reports), never for a baseline."""
    return update_file(path, lambda current: text)


def update_file(path: Path, change) -> Path:
    """Read, change and write path as one step under the folder's lock: `change(current text, or None when there is
    no file)` returns the new text, written atomically. Two processes updating one file at once both keep their
    changes (each reads what the other wrote). Never for a baseline."""
    path = Path(path)
    if file_number(path) is not None:
        raise ValueError(f"{path} is named like a baseline: baselines are written once, with save_new")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _holding(path.parent):
        text = change(path.read_text(encoding="utf-8") if path.exists() else None)
        with _staged(path.parent, text) as temporary:
            os.replace(temporary, path)
    return path


def rewrite(path: Path, text: str) -> Path:
    """Replaces a baseline file atomically, under its folder's lock: for the migration alone (migrate.py), which a
    user asks for by name; everything else writes a baseline once, with save_new."""
    path = Path(path)
    with _holding(path.parent), _staged(path.parent, text) as temporary:
        os.replace(temporary, path)
    return path


def save_new(folder: Path, name: str, text: str) -> Path:
    """Write text as folder/NNNN_name.json under the next free number, atomically, never replacing a file.

    Saves into one folder are serialized by a lock on the folder, so two runs saving at once get different numbers.
    The text goes to a hidden temporary file in the same folder first (flushed to disk), which is then hard-linked
    to its final name: a link appears complete or not at all, and fails rather than replace an existing file. A
    SIGTERM during the save still removes the temporary file, and the next save removes any a harder kill left.
    """
    check_name(name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _holding(folder), _staged(folder, text) as temporary:
        while True:
            number = next_number(folder)
            if number > MAX_NUMBER:
                raise BaselineError(f"{folder} already holds baseline {MAX_NUMBER}; move old files away to save")
            target = folder / file_name(number, name)
            try:
                os.link(temporary, target)
            except FileExistsError:
                continue
            return target


def write_new_file(path: Path, text: str) -> None:
    """Writes text to path atomically (a temporary file in the same folder, then a hard link, which fails with
    FileExistsError rather than replace a file that is already there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _staged(path.parent, text, f".{path.name}.", ".tmp") as temporary:
        os.link(temporary, path)
