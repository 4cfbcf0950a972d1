"""Noise calibration (lmsys.perf.calibration, --perf-calibrate): the spread of a benchmark's median between
fresh processes, the tolerance it gives, the file next to the GPU's baselines, and a run that uses it."""

import json
import multiprocessing
import math
import os
from pathlib import Path

import pytest
from perf_fakes import INNER_CONFTEST, GPU, MACHINE, run, save_baseline

from lmsys.perf import calibration, reruns, verdict

pytest_plugins = ["pytester"]


def run_doc(medians: dict[str, float], timing: str = "eager", eager: float | None = None, peak: int | None = None,
            eager_timing: str | None = "launch"):
    benches = []
    for fullname, median in medians.items():
        info = {"timing": timing}
        if eager is not None:
            info["eager_median"] = eager
            if eager_timing is not None:
                info["eager_timing"] = eager_timing
        if peak is not None:
            info["peak_allocated_above_start_bytes"] = peak
        benches.append({"fullname": fullname, "name": fullname, "stats": {"median": median}, "extra_info": info})
    return {"benchmarks": benches}


def test_noise_is_the_relative_spread_of_the_medians_of_benchmarks_every_run_measured():
    docs = [run_doc({"t::a": 1.00e-3, "t::b": 2e-3}, peak=10), run_doc({"t::a": 1.02e-3}, peak=12),
            run_doc({"t::a": 0.98e-3, "t::b": 2e-3}, peak=10)]
    entries = calibration.noise(docs)
    assert list(entries) == ["t::a"]  # t::b is missing from one run
    entry = entries["t::a"]
    assert entry["runs"] == 3 and entry["timing"] == "eager"
    assert entry["spread"] == pytest.approx(0.02)
    assert calibration.memory_range(entry) == 2
    assert calibration.device_spread(entry) == pytest.approx(0.02)
    assert verdict.time_tolerance(same_start=True, spread=0.02, runs=3).value == pytest.approx(3 * math.sqrt(2) * 0.02)
    with pytest.raises(ValueError, match="at least 2 runs"):
        calibration.noise(docs[:1])


def test_a_tiny_spread_gives_the_floor_and_graph_entries_keep_their_eager_spread():
    docs = [run_doc({"t::a": 1e-3}, timing="graph", eager=e) for e in (3.0e-3, 3.3e-3, 2.7e-3)]
    entry = calibration.noise(docs)["t::a"]
    assert entry["spread"] == 0
    assert verdict.time_tolerance(same_start=True, spread=calibration.device_spread(entry)).value == verdict.SAME_START
    # The LAUNCH rounds beside the replays (or the queued rounds, when the capture fails) keep their own spread.
    assert entry["eager_spread"] == pytest.approx(0.1)


def test_eager_rounds_timed_behind_the_old_sleep_give_no_eager_tolerance():
    docs = [run_doc({"t::a": 1e-3}, timing="graph", eager=e, eager_timing=None) for e in (3.0e-3, 3.3e-3)]
    entry = calibration.noise(docs)["t::a"]
    assert "eager_spread" not in entry


def test_a_host_timed_entry_raises_no_device_tolerance():
    entry = calibration.noise([run_doc({"t::a": m}, timing="host") for m in (1e-3, 1.5e-3)])["t::a"]
    assert entry["spread"] > 0.1 and calibration.device_spread(entry) is None


def test_mixed_timings_are_not_calibrated():
    docs = [run_doc({"t::a": 1e-3}, timing="graph"), run_doc({"t::a": 1e-3}, timing="eager")]
    assert calibration.noise(docs) == {}


