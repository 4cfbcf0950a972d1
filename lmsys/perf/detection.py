"""How good the gate is on this GPU, measured: the false-alarm rate of unchanged reruns (A/A) and the rate at which
it catches a device-side delay (or an allocation) of a chosen size injected into every benchmarked call.

    python -m lmsys.perf.detection --runs 20 --inject 0.03 0.05 --inject-memory 1048576 -- perf_tests -k anchors

Each rerun is a fresh pytest process (reruns.py) comparing with a reference: --baseline NUM names one of this GPU's
baselines, --baseline newest compares as a user's --benchmark-compare does (each benchmark with the newest baseline
that has it), otherwise a first run saves a fresh reference into a temporary storage (with a copy of the GPU's
calibration.json, so calibrated tolerances apply); before it, an untimed run (--benchmark-disable) fills the
compilation caches (--no-warm-up: none). The cases take turns (a round is one run of each), so a drift of the
machine over the measurement (warming up, another start) falls on every case alike, and a measurement stopped
partway has as many runs of each case. Their runs load the injection plugin (-p lmsys.perf.injection), where
LMSYS_INJECT_DELAY=f makes every benchmarked call queue device-side work of f times its own time (tensor-core
multiplies, injection.make_work), LMSYS_INJECT_MEMORY=B hold B more bytes on the device while it runs.
--in-process measures every case in each run instead: a fresh process judges each benchmark unchanged (the A/A
case), then once more per injected case (LMSYS_INJECT_CASES, judged against the same reference, failing nothing):
the cases share each run's process, and its start-up and compilations are paid once (on the H100 such a run of the
default subset took 982 s, a plain warm run 330 s: the timing of the cases, not the start-up, is most of it; a
caught delay is measured twice, as the gate re-measures a SLOWER; a case's passes leave out what its verdict does not
read: injection.Injection). --delays-from SECONDS injects the delays only into
benchmarks whose reference median is at least SECONDS, and measures the others again with the allocation alone.
--budget-s SECONDS starts no run that would end past SECONDS from the command's start (a run expected to take as long
as the longest so far, --run-s before the first): a session's share of a measurement that --resume adds to later.
--keep DIR keeps every run's JSON (and each fresh reference, DIR/references/), and --resume adds to them later
(another session, another machine start) until each case has --runs runs, but never to runs of another gate
(gate_files: the manifest records a hash of each file that decides a verdict); --table DIR...
tabulates the runs kept by several measurements of the same cases without running anything (--per-run: also run by
run, with each miss and each throttled GPU); --compact SRC DEST copies the runs kept in SRC into DEST without their
rounds, small enough to commit (baselines/<GPU>/detection/<gate>/), adding only the runs DEST lacks (renumbered where
DEST has taken a run's name with another measurement). The table counts, per benchmark and over all, the failing
verdicts of the A/A runs, the caught delays of each size (any failing verdict) and the caught allocations
(MORE-MEMORY).
"""

import argparse
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from lmsys.perf import baselines, calibration, reruns
from lmsys.perf.report import markdown_table
from lmsys.perf.verdict import MORE_MEMORY, Verdict, format_bytes
from lmsys.perf.injection import INJECT_CASES, INJECT_DELAY, INJECT_DELAYS_FROM, INJECT_MEMORY, INJECTED_CASES_KEY

UNCHANGED = {INJECT_DELAY: "0", INJECT_MEMORY: "0"}
# What the runs of the cases add to the tests' arguments: the plugin that reads the variables above.
INJECTION = ["-p", "lmsys.perf.injection"]
AA_COLUMN = "A/A false alarms"


def failed(label: str | None) -> bool:
    """Whether a verdict label fails its test (the A/A false alarms, the caught delays)."""
    return label is not None and Verdict(label).failed


def slower(label: str | None) -> bool:
    """Whether a verdict label says SLOWER or SLOWER-HOST (the caught delays of runs that also hold memory)."""
    return label is not None and any(part.startswith("SLOWER") for part in label.split("+"))


def more_memory(label: str | None) -> bool:
    """Whether a verdict label says MORE-MEMORY (the caught allocations)."""
    return label is not None and MORE_MEMORY in label.split("+")


def _judged(doc: dict):
    """(benchmark, its extra_info, its verdict label) for each benchmark a run compared with the reference."""
    for bench in doc.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        label = info.get("verdict")
        if label is not None and label != "NEW":
            yield bench, info, label


def tally(cases: list[tuple[str, list[dict], Callable[[str | None], bool]]]) -> pd.DataFrame:
    """Rows per benchmark, per timing when the benchmarks were timed in more than one way ('all graph': the graph
    replays, 'all host': the launch costs, ...) and 'all'; a column per case: 'k/n', k the runs whose verdict the
    case's predicate counts out of n that compared the benchmark. A case is (column, its runs' pytest-benchmark JSON,
    predicate)."""
    counts: dict[str, dict[str, list[int]]] = {}
    timings = set()
    for column, docs, counted in cases:
        for doc in docs:
            for bench, info, label in _judged(doc):
                timed = f"all {info['timing']}" if info.get("timing") else None
                timings.add(timed)
                for name in (bench["name"], timed, "all"):
                    if name is None:
                        continue
                    cell = counts.setdefault(name, {}).setdefault(column, [0, 0])
                    cell[0] += counted(label)
                    cell[1] += 1
    columns = [column for column, _, _ in cases]
    subtotals = sorted(name for name in timings if name) if len(timings) > 1 else []
    names = sorted(name for name in counts if name != "all" and name not in timings)
    names += subtotals + (["all"] if "all" in counts else [])
    rows = [
        {"benchmark": name, **{c: "{}/{}".format(*counts[name][c]) if c in counts[name] else "" for c in columns}}
        for name in names
    ]
    return pd.DataFrame(rows, columns=["benchmark", *columns])


