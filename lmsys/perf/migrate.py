"""Brings baseline files saved by earlier versions of the gate to the one format it reads (baselines.SCHEMA).

    python -m lmsys.perf.migrate baselines/NVIDIA_H100_80GB_HBM3 [more folders or files] [--write]

Without --write it prints what would change and writes nothing. A migrated file keeps every measurement the gate
still reads (the per-round samples, the memory peaks, the LAUNCH rounds timed from an idle device, the machine and
software it was recorded on) and says `"schema": SCHEMA` in machine_info["lmsys"]. What goes:
- the CPU probe's per-round times (`cpu_probe_data`, `eager_cpu_probe_data`, `cpu_probe`): the gate no longer
  rescales host-set times by a probe;
- eager rounds beside graph or queued ones that were timed behind a short device-side sleep (no `eager_timing`):
  they hid part of the launch cost and were never compared with rounds timed from an idle device.
A file saved without per-round samples gets its median as its one sample. Each file is rewritten atomically, under
its folder's lock; a file that is already current is left as it is. Git keeps the files as they were.
"""

import argparse
import json
import sys
from pathlib import Path

from lmsys.perf import baselines

# The CPU probe's per-round times and its kind, which files of the first format hold.
DROPPED_KEYS = ("cpu_probe_data", "eager_cpu_probe_data", "cpu_probe")


def migrated(doc: dict) -> tuple[dict, list[str]]:
    """The document in the current format, and what changed (empty when it was current already)."""
    probed = sleep = single = 0
    for bench in doc.get("benchmarks", []):
        info = bench.setdefault("extra_info", {})
        dropped = [key for key in DROPPED_KEYS if key in info]
        for key in dropped:
            del info[key]
        probed += bool(dropped)
        if info.get(baselines.EAGER_KEY) is not None and info.get(baselines.EAGER_TIMING_KEY) != "launch":
            info.pop(baselines.EAGER_KEY)
            info.pop("eager_median", None)
            sleep += 1
        stats = bench["stats"]
        if not stats.get("data"):
            stats["data"] = [stats["median"]]
            single += 1
    lmsys = doc["machine_info"].setdefault("lmsys", {})
    changes = [] if lmsys.get("schema") == baselines.SCHEMA else [f"schema {lmsys.get('schema', 1)} -> {baselines.SCHEMA}"]
    lmsys["schema"] = baselines.SCHEMA
    for count, what in ((probed, "CPU probe times dropped"), (sleep, "eager rounds timed behind the sleep dropped"),
                        (single, "no per-round samples: the median kept as one")):
        if count:
            changes.append(f"{what} in {count} benchmark(s)")
    return doc, changes


def files(paths: list[Path]) -> list[Path]:
    """The baseline files among paths (a folder stands for the baseline files in it)."""
    found = []
    for path in paths:
        found += baselines.baseline_files(path) if path.is_dir() else [path]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmsys.perf.migrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+", help="baseline folders (baselines/<GPU>) or files")
    parser.add_argument("--write", action="store_true", help="rewrite the files (default: say what would change)")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        parser.error(f"no such file or folder: {', '.join(missing)}")
    status = 0
    for path in files(args.paths):
        try:
            doc = baselines.read_baseline(path, any_schema=True)
        except baselines.BaselineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        doc, changes = migrated(doc)
        if not changes:
            print(f"{path}: current")
            continue
        print(f"{path}: {'migrated' if args.write else 'would migrate'} ({'; '.join(changes)})")
        if args.write:
            baselines.rewrite(path, json.dumps(doc, indent=4))
    return status


if __name__ == "__main__":
    sys.exit(main())