def test_the_file_is_merged_written_atomically_and_validated(tmp_path):
    first = calibration.noise([run_doc({"t::a": x, "t::b": x}) for x in (1e-3, 1.1e-3)])
    calibration.update(tmp_path, "GPU", first)
    second = calibration.noise([run_doc({"t::b": x}) for x in (2e-3, 2.2e-3)])
    path, merged, replaced = calibration.update(tmp_path, "GPU", second)
    assert path == tmp_path / "calibration.json" and replaced == ["t::b"] and sorted(merged) == ["t::a", "t::b"]
    assert calibration.read(tmp_path)["t::b"]["medians"] == [2e-3, 2.2e-3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json"]
    assert calibration.read(tmp_path / "nowhere") == {}
    (tmp_path / "calibration.json").write_text(json.dumps({"benchmarks": {"t::a": {"timing": "eager", "runs": 2,
                                                                                   "medians": [1e-3, -1.0]}}}))
    with pytest.raises(calibration.CalibrationError, match="medians that are not positive"):
        calibration.read(tmp_path)


def _calibrate_many(folder, prefix, count):
    for index in range(count):
        calibration.update(folder, "GPU", calibration.noise([run_doc({f"t::{prefix}{index}": x}) for x in (1e-3, 2e-3)]))


def test_calibrations_at_the_same_time_keep_each_others_entries(tmp_path):
    """Processes writing calibrations into one folder at once: each merges into the file as it is when it writes
    (read, merge and write under the folder's lock), so none loses another's entries."""
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_calibrate_many, args=(tmp_path, prefix, 15)) for prefix in "abc"]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert sorted(calibration.read(tmp_path)) == sorted(f"t::{p}{i}" for p in "abc" for i in range(15))


def test_a_corrupt_calibration_file_is_named_and_left_as_it_was(tmp_path):
    (tmp_path / "calibration.json").write_text("{not json")
    with pytest.raises(calibration.CalibrationError, match="calibration file .*calibration.json cannot be read"):
        calibration.update(tmp_path, "GPU", calibration.noise([run_doc({"t::a": x}) for x in (1e-3, 1.1e-3)]))
    assert (tmp_path / "calibration.json").read_text() == "{not json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json"]


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        (["perf_tests", "--perf-calibrate=5", "-k", "x"], ["perf_tests", "-k", "x"]),
        (["--perf-calibrate", "5", "perf_tests"], ["perf_tests"]),
        (["--benchmark-compare", "perf_tests", "--benchmark-save", "x"], ["perf_tests"]),
        (["--benchmark-compare", "3", "--perf-mem-report", "-q"], ["-q"]),
        (["--benchmark-json=a.json", "--benchmark-autosave", "--perf-full-grid"], ["--perf-full-grid"]),
    ],
)
def test_reruns_leave_out_the_parents_own_options(tmp_path, args, kept):
    (tmp_path / "perf_tests").mkdir()
    assert reruns.child_args(args, tmp_path) == kept


# Each process draws its own noise (seeded by its pid), so the calibration sees a spread.
# Noise of 0.5% a call, another draw in each process: two runs' medians differ, and their spread stays far under the
# 1.2% that would lift the calibrated tolerance (3 x sqrt(2) x spread) past the 3.6% slowdown judged below. At 1% a call
# one CI run in a few hundred drew such a spread (tolerance 3.64%) and passed the slowdown.
NOISY_SUITE = """
import os

def test_a(gpu_benchmark, fake):
    gpu_benchmark(fake.work(1.0, noise=0.005, seed=os.getpid(), memory=64 * 2**20))
"""


def calibrate(pytester, monkeypatch, suite: str, runs: int):
    """Runs --perf-calibrate=runs over `suite` (its reruns import the fakes and lmsys through PYTHONPATH)."""
    tests = Path(__file__).parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    pytester.makepyfile(test_suite=suite)
    return run(pytester, f"--perf-calibrate={runs}", "-p", "no:xdist")


def test_calibrate_reruns_in_fresh_processes_and_the_next_compare_uses_it(pytester, monkeypatch):
    result = calibrate(pytester, monkeypatch, NOISY_SUITE, 2)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    path = pytester.path / "baselines" / MACHINE / "calibration.json"
    result.stdout.fnmatch_lines([
        "lmsys perf: calibration run 1 of 2 done (exit 0)",
        "lmsys perf: calibration run 2 of 2 done (exit 0); calibration.json holds these 2 runs",
        f"calibration of 1 benchmark(s) written to {path}",
        "  test_suite.py::test_a: eager median spread *% over 2 runs -> time tolerance *% (*)",
    ])
    entry = calibration.read(path.parent)["test_suite.py::test_a"]
    assert entry["runs"] == 2 and len(set(entry["medians"])) == 2
    tolerance = verdict.time_tolerance(same_start=True, spread=calibration.device_spread(entry), runs=2)
    assert tolerance.value < 0.04
    # 4% slower: beyond the tolerance the calibration leaves.
    pytester.makeconftest(INNER_CONFTEST.format(name=GPU))
    pytester.makepyfile(test_suite="def test_a(gpu_benchmark, fake):\n"
                                   "    gpu_benchmark(fake.work(1.04, noise=0.001, memory=64 * 2**20))\n")
    result = run(pytester, "--benchmark-compare")
    result.stdout.fnmatch_lines([
        "lmsys perf: noise calibration of 1 benchmark(s) in *calibration.json",
        f"*SLOWER: test_a median * (+*%, tolerance {tolerance.value * 100:.3g}% ({tolerance.source})*",
    ])
    result.assert_outcomes(failed=1)