def _memory_column(held: dict) -> str:
    """The column of the allocation held in the delay runs (--memory-with-delays)."""
    return f"+{format_bytes(int(held[INJECT_MEMORY]))} caught"


def _with_memory(results: list, held: dict) -> list:
    """The cases run, plus (with --memory-with-delays) the allocation's case over all delay runs and the runs of the
    benchmarks that --delays-from measured with the allocation alone."""
    if not held:
        return results
    memory = [doc for column, docs, _ in results if column != AA_COLUMN for doc in docs]
    column = _memory_column(held)
    shown = [result for result in results if result[0] != column]
    return shown + ([(column, memory, more_memory)] if memory else [])


def per_run(cases: list[tuple[str, list[dict], Callable[[str | None], bool]]], held: dict
            ) -> tuple[pd.DataFrame, list[str]]:
    """What a measurement's table sums, run by run (the n-th document of each case is run n; `cases` as `tally` takes
    them, before `_with_memory`): a row per run, case and timing with the verdicts counted as in `tally` and the lowest
    and highest time change (none for an allocation's case), and a line per verdict of an injected case that was not
    counted (a missed delay or allocation; with an allocation `held` in the delay runs, a delay verdict without
    MORE-MEMORY too) and per benchmark throttled after its A/A measurement."""
    rows, lines = [], []
    for column, docs, counted in cases:
        changes = counted is not more_memory
        for run, doc in enumerate(docs, 1):
            timings: dict[str, list] = {}
            for bench, info, label in _judged(doc):
                change = info.get("time_change")
                timings.setdefault(info.get("timing") or "", []).append((change, bench["name"], counted(label)))
                if column != AA_COLUMN and not counted(label):
                    measured = f" at {change:+.2%}" if changes and change is not None else ""
                    if measured and info.get("time_resolution") is not None:  # what this comparison could catch
                        measured += f" (catches past {info['time_resolution']:+.2%})"
                    if changes and info.get("added") is not None:  # the delay's work against the A/A median
                        first = info.get("added_before_resize")
                        resized = (f" resized (from {first:+.2%})" if first is not None
                                   else " resized" if info.get("resized") else "")  # runs kept before it was recorded
                        measured += f", the work adding {info['added']:+.2%}{resized}"
                    lines.append(f"run {run}, {column}: missed {bench['name']}{measured} ({label})")
                if column != AA_COLUMN and held and counted is not more_memory and not more_memory(label):
                    lines.append(f"run {run}, {column}: the allocation missed by {bench['name']} ({label})")
                throttle = ((info.get("machine") or {}).get("after") or {}).get("throttle")
                if column == AA_COLUMN and throttle:
                    lines.append(f"run {run}: {bench['name']} throttled after: {', '.join(throttle)}")
            for timing, entries in sorted(timings.items()):
                known = sorted((change, name) for change, name, _ in entries if change is not None and changes)
                ends = [f"{change:+.2%} {name}" for change, name in (known[0], known[-1])] if known else ["", ""]
                rows.append({"run": run, "case": column, "timing": timing,
                             "counted": f"{sum(hit for *_, hit in entries)}/{len(entries)}",
                             "lowest change": ends[0], "highest change": ends[1]})
    columns = ["run", "case", "timing", "counted", "lowest change", "highest change"]
    return pd.DataFrame(rows, columns=columns).sort_values(["run"], kind="stable"), lines


def _shown(table: pd.DataFrame, markdown: bool) -> str:
    """The table as markdown (--markdown) or as text."""
    return markdown_table(table).rstrip("\n") if markdown else table.to_string(index=False)


# Every run (the references too) reports its slowest tests, set-up and compilation included: where a run's time goes
# on a cold machine, where a reference of the default subset took 19 minutes for 60 s of timed rounds.
SLOWEST = 10
DURATIONS = f"--durations={SLOWEST}"
DURATION_LINE = re.compile(r"\d+(\.\d+)?s\s+(setup|call|teardown)\s+\S")


def slowest(output: str | None) -> str:
    """The lines of pytest's table of the slowest durations in a run's output ('' when there is none)."""
    lines = (output or "").splitlines()
    start = next((i for i, line in enumerate(lines) if "slowest" in line and "durations" in line), None)
    if start is None:
        return ""
    return "\n".join(line for line in lines[start + 1:] if DURATION_LINE.match(line))


