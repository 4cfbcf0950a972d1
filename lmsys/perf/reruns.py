"""The selected benchmarks rerun in fresh pytest processes, each writing a pytest-benchmark JSON: what the noise
calibration (--perf-calibrate) and the measurement of the gate (detection.py) are made of.

A fresh process per run, because what moves a median from one run to the next (memory layout, autotuning
choices, clocks, the allocator's history) is reset only by a new process. No pytest import: the runs are
subprocesses, each with a timeout.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

RUN_TIMEOUT = 3600.0
# Options of the parent run that a rerun must not repeat (it would compare, save or write reports again), and
# whether they take a value: "value" (always), "optional" (nargs='?') or "flag".
PARENT_ONLY = {
    "--perf-calibrate": "value",
    "--benchmark-compare": "optional",
    "--benchmark-save": "value",
    "--benchmark-autosave": "flag",
    "--perf-save-failing": "flag",
    "--benchmark-json": "value",
    "--perf-mem-report": "optional",
    "--gpu-mem-report": "optional",
    "--perf-mem-report-overwrite": "flag",
}


class RerunError(RuntimeError):
    """A rerun that did not finish with its tests run (a usage error, a crash, a timeout); says which and why."""


def child_args(args: Sequence[str], cwd: Path) -> list[str]:
    """The parent's command-line arguments without PARENT_ONLY options (both --opt=value and --opt value forms);
    an optional value is taken only when it is not an option and not a path that exists."""
    kept = []
    skip_next = False
    for position, arg in enumerate(args):
        if skip_next:
            skip_next = False
            continue
        name = arg.split("=", 1)[0]
        kind = PARENT_ONLY.get(name)
        if kind is None:
            kept.append(arg)
            continue
        if "=" in arg or kind == "flag" or position + 1 >= len(args):
            continue
        following = args[position + 1]
        if kind == "value":
            skip_next = True
        elif not following.startswith("-") and not (cwd / following.split("::")[0]).exists():
            skip_next = True
    return kept


def rerun(
    args: Sequence[str],
    runs: int,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = RUN_TIMEOUT,
    progress: Callable[[int, subprocess.CompletedProcess, list[dict]], None] | None = None,
    keep: Path | None = None,
    first: int = 0,
) -> list[dict]:
    """Runs `python -m pytest ARGS --benchmark-json=...` `runs` times in cwd; returns each run's JSON document.

    `progress(index, completed process, the JSON documents so far)` is called after each run. A run may fail tests
    (exit 1: a SLOWER verdict of an injected delay, say); any other exit status, a missing
    JSON or a timeout raises RerunError with the end of that run's output. With `keep` (a folder, created when
    missing) each run's JSON is also copied there as PREFIX-run-N.json, PREFIX the folder's name. The runs are
    numbered from `first` (in `progress`, the kept files and the errors), for a caller that runs a series in parts.
    """
    docs = []
    with tempfile.TemporaryDirectory(prefix="lmsys-reruns-") as folder:
        for index in range(first, first + runs):
            path = Path(folder) / f"run-{index}.json"
            label = f"run {index + 1}" + (f" of {runs}" if first == 0 else "")
            command = [sys.executable, "-m", "pytest", *args, f"--benchmark-json={path}"]
            try:
                done = subprocess.run(
                    command, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise RerunError(f"{label} took more than {timeout:.0f} s: {' '.join(command)}")
            if done.returncode not in (0, 1) or not path.exists():
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
                raise RerunError(
                    f"{label} ended with exit status {done.returncode} "
                    f"({' '.join(command)}):\n{tail}"
                )
            docs.append(json.loads(path.read_text(encoding="utf-8")))
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, keep / f"{keep.name}-run-{index}.json")
            if progress is not None:
                progress(index, done, docs)
    return docs


def warm_up(args: Sequence[str], cwd: Path, timeout: float = RUN_TIMEOUT) -> None:
    """One untimed run of the tests (--benchmark-disable: each benchmarked call once), so that compilations and
    autotuning are in their on-disk caches before the timed runs: on the H100 a warm process's eager medians were up
    to 43% under a cold one's. Raises RerunError when it does not pass."""
    command = [sys.executable, "-m", "pytest", *args, "--benchmark-disable", "-q"]
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RerunError(f"the untimed warm-up run took more than {timeout:.0f} s: {' '.join(command)}")
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RerunError(f"the untimed warm-up run ended with exit status {done.returncode} ({' '.join(command)}):\n"
                         f"{tail}")