# The third process of a calibration fails collection: the calibration stops, with the first two runs kept.
FAILS_THIRD_SUITE = """
import os
from pathlib import Path

count = Path("runs.txt")
count.write_text(str(int(count.read_text()) + 1) if count.exists() else "1")
if int(count.read_text()) > 3:  # the parent's own collection was the first
    raise RuntimeError("a run that crashes")


def test_a(gpu_benchmark, fake):
    gpu_benchmark(fake.work(1.0, noise=0.01, seed=os.getpid(), memory=64 * 2**20))
"""


def test_a_calibration_stopped_partway_keeps_the_runs_it_finished(pytester, monkeypatch):
    result = calibrate(pytester, monkeypatch, FAILS_THIRD_SUITE, 5)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(["lmsys perf: calibration run 2 of 5 done (exit 0); calibration.json holds these 2 runs"])
    result.stderr.fnmatch_lines([
        "*--perf-calibrate=5 stopped (the calibration file holds the first 2 runs): run 3 of 5 ended with exit*"
    ])
    entry = calibration.read(pytester.path / "baselines" / MACHINE)["test_suite.py::test_a"]
    assert entry["runs"] == 2


def test_calibrate_refuses_to_also_compare_or_save(pytester):
    save_baseline(pytester, {"test_a": {"ms": 1.0}})
    result = run(pytester, "--perf-calibrate=3", "--benchmark-compare")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--perf-calibrate runs the benchmarks in other processes*--benchmark-compare"])


def test_reruns_are_fresh_processes_whose_json_is_returned_and_kept_when_asked(tmp_path):
    # A tiny suite, no plugin needed: pytest-benchmark's own --benchmark-json is what each run writes.
    (tmp_path / "test_one.py").write_text("import os\n\ndef test_pid(benchmark):\n    benchmark(os.getpid)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    docs = reruns.rerun(["-q", "-p", "no:cacheprovider", "-p", "no:lmsys_perf", "test_one.py"], 2, tmp_path,
                        keep=tmp_path / "kept")
    assert [len(doc["benchmarks"]) for doc in docs] == [1, 1]
    assert sorted(path.name for path in (tmp_path / "kept").iterdir()) == ["kept-run-0.json", "kept-run-1.json"]
    seen = []
    reruns.rerun(["-q", "-p", "no:cacheprovider", "-p", "no:lmsys_perf", "test_one.py"], 1, tmp_path,
                 keep=tmp_path / "kept", first=2, progress=lambda index, done, docs: seen.append(index))
    assert seen == [2] and (tmp_path / "kept" / "kept-run-2.json").exists()  # a series run in parts: numbered on


def _kept_run(tmp_path, name: str, medians: dict[str, float], machine: str = MACHINE) -> Path:
    """A run's pytest-benchmark JSON as a detection keeps it: every round, the machine it was recorded on."""
    benches = []
    for fullname, median in medians.items():
        stats = {key: median for key in ("min", "max", "mean", "median")}
        stats.update(stddev=0.0, iqr=0.0, rounds=3, iterations=1, data=[median] * 3)
        benches.append({"fullname": fullname, "name": fullname, "stats": stats, "extra_info": {"timing": "graph"}})
    path = tmp_path / f"{name}.json"
    # Each run recorded at its own time (as pytest-benchmark's "datetime"): the command refuses a run given twice.
    path.write_text(json.dumps({"machine_info": {"lmsys": {"machine_id": machine}}, "benchmarks": benches,
                                "datetime": f"2026-01-01T00:00:00.{len(list(tmp_path.iterdir())):06d}",
                                "commit_info": {"id": "abc"}}))
    return path


