"""Per-benchmark noise: how far a benchmark's median moves between fresh processes, which raises its tolerance.

No pytest, no torch. `pytest perf_tests --perf-calibrate=N` reruns the selected benchmarks N times in fresh
processes (`calibrate`, with reruns.py); `noise` turns those runs' pytest-benchmark JSON into one entry per benchmark,
and `update` merges them into the GPU's baselines folder, next to its baselines, after every run from the second on:

    baselines/NVIDIA_H100_80GB_HBM3/calibration.json
        {"machine_id": ..., "benchmarks": {fullname: {"runs": 20, "timing": "graph", "medians": [...],
         "spread": 0.004, "eager_medians": [...], "eager_spread": 0.02, "peaks": [...]}}}

`spread` is the relative standard deviation of the N medians (what one run's median is uncertain by, from one
process to the next); verdict.time_tolerance raises a device time's tolerance to SIGMAS * sqrt(2) * spread where
that is above the floor of its case. `eager_spread` is that of the LAUNCH rounds beside graph or queued ones, kept
for the report (host-set times are gated only at a tolerance their test names). `peaks` are the requested bytes
above start where every run read them, else the allocated ones; the memory floor grows by their range (zero for a
deterministic peak).

The runs can also be ones measured before, in fresh processes: `python -m lmsys.perf.calibration FOLDER RUN.json...`
calibrates from their JSON (the references and A/A runs a detection kept, --benchmark-json files, saved baselines of
that GPU), `-k SUBSTRING` only the benchmarks whose name holds it.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path
from statistics import mean, stdev

from lmsys.perf import baselines, verdict
from lmsys.perf.timing import HOST, LAUNCH
from lmsys.perf.verdict import format_bytes

FILE_NAME = baselines.CALIBRATION_FILE
MIN_RUNS = 2
TIMINGS = baselines.TIMINGS


class CalibrationError(ValueError):
    """A calibration file that cannot be read or holds impossible values; the message names the file."""


def _spread(medians: list[float]) -> float:
    return stdev(medians) / mean(medians)


def noise(docs: list[dict]) -> dict[str, dict]:
    """One entry per benchmark that every run measured, with the same timing (eager, graph, queued or host) in each: the
    medians, their relative spread, the eager medians of graph-mode benchmarks, and the peak memory above start."""
    if len(docs) < MIN_RUNS:
        raise ValueError(f"a calibration needs at least {MIN_RUNS} runs, got {len(docs)}")
    per_run = [{bench["fullname"]: bench for bench in doc.get("benchmarks", [])} for doc in docs]
    entries = {}
    for fullname in per_run[0]:
        runs = [run.get(fullname) for run in per_run]
        if any(bench is None for bench in runs):
            continue
        infos = [bench.get("extra_info") or {} for bench in runs]
        timings = {info.get("timing", "eager") for info in infos}
        if len(timings) != 1:
            continue
        timed = timings.pop()
        medians = [float(bench["stats"]["median"]) for bench in runs]
        entry = {"runs": len(runs), "timing": timed, "medians": medians, "spread": _spread(medians)}
        eager = [info.get("eager_median") for info in infos]
        if all(isinstance(value, (int, float)) for value in eager) and all(
            info.get(baselines.EAGER_TIMING_KEY) == LAUNCH for info in infos
        ):
            entry.update(eager_medians=eager, eager_spread=_spread(eager), eager_timing=LAUNCH)
        for key, _ in baselines.PEAK_KEYS:  # the peaks the gate compares, where every run has them
            peaks = [info.get(key) for info in infos]
            if all(isinstance(value, int) for value in peaks):
                entry["peaks"] = peaks
                break
        entries[fullname] = entry
    return entries


def device_spread(entry: dict) -> float | None:
    """The spread of a benchmark's device time across the calibration's runs, or None for a host-timed one (its time
    is the CPU's)."""
    return None if entry["timing"] == HOST else entry["spread"]


def memory_range(entry: dict) -> int:
    """How far the peak memory above start moved between the calibration runs, in bytes (0 without readings)."""
    peaks = entry.get("peaks") or [0]
    return max(peaks) - min(peaks)


def _problem(doc) -> str | None:
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), dict):
        return "it is not an object with a 'benchmarks' object"
    for fullname, entry in doc["benchmarks"].items():
        if not isinstance(entry, dict) or entry.get("timing") not in TIMINGS:
            return f"{fullname!r} has no timing ({' or '.join(TIMINGS)})"
        runs, medians = entry.get("runs"), entry.get("medians")
        if not (isinstance(runs, int) and runs >= MIN_RUNS and isinstance(medians, list) and len(medians) == runs):
            return f"{fullname!r} does not have its {MIN_RUNS} or more runs' medians"
        for key in ("spread", "eager_spread"):
            value = entry.get(key, 0.0)
            if not (baselines.is_number(value) and value >= 0):
                return f"{fullname!r} has a {key} that is not a finite non-negative number"
        if not all(baselines.is_number(x) and x > 0 for x in medians):
            return f"{fullname!r} has medians that are not positive numbers"
        peaks = entry.get("peaks", [])
        if not (isinstance(peaks, list) and all(baselines.is_number(x) and x == int(x) >= 0 for x in peaks)):
            return f"{fullname!r} has peaks that are not non-negative byte counts"
    return None