def _progress(column: str, runs: int) -> Callable[[int, subprocess.CompletedProcess, list[dict]], None]:
    """Prints to stderr, per finished run, a line (the case, the run, its exit status and how long it took) and its
    slowest tests."""
    started = time.monotonic()

    def report(index: int, done: subprocess.CompletedProcess, docs: list[dict]) -> None:
        print(f"  {column}: run {index + 1}/{runs} done, exit {done.returncode}, {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)
        table = slowest(done.stdout)
        if table:
            print(f"  its {SLOWEST} slowest:\n{table}", file=sys.stderr, flush=True)

    return report


MANIFEST = "detection.json"


def _run_files(folder: Path) -> list[Path]:
    """The run files kept in folder (a case's folder under --keep: <case>-run-N.json), in run order."""
    numbered = []
    for path in folder.glob(f"{folder.name}-run-*.json") if folder.is_dir() else ():
        match = re.fullmatch(rf"{re.escape(folder.name)}-run-(\d+)\.json", path.name)
        if match:
            numbered.append((int(match[1]), path))
    return [path for _, path in sorted(numbered)]


def _run_number(name: str) -> int:
    """N of a run file's name, <case>-run-N.json."""
    return int(re.fullmatch(r".*-run-(\d+)\.json", name)[1])


def _resumed_runs(folder: Path) -> list[dict]:
    """kept_runs(folder) for a measurement that adds runs numbered on from them, after checking that they are numbered
    0 to n-1: a run is never written over one kept under the number it would take."""
    numbers = [int(path.stem.rsplit("-", 1)[1]) for path in _run_files(folder)]
    if numbers != list(range(len(numbers))):
        raise SystemExit(f"{folder} holds runs numbered {numbers}, not 0 to {len(numbers) - 1}: the next runs would "
                         "be written over kept ones; keep these runs elsewhere")
    return kept_runs(folder)


def kept_runs(folder: Path) -> list[dict]:
    """The JSON documents kept in folder (a case's folder under --keep), in run order; [] when there is none."""
    return [json.loads(path.read_text(encoding="utf-8")) for path in _run_files(folder)]


PLUGIN = "lmsys.perf.plugin"


def _selection(pytest_args: list[str]) -> list[str]:
    """The pytest arguments without `-p lmsys.perf.plugin`: .ci/detection adds it where the plugin's entry point is not
    installed, and it changes nothing measured (runs kept on a machine with the entry point and on one without are of
    the same measurement)."""
    out, skip = [], False
    for index, arg in enumerate(pytest_args):
        if skip:
            skip = False
        elif arg == "-p" and pytest_args[index + 1:index + 2] == [PLUGIN]:
            skip = True
        elif arg != f"-p{PLUGIN}":
            out.append(arg)
    return out


def _settings(args: argparse.Namespace) -> dict:
    """What makes runs of two measurements the same cases (kept in DIR/detection.json, compared on --resume)."""
    settings = {"pytest_args": _selection(args.pytest_args), "baseline": args.baseline, "no_aa": args.no_aa,
                "inject": args.inject, "inject_memory": args.inject_memory,
                "memory_with_delays": args.memory_with_delays}
    if args.in_process:
        settings["in_process"] = True
    if args.delays_from is not None:
        settings["delays_from"] = args.delays_from
    return settings


# --in-process: the folder (under --keep) of the runs, each of which measures every case.
IN_PROCESS = "runs"
# --delays-from with --memory-with-delays: the case of the benchmarks measured with the allocation alone, which the
# runs' plugin derives from the delay cases (it is not one of LMSYS_INJECT_CASES).
MEMORY_ONLY = "memory-only"


class Case(NamedTuple):
    """One case of a measurement: its table column, the folder of its kept runs, the environment of its runs, the
    verdicts it counts, and what it injects ((delay fraction, bytes held); None for the A/A case)."""

    column: str
    name: str
    env: dict
    counted: Callable[[str | None], bool]
    injected: tuple[float, int] | None


def _case_docs(docs: list[dict], case: tuple[float, int]) -> list[dict]:
    """The verdicts of one injected case in each run of an --in-process measurement, as documents of their own (what
    `tally` reads): a benchmark whose run measured no such case (no baseline, a multi-rank benchmark) is left out."""
    out = []
    for doc in docs:
        benchmarks = []
        for bench in doc.get("benchmarks", []):
            for entry in (bench.get("extra_info") or {}).get(INJECTED_CASES_KEY, []):
                if (entry["delay"], entry["memory"]) == case:
                    # The case's record as it is (verdict, change, resolution, what its work added), with the
                    # benchmark's timing.
                    info = {**entry, "timing": bench["extra_info"].get("timing")}
                    benchmarks.append({"name": bench["name"], "extra_info": info})
        out.append({"benchmarks": benchmarks})
    return out


def _in_process_results(cases: list[Case], docs: list[dict]) -> list[tuple[str, list[dict], Callable]]:
    """(column, documents, predicate) of every case of an --in-process measurement, from its runs: the A/A case's
    verdicts are the runs' own, an injected case's those kept in each benchmark's extra_info."""
    return [(case.column, docs if case.injected is None else _case_docs(docs, case.injected), case.counted)
            for case in cases]


def _cases(settings: dict) -> tuple[list[Case], dict]:
    """The cases of a measurement and the allocation held in the delay runs ({} unless memory_with_delays)."""
    cases = [] if settings["no_aa"] else [Case(AA_COLUMN, "aa", UNCHANGED, failed, None)]
    held = {INJECT_MEMORY: str(settings["inject_memory"][0])} if settings["memory_with_delays"] else {}
    held_bytes = int(held.get(INJECT_MEMORY, 0))
    cases += [Case(f"+{delay:.0%} caught", f"delay-{delay:g}", {**UNCHANGED, INJECT_DELAY: str(delay), **held},
                   slower if held else failed, (delay, held_bytes)) for delay in settings["inject"]]
    if not held:
        cases += [Case(f"+{format_bytes(n)} caught", f"memory-{n}", {**UNCHANGED, INJECT_MEMORY: str(n)}, more_memory,
                       (0.0, n)) for n in settings["inject_memory"]]
    elif settings.get("delays_from"):
        cases.append(Case(_memory_column(held), MEMORY_ONLY, {}, more_memory, (0.0, held_bytes)))
    return cases, held


def _manifest(folder: Path) -> dict | None:
    """The settings of the measurement whose runs folder keeps (--keep), or None when it keeps none; its test
    selection as _selection has it (a manifest written before that may hold `-p lmsys.perf.plugin`)."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if "pytest_args" in manifest:
        manifest["pytest_args"] = _selection(manifest["pytest_args"])
    return manifest


def _table_of_kept(folders: list[Path]) -> tuple[pd.DataFrame, dict[Path, list[str]], list[str], tuple[list, dict]]:
    """The table of the runs kept by one or more measurements of the same cases and gate (--table), each folder's test
    selection, the false alarms and what `per_run` takes (the cases and the allocation held in the delay runs). The
    selections may differ: a benchmark's row counts its verdicts wherever they were kept, so measurements of parts
    of a suite (each part's runs after a fresh reference of its own, when a whole run does not fit in one machine
    start) make up the suite's table."""
    manifests = {folder: _manifest(folder) for folder in folders}
    for folder, manifest in manifests.items():
        if manifest is None:
            raise SystemExit(f"--table: {folder} holds no measurement ({MANIFEST} is missing)")
    gates = {folder: manifest.pop(GATE, None) for folder, manifest in manifests.items()}
    selections = {folder: manifest.pop("pytest_args") for folder, manifest in manifests.items()}
    settings = manifests[folders[0]]
    for folder, other in manifests.items():
        if other != settings:
            raise SystemExit(f"--table: {folder} measured {other}, {folders[0]} {settings}: not the same cases")
    recorded = {folder: gate for folder, gate in gates.items() if gate is not None}
    first = next(iter(recorded), None)
    for folder, gate in recorded.items():
        if gate != recorded[first]:
            raise SystemExit(f"--table: {folder} was measured by another gate than {first} "
                             f"({gate_changes(recorded[first], gate)}): not the same gate")
    unknown = [str(folder) for folder, gate in gates.items() if gate is None]
    if unknown:
        print(f"--table: no gate recorded in {', '.join(unknown)} (kept before it was recorded): not checked",
              file=sys.stderr)
    cases, held = _cases(settings)
    if settings.get("in_process"):
        docs = [doc for folder in folders for doc in kept_runs(folder / IN_PROCESS)]
        results = _in_process_results(cases, docs)
    else:
        results = [(case.column, [doc for folder in folders for doc in kept_runs(folder / case.name)], case.counted)
                   for case in cases]
    return tally(_with_memory(results, held)), selections, false_alarms(results), (results, held)


def false_alarms(results: list[tuple[str, list[dict], Callable[[str | None], bool]]]) -> list[str]:
    """A line per A/A verdict that failed: the benchmark, the verdict, the change against its tolerance (the host-set
    time's where it failed it) and the throttle reasons NVML gave after the measurement, so that an alarm the
    machine raised (a GPU slowed by its temperature) can be told from one of the gate."""
    lines = []
    for column, docs, counted in results:
        if column != AA_COLUMN:
            continue
        for doc in docs:
            for bench in doc.get("benchmarks", []):
                info = bench.get("extra_info") or {}
                if info.get("verdict") in (None, "NEW") or not counted(info["verdict"]):
                    continue
                host = info["verdict"].endswith("HOST")
                change = info.get("host_change" if host else "time_change")
                tolerance = None if host else info.get("time_tolerance")
                measured = "" if change is None or tolerance is None else f", {change:+.2%} against {tolerance:.2%}"
                throttle = ((info.get("machine") or {}).get("after") or {}).get("throttle")
                throttled = f"; throttled after: {', '.join(throttle)}" if throttle else ""
                lines.append(f"{bench['name']}: {info['verdict']}{measured}{throttled}")
    return lines


# The modules of lmsys.perf that decide no verdict: this measurement of the gate (its injected regressions,
# injection.py, are measured with the gate), the docs built from baselines, the tables and reports printed or written
# after the verdicts, and the commands that convert or compare baseline files.
NOT_THE_GATE = ("detection.py", "docs.py", "report.py", "markdown.py", "memory_report.py", "sidebyside.py",
                "migrate.py")
GATE = "gate"


def gate_files(storage: Path) -> dict[str, str]:
    """What decides a verdict, file by file (a SHA-256 prefix each), so that runs of one gate are never counted for
    another: lmsys.perf's modules (NOT_THE_GATE aside), the benchmarks and their pytest set-up in the working folder
    (perf_tests/, conftest.py, pytest.ini) and the calibrations under `storage`."""
    package = Path(__file__).resolve().parent
    files = {f"lmsys/perf/{path.name}": path for path in package.glob("*.py") if path.name not in NOT_THE_GATE}
    here = Path.cwd()
    for path in (*here.glob("perf_tests/**/*.py"), here / "conftest.py", here / "pytest.ini",
                 *storage.glob(f"*/{calibration.FILE_NAME}")):
        if path.is_file():
            files[path.relative_to(here).as_posix() if path.is_relative_to(here) else str(path)] = path
    return {name: hashlib.sha256(files[name].read_bytes()).hexdigest()[:16] for name in sorted(files)}


def gate_changes(earlier: dict[str, str], now: dict[str, str]) -> str:
    """The files by which two gates (gate_files) differ, in words."""
    parts = [
        f"{what} {', '.join(names)}" for what, names in (
            ("changed", [name for name in now if name in earlier and earlier[name] != now[name]]),
            ("added", [name for name in now if name not in earlier]),
            ("removed", [name for name in earlier if name not in now]),
        ) if names
    ]
    return "; ".join(parts)


def _resume(keep: Path, settings: dict, resume: bool, gate: dict[str, str]) -> None:
    """Checks that --keep DIR may take this measurement's runs: a folder that holds runs needs --resume (so kept runs
    are never overwritten), the same settings (test selection, reference) as the runs it holds and the same gate
    (gate_files); records them. A folder kept before the gate was recorded takes this gate's record, with a warning."""
    earlier = _manifest(keep)
    if earlier is not None:
        if not resume:
            raise SystemExit(f"--keep {keep} holds the runs of an earlier measurement: add --resume to add runs to it, "
                             "or keep these runs in another folder")
        earlier_gate = earlier.pop(GATE, None)
        if earlier != settings:
            raise SystemExit(f"--resume: {keep} holds runs of {earlier}, not of {settings}")
        if earlier_gate is None:
            print(f"--resume: {keep} does not record the gate its runs were measured by (kept before the gate was "
                  "recorded): its runs are counted as this gate's, and this gate is recorded from now on",
                  file=sys.stderr, flush=True)
        elif earlier_gate != gate:
            raise SystemExit(f"--resume: {keep} holds runs of another gate ({gate_changes(earlier_gate, gate)} since): "
                             "keep this gate's runs in another folder")
        else:
            return
    elif keep.is_dir() and any(keep.rglob("*.json")):
        # runs or references without the manifest written before them: a copy made partway (a folder synced away
        # under a running measurement) or by hand; measuring into it would number its runs from 0 again
        raise SystemExit(f"--keep {keep} holds JSON files but no {MANIFEST}: not a measurement this can add to "
                         "(its runs would be overwritten); restore its manifest, or keep these runs in another folder")
    elif resume:
        raise SystemExit(f"--resume: {keep} holds no measurement to resume ({MANIFEST} is missing)")
    keep.mkdir(parents=True, exist_ok=True)
    (keep / MANIFEST).write_text(json.dumps({**settings, GATE: gate}, indent=1), encoding="utf-8")


REFERENCES = "references"


def _reference(args: list[str], storage: Path, baselines: Path, timeout: float, keep: Path | None = None
               ) -> list[str]:
    """Saves a fresh reference into `storage` (with a copy of the GPU's calibration); returns the arguments that
    compare with it. With `keep`, the reference is kept too, as keep/references/<GPU>/reference-N.json (N counting
    the measurement's machine starts): the baseline its runs were judged against, a baseline of that commit, and
    with the runs a calibration's fresh processes."""
    reruns.rerun([*args, f"--benchmark-storage={storage}", "--benchmark-save=reference", DURATIONS], 1, Path.cwd(),
                 env=UNCHANGED, timeout=timeout, progress=_progress("a fresh reference", 1))
    for folder in storage.iterdir():
        calibrated = baselines / folder.name / calibration.FILE_NAME
        if calibrated.exists():
            shutil.copy(calibrated, folder / calibration.FILE_NAME)
        if keep is not None:
            kept = keep / REFERENCES / folder.name
            kept.mkdir(parents=True, exist_ok=True)
            for saved in sorted(folder.glob("*_reference.json")):
                shutil.copy(saved, kept / f"reference-{len(list(kept.glob('reference-*.json')))}.json")
    return [f"--benchmark-storage={storage}", "--benchmark-compare"]


def _compare_args(args: argparse.Namespace, folder: Path) -> list[str]:
    """The untimed warm-up run (unless --no-warm-up), then the arguments that make a run compare: with a named
    baseline, each benchmark's newest one, or a fresh reference saved into `folder`."""
    if not args.no_warm_up:
        print("an untimed run first, to fill the compilation caches", file=sys.stderr, flush=True)
        started = time.monotonic()
        reruns.warm_up(args.pytest_args, Path.cwd(), timeout=args.timeout)
        print(f"  the untimed run took {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    if args.baseline == "newest":
        return [f"--benchmark-storage={args.storage}", "--benchmark-compare"]
    if args.baseline:
        return [f"--benchmark-storage={args.storage}", f"--benchmark-compare={args.baseline}"]
    # a reference of this machine, for this measurement (a resumed one saves its own)
    return _reference(args.pytest_args, folder, args.storage, args.timeout, args.keep)


def _measure_in_process(args: argparse.Namespace, cases: list[Case], held: dict
                        ) -> list[tuple[str, list[dict], Callable]]:
    """--in-process: each run, one fresh process, measures every benchmark unchanged (its own verdict: the A/A case)
    and then once per injected case (LMSYS_INJECT_CASES); returns the cases' results over every run."""
    started = time.monotonic()
    docs = _resumed_runs(args.keep / IN_PROCESS) if args.resume else []
    if args.resume:
        print(f"resuming {args.keep}: {len(docs)} runs", file=sys.stderr, flush=True)
    if len(docs) >= args.runs:
        print(f"{args.runs} runs kept already: nothing to run", file=sys.stderr, flush=True)
        return _in_process_results(cases, docs)
    injected = ",".join(f"{case.injected[0]:g}:{case.injected[1]}" for case in cases
                        if case.injected and case.name != MEMORY_ONLY)
    env = {**UNCHANGED, INJECT_CASES: injected}
    if args.delays_from is not None:
        env[INJECT_DELAYS_FROM] = f"{args.delays_from:g}"
    with tempfile.TemporaryDirectory(prefix="lmsys-detection-") as folder:
        compare = _compare_args(args, Path(folder))
        print(f"{args.runs} runs, each measuring every case", file=sys.stderr, flush=True)
        longest = None  # the longest run timed so far; --run-s stands for it until the first is timed
        while len(docs) < args.runs:
            spent = time.monotonic() - started
            expected = longest if longest is not None else args.run_s or 0.0
            if args.budget_s is not None and spent + expected > args.budget_s:
                print(f"the budget of {args.budget_s:.0f} s leaves no room for another run ({spent:.0f} s spent, a run "
                      f"expected to take {expected:.0f} s): {len(docs)} of {args.runs} runs kept", file=sys.stderr,
                      flush=True)
                break
            begun = time.monotonic()
            docs += reruns.rerun([*INJECTION, *args.pytest_args, *compare, DURATIONS], 1, Path.cwd(), env=env,
                                 timeout=args.timeout, progress=_progress("every case", args.runs),
                                 keep=None if args.keep is None else args.keep / IN_PROCESS, first=len(docs))
            longest = max(longest or 0.0, time.monotonic() - begun)
            if len(docs) < args.runs:  # what is measured so far, in case the rest never finishes
                print(f"after {len(docs)} of {args.runs} runs:", file=sys.stderr)
                print(tally(_with_memory(_in_process_results(cases, docs), held)).to_string(index=False),
                      file=sys.stderr, flush=True)
    return _in_process_results(cases, docs)


def _measure(args: argparse.Namespace, cases: list[Case], held: dict) -> list[tuple[str, list[dict], Callable]]:
    """Each case in runs of its own, the cases taking turns a round at a time; returns their results."""
    docs = {case.name: _resumed_runs(args.keep / case.name) if args.resume else [] for case in cases}
    if args.resume:
        print(f"resuming {args.keep}: " + ", ".join(f"{name} {len(runs)} runs" for name, runs in docs.items()),
              file=sys.stderr, flush=True)
    results = [(case.column, docs[case.name], case.counted) for case in cases]
    if all(len(runs) >= args.runs for runs in docs.values()):
        print(f"every case has {args.runs} runs already: nothing to run", file=sys.stderr, flush=True)
    else:
        with tempfile.TemporaryDirectory(prefix="lmsys-detection-") as folder:
            compare = _compare_args(args, Path(folder))
            print(f"{args.runs} rounds of: {', '.join(case.column for case in cases)}", file=sys.stderr,
                  flush=True)
            for index in range(args.runs):  # a round: one run of each case that has fewer runs than that
                for column, name, env, _, _ in cases:
                    if len(docs[name]) > index:
                        continue
                    kept = None if args.keep is None else args.keep / name
                    docs[name] += reruns.rerun([*INJECTION, *args.pytest_args, *compare, DURATIONS], 1, Path.cwd(),
                                               env=env, timeout=args.timeout, progress=_progress(column, args.runs),
                                               keep=kept, first=len(docs[name]))
                results = [(case.column, docs[case.name], case.counted) for case in cases]
                if index + 1 < args.runs:  # what is measured so far, in case the rest never finishes
                    print(f"after {index + 1} of {args.runs} rounds:", file=sys.stderr)
                    print(tally(_with_memory(results, held)).to_string(index=False), file=sys.stderr, flush=True)
    return results


# The per-round lists a benchmark's extra_info holds beside stats["data"] (the LAUNCH rounds of graph and queued mode,
# and the CPU probe's times that runs of the first format kept): with stats["data"], what --compact leaves out.
ROUND_KEYS = (baselines.EAGER_KEY, "cpu_probe_data", "eager_cpu_probe_data")


def compacted(doc: dict) -> dict:
    """A kept run without its rounds (each benchmark's stats["data"] and ROUND_KEYS): the verdicts, the medians and
    the other stats, the injected cases, the memory and machine readings and the notes stay, and a compacted run
    compacts to itself."""
    def without_rounds(bench: dict) -> dict:
        bench = dict(bench)
        if "stats" in bench:
            bench["stats"] = {key: value for key, value in bench["stats"].items() if key != "data"}
        if bench.get("extra_info"):
            bench["extra_info"] = {key: value for key, value in bench["extra_info"].items() if key not in ROUND_KEYS}
        return bench

    return {**doc, "benchmarks": [without_rounds(bench) for bench in doc["benchmarks"]]}


def _read_run(path: Path) -> dict:
    """A kept run's JSON document; a file that is not one is a SystemExit naming it."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--compact: {path} cannot be read as a run's JSON: {exc}") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("benchmarks"), list)):
        raise SystemExit(f"--compact: {path} is not a pytest-benchmark run (no list of benchmarks)")
    return doc


def compact(src: Path, dest: Path) -> str:
    """Copies the measurement kept in src (--keep) into dest small enough to commit: its manifest as it is and each
    kept run compacted (`compacted`), adding only the runs dest lacks (a run already kept under any name counts as
    there); returns the summary line. The references (src/references/) are not copied: they are baselines, with every
    round. A run of another measurement (another `datetime`, both recorded) whose name dest has taken is added under the
    next free number: what a session's copy of the kept runs numbers on when it was taken before the last runs were
    compacted into dest. Refuses (SystemExit), before writing anything, a src without a measurement, a dest of another
    measurement (another manifest) and a run file in dest that is not the compacted run of the same name in src and
    not another measurement. Runs in dest that src lacks stay."""
    manifest = _manifest(src)
    if manifest is None:
        raise SystemExit(f"--compact: {src} holds no measurement ({MANIFEST} is missing)")
    there = _manifest(dest)
    if there is not None and there != manifest:
        theirs, ours = dict(there), dict(manifest)
        their_gate, our_gate = theirs.pop(GATE, None), ours.pop(GATE, None)
        if theirs != ours:
            why = f"{dest} measured {theirs}, {src} {ours}: not the same cases"
        elif their_gate is None or our_gate is None:
            why = f"{dest if their_gate is None else src} records no gate (kept before it was recorded), the other does"
        else:
            why = f"{dest} and {src} were measured by different gates ({gate_changes(their_gate, our_gate)} in {src})"
        raise SystemExit(f"--compact: {why}: compact into another folder (nothing was written)")
    settings = {key: value for key, value in manifest.items() if key != GATE}
    folders = [IN_PROCESS] if settings.get("in_process") else [case.name for case in _cases(settings)[0]]
    new, already, conflicts, renamed = [], 0, [], []
    for name in folders:
        kept = {path.name: _read_run(path) for path in _run_files(dest / name)}
        texts = {n: json.dumps(doc, indent=1) for n, doc in kept.items()}  # as text: a NaN never equals a NaN
        free = 1 + max(map(_run_number, kept), default=-1)
        for path in _run_files(src / name):
            doc = compacted(_read_run(path))
            text = json.dumps(doc, indent=1)
            when, taken = doc.get("datetime"), kept.get(path.name)
            # There already: under its name, or renumbered (a run that records when it ran is that run alone).
            if texts.get(path.name) == text or (when is not None and text in texts.values()):
                already += 1
                continue
            # This run kept otherwise, under its name or (renumbered) another, or a name taken by a run that is not
            # known to be another measurement: refused, never a second copy.
            clash = [n for n, run in kept.items() if when is not None and run.get("datetime") == when]
            if taken is not None and (when is None or taken.get("datetime") in (None, when)):
                clash = sorted({path.name, *clash})
            if clash:
                conflicts.extend(str(dest / name / n) for n in clash)
                continue
            target = dest / name / path.name
            # The name is another measurement's, or an earlier run of src was renumbered onto it.
            if taken is not None or path.name in texts:
                target = dest / name / f"{name}-run-{free}.json"
                renamed.append(f"{path.relative_to(src)} as {target.name}")
                free += 1
            texts[target.name] = text
            new.append((path, target, text))
    if conflicts:
        raise SystemExit(f"--compact: {', '.join(conflicts)}: not what compacting the run of that name or datetime in "
                         f"{src} gives, and a kept run is never replaced (nothing was written)")
    written = read = 0
    if there is None:
        text = (src / MANIFEST).read_text(encoding="utf-8")
        baselines.write_new_file(dest / MANIFEST, text)
        written += len(text.encode())
        read += (src / MANIFEST).stat().st_size
    for path, target, text in new:
        baselines.write_new_file(target, text)
        written += len(text.encode())
        read += path.stat().st_size
    renumbered = f" ({len(renamed)} renumbered, their names taken: {', '.join(renamed)})" if renamed else ""
    return (f"--compact: {len(new)} runs added to {dest}{renumbered}, {already} already there; "
            f"{format_bytes(written)} written for {format_bytes(read)} in {src}; its references ({src / REFERENCES}) "
            "are not copied: baselines with every round")


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds above 0")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds, 0 or more")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmsys.perf.detection", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="fresh processes per case (default: 20)")
    parser.add_argument("--inject", type=float, nargs="*", default=[0.03, 0.05],
                        help="device-side delays to inject, fractions of each call's time (default: 0.03 0.05)")
    parser.add_argument("--inject-memory", type=int, nargs="*", default=[], metavar="BYTES",
                        help="allocations to hold during every call, in bytes (e.g. 1048576), counted when MORE-MEMORY")
    parser.add_argument("--no-aa", action="store_true",
                        help="leave out the unchanged reruns (A/A), e.g. when an earlier run measured them")
    parser.add_argument("--memory-with-delays", action="store_true",
                        help="hold the --inject-memory allocation in the runs of each delay instead of runs of their "
                        "own: a run then counts for both columns (a delay caught: SLOWER; an allocation: MORE-MEMORY)")
    parser.add_argument("--baseline", help="compare with this baseline of the GPU (--benchmark-compare=VALUE), or "
                        "with 'newest': each benchmark's newest baseline, instead of a fresh reference")
    parser.add_argument("--storage", type=Path, default=Path("baselines"),
                        help="the baselines folder, for --baseline and the calibration (default: baselines)")
    parser.add_argument("--timeout", type=_positive_seconds, default=reruns.RUN_TIMEOUT, help="seconds per run")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep every run's pytest-benchmark JSON (medians, memory, machine readings) in "
                        "DIR/<case>: aa, delay-0.05, memory-1048576")
    parser.add_argument("--resume", action="store_true",
                        help="add to the runs kept in --keep DIR by an earlier measurement (another session or machine "
                        "start) until each case has --runs runs, and counts them all; refuses a folder whose runs "
                        "another gate measured (other lmsys.perf modules, perf_tests or calibrations)")
    offline = parser.add_mutually_exclusive_group()
    offline.add_argument("--table", type=Path, nargs="+", metavar="DIR",
                         help="run nothing: print the table of the runs kept (--keep) by one or more measurements of "
                         "the same tests and cases, e.g. one per machine start")
    parser.add_argument("--per-run", action="store_true",
                        help="with --table: also a row per run, case and timing (the verdicts counted, the lowest and "
                        "highest time change and their benchmarks), each missed injection and each throttled GPU")
    offline.add_argument("--compact", type=Path, nargs=2, metavar=("SRC", "DEST"),
                         help="run nothing: copy the measurement kept in SRC (--keep) into DEST without the runs' "
                         "rounds (stats data, eager rounds, CPU probe times), small enough to commit; adds the runs "
                         "DEST lacks and refuses another measurement's DEST or a run that differs; SRC/references "
                         "(baselines with every round) are not copied")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="leave out the untimed run (--benchmark-disable) that fills the compilation caches first, "
                        "so that the reference and the first runs are not timed in a cold process")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every case in each run: each benchmark unchanged (the A/A case), then once per "
                        "injected case in the same process (LMSYS_INJECT_CASES), instead of a run per case; the "
                        "cases' verdicts then share each run's process, and a run of the whole suite costs one "
                        "start-up and compilation instead of one per case")
    parser.add_argument("--delays-from", type=_seconds, metavar="SECONDS",
                        help="with --in-process: the delays only into benchmarks whose reference median is at least "
                        "SECONDS (e.g. 0.001); the others are measured again with each --inject-memory size alone, so "
                        "that the allocation is still judged on every benchmark")
    parser.add_argument("--budget-s", type=_positive_seconds, metavar="SECONDS",
                        help="with --in-process: start no run that would end more than SECONDS after this command "
                        "began (the warm-up and the reference included); a run is expected to take as long as the "
                        "longest so far, or --run-s before the first")
    parser.add_argument("--run-s", type=_positive_seconds, metavar="SECONDS",
                        help="with --budget-s: how long a run is expected to take until one has been timed")
    parser.add_argument("pytest_args", nargs="*", help="what to run, after --: test paths, -k, options")
    args = parser.parse_args(argv)
    if args.per_run and not args.table:
        parser.error("--per-run goes with --table: it breaks a table of kept runs down run by run")
    if args.compact:
        if args.pytest_args or args.keep or args.resume:
            parser.error("--compact runs nothing: give it no tests to run, no --keep and no --resume")
        print(compact(*args.compact), file=sys.stderr)
        return 0
    if args.table:
        table, selections, alarms, cases = _table_of_kept(args.table)
        for folder, selection in selections.items():
            print(f"runs kept in {folder} of: {' '.join(selection)}", file=sys.stderr)
        print(_shown(table, args.markdown))
        print("\n".join([f"{len(alarms)} A/A false alarm(s):"] + [f"  {line}" for line in alarms]), file=sys.stderr)
        if args.per_run:
            runs, lines = per_run(*cases)
            print("\n" + _shown(runs, args.markdown))
            print("\n".join(lines), file=sys.stderr)
        return 0
    if not args.pytest_args:
        parser.error("what to run is missing: give the tests after --, e.g. -- perf_tests -k anchors")
    if args.memory_with_delays and not (args.inject and len(args.inject_memory) == 1):
        parser.error("--memory-with-delays needs --inject and one --inject-memory size")
    if args.no_aa and not (args.inject or args.inject_memory):
        parser.error("--no-aa leaves nothing to measure without --inject or --inject-memory")
    if args.runs < 1 or any(not 0 < delay <= 10 for delay in args.inject) or any(n < 1 for n in args.inject_memory):
        parser.error("--runs must be at least 1, --inject fractions in (0, 10] and --inject-memory positive")
    if args.resume and args.keep is None:
        parser.error("--resume needs --keep DIR, the folder of the runs to add to")
    if not args.in_process and (args.delays_from is not None or args.budget_s is not None):
        parser.error("--delays-from and --budget-s go with --in-process")
    if args.delays_from is not None and not args.inject:
        parser.error("--delays-from chooses the benchmarks that get the --inject delays: give some")
    if args.run_s is not None and args.budget_s is None:
        parser.error("--run-s goes with --budget-s")
    if args.keep is not None:
        _resume(args.keep, _settings(args), args.resume, gate_files(args.storage))
    settings = _settings(args)
    cases, held = _cases(settings)
    if args.in_process:
        results = _measure_in_process(args, cases, held)
    else:
        results = _measure(args, cases, held)
    table = tally(_with_memory(results, held))
    print(_shown(table, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