def test_the_command_calibrates_from_runs_measured_before(tmp_path, capsys):
    folder = tmp_path / MACHINE
    folder.mkdir()
    calibration.update(folder, MACHINE, {"t::old": calibration.noise([run_doc({"t::old": 1e-3})] * 2)["t::old"]})
    runs = [_kept_run(tmp_path, f"run-{k}", {"t::a": 1e-3 * (1 + k / 100), "t::b": 2e-3}) for k in (-1, 0, 1)]
    assert calibration.main([str(folder), *map(str, runs), "-k", "t::a", "--dry-run"]) == 0
    assert "t::a: graph median spread 1.00% over 3 runs -> time tolerance 4.24%" in capsys.readouterr().out
    assert set(calibration.read(folder)) == {"t::old"}  # a dry run writes nothing
    assert calibration.main([str(folder), *map(str, runs), "-k", "t::a"]) == 0
    entries = calibration.read(folder)
    assert set(entries) == {"t::old", "t::a"} and entries["t::a"]["runs"] == 3  # t::b not asked for, t::old kept


@pytest.mark.parametrize(("case", "message"), [
    ("other-gpu", "was recorded on NVIDIA_H200, not Fake_GPU_80GB"),
    ("one-run", "a calibration needs at least 2 runs, got 1"),
    ("no-match", "no benchmark that every run measured (with one timing) matches"),
    ("not-json", "is not valid JSON"),
])
def test_the_command_refuses_runs_it_cannot_use(tmp_path, capsys, case, message):
    folder = tmp_path / MACHINE
    folder.mkdir()
    runs = [_kept_run(tmp_path, f"run-{k}", {"t::a": 1e-3}) for k in range(2)]
    args = [str(folder), *map(str, runs)]
    if case == "other-gpu":
        args.append(str(_kept_run(tmp_path, "h200", {"t::a": 1e-3}, machine="NVIDIA_H200")))
    elif case == "one-run":
        args = args[:2]
    elif case == "no-match":
        args += ["-k", "t::zzz"]
    else:
        (tmp_path / "bad.json").write_text("{")
        args.append(str(tmp_path / "bad.json"))
    with pytest.raises(SystemExit) as exited:
        calibration.main(args)
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (folder / calibration.FILE_NAME).exists()


@pytest.mark.parametrize("how", ["same path", "copied", "same datetime and commit"])
def test_the_command_refuses_a_run_given_twice(tmp_path, capsys, how):
    folder = tmp_path / MACHINE
    folder.mkdir()
    first = _kept_run(tmp_path, "run-0", {"t::a": 1e-3})
    second = first
    if how == "copied":
        second = tmp_path / "copy.json"
        second.write_bytes(first.read_bytes())
    elif how == "same datetime and commit":
        doc = json.loads(first.read_text())
        doc["benchmarks"][0]["stats"]["data"] = [1e-3, 1e-3, 1e-3 + 1e-12]
        second = tmp_path / "edited.json"
        second.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as exited:
        calibration.main([str(folder), str(first), str(second)])
    assert exited.value.code == 2
    assert f"{second} and {first} are the same run" in capsys.readouterr().err
    assert not (folder / calibration.FILE_NAME).exists()


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 100_000 + "]" * 100_000, "is nested too deeply"),
    ('{"benchmarks": {"t::a": {"timing": "eager", "runs": 2, "medians": [1e-3, 1e-3], "spread": 1' + "0" * 400 + "}}}",
     "'t::a' has a spread that is not a finite non-negative number"),
    ('{"benchmarks": {"t::a": {"timing": "eager", "runs": 2, "medians": [1' + "0" * 400 + ', 1e-3], "spread": 0}}}',
     "'t::a' has medians that are not positive numbers"),
], ids=["nested", "huge-spread", "huge-median"])
def test_a_hostile_calibration_file_is_named(tmp_path, text, message):
    (tmp_path / calibration.FILE_NAME).write_text(text)
    with pytest.raises(calibration.CalibrationError, match=f"calibration file {tmp_path}.*{message}"):
        calibration.read(tmp_path)