def read(folder: Path) -> dict:
    """The calibration of a GPU's folder ({} when there is none); raises CalibrationError naming a bad file."""
    path = Path(folder) / FILE_NAME
    if not path.exists():
        return {}
    return _checked(path, baselines.read_json(path, "calibration file", CalibrationError))


def _parsed(path: Path, text: str) -> dict:
    try:
        doc = json.loads(text)
    except RecursionError:
        raise CalibrationError(f"calibration file {path} cannot be read: it is nested too deeply") from None
    except ValueError as exc:
        raise CalibrationError(f"calibration file {path} cannot be read: {exc}") from None
    return _checked(path, doc)


def _checked(path: Path, doc) -> dict:
    problem = _problem(doc)
    if problem:
        raise CalibrationError(f"calibration file {path} is not usable: {problem}")
    return doc["benchmarks"]


def merged(old: dict[str, dict], new: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """old with new's entries added or replacing theirs; also the names whose earlier calibration was replaced."""
    return {**old, **new}, sorted(set(old) & set(new))


def update(folder: Path, machine_id: str, entries: dict[str, dict]) -> tuple[Path, dict[str, dict], list[str]]:
    """Merges `entries` into the calibration file of a GPU's folder as it is now (read, merged and written atomically
    under the folder's lock, so a calibration running at the same time keeps its entries too). Returns the path, the
    merged calibration and the names whose earlier calibration was replaced; a CalibrationError names a bad file,
    which is left as it was."""
    path = Path(folder) / FILE_NAME
    result = {}

    def change(current: str | None) -> str:
        result["all"], result["replaced"] = merged({} if current is None else _parsed(path, current), entries)
        return json.dumps({"machine_id": machine_id, "benchmarks": result["all"]}, indent=2, sort_keys=True)

    baselines.update_file(path, change)
    return path, result["all"], result["replaced"]


def describe(fullname: str, entry: dict) -> str:
    """One line of what a calibration entry measured and the time tolerance it gives."""
    line = f"  {fullname}: {entry['timing']} median spread {entry['spread']:.2%} over {entry['runs']} runs"
    spread = device_spread(entry)
    if spread is not None:
        tolerance = verdict.time_tolerance(same_start=True, spread=spread, runs=entry["runs"])
        line += f" -> time tolerance {tolerance.value:.2%} ({tolerance.source})"
    if "eager_spread" in entry:
        line += f"; launch spread {entry['eager_spread']:.2%}"
    if memory_range(entry):
        line += f"; peak memory moved by {format_bytes(memory_range(entry))}"
    return line


def calibrate(perf, args, cwd: Path, say=None) -> None:
    """--perf-calibrate=N: reruns the tests of `args` (the run's command line, without the options only it takes)
    perf.calibrate times in fresh processes and merges their entries into the GPU's calibration file after every run
    from the second on, so that a calibration stopped later (a timeout, Ctrl-C, a kill) keeps what it measured; then
    notes in perf what was written and which earlier entries it replaced. `say(line)` reports each run. A rerun that
    fails raises CalibrationError saying what the file holds."""
    from lmsys.perf import reruns

    earlier, kept = set(perf.calibration), []

    def write(entries: dict[str, dict]) -> Path:
        path, perf.calibration, _ = update(perf.folder, perf.machine_id, entries)
        return path

    def progress(index, done, docs):
        line = f"lmsys perf: calibration run {index + 1} of {perf.calibrate} done (exit {done.returncode})"
        entries = noise(docs) if len(docs) >= MIN_RUNS else {}
        if entries:
            path = write(entries)
            kept[:] = [len(docs)]
            line += f"; {path.name} holds these {len(docs)} runs"
        if say is not None:
            say(line)

    try:
        docs = reruns.rerun(reruns.child_args(args, cwd), perf.calibrate, cwd, progress=progress)
    except reruns.RerunError as exc:
        held = f"the calibration file holds the first {kept[0]} runs" if kept else "nothing was written"
        raise CalibrationError(f"--perf-calibrate={perf.calibrate} stopped ({held}): {exc}") from None
    entries = noise(docs)
    path = write(entries)
    replaced = sorted(set(entries) & earlier)
    perf.notes.append(f"calibration of {len(entries)} benchmark(s) written to {path}")
    if replaced:
        perf.notes.append(f"it replaced the earlier calibration of: {', '.join(replaced)}")
    perf.notes += [describe(fullname, entry) for fullname, entry in entries.items()]


def _run_identities(path: Path, doc: dict) -> list[tuple]:
    """What makes a run the same as another for the command: the same file (its real path), the same content, or
    the same time and commit recorded by pytest-benchmark (a copy of one run)."""
    identities = [("the same file", Path(path).resolve()),
                  ("the same content", hashlib.sha256(Path(path).read_bytes()).hexdigest())]
    stamp, commit = doc.get("datetime"), (doc.get("commit_info") or {}).get("id")
    if stamp:
        identities.append(("the same datetime and commit", stamp, commit))
    return identities


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmsys.perf.calibration",
        description="Calibrate a GPU's benchmarks from runs measured before, each in a fresh process, and merge the "
                    "entries into the folder's calibration.json (the others stay).",
    )
    parser.add_argument("folder", type=Path, help="the GPU's baselines folder, e.g. baselines/NVIDIA_H100_80GB_HBM3")
    parser.add_argument("runs", type=Path, nargs="+",
                        help="pytest-benchmark JSON of the runs, at least 2, all recorded on that GPU")
    parser.add_argument("-k", dest="only", action="append", default=[], metavar="SUBSTRING",
                        help="only the benchmarks whose full name contains SUBSTRING (repeatable: any of them)")
    parser.add_argument("--dry-run", action="store_true", help="print the entries, write nothing")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    docs = []
    seen = {}
    for path in args.runs:
        try:
            doc = baselines.read_baseline(path, any_schema=True)  # the medians read alike in every format
        except baselines.BaselineError as exc:
            parser.error(str(exc))
        recorded = (doc.get("machine_info", {}).get("lmsys") or {}).get("machine_id")
        if recorded != args.folder.name:
            parser.error(f"{path} was recorded on {recorded or 'a machine it does not name'}, not {args.folder.name}")
        for key in _run_identities(path, doc):
            if key in seen:
                parser.error(f"{path} and {seen[key]} are the same run ({key[0]}): a run counted twice makes the "
                             "spread look smaller than it is; give each run once")
            seen[key] = path
        docs.append(doc)
    if len(docs) < MIN_RUNS:
        parser.error(f"a calibration needs at least {MIN_RUNS} runs, got {len(docs)}")
    entries = {name: entry for name, entry in noise(docs).items()
               if not args.only or any(part in name for part in args.only)}
    if not entries:
        parser.error("no benchmark that every run measured (with one timing) matches")
    for name, entry in entries.items():
        print(describe(name, entry))
    if args.dry_run:
        return 0
    try:
        path, _, replaced = update(args.folder, args.folder.name, entries)
    except CalibrationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(entries)} calibration(s) written to {path}"
          + (f"; replaced: {', '.join(replaced)}" if replaced else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
