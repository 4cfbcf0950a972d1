"""How good the gate is on this GPU, measured: the false-alarm rate of unchanged reruns (A/A) and the rate at which
it catches a device-side delay of a chosen size injected into every benchmarked call.

    python -m lmsys.perf.detection --runs 20 --inject 0.03 0.05 -- perf_tests -k "leaderboard or anchors"

Each rerun is a fresh pytest process (reruns.py) comparing with a reference: --baseline NUM names one of this
GPU's baselines, otherwise a first run saves a fresh reference into a temporary storage (with a copy of the GPU's
calibration.json, so calibrated tolerances apply). LMSYS_INJECT_DELAY=f makes every benchmarked call queue a
device-side delay of f times its own time (torch.cuda._sleep, calibrated to the GPU's clock). The table counts,
per benchmark and over all, the failing verdicts of the A/A runs and the caught delays of each size.
"""

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from lmsys.perf import calibration, reruns
from lmsys.perf.timing import INJECT_DELAY
FAILING = ("SLOWER", "SLOWER-EAGER", "MORE-MEMORY")


def _failed(label: str | None) -> bool:
    return label is not None and any(part in FAILING for part in label.split("+"))


def tally(results: dict[float, list[dict]]) -> pd.DataFrame:
    """Rows per benchmark (and 'all'), a column per injected delay (0: the A/A runs): 'k/n', k the runs whose
    verdict failed out of n that compared the benchmark. results maps a delay to its runs' pytest-benchmark JSON."""
    counts: dict[str, dict[str, list[int]]] = {}
    columns = []
    for delay, docs in results.items():
        column = "A/A false alarms" if delay == 0 else f"+{delay:.0%} caught"
        columns.append(column)
        for doc in docs:
            for bench in doc.get("benchmarks", []):
                label = (bench.get("extra_info") or {}).get("verdict")
                if label is None or label == "NEW":
                    continue
                for name in (bench["name"], "all"):
                    cell = counts.setdefault(name, {}).setdefault(column, [0, 0])
                    cell[0] += _failed(label)
                    cell[1] += 1
    names = sorted(name for name in counts if name != "all") + (["all"] if "all" in counts else [])
    rows = [
        {"benchmark": name, **{c: "{}/{}".format(*counts[name][c]) if c in counts[name] else "" for c in columns}}
        for name in names
    ]
    return pd.DataFrame(rows, columns=["benchmark", *columns])


def _reference(args: list[str], storage: Path, baselines: Path, timeout: float) -> list[str]:
    """Saves a fresh reference into `storage` (with a copy of the GPU's calibration); returns the arguments that
    compare with it."""
    reruns.rerun([*args, f"--benchmark-storage={storage}", "--benchmark-save=reference"], 1, Path.cwd(),
                 env={INJECT_DELAY: "0"}, timeout=timeout)
    for folder in storage.iterdir():
        calibrated = baselines / folder.name / calibration.FILE_NAME
        if calibrated.exists():
            shutil.copy(calibrated, folder / calibration.FILE_NAME)
    return [f"--benchmark-storage={storage}", "--benchmark-compare"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmsys.perf.detection", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="fresh processes per case (default: 20)")
    parser.add_argument("--inject", type=float, nargs="*", default=[0.03, 0.05],
                        help="device-side delays to inject, fractions of each call's time (default: 0.03 0.05)")
    parser.add_argument("--baseline", help="compare with this baseline of the GPU (--benchmark-compare=VALUE) "
                        "instead of a fresh reference")
    parser.add_argument("--storage", type=Path, default=Path("baselines"),
                        help="the baselines folder, for --baseline and the calibration (default: baselines)")
    parser.add_argument("--timeout", type=float, default=reruns.RUN_TIMEOUT, help="seconds per run")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("pytest_args", nargs="+", help="what to run, after --: test paths, -k, options")
    args = parser.parse_args(argv)
    if args.runs < 1 or any(not 0 < delay <= 10 for delay in args.inject):
        parser.error("--runs must be at least 1 and --inject fractions in (0, 10]")
    with tempfile.TemporaryDirectory(prefix="lmsys-detection-") as folder:
        if args.baseline:
            compare = [f"--benchmark-storage={args.storage}", f"--benchmark-compare={args.baseline}"]
        else:
            compare = _reference(args.pytest_args, Path(folder), args.storage, args.timeout)
        results = {}
        for delay in [0.0, *args.inject]:
            print(f"{args.runs} runs with {INJECT_DELAY}={delay} ...", file=sys.stderr, flush=True)
            results[delay] = reruns.rerun([*args.pytest_args, *compare], args.runs, Path.cwd(),
                                          env={INJECT_DELAY: str(delay)}, timeout=args.timeout)
    table = tally(results)
    if args.markdown:
        print("| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns))
        for row in table.itertuples(index=False):
            print("| " + " | ".join(map(str, row)) + " |")
    else:
        print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
