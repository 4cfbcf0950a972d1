"""Where a baseline for this GPU lives, and reading, validating and writing baseline files.

Pure (no pytest, no torch). Layout, in pytest-benchmark's own storage format:

    baselines/                          the storage root (rootdir/baselines unless --benchmark-storage says otherwise)
      NVIDIA_H100_80GB_HBM3/            one folder per GPU model: the machine id, a slug of the CUDA device name
        0001_<name>.json                pytest-benchmark JSON, per-round samples kept (stats.data)
        0002_<name>.json                the highest number is the newest
      cpu-Intel_R_Xeon_R_CPU_2.20GHz/   CPU runs: 'cpu-' and a slug of the processor model

A run only looks into its own folder, so an H100 run never compares against an A100, an H200 or a CPU run; files
also record their machine id (machine_info.lmsys.machine_id) so a file named explicitly is checked as well.
Files are written once, atomically and under a fresh number; an existing file is never replaced.
"""

import json
import math
import os
import re
import tempfile
from pathlib import Path

BASELINE_GLOB = "[0-9][0-9][0-9][0-9]_*.json"
# The stats pytest-benchmark's comparison table reads from a loaded baseline.
REQUIRED_STATS = ("min", "max", "mean", "stddev", "median", "iqr", "rounds", "iterations")
MEMORY_KEY = "peak_allocated_above_start_bytes"


class BaselineError(ValueError):
    """A baseline file that cannot be read or is not a pytest-benchmark JSON file; the message names the file."""


def slug(text: str) -> str:
    """A file-name-safe form of a device name: runs of other characters than letters, digits, '.' and '-' become '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_")


def machine_id(device_name: str, is_gpu: bool) -> str:
    """The storage folder of a device: 'NVIDIA_H100_80GB_HBM3' for a GPU, 'cpu-<model>' for a CPU."""
    if not device_name.strip():
        raise ValueError("device_name must not be empty")
    return slug(device_name) if is_gpu else f"cpu-{slug(device_name)}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        missing = [key for key in REQUIRED_STATS if not _is_number(stats.get(key))]
        if missing:
            return f"benchmark {bench['fullname']!r} lacks numeric stats {missing}"
        data = stats.get("data")
        if data is not None and not (isinstance(data, list) and data and all(_is_number(x) and x >= 0 for x in data)):
            return f"benchmark {bench['fullname']!r} has malformed per-round data"
    return None


def read_baseline(path: Path) -> dict:
    """Read and validate one baseline file; raises BaselineError naming the file and what is wrong with it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BaselineError(f"cannot read baseline file {path}: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BaselineError(f"baseline file {path} is not valid JSON: {exc}") from None
    problem = _problem(doc)
    if problem:
        raise BaselineError(f"baseline file {path} is not a pytest-benchmark result: {problem}")
    return doc


def recorded_machine_id(doc: dict, path: Path) -> str:
    """The machine id a baseline was recorded on: the one it stores, else the name of its folder."""
    recorded = (doc.get("machine_info", {}).get("lmsys") or {}).get("machine_id")
    return recorded if isinstance(recorded, str) else Path(path).parent.name


def samples(bench: dict) -> list[float]:
    """A baseline benchmark's per-round times in seconds, or [median] when it was saved without them."""
    stats = bench["stats"]
    return list(stats.get("data") or [stats["median"]])


def peak_memory(bench: dict) -> int | None:
    """A baseline benchmark's peak allocated bytes above start, or None when it has no memory reading."""
    value = (bench.get("extra_info") or {}).get(MEMORY_KEY)
    return int(value) if _is_number(value) else None


def next_number(folder: Path) -> int:
    """One more than the highest NNNN_ number among the baseline files in folder (1 in an empty folder)."""
    numbers = [int(path.name[:4]) for path in Path(folder).glob(BASELINE_GLOB)]
    return max(numbers, default=0) + 1


def save_new(folder: Path, name: str, text: str) -> Path:
    """Write text as folder/NNNN_name.json under the next free number, atomically, never replacing a file.

    The text goes to a hidden temporary file in the same folder first (flushed to disk), which is then hard-linked
    to its final name: a link appears complete or not at all, and fails rather than replace an existing file, so a
    concurrent save that took the same number makes this one move on to the next.
    """
    if not name or any(c in name for c in '\\/:*?<>|'):
        raise ValueError(f"baseline name must be non-empty without any of \\/:*?<>|, got {name!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        while True:
            number = next_number(folder)
            if number > 9999:
                raise BaselineError(f"{folder} already holds baseline 9999; move old files away to save more")
            target = folder / f"{number:04d}_{name}.json"
            try:
                os.link(temporary, target)
            except FileExistsError:
                continue
            return target
    finally:
        os.unlink(temporary)
