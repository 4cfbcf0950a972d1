"""lmsys.perf.detection: the A/A false-alarm and injected-delay detection table, from the reruns' JSON."""

import json
import math
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lmsys.perf import detection, reruns

pytest_plugins = ["pytester"]

WARM_UP = reruns.warm_up  # the real one: the fixture below replaces it for detection.main


@pytest.fixture(autouse=True)
def warm_ups(monkeypatch):
    """The untimed warm-up runs detection.main asked for (their pytest arguments), instead of running them."""
    calls = []
    monkeypatch.setattr(detection.reruns, "warm_up", lambda args, cwd, timeout=None: calls.append(list(args)))
    return calls


def doc(verdicts: dict[str, str]) -> dict:
    return {"benchmarks": [{"name": name, "fullname": f"t.py::{name}", "extra_info": {"verdict": verdict}}
                           for name, verdict in verdicts.items()]}


def test_tally_counts_the_verdicts_each_case_looks_for_per_benchmark_and_over_all():
    same = [doc({"a": "PASS", "b": "PASS"}), doc({"a": "SLOWER", "b": "IMPROVED"})]
    delayed = [doc({"a": "SLOWER", "b": "SLOWER-HOST"}), doc({"a": "SLOWER+MORE-MEMORY", "b": "PASS", "c": "NEW"})]
    allocated = [doc({"a": "MORE-MEMORY", "b": "SLOWER"})]
    cases = [
        ("A/A false alarms", same, detection.failed),
        ("+5% caught", delayed, detection.failed),
        ("+1 MiB caught", allocated, detection.more_memory),
    ]
    table = detection.tally(cases)
    assert list(table.columns) == ["benchmark", "A/A false alarms", "+5% caught", "+1 MiB caught"]
    assert table.values.tolist() == [
        ["a", "1/2", "2/2", "1/1"], ["b", "0/2", "1/2", "0/1"], ["all", "1/4", "3/4", "1/2"]
    ]


def test_tally_adds_a_row_per_timing_when_there_are_several():
    # The gate's categories: graph replays (launch-bound calls), host timing (launch costs), eager and queued rounds.
    def timed(verdicts: dict[str, tuple[str, str]]) -> dict:
        return {"benchmarks": [{"name": name, "extra_info": {"verdict": verdict, "timing": timing}}
                               for name, (verdict, timing) in verdicts.items()]}

    runs = [timed({"a": ("PASS", "graph"), "b": ("SLOWER", "host"), "c": ("PASS", "graph")}),
            timed({"a": ("SLOWER", "graph"), "b": ("PASS", "host"), "c": ("PASS", "graph")})]
    table = detection.tally([("A/A false alarms", runs, detection.failed)])
    assert table.values.tolist() == [["a", "1/2"], ["b", "1/2"], ["c", "0/2"], ["all graph", "1/4"],
                                     ["all host", "1/2"], ["all", "2/6"]]
    single = detection.tally([("A/A false alarms", runs[:1], detection.failed)])
    assert single.values.tolist()[-3:] == [["all graph", "0/2"], ["all host", "1/1"], ["all", "1/3"]]
    graph_only = [timed({"a": ("PASS", "graph")})]
    assert detection.tally([("A/A", graph_only, detection.failed)]).values.tolist() == [["a", "0/1"], ["all", "0/1"]]


def test_main_saves_a_reference_then_reruns_each_case_with_the_delay(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_rerun(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        calls.append((list(args), runs, env))
        if any(arg.startswith("--benchmark-save=") for arg in args):
            storage = Path(next(a for a in args if a.startswith("--benchmark-storage=")).split("=", 1)[1])
            (storage / "GPU").mkdir(parents=True)
            return [doc({})]
        storage = Path(next(a for a in args if a.startswith("--benchmark-storage=")).split("=", 1)[1])
        assert (storage / "GPU" / "calibration.json").exists()  # the GPU's calibration applies to the reruns too
        caught = "SLOWER" if float(env[detection.INJECT_DELAY]) > 0 else "PASS"
        caught = "PASS+SLOWER" if int(env[detection.INJECT_MEMORY]) else caught  # a slow run: not a caught allocation
        return [doc({"test_x": caught})] * runs

    (tmp_path / "baselines" / "GPU").mkdir(parents=True)
    (tmp_path / "baselines" / "GPU" / "calibration.json").write_text("{}")
    monkeypatch.setattr(detection.reruns, "rerun", fake_rerun)
    argv = ["--runs", "3", "--inject", "0.05", "--inject-memory", "1048576", "--", "perf_tests", "-k", "x"]
    assert detection.main(argv) == 0
    out = capsys.readouterr().out
    assert "benchmark A/A false alarms +5% caught +1 MiB caught" in out
    assert "   test_x              0/3        3/3           0/3" in out
    reference, *rounds = calls
    assert reference[0][:3] == ["perf_tests", "-k", "x"] and reference[1] == 1
    assert len(rounds) == 9 and all(runs == 1 for _, runs, _ in rounds)  # the cases take turns, a run each
    aa, injected, allocated = rounds[:3]
    assert rounds[3:6] == rounds[:3]
    assert aa[0][-2:] == ["--benchmark-compare", detection.DURATIONS]  # each run reports its slowest tests
    assert reference[0][-1] == detection.DURATIONS
    assert aa[2] == {detection.INJECT_DELAY: "0", detection.INJECT_MEMORY: "0"}
    assert injected[2] == {detection.INJECT_DELAY: "0.05", detection.INJECT_MEMORY: "0"}
    assert allocated[2] == {detection.INJECT_DELAY: "0", detection.INJECT_MEMORY: "1048576"}


def test_each_run_reports_its_slowest_tests(tmp_path, capsys):
    """The table pytest's --durations prints (here from a real pytest run) is what a finished run reports."""
    (tmp_path / "test_d.py").write_text("import time\ndef test_a():\n    time.sleep(0.05)\ndef test_b():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", detection.DURATIONS,
                           str(tmp_path / "test_d.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    table = detection.slowest(done.stdout)
    assert table.splitlines()[0].endswith("test_d.py::test_a") and " call " in table
    assert "hidden" not in table and "passed" not in table
    assert detection.slowest("1 passed in 0.01s") == "" and detection.slowest(None) == ""
    detection._progress("every case", 2)(0, done, [])
    err = capsys.readouterr().err
    assert "every case: run 1/2 done, exit 0" in err
    assert f"its {detection.SLOWEST} slowest:" in err and "test_d.py::test_a" in err


def test_main_compares_with_a_named_baseline_when_asked(monkeypatch, capsys):
    calls = []
    def fake_rerun(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        calls.append(args)
        return [doc({"test_x": "PASS"})] * runs

    monkeypatch.setattr(detection.reruns, "rerun", fake_rerun)
    assert detection.main(["--runs", "2", "--inject", "0.1", "--baseline", "7", "--markdown", "--", "perf_tests"]) == 0
    assert calls[0][-3:] == ["--benchmark-storage=baselines", "--benchmark-compare=7", detection.DURATIONS]
    assert "| test_x | 0/2 | 0/2 |" in capsys.readouterr().out
    calls.clear()
    assert detection.main(["--runs", "1", "--baseline", "newest", "--", "perf_tests"]) == 0
    assert calls[0][-3:] == ["--benchmark-storage=baselines", "--benchmark-compare", detection.DURATIONS]  # newest


def test_main_reports_each_run_and_the_table_after_each_round_and_can_leave_out_the_aa_case(monkeypatch, capsys):
    calls = []

    def fake_rerun(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        calls.append((env[detection.INJECT_DELAY], first))
        for index in range(first, first + runs):
            progress(index, subprocess.CompletedProcess(args, 1), [])
        return [doc({"test_x": "SLOWER" if env[detection.INJECT_DELAY] == "0.05" or first == 0 else "PASS"})] * runs

    monkeypatch.setattr(detection.reruns, "rerun", fake_rerun)
    argv = ["--no-aa", "--runs", "2", "--inject", "0.03", "0.05", "--baseline", "7", "--", "perf_tests"]
    assert detection.main(argv) == 0
    assert calls == [("0.03", 0), ("0.05", 0), ("0.03", 1), ("0.05", 1)]  # no unchanged case; rounds of both
    err = capsys.readouterr().err
    assert "+3% caught: run 2/2 done, exit 1" in err
    partial = err.split("after 1 of 2 rounds:")[1].splitlines()  # both columns after the first round
    assert [line.split() for line in partial[1:4]] == [
        ["benchmark", "+3%", "caught", "+5%", "caught"], ["test_x", "1/1", "1/1"], ["all", "1/1", "1/1"]
    ]


def test_no_aa_without_an_injection_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        detection.main(["--no-aa", "--inject", "--", "perf_tests"])
    assert "--no-aa leaves nothing to measure" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exited:
        detection.main(["--timeout", value, "--", "perf_tests"])
    assert exited.value.code == 2
    assert f"argument --timeout: {value!r} " in capsys.readouterr().err


def test_memory_with_delays_counts_each_delay_run_for_its_delay_and_for_the_allocation(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_rerun(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        calls.append((env, keep))
        # A held allocation shows as MORE-MEMORY; only SLOWER counts as a caught delay.
        delayed = "SLOWER+MORE-MEMORY" if float(env[detection.INJECT_DELAY]) >= 0.05 else "MORE-MEMORY"
        return [doc({"test_x": delayed if int(env[detection.INJECT_MEMORY]) else "PASS"})] * runs

    monkeypatch.setattr(detection.reruns, "rerun", fake_rerun)
    argv = ["--runs", "2", "--inject", "0.03", "0.05", "--inject-memory", "1048576", "--memory-with-delays",
            "--baseline", "7", "--keep", "runs", "--", "perf_tests"]
    assert detection.main(argv) == 0
    assert [(env[detection.INJECT_DELAY], env[detection.INJECT_MEMORY], keep) for env, keep in calls] == [
        ("0", "0", Path("runs/aa")),
        ("0.03", "1048576", Path("runs/delay-0.03")),
        ("0.05", "1048576", Path("runs/delay-0.05")),
    ] * 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["benchmark", "A/A", "false", "alarms", "+3%", "caught", "+5%", "caught", "+1", "MiB",
                              "caught"]
    assert out[1].split() == ["test_x", "0/2", "0/2", "2/2", "4/4"]


def test_memory_with_delays_needs_a_delay_and_one_size(capsys):
    with pytest.raises(SystemExit):
        detection.main(["--memory-with-delays", "--inject", "0.05", "--", "perf_tests"])
    assert "--memory-with-delays needs --inject and one --inject-memory size" in capsys.readouterr().err


def kept_run(env: dict) -> dict:
    """A run's JSON as a real run keeps it, every round included (stats.data, and in extra_info the eager rounds and
    the CPU probe's times: detection.ROUND_KEYS), with machine readings: an A/A run passes, what is injected is
    caught (SLOWER, MORE-MEMORY); with LMSYS_INJECT_CASES (--in-process) the run passes and each case is caught."""
    def caught(delay: str, held: str) -> str:
        return "+".join(["SLOWER"] * (float(delay) > 0) + ["MORE-MEMORY"] * (int(held) > 0)) or "PASS"

    if env.get(detection.INJECT_CASES):
        cases = [case.split(":") for case in env[detection.INJECT_CASES].split(",")]
        one = injected_doc("PASS", {(float(delay), int(held)): caught(delay, held) for delay, held in cases})
    else:
        one = doc({"test_x": caught(env[detection.INJECT_DELAY], env[detection.INJECT_MEMORY])})
    one["machine_info"] = {"node": "gpu-node", "lmsys": {"machine_id": "GPU"}}
    for bench in one["benchmarks"]:
        # A stddev of NaN, as pytest-benchmark writes it for a single round.
        bench["stats"] = {"median": 1e-3, "rounds": 3, "stddev": float("nan"), "data": [1e-3, 1.1e-3, 0.9e-3]}
        bench["extra_info"].update({
            detection.baselines.EAGER_KEY: [2e-3, 2.1e-3], "cpu_probe_data": [1e-4, 1e-4, 1.1e-4],
            "eager_cpu_probe_data": [1e-4, 1.2e-4], "eager_median": 2.05e-3,
            "machine": {"before": {"sm_clock_mhz": 1980}, "after": {"sm_clock_mhz": 1980}},
        })
    return one


def keeping_rerun(calls: list):
    """A fake reruns.rerun that keeps each run's JSON as the real one does (DIR/<case>/<case>-run-N.json; kept_run).
    Saving the reference is recorded as ('reference', args)."""
    def fake(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        if any(arg.startswith("--benchmark-save=") for arg in args):
            calls.append(("reference", list(args)))
            storage = Path(next(a for a in args if a.startswith("--benchmark-storage=")).split("=", 1)[1])
            (storage / "GPU").mkdir(parents=True)
            (storage / "GPU" / "0001_reference.json").write_text(json.dumps(doc({"test_x": None})))
            return [doc({})]
        docs = [kept_run(env) for _ in range(runs)]
        for index, one in zip(range(first, first + runs), docs):
            calls.append((keep.name, index))
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{keep.name}-run-{index}.json").write_text(json.dumps(one, indent=4))  # as pytest-benchmark
        return docs

    return fake


def test_a_measurement_resumed_later_adds_runs_until_each_case_has_enough(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun(calls))
    argv = ["--inject", "0.05", "--keep", "kept", "--", "perf_tests", "-k", "x"]
    assert detection.main(["--runs", "2", *argv]) == 0
    assert [c for c in calls if c[0] != "reference"] == [("aa", 0), ("delay-0.05", 0), ("aa", 1), ("delay-0.05", 1)]
    references = tmp_path / "kept" / "references" / "GPU"
    assert [p.name for p in references.iterdir()] == ["reference-0.json"]  # what the runs were judged against
    calls.clear()
    # A later session (another machine start): its own reference, then the runs still missing, numbered on.
    assert detection.main(["--runs", "3", "--resume", *argv]) == 0
    assert [c[0] for c in calls] == ["reference", "aa", "delay-0.05"]
    assert calls[1:] == [("aa", 2), ("delay-0.05", 2)]
    assert sorted(p.name for p in references.iterdir()) == ["reference-0.json", "reference-1.json"]
    captured = capsys.readouterr()
    assert "resuming kept: aa 2 runs, delay-0.05 2 runs" in captured.err
    table = captured.out.split("benchmark")[-1].splitlines()  # the second measurement's table
    assert table[1].split() == ["test_x", "0/3", "3/3"]  # counts every kept run
    calls.clear()
    assert detection.main(["--runs", "3", "--resume", *argv]) == 0
    assert calls == []  # nothing missing: no reference is saved, nothing runs
    assert "every case has 3 runs already: nothing to run" in capsys.readouterr().err


def test_kept_runs_are_never_overwritten_nor_mixed_with_another_measurement(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    assert detection.main(["--runs", "1", "--keep", "kept", "--", "perf_tests", "-k", "x"]) == 0
    before = sorted(p.name for p in Path("kept").rglob("*.json"))
    with pytest.raises(SystemExit, match="holds the runs of an earlier measurement: add --resume"):
        detection.main(["--runs", "1", "--keep", "kept", "--", "perf_tests", "-k", "x"])
    with pytest.raises(SystemExit, match="--resume: kept holds runs of .*'-k', 'x'.*not of .*'-k', 'y'"):
        detection.main(["--runs", "2", "--resume", "--keep", "kept", "--", "perf_tests", "-k", "y"])
    with pytest.raises(SystemExit, match="--resume: elsewhere holds no measurement to resume"):
        detection.main(["--runs", "2", "--resume", "--keep", "elsewhere", "--", "perf_tests"])
    assert sorted(p.name for p in Path("kept").rglob("*.json")) == before


@pytest.mark.parametrize("in_process", [False, True])
def test_a_folder_of_runs_without_its_manifest_is_refused_and_nothing_in_it_is_overwritten(monkeypatch, tmp_path,
                                                                                          in_process):
    """On the H100 the manifest of a running measurement was deleted under it (its folder synced away), and the next
    call measured into the folder afresh, numbering from 0 over the kept run: such a folder is refused, with or
    without --resume, and so is one whose runs are not numbered 0 to n-1 (the next would take a kept one's
    number)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    mode = ["--in-process"] * in_process
    argv = [*mode, "--inject", "0.05", "--keep", "kept", "--", "perf_tests", "-k", "x"]
    assert detection.main(["--runs", "1", *argv]) == 0
    (tmp_path / "kept" / detection.MANIFEST).unlink()
    before = {p: p.read_bytes() for p in Path("kept").rglob("*.json")}
    for resume in ([], ["--resume"]):
        with pytest.raises(SystemExit, match=r"holds JSON files but no detection.json: .*would be overwritten"):
            detection.main(["--runs", "2", *resume, *argv])
    assert {p: p.read_bytes() for p in Path("kept").rglob("*.json")} == before

    shutil.rmtree("kept")
    assert detection.main(["--runs", "1", *argv]) == 0
    case = next(p for p in Path("kept").iterdir() if p.is_dir() and p.name != "references")
    (case / f"{case.name}-run-0.json").rename(case / f"{case.name}-run-1.json")  # a gap: one run, numbered 1
    before = {p: p.read_bytes() for p in Path("kept").rglob("*.json")}
    with pytest.raises(SystemExit, match=r"holds runs numbered \[1\], not 0 to 0: .*written over kept ones"):
        detection.main(["--runs", "2", "--resume", *argv])
    assert {p: p.read_bytes() for p in Path("kept").rglob("*.json")} == before  # refused before measuring


def test_a_measurement_resumes_with_or_without_the_plugin_loaded_by_name(monkeypatch, tmp_path, capsys):
    """`-p lmsys.perf.plugin` (which .ci/detection adds where the plugin's entry point is not installed, as on the
    H100's image) changes nothing measured: runs kept with it and without it are one measurement, in a manifest
    written before it was left out too; another selection is still refused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = ["--in-process", "--inject", "0.05", "--keep", "kept", "--"]
    assert detection.main(["--runs", "1", *argv, "perf_tests", "-p", "lmsys.perf.plugin"]) == 0
    manifest = tmp_path / "kept" / detection.MANIFEST
    assert json.loads(manifest.read_text())["pytest_args"] == ["perf_tests"]
    written = json.loads(manifest.read_text())  # as a manifest written before: the plugin in the selection
    manifest.write_text(json.dumps({**written, "pytest_args": ["perf_tests", "-p", "lmsys.perf.plugin"]}))
    assert detection.main(["--runs", "2", "--resume", *argv, "perf_tests"]) == 0
    assert detection.main(["--runs", "3", "--resume", *argv, "perf_tests", "-plmsys.perf.plugin"]) == 0
    assert len(list((tmp_path / "kept" / detection.IN_PROCESS).glob("*.json"))) == 3
    with pytest.raises(SystemExit, match="--resume: kept holds runs of"):
        detection.main(["--runs", "4", "--resume", *argv, "perf_tests", "-p", "other.plugin"])


def test_runs_of_another_gate_are_never_resumed_nor_tabulated_together(monkeypatch, tmp_path, capsys):
    """The manifest records a hash of each file that decides a verdict (lmsys.perf, perf_tests, the calibrations): a
    changed calibration or benchmark is another gate, whose runs go into another folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    calibrated = tmp_path / "baselines" / "GPU" / "calibration.json"
    calibrated.parent.mkdir(parents=True)
    calibrated.write_text('{"t.py::test_x": {"time_tolerance": 0.025}}')
    (tmp_path / "perf_tests").mkdir()
    (tmp_path / "perf_tests" / "test_a.py").write_text("def test_x(): pass\n")
    argv = ["--inject", "0.05", "--keep", "kept", "--", "perf_tests"]
    assert detection.main(["--runs", "1", *argv]) == 0
    gate = json.loads((tmp_path / "kept" / detection.MANIFEST).read_text())["gate"]
    assert {"lmsys/perf/fixture.py", "lmsys/perf/verdict.py", "lmsys/perf/injection.py", "perf_tests/test_a.py",
            "baselines/GPU/calibration.json"} <= set(gate)
    assert not {"lmsys/perf/detection.py", "lmsys/perf/docs.py", "lmsys/perf/report.py"} & set(gate)
    before = sorted(p.name for p in Path("kept").rglob("*.json"))

    calibrated.write_text('{"t.py::test_x": {"time_tolerance": 0.05}}')
    with pytest.raises(SystemExit, match=r"kept holds runs of another gate \(changed baselines/GPU/calibration.json "
                       r"since\): keep this gate's runs in another folder"):
        detection.main(["--runs", "2", "--resume", *argv])
    (tmp_path / "perf_tests" / "test_b.py").write_text("def test_y(): pass\n")
    with pytest.raises(SystemExit, match="changed baselines/GPU/calibration.json; added perf_tests/test_b.py"):
        detection.main(["--runs", "2", "--resume", *argv])
    assert sorted(p.name for p in Path("kept").rglob("*.json")) == before  # nothing ran, nothing was written

    # The new gate's runs in a folder of their own; the table refuses to count both gates' runs together.
    assert detection.main(["--runs", "1", "--inject", "0.05", "--keep", "kept2", "--", "perf_tests"]) == 0
    with pytest.raises(SystemExit, match="--table: kept2 was measured by another gate than kept .*not the same gate"):
        detection.main(["--table", "kept", "kept2"])
    # Back to the first gate: its folder takes runs again.
    calibrated.write_text('{"t.py::test_x": {"time_tolerance": 0.025}}')
    (tmp_path / "perf_tests" / "test_b.py").unlink()
    capsys.readouterr()
    assert detection.main(["--runs", "2", "--resume", *argv]) == 0
    assert "| test_x | 0/2 | 2/2 |" in detection._shown(detection._table_of_kept([Path("kept")])[0], markdown=True)


def test_a_folder_kept_before_the_gate_was_recorded_takes_this_gate_with_a_warning(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = ["--inject", "0.05", "--keep", "kept", "--", "perf_tests"]
    assert detection.main(["--runs", "1", *argv]) == 0
    manifest = tmp_path / "kept" / detection.MANIFEST
    legacy = json.loads(manifest.read_text())
    gate = legacy.pop("gate")
    manifest.write_text(json.dumps(legacy))
    capsys.readouterr()
    assert detection.main(["--table", "kept"]) == 0
    assert "no gate recorded in kept (kept before it was recorded): not checked" in capsys.readouterr().err
    assert detection.main(["--runs", "2", "--resume", *argv]) == 0
    assert "does not record the gate its runs were measured by" in capsys.readouterr().err
    assert json.loads(manifest.read_text()) == {**legacy, "gate": gate}


def test_resume_needs_keep(capsys):
    with pytest.raises(SystemExit):
        detection.main(["--resume", "--", "perf_tests"])
    assert "--resume needs --keep DIR" in capsys.readouterr().err


def test_the_table_of_several_kept_measurements_counts_them_all_and_runs_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun(calls))
    for folder, runs in (("start1", "2"), ("start2", "3")):
        assert detection.main(["--runs", runs, "--inject", "0.05", "--keep", folder, "--", "perf_tests"]) == 0
    assert detection.main(["--runs", "1", "--inject", "0.1", "--keep", "other", "--", "perf_tests"]) == 0
    capsys.readouterr()
    calls.clear()
    assert detection.main(["--markdown", "--table", "start1", "start2"]) == 0
    assert calls == []
    assert "| test_x | 0/5 | 5/5 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--table: other measured .*not the same cases"):
        detection.main(["--table", "start1", "other"])
    with pytest.raises(SystemExit, match="--table: nowhere holds no measurement"):
        detection.main(["--table", "nowhere"])


def test_the_table_of_parts_of_a_suite_counts_each_benchmark_where_it_was_measured(monkeypatch, tmp_path, capsys):
    """Measurements of parts of a suite (other test selections, the same cases and gate) make up the suite's table:
    each benchmark's row counts its own verdicts, and 'all' every verdict of every part."""
    monkeypatch.chdir(tmp_path)
    fake = keeping_rerun([])

    def rerun_of_part(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        docs = fake(args, runs, cwd, env, timeout, progress, keep, first)
        if keep is not None:  # the runs of part b measured test_y instead of test_x
            part = "b" if "b.py" in args else "a"
            for path in keep.glob("*-run-*.json"):
                path.write_text(path.read_text().replace('"test_x"', f'"test_{"x" if part == "a" else "y"}"'))
        return docs

    monkeypatch.setattr(detection.reruns, "rerun", rerun_of_part)
    for folder, runs, part in (("part-a", "2", "a.py"), ("part-b", "3", "b.py")):
        assert detection.main(["--runs", runs, "--inject", "0.05", "--keep", folder, "--", part]) == 0
    capsys.readouterr()
    assert detection.main(["--markdown", "--table", "part-a", "part-b"]) == 0
    captured = capsys.readouterr()
    assert "| test_x | 0/2 | 2/2 |" in captured.out
    assert "| test_y | 0/3 | 3/3 |" in captured.out
    assert "| all | 0/5 | 5/5 |" in captured.out
    assert "runs kept in part-a of: a.py" in captured.err and "runs kept in part-b of: b.py" in captured.err
    # Other cases are still refused, whatever the selection.
    assert detection.main(["--runs", "1", "--inject", "0.1", "--keep", "part-c", "--", "c.py"]) == 0
    with pytest.raises(SystemExit, match="--table: part-c measured .*not the same cases"):
        detection.main(["--table", "part-a", "part-c"])


def test_without_tests_to_run_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        detection.main(["--runs", "2"])
    assert "what to run is missing" in capsys.readouterr().err


def test_an_untimed_run_fills_the_caches_before_anything_is_timed(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun(calls))
    monkeypatch.setattr(detection.reruns, "warm_up",
                        lambda args, cwd, timeout=None: calls.append(("warm-up", list(args))))
    assert detection.main(["--runs", "1", "--inject", "0.05", "--keep", "a", "--", "perf_tests", "-k", "x"]) == 0
    assert [c[0] for c in calls] == ["warm-up", "reference", "aa", "delay-0.05"]
    assert calls[0][1] == ["perf_tests", "-k", "x"]
    calls.clear()
    argv = ["--runs", "1", "--no-warm-up", "--inject", "0.05", "--keep", "b", "--", "perf_tests", "-k", "x"]
    assert detection.main(argv) == 0
    assert [c[0] for c in calls] == ["reference", "aa", "delay-0.05"]


@pytest.mark.parametrize(("body", "passes"), [("pass", True), ("assert False", False)])
def test_the_warm_up_runs_each_test_once_untimed_and_fails_loudly(tmp_path, body, passes):
    (tmp_path / "test_w.py").write_text(f"def test_w(benchmark):\n    benchmark(lambda: None)\n    {body}\n")
    if passes:
        WARM_UP(["test_w.py", "-p", "no:cacheprovider"], tmp_path, timeout=120)
    else:
        with pytest.raises(reruns.RerunError, match="the untimed warm-up run ended with exit status 1"):
            WARM_UP(["test_w.py", "-p", "no:cacheprovider"], tmp_path, timeout=120)


def injected_doc(verdict: str, cases: dict[tuple[float, int], str]) -> dict:
    return {"benchmarks": [{"name": "test_x", "fullname": "t.py::test_x", "extra_info": {
        "verdict": verdict,
        "injected_cases": [{"delay": d, "memory": n, "verdict": v, "time_change": 0.0} for (d, n), v in cases.items()],
    }}]}


def test_per_run_gives_each_runs_counts_and_extreme_changes_its_misses_and_throttling():
    def bench(name, verdict, timing, change, throttle=()):
        return {"name": name, "extra_info": {"verdict": verdict, "timing": timing, "time_change": change,
                                             "machine": {"after": {"throttle": list(throttle)}}}}

    aa = [{"benchmarks": [bench("a", "PASS", "graph", 0.004), bench("b", "PASS", "graph", -0.002),
                          bench("c", "PASS", "eager", 0.01, ["sw_power_cap"]), bench("d", "NEW", "graph", None)]},
          {"benchmarks": [bench("a", "SLOWER", "graph", 0.031), bench("b", "PASS", "graph", 0.001),
                          bench("c", "PASS", "eager", -0.02)]}]
    delayed = [{"benchmarks": [bench("a", "SLOWER+MORE-MEMORY", "graph", 0.052),
                               bench("b", "MORE-MEMORY", "graph", 0.021), bench("c", "SLOWER", "eager", 0.06)]},
               {"benchmarks": [bench("a", "SLOWER+MORE-MEMORY", "graph", 0.049),
                               bench("b", "SLOWER+MORE-MEMORY", "graph", 0.055),
                               bench("c", "SLOWER+MORE-MEMORY", "eager", 0.07)]}]
    cases = [(detection.AA_COLUMN, aa, detection.failed), ("+5% caught", delayed, detection.slower)]
    table, lines = detection.per_run(cases, {detection.INJECT_MEMORY: str(2**20)})
    assert table.values.tolist() == [
        [1, "A/A false alarms", "eager", "0/1", "+1.00% c", "+1.00% c"],
        [1, "A/A false alarms", "graph", "0/2", "-0.20% b", "+0.40% a"],
        [1, "+5% caught", "eager", "1/1", "+6.00% c", "+6.00% c"],
        [1, "+5% caught", "graph", "1/2", "+2.10% b", "+5.20% a"],
        [2, "A/A false alarms", "eager", "0/1", "-2.00% c", "-2.00% c"],
        [2, "A/A false alarms", "graph", "1/2", "+0.10% b", "+3.10% a"],
        [2, "+5% caught", "eager", "1/1", "+7.00% c", "+7.00% c"],
        [2, "+5% caught", "graph", "2/2", "+4.90% a", "+5.50% b"],
    ]
    assert lines == ["run 1: c throttled after: sw_power_cap",
                     "run 1, +5% caught: missed b at +2.10% (MORE-MEMORY)",
                     "run 1, +5% caught: the allocation missed by c (SLOWER)"]
    # An allocation's case of its own: its verdicts counted, no change.
    allocated = [{"benchmarks": [bench("a", "PASS", "graph", 0.001)]}]
    table, lines = detection.per_run([("+1 MiB caught", allocated, detection.more_memory)], {})
    assert table.values.tolist() == [[1, "+1 MiB caught", "graph", "0/1", "", ""]]
    assert lines == ["run 1, +1 MiB caught: missed a (PASS)"]


def test_in_process_runs_every_case_in_each_run_and_tallies_them_apart(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []
    verdicts = iter([
        injected_doc("PASS", {(0.03, 2**20): "MORE-MEMORY", (0.05, 2**20): "SLOWER+MORE-MEMORY"}),
        injected_doc("SLOWER", {(0.03, 2**20): "SLOWER+MORE-MEMORY", (0.05, 2**20): "SLOWER"}),
    ])

    def fake_rerun(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        calls.append((list(args), env, keep and keep.name, first))
        docs = [next(verdicts)]
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{keep.name}-run-{first}.json").write_text(json.dumps(docs[0]))
        return docs

    monkeypatch.setattr(detection.reruns, "rerun", fake_rerun)
    argv = ["--in-process", "--runs", "2", "--inject", "0.03", "0.05", "--inject-memory", "1048576",
            "--memory-with-delays", "--baseline", "newest", "--keep", "k", "--", "perf_tests"]
    assert detection.main(argv) == 0
    assert [(c[1][detection.INJECT_CASES], c[2], c[3]) for c in calls] == [
        ("0.03:1048576,0.05:1048576", "runs", 0), ("0.03:1048576,0.05:1048576", "runs", 1)]
    assert calls[0][1][detection.INJECT_DELAY] == "0" and calls[0][1][detection.INJECT_MEMORY] == "0"
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split("  ")[0] == "benchmark A/A false alarms +3% caught +5% caught +1 MiB caught"
    assert out.out.splitlines()[-1].split() == ["all", "1/2", "1/2", "2/2", "3/4"]
    assert "2 runs, each measuring every case" in out.err and "after 1 of 2 runs:" in out.err
    # The kept runs make the same table without running anything, and a resumed measurement has nothing to add.
    assert detection.main(["--table", "k"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split() == ["all", "1/2", "1/2", "2/2", "3/4"]
    # Run by run: the injected cases' verdicts and changes come from each benchmark's extra_info.
    assert detection.main(["--table", "k", "--per-run", "--markdown"]) == 0
    out = capsys.readouterr()
    assert "| 1 | +3% caught |  | 0/1 | +0.00% test_x | +0.00% test_x |" in out.out
    assert "| 2 | A/A false alarms |  | 1/1 |  |  |" in out.out
    assert "run 1, +3% caught: missed test_x at +0.00% (MORE-MEMORY)" in out.err
    assert "run 2, +5% caught: the allocation missed by test_x (SLOWER)" in out.err
    assert detection.main([*argv[:-2], "--resume", "--", "perf_tests"]) == 0
    assert "2 runs kept already: nothing to run" in capsys.readouterr().err and len(calls) == 2
    # Runs of separate processes per case are other cases: not resumed into this folder.
    with pytest.raises(SystemExit, match="--resume: k holds runs of"):
        detection.main([a for a in argv if a != "--in-process"][:-2] + ["--resume", "--", "perf_tests"])


def test_in_process_measures_the_gate_end_to_end_on_the_fake_gpu(pytester, monkeypatch):
    # Real pytest processes: a fresh reference, then runs whose benchmarks are judged unchanged and then with each
    # injected case (the fake GPU is deterministic, so every case is caught and no A/A run fails).
    from perf_fakes import RUN_ARGS, write_suite

    tests = Path(__file__).parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    write_suite(pytester, {"test_a": {"ms": 1.0}, "test_b": {"ms": 2.0, "launch_ms": 3.0, "call": ", graph=True"}},
                seed=1)
    (pytester.path / "baselines").mkdir()
    monkeypatch.chdir(pytester.path)
    argv = ["--in-process", "--runs", "2", "--no-warm-up", "--inject", "0.1", "--inject-memory", "1048576",
            "--keep", "k", "--", "test_suite.py", *RUN_ARGS, "-p", "lmsys.perf.plugin"]
    if any(e.value == "lmsys.perf.plugin" for e in entry_points(group="pytest11")):
        argv = argv[:-2]
    assert detection.main(argv) == 0
    table = detection._table_of_kept([Path("k")])[0]
    assert table.values.tolist() == [["test_a", "0/2", "2/2", "2/2"], ["test_b", "0/2", "2/2", "2/2"],
                                     ["all eager", "0/2", "2/2", "2/2"], ["all graph", "0/2", "2/2", "2/2"],
                                     ["all", "0/4", "4/4", "4/4"]]
    [run] = [json.loads(p.read_text()) for p in sorted(Path("k/runs").glob("runs-run-0.json"))]
    cases = run["benchmarks"][0]["extra_info"]["injected_cases"]
    assert [(c["delay"], c["memory"], c["verdict"]) for c in cases] == [(0.1, 0, "SLOWER"),
                                                                          (0.0, 2**20, "MORE-MEMORY")]


class ShareGpu:
    """A fake device for Injection alone: a clock that moves by the call's `call_ms` (not in host timing) and by
    `share` of each injected work's length less `give_back` of the call's time (a kernel at the power cap runs faster
    behind work that lets its clocks rise), graphs that replay the call, and counts of the call's calls outside a
    capture and of the works made."""

    is_gpu = True

    def __init__(self, share: float, call_ms: float = 2.0, give_back: float = 0.0):
        self.share, self.call_ms, self.give_back = share, call_ms, give_back
        self.now, self.calls, self.works, self.capturing = 0.0, 0, 0, False

    def time_call(self, call, lead=None):
        if lead is not None:
            lead()
        start = self.now
        call()
        return self.now - start

    time_host = time_call

    def capture_graph(self, call):
        self.capturing = True
        try:
            call()
        finally:
            self.capturing = False
        return call, lambda: None

    def make_delay(self, seconds):
        def delay():
            if not self.capturing:
                self.now += seconds

        return delay

    def make_work(self, seconds):
        self.works += 1
        return self.make_delay(self.share * seconds - self.give_back * self.call_ms / 1e3)

    def make_host_delay(self, seconds):
        return self.make_delay(seconds)

    def call(self):
        if not self.capturing:
            self.calls += 1
            self.now += self.call_ms / 1e3


def added(gpu: ShareGpu, delayed) -> float:
    start = gpu.now
    delayed()
    return (gpu.now - start) / (gpu.call_ms / 1e3) - 1


def sizing_calls(call_ms: float) -> int:
    """The calls of the call that sizing a benchmark's delays makes: two turns of three blocks."""
    from lmsys.perf import injection

    return 2 * 3 * sum(injection.block_rounds(call_ms / 1e3))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("share", "give_back"), [(0.6, 0.0), (1.0, 0.016), (1.2, -0.005)],
                         ids=["proportional", "gives-back", "adds-more"])
def test_a_benchmarks_delays_are_sized_once_and_each_adds_its_share_where_it_runs(graph, share, give_back):
    """One Sizing per benchmark: the call alone and followed by work of the smallest and the largest delay's nominal
    length are timed in blocks, and each delay's work gets the length that adds its share where it runs: work that adds
    60% of its length, or its length less 1.6% of the call (a power-capped kernel running faster behind it), or more,
    adds +3% for +3% and +10% for +10%. A re-measurement gets the same work, sized again nowhere."""
    from lmsys.perf.injection import Injection, Sizing

    gpu = ShareGpu(share=share, give_back=give_back)
    sizing = Sizing((0.03, 0.05, 0.1), typical=2e-3)  # typical: the benchmark's own median (no rounds of it)
    first = Injection(0.03, sizing=sizing).delayed(gpu, gpu.call, None, graph, False)
    assert gpu.calls == sizing_calls(2.0)
    assert [nominal for nominal, _ in sizing.points] == [0.03, 0.1]
    for delay in (0.03, 0.05, 0.1):
        assert added(gpu, Injection(delay, sizing=sizing).delayed(gpu, gpu.call, None, graph, False)) == (
            pytest.approx(delay, rel=1e-6))
    again = Injection(0.03, 2**20, sizing=sizing).delayed(gpu, gpu.call, None, graph, False)
    assert gpu.calls == sizing_calls(2.0) + 3  # the three calls timed above, no sizing rounds
    assert gpu.works == 2 + 3  # the works sized with, and one per delay: +3% again is the same work
    assert added(gpu, again) == added(gpu, first) == pytest.approx(0.03, rel=1e-6)
    # Without a Sizing of its own the delay measures its typical time (three rounds) and its length.
    gpu = ShareGpu(share=share, give_back=give_back)
    assert added(gpu, Injection(0.05).delayed(gpu, gpu.call, None, graph, False)) == pytest.approx(0.05, rel=1e-6)
    assert gpu.calls == 3 + sizing_calls(2.0) + 1


class LaggingGpu(ShareGpu):
    """A power-capped GPU whose clocks lag: a state that relaxes with time constant `tau_ms` towards 1 while the call
    runs and towards `work_level` while injected work runs; the call takes call_ms x (1 + `slowdown` x (state - 1)).
    Behind work that draws less power the call runs faster, by how much depending on the recent past."""

    def __init__(self, call_ms=3.4, tau_ms=20.0, work_level=0.6, slowdown=0.75):
        super().__init__(share=1.0, call_ms=call_ms)
        self.tau, self.work_level, self.slowdown, self.state = tau_ms / 1e3, work_level, slowdown, 1.0

    def _run(self, seconds: float, level: float) -> None:
        self.now += seconds
        self.state = level + (self.state - level) * math.exp(-seconds / self.tau)

    def call(self):
        if not self.capturing:
            self.calls += 1
            self._run(self.call_ms / 1e3 * (1 + self.slowdown * (self.state - 1)), 1.0)

    def make_work(self, seconds):
        self.works += 1

        def work():
            if not self.capturing:
                self._run(seconds, self.work_level)

        return work


def steady_share(gpu: LaggingGpu, delayed, rounds: int = 400) -> float:
    """The share that `delayed` adds to the call's median over a long run of each, as the gate's timed rounds read."""
    from statistics import median as median_of

    def timed(function):
        for _ in range(rounds // 4):  # warm-up
            gpu.time_call(function)
        return median_of(gpu.time_call(function) for _ in range(rounds))

    return timed(delayed) / timed(gpu.call) - 1


@pytest.mark.parametrize("tau_ms", [5.0, 20.0, 100.0])
def test_on_a_gpu_whose_clocks_lag_each_delay_adds_its_share_over_a_long_run_resized_once_where_needed(tau_ms):
    """Sized in blocks that let clocks of a 5-20 ms lag settle, +3% and +5% add their share over a long run of rounds
    as they are; behind a 100 ms lag the blocks see part of the give-back, the first long run reads the shortfall, and
    one resize (the in-process loop of pytest_perf_measured: Sizing.resize, then the case again) puts it right."""
    from lmsys.perf.injection import Injection, Sizing

    gpu = LaggingGpu(tau_ms=tau_ms)
    sizing = Sizing((0.03, 0.05), typical=gpu.call_ms / 1e3)
    resized = []
    for delay in (0.03, 0.05):
        share = steady_share(gpu, Injection(delay, sizing=sizing).delayed(gpu, gpu.call, None, True, False))
        if sizing.resize(delay, share):
            resized.append(delay)
            share = steady_share(gpu, Injection(delay, sizing=sizing).delayed(gpu, gpu.call, None, True, False))
        assert share == pytest.approx(delay, abs=0.002)
    assert resized == ([0.03] if tau_ms == 100.0 else [])  # +3%'s shortfall shifted +5%'s work too


def test_a_resize_shifts_the_works_not_resized_yet_once_each_within_the_sizing_limit():
    from lmsys.perf.injection import RESIZE_SHARE, Sizing

    sizing = Sizing((0.03, 0.05), typical=1e-3, lengths={0.03: 3e-5, 0.05: 5e-5}, works={0.03: None, 0.05: None})
    assert not sizing.resize(0.03, 0.03 * (1 - RESIZE_SHARE / 2))  # close enough: measured as it is
    assert not sizing.resize(0.03, None) and not sizing.resize(0.03, math.nan)
    assert sizing.resize(0.03, 0.025)  # 0.5 points short: half a point of work more
    assert sizing.lengths == {0.03: pytest.approx(3.5e-5), 0.05: pytest.approx(5.5e-5)} and sizing.works == {}
    assert not sizing.resize(0.03, 0.02)  # once per delay
    assert sizing.resize(0.05, 0.0)  # far short: held at twice the nominal length; +3% is not shifted again
    assert sizing.lengths == {0.03: pytest.approx(3.5e-5), 0.05: pytest.approx(1e-4)}
    assert not Sizing((0.05,)).resize(0.05, 0.0)  # nothing sized (a host delay): nothing to resize


# Three compiled leaderboards' +10% on the H200 (gate 79001a3, docs/gate-measurements.md): the share of work the
# sizing gave (its blocks read 0.63, 0.75 and 0.67 of a point per point of work), and the line a whole pass reads
# (through its two passes, before and after the resize): share added = pass_slope x share of work + offset.
@pytest.mark.parametrize(("sized", "pass_slope", "offset"), [
    (0.193, 1.014, -0.0077), (0.156, 0.843, 0.0065), (0.160, 1.0, -0.0085),
], ids=["cudnn-run-4", "cudnn-run-0", "flash-run-2"])
def test_a_resize_lands_where_a_pass_adds_about_its_length_though_the_sizing_blocks_read_much_less(
        sized, pass_slope, offset):
    """A whole pass adds about a point per point of work where the sizing's short blocks read 0.63-0.75: one resize
    by the shortfall brings +10% within RESIZE_SHARE of it (a shift through the blocks' line fell 25-54% short)."""
    from lmsys.perf.injection import RESIZE_SHARE, Sizing

    typical = 4.2e-3
    sizing = Sizing((0.1,), typical=typical, lengths={0.1: sized * typical}, works={0.1: None})

    def pass_added():
        return offset + pass_slope * sizing.lengths[0.1] / typical

    assert sizing.resize(0.1, pass_added())
    assert pass_added() == pytest.approx(0.1, abs=RESIZE_SHARE * 0.1)


def test_an_in_process_case_that_adds_less_than_its_delay_is_resized_and_measured_again(pytester, monkeypatch):
    """Works made after the sizing add a point less than their length (a GPU whose clocks follow more than the
    sizing's blocks): +3%'s first pass reads the shortfall, its work and +10%'s are shifted by it, and +3% is measured
    again, the pass kept with what it added; +10%, on target then, is kept as first measured."""
    from lmsys.perf import injection

    lengths, real_work = injection.Injection._lengths, injection.make_work
    sized = set()

    def sizing_then_short(backend, call, flush, graph, sizing):
        lengths(backend, call, flush, graph, sizing)
        sized.add(id(sizing))

    def short_work(backend, seconds):
        return real_work(backend, max(seconds - 0.01 * 2e-3, 0.0) if sized else seconds)

    monkeypatch.setattr(injection.Injection, "_lengths", staticmethod(sizing_then_short))
    monkeypatch.setattr(injection, "make_work", short_work)
    tests = {"test_a": {"ms": 2.0, "noise": 0.001}}
    result, benches = inner_run(pytester, monkeypatch, tests, "0.03,0.1")
    result.assert_outcomes(passed=1)
    cases = benches["test_a"]["extra_info"]["injected_cases"]
    assert [(c["delay"], c["resized"]) for c in cases] == [(0.03, True), (0.1, False)]
    assert [c["added"] for c in cases] == [pytest.approx(0.03, abs=0.002), pytest.approx(0.1, abs=0.002)]
    assert cases[0]["added_before_resize"] == pytest.approx(0.02, abs=0.002)  # the first pass, a point short
    assert "added_before_resize" not in cases[1]
    assert all(c["verdict"] == "SLOWER" for c in cases)
    # Each case's own comparison says what it could catch: a SLOWER case's change is past it.
    assert all(0.02 <= c["time_resolution"] < c["time_change"] for c in cases)


@pytest.mark.parametrize(("share", "give_back", "expected"), [(0.0, 0.0, 0.05), (0.1, 0.0, 0.1), (5.0, 0.0, 0.025)],
                         ids=["adds-nothing", "adds-a-tenth", "adds-five-times"])
def test_a_delays_length_stays_within_the_sizing_limit_of_its_nominal_length(share, give_back, expected):
    """Work that adds nothing measurable keeps its nominal length; a length the line asks for is held within
    SIZING_LIMIT (2x) of the nominal either way."""
    from lmsys.perf.injection import Injection, Sizing

    gpu = ShareGpu(share=share, give_back=give_back)
    sizing = Sizing((0.03, 0.05), typical=2e-3)
    Injection(0.05, sizing=sizing).delayed(gpu, gpu.call, None, False, False)
    assert sizing.lengths[0.05] / sizing.typical == pytest.approx(expected)


def test_a_host_delay_is_a_share_of_the_typical_host_time_measured_once():
    from lmsys.perf.injection import Injection, Sizing

    gpu = ShareGpu(share=1.0)
    sizing = Sizing((0.05,))
    first = Injection(0.05, sizing=sizing).delayed(gpu, gpu.call, None, False, True)
    assert gpu.calls == 1 + 3 and sizing.typical == pytest.approx(2e-3)  # the lead's round, three host rounds
    Injection(0.05, sizing=sizing).delayed(gpu, gpu.call, None, False, True)
    assert gpu.calls == 1 + 3 and added(gpu, first) == pytest.approx(0.05)


def test_a_sizing_travels_to_the_ranks_without_its_works():
    import pickle

    from lmsys.perf.injection import Injection, Sizing

    sizing = Sizing((0.05,), typical=1e-3, lengths={0.05: 1.2e-4}, works={0.05: lambda: None})
    copy = pickle.loads(pickle.dumps(Injection(0.05, sizing=sizing)))
    assert (copy.delay, copy.sizing.typical, copy.sizing.lengths, copy.sizing.works) == (0.05, 1e-3, {0.05: 1.2e-4}, {})
    assert copy == Injection(0.05) and sizing.works  # the sizing is no part of what the case is


def inner_run(pytester, monkeypatch, tests: dict, cases: str, delays_from: str | None = None):
    """A baseline of `tests` on the fake GPU, then a compare run with LMSYS_INJECT_CASES (and
    LMSYS_INJECT_DELAYS_FROM); returns the run's result and its benchmarks by name."""
    from perf_fakes import INJECTION, run, save_baseline, write_suite

    save_baseline(pytester, tests)
    write_suite(pytester, tests, seed=2)
    monkeypatch.setenv(detection.INJECT_CASES, cases)
    if delays_from is not None:
        monkeypatch.setenv(detection.INJECT_DELAYS_FROM, delays_from)
    result = run(pytester, *INJECTION, "--benchmark-compare", "--benchmark-json=out.json")
    benches = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    return result, {bench["name"]: bench for bench in benches}


def test_in_process_cases_share_one_sizing_per_benchmark_from_its_own_median(pytester, monkeypatch):
    """Two delays, each caught and so measured twice (the gate's re-measurement): each benchmark's works are sized
    once, for both delays, from the median its own measurement judged, and what they were sized by is kept."""
    from lmsys.perf.injection import Injection

    sized = []
    lengths = Injection._lengths

    def counted(backend, call, flush, graph, sizing):
        sized.append((sizing.delays, sizing.typical))
        return lengths(backend, call, flush, graph, sizing)

    monkeypatch.setattr(Injection, "_lengths", staticmethod(counted))
    tests = {"test_a": {"ms": 1.0, "noise": 0.002},
             "test_b": {"ms": 2.0, "noise": 0.002, "launch_ms": 3.0, "call": ", graph=True"}}
    result, benches = inner_run(pytester, monkeypatch, tests, "0.05:1048576,0.1:1048576")
    result.assert_outcomes(passed=2)
    assert sized == [((0.05, 0.1), benches[name]["stats"]["median"]) for name in ("test_a", "test_b")]
    for bench in benches.values():
        cases = bench["extra_info"]["injected_cases"]
        assert [c["verdict"] for c in cases] == ["SLOWER+MORE-MEMORY"] * 2
        assert [c["time_change"] for c in cases] == [pytest.approx(0.05, abs=0.005), pytest.approx(0.1, abs=0.005)]
        sized_by = bench["extra_info"]["injected_sizing"]
        assert [nominal for nominal, _ in sized_by["points"]] == [0.05, 0.1] and list(sized_by["shares"]) == ["0.05",
                                                                                                          "0.1"]


@pytest.mark.parametrize(("cases", "short"), [("0.03:1048576,0.05:1048576", [(0.0, 2**20, "MORE-MEMORY")]),
                                              ("0.05,0:1048576", [(0.0, 2**20, "MORE-MEMORY")]),
                                              ("0.05", None)], ids=["memory-with-delays", "memory-apart", "no-memory"])
def test_delays_go_only_into_benchmarks_whose_baseline_median_reaches_the_threshold(pytester, monkeypatch, cases,
                                                                                    short):
    """LMSYS_INJECT_DELAYS_FROM=0.001: the 0.5 ms benchmark is measured again with the memory alone (each size once),
    or not at all when no case holds memory; the 2 ms one with every case."""
    quiet = {"noise": 0.002}  # +3% well past what 21 rounds resolve
    tests = {"test_short": {"ms": 0.5, **quiet}, "test_long": {"ms": 2.0, **quiet}}
    result, benches = inner_run(pytester, monkeypatch, tests, cases, delays_from="0.001")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*LMSYS_INJECT_DELAYS_FROM=0.001: the delays only where the baseline's median is at "
                                 "least 1 ms; the other benchmarks are measured again *"])
    measured = {name: [(c["delay"], c["memory"], c["verdict"]) for c in bench["extra_info"].get("injected_cases", [])]
                or None for name, bench in benches.items()}
    assert measured["test_short"] == short
    assert [delay for delay, _, _ in measured["test_long"]] == [float(c.split(":")[0]) for c in cases.split(",")]
    assert all(verdict.startswith("SLOWER") for delay, _, verdict in measured["test_long"] if delay)


@pytest.mark.parametrize(("value", "cases", "message"), [
    ("soon", "0.05", "*LMSYS_INJECT_DELAYS_FROM=soon: must be a non-negative number of seconds*"),
    ("-1", "0.05", "*LMSYS_INJECT_DELAYS_FROM=-1: must be a non-negative number of seconds*"),
    ("0.001", "", "*LMSYS_INJECT_DELAYS_FROM chooses which benchmarks get the delays of LMSYS_INJECT_CASES*"),
])
def test_a_bad_delay_threshold_is_a_usage_error(pytester, monkeypatch, value, cases, message):
    from perf_fakes import INJECTION, run, write_suite

    write_suite(pytester, {"test_a": {"ms": 1.0}}, seed=1)
    monkeypatch.setenv(detection.INJECT_CASES, cases)
    monkeypatch.setenv(detection.INJECT_DELAYS_FROM, value)
    result = run(pytester, *INJECTION)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_in_process_delays_from_counts_the_allocation_on_every_benchmark(pytester, monkeypatch):
    """--delays-from with --memory-with-delays, real pytest processes on the fake GPU: the short benchmark has no delay
    verdicts, and its allocation, measured alone, counts in the allocation's column beside the delay runs'."""
    from perf_fakes import RUN_ARGS, write_suite

    tests = Path(__file__).parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    quiet = {"noise": 0.002}
    write_suite(pytester, {"test_short": {"ms": 0.5, **quiet}, "test_long": {"ms": 2.0, **quiet}}, seed=1)
    (pytester.path / "baselines").mkdir()
    monkeypatch.chdir(pytester.path)
    argv = ["--in-process", "--runs", "2", "--no-warm-up", "--inject", "0.03", "0.05", "--inject-memory", "1048576",
            "--memory-with-delays", "--delays-from", "0.001", "--keep", "k", "--", "test_suite.py", *RUN_ARGS,
            "-p", "lmsys.perf.plugin"]
    if any(e.value == "lmsys.perf.plugin" for e in entry_points(group="pytest11")):
        argv = argv[:-2]
    assert detection.main(argv) == 0
    table, _, _, cases = detection._table_of_kept([Path("k")])
    assert list(table.columns) == ["benchmark", "A/A false alarms", "+3% caught", "+5% caught", "+1 MiB caught"]
    assert table.values.tolist() == [["test_long", "0/2", "2/2", "2/2", "4/4"], ["test_short", "0/2", "", "", "2/2"],
                                     ["all", "0/4", "2/2", "2/2", "6/6"]]
    runs, lines = detection.per_run(*cases)
    assert lines == [] and ["+1 MiB caught", "1/1"] in runs[["case", "counted"]].values.tolist()
    assert json.loads(Path("k/detection.json").read_text())["delays_from"] == 0.001
    # Another threshold is another measurement.
    with pytest.raises(SystemExit, match="--resume: k holds runs of"):
        detection.main([*argv[:argv.index("0.001")], "0.002", *argv[argv.index("0.001") + 1:argv.index("--")],
                        "--resume", *argv[argv.index("--"):]])


def test_with_one_injected_delay_each_benchmark_is_sized_once_for_its_measurement_and_re_measurement(pytester,
                                                                                                     monkeypatch):
    """LMSYS_INJECT_DELAY (a run per case): a caught delay is measured twice, and each test's Sizing makes the second
    measurement add the same work instead of sizing it again."""
    from perf_fakes import INJECTION, run, save_baseline, write_suite

    from lmsys.perf.injection import Injection

    sized = []
    lengths = Injection._lengths

    def counted(backend, call, flush, graph, sizing):
        sized.append(sizing.delays)
        return lengths(backend, call, flush, graph, sizing)

    monkeypatch.setattr(Injection, "_lengths", staticmethod(counted))
    tests = {"test_a": {"ms": 1.0, "noise": 0.002}, "test_b": {"ms": 2.0, "noise": 0.002, "call": ", graph=True"}}
    save_baseline(pytester, tests)
    write_suite(pytester, tests, seed=2)
    monkeypatch.setenv(detection.INJECT_DELAY, "0.1")
    result = run(pytester, *INJECTION, "--benchmark-compare", "--benchmark-json=out.json")
    result.assert_outcomes(failed=2)
    assert sized == [(0.1,), (0.1,)]
    benches = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    assert [bench["extra_info"]["remeasured"] for bench in benches] == [True, True]


def test_per_run_names_a_missed_allocation_of_a_benchmark_measured_with_it_alone_once():
    miss = {"benchmarks": [{"name": "short", "extra_info": {"verdict": "PASS", "time_change": 0.001}}]}
    cases = [("+1 MiB caught", [miss], detection.more_memory)]
    assert detection.per_run(cases, {detection.INJECT_MEMORY: str(2**20)})[1] == ["run 1, +1 MiB caught: missed short "
                                                                                  "(PASS)"]


def test_per_run_says_what_a_missed_in_process_delay_added_and_whether_it_was_resized():
    """An in-process run's missed delay names the share its work added against the benchmark's own median, so that a
    miss of the gate and a short injection can be told apart."""
    run = {"benchmarks": [{"name": "a", "extra_info": {"verdict": "PASS", "timing": "graph", "injected_cases": [
        {"delay": 0.03, "memory": 0, "verdict": "PASS", "time_change": 0.021, "time_resolution": 0.0243,
         "added": 0.0262, "resized": True, "added_before_resize": 0.0205}]}},
        {"name": "b", "extra_info": {"verdict": "PASS", "timing": "graph", "injected_cases": [
            {"delay": 0.03, "memory": 0, "verdict": "PASS", "time_change": 0.019}]}}]}
    cases = [("+3% caught", detection._case_docs([run], (0.03, 0)), detection.slower)]
    assert detection.per_run(cases, {})[1] == [
        "run 1, +3% caught: missed a at +2.10% (catches past +2.43%), the work adding +2.62% resized (from +2.05%) "
        "(PASS)",
        "run 1, +3% caught: missed b at +1.90% (PASS)"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--delays-from", "0.001"], "--delays-from and --budget-s go with --in-process"),
    (["--budget-s", "600"], "--delays-from and --budget-s go with --in-process"),
    (["--in-process", "--inject", "--inject-memory", "1", "--delays-from", "0.001"],
     "--delays-from chooses the benchmarks that get the --inject delays"),
    (["--in-process", "--run-s", "60"], "--run-s goes with --budget-s"),
])
def test_delays_from_and_the_budget_need_in_process_runs(capsys, argv, message):
    with pytest.raises(SystemExit):
        detection.main([*argv, "--", "perf_tests"])
    assert message in capsys.readouterr().err


def clocked_runs(monkeypatch, tmp_path) -> list:
    """keeping_rerun's calls, in tmp_path, on a clock that a reference's save moves by 50 s and every run by 200 s."""
    monkeypatch.chdir(tmp_path)
    clock = [0.0]
    monkeypatch.setattr(detection.time, "monotonic", lambda: clock[0])
    calls = []
    rerun = keeping_rerun(calls)

    def timed_rerun(args, runs, cwd, env=None, timeout=None, progress=None, keep=None, first=0):
        clock[0] += 50.0 if any(a.startswith("--benchmark-save=") for a in args) else 200.0
        return rerun(args, runs, cwd, env, timeout, progress, keep, first)

    monkeypatch.setattr(detection.reruns, "rerun", timed_rerun)
    return calls


def test_a_budget_starts_only_the_runs_that_fit(monkeypatch, tmp_path, capsys):
    """--budget-s 1000 with runs of 200 s after a reference of 50 s: runs start at 50, 250, 450 and 650 s; one
    starting at 850 s would end past 1000 s. --run-s stands for a run's length before the first; a resumed
    measurement counts its budget from its own start."""
    calls = clocked_runs(monkeypatch, tmp_path)
    argv = ["--in-process", "--runs", "10", "--inject", "0.05", "--keep", "k", "--budget-s", "1000", "--", "perf_tests"]
    assert detection.main(argv) == 0
    assert [c for c in calls if c[0] == "runs"] == [("runs", n) for n in range(4)]
    assert "the budget of 1000 s leaves no room for another run (850 s spent, a run expected to take 200 s): " \
           "4 of 10 runs kept" in capsys.readouterr().err
    calls.clear()
    assert detection.main([*argv[:-2], "--run-s", "960", "--resume", "--", "perf_tests"]) == 0
    assert [c[0] for c in calls] == ["reference"]  # 50 s + 960 s expected: past the budget
    calls.clear()
    assert detection.main([*argv[:-2], "--run-s", "150", "--resume", "--", "perf_tests"]) == 0
    assert [c for c in calls if c[0] == "runs"] == [("runs", n) for n in range(4, 8)]


def test_a_timed_run_replaces_the_expected_length(monkeypatch, tmp_path, capsys):
    """--run-s stands for a run's length until one is timed, then the longest timed run does: with --run-s 400, runs
    of 200 s after a reference of 50 s start at 50 s (50 + 400 fits 1000), then at 250, 450 and 650 s."""
    calls = clocked_runs(monkeypatch, tmp_path)
    assert detection.main(["--in-process", "--runs", "10", "--inject", "0.05", "--keep", "k", "--budget-s", "1000",
                           "--run-s", "400", "--", "perf_tests"]) == 0
    assert [c for c in calls if c[0] == "runs"] == [("runs", n) for n in range(4)]
    assert "(850 s spent, a run expected to take 200 s): 4 of 10 runs kept" in capsys.readouterr().err


SCRIPT = Path(__file__).parent.parent / "scripts" / "detection_campaign.sh"


def campaign_tree(tmp_path: Path) -> tuple[Path, dict]:
    """A tree as a device machine gets it (no .git, lmsys not installed) whose perf_tests run on the fake GPU, and
    the environment of its calls: `python3` answers the GPU's name and is the real interpreter otherwise."""
    import perf_fakes

    main = Path(__file__).parent.parent
    tree = tmp_path / "tree"
    shutil.copytree(main / "lmsys", tree / "lmsys", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "scripts").mkdir()
    shutil.copy(SCRIPT, tree / "scripts")
    shutil.copy(perf_fakes.__file__, tree)
    (tree / "pytest.ini").write_text("[pytest]\naddopts = -p no:hypothesispytest --benchmark-max-time=0 "
                                     "--benchmark-min-rounds=21\n")
    (tree / "perf_tests").mkdir()
    (tree / "perf_tests" / "conftest.py").write_text(perf_fakes.INNER_CONFTEST.format(name=perf_fakes.GPU))
    (tree / "perf_tests" / "test_fake.py").write_text(
        "def test_attention_short(gpu_benchmark, fake):\n    gpu_benchmark(fake.work(0.5, noise=0.002, seed=1))\n\n"
        "def test_attention_long(gpu_benchmark, fake):\n    gpu_benchmark(fake.work(2.0, noise=0.002, seed=2))\n\n"
        "def test_matmul(gpu_benchmark, fake):\n    gpu_benchmark(fake.work(1.0, noise=0.002, seed=3))\n")
    (tree / "baselines" / perf_fakes.MACHINE).mkdir(parents=True)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(f'#!/bin/sh\ncase "$2" in *get_device_name*) echo {perf_fakes.MACHINE}; exit;; esac\n'
                                  f'exec {sys.executable} "$@"\n')
    (bin_ / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "LMSYS_CAMPAIGN_JOBS": str(tmp_path / "jobs")}
    env.pop("PYTHONPATH", None)
    return tree, env


def campaign(tree: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/detection_campaign.sh", *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_campaign_script_measures_a_sessions_share_and_a_later_session_adds_to_it(tmp_path):
    """Two sessions of the same-start attention half on the fake GPU: the first builds up two runs, its kept folder is
    compacted into the tree, and the second resumes it to three, against a fresh reference of its own; a budget
    that leaves no room for a run runs none. The rest half's runs are A/A runs of the other tests."""
    tree, env = campaign_tree(tmp_path)
    gate, commit = "f00ba47", "0123abcd" * 5
    committed = tree / "baselines" / "Fake_GPU_80GB" / "detection" / "attention-same" / gate
    for session, runs in ((1, "2"), (2, "3")):
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        done = campaign(tree, {**env, "LMSYS_CAMPAIGN_RUNS": runs, "PYTHONDONTWRITEBYTECODE": "1"},
                        "start", "attention-same", gate, commit, "900")
        assert done.returncode == 0, done.stderr
        assert "--delays-from 0.001" in done.stdout and ("--resume" in done.stdout) == (session == 2)
        done = campaign(tree, env, "wait", "240")
        assert done.returncode == 0 and "exit 0 after" in done.stdout, done.stdout + done.stderr
        unpacked = tmp_path / f"session-{session}"
        unpacked.mkdir()
        subprocess.run(["tar", "-xzf", str(out / "attention-same.tar.gz"), "-C", str(unpacked)], check=True)
        assert detection.main(["--compact", str(unpacked / gate), str(committed)]) == 0
    # The runs wrote their bytecode, whatever the machine's environment said, and outside the tree.
    assert any((tmp_path / "jobs" / "pycache").rglob("detection*.pyc"))
    assert not any((tmp_path / "jobs" / "attention-same" / "tree").rglob("*.pyc"))
    table = detection._table_of_kept([committed])[0]
    assert table.values.tolist() == [["test_attention_long", "0/3", "3/3", "3/3", "6/6"],
                                     ["test_attention_short", "0/3", "", "", "3/3"], ["all", "0/6", "3/3", "3/3", "9/9"]]
    assert len(list((unpacked / gate / "references").rglob("reference-*.json"))) == 1  # the second start's own
    assert json.loads((committed / "detection.json").read_text())["pytest_args"] == [
        "perf_tests", "-k", "attention", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]

    # A budget that a run does not fit in: the reference, and no run.
    done = campaign(tree, {**env, "LMSYS_CAMPAIGN_RUNS": "1"}, "start", "rest-same", gate, commit, "200")
    assert done.returncode == 0, done.stderr
    done = campaign(tree, env, "wait", "240")
    assert "the budget of 155 s leaves no room for another run" in done.stdout, done.stdout
    done = campaign(tree, {**env, "LMSYS_CAMPAIGN_RUNS": "1"}, "start", "rest-same", gate, commit, "600")
    done = campaign(tree, env, "wait", "240")
    assert "exit 0 after" in done.stdout, done.stdout
    doc = json.loads(next((tmp_path / "jobs" / "rest-same" / "keep" / gate / "runs").glob("*.json")).read_text())
    assert [(b["name"], b["extra_info"]["verdict"], "injected_cases" in b["extra_info"]) for b in doc["benchmarks"]] \
        == [("test_matmul", "PASS", False)]
    assert doc["machine_info"]["lmsys"]["git_commit"] == commit


def test_the_campaign_script_packs_the_caches_its_job_used_or_refuses(tmp_path):
    """pack-caches runs in a call of its own, without the variables `start` had: it packs the cache folders that
    `start` saw, and where they are gone it fails and writes no archive (an empty one would pass for caches)."""
    import tarfile

    tree, env = campaign_tree(tmp_path)
    caches = {name: tmp_path / name for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    for name, folder in caches.items():
        folder.mkdir()
        (folder / f"{name}.bin").write_text(name)
    (tmp_path / "out").mkdir()
    done = campaign(tree, {**env, **{k: str(v) for k, v in caches.items()}, "LMSYS_CAMPAIGN_RUNS": "1"},
                    "start", "rest-same", "f00ba47", "0123abcd", "200")
    assert done.returncode == 0, done.stderr
    assert campaign(tree, env, "wait", "240").returncode == 0
    done = campaign(tree, env, "pack-caches")
    assert done.returncode == 0, done.stderr
    parts = sorted((tmp_path / "out").glob("caches.tgz.part-*"))
    (tmp_path / "caches.tgz").write_bytes(b"".join(part.read_bytes() for part in parts))
    with tarfile.open(tmp_path / "caches.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert {"TORCHINDUCTOR_CACHE_DIR.bin", "TRITON_CACHE_DIR.bin"} <= names

    shutil.rmtree(caches["TRITON_CACHE_DIR"])
    for part in parts:
        part.unlink()
    done = campaign(tree, env, "pack-caches")
    assert done.returncode == 1 and f"no cache at {caches['TRITON_CACHE_DIR']}" in done.stderr
    assert not list((tmp_path / "out").glob("caches.tgz.part-*"))


def test_the_campaign_script_runs_from_an_archived_tree_while_the_checkout_moves_on(tmp_path):
    """LMSYS_CAMPAIGN_TREE: the job runs the archive's code and baselines, not the checkout's (broken here); the runs
    kept so far still come from the checkout. A path that is no archive of this repository is refused, and the ended
    job's folder stays as it was."""
    import tarfile

    tree, env = campaign_tree(tmp_path)

    def archive(name: str, keep=lambda path: True) -> Path:
        with tarfile.open(tmp_path / name, "w") as tar:
            for path in tree.iterdir():
                if keep(path):
                    tar.add(path, arcname=path.name)
        return tmp_path / name

    whole = archive("tree.tar")
    (tree / "lmsys" / "perf" / "detection.py").write_text("raise SystemExit('the checkout, not the archive')\n")
    (tmp_path / "out").mkdir()
    done = campaign(tree, {**env, "LMSYS_CAMPAIGN_RUNS": "1", "LMSYS_CAMPAIGN_TREE": str(whole)},
                    "start", "rest-same", "f00ba47", "0123abcd" * 5, "600")
    assert done.returncode == 0, done.stderr
    done = campaign(tree, env, "wait", "240")
    assert "exit 0 after" in done.stdout and "| test_matmul | 0/1 |" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "jobs" / "rest-same" / "tree" / "lmsys" / "perf" / "detection.py").read_text() == \
        (Path(__file__).parent.parent / "lmsys" / "perf" / "detection.py").read_text()

    (tmp_path / "junk.tar").write_bytes(b"not a tar archive")
    archive("other.tar", lambda path: path.name == "pytest.ini")
    archive("no-baselines.tar", lambda path: path.name != "baselines")
    for path, said in ((tmp_path / "missing.tar", "is not a file"), (tmp_path / "junk.tar", "does not unpack"),
                       (tmp_path / "other.tar", "does not unpack to a tree of this repository"),
                       (tmp_path / "no-baselines.tar", "no baselines/Fake_GPU_80GB in the tree")):
        done = campaign(tree, {**env, "LMSYS_CAMPAIGN_TREE": str(path)}, "start", "rest-same", "f00ba47", "0123abcd",
                        "600")
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert (tmp_path / "jobs" / "rest-same" / "done").read_text() == "0\n"


def test_the_campaign_script_packs_the_caches_its_variables_name_for_a_later_start(tmp_path):
    tree, env = campaign_tree(tmp_path)
    caches = {"TRITON_CACHE_DIR": tmp_path / "tc", "TORCHINDUCTOR_CACHE_DIR": tmp_path / "ic"}
    for name, folder in caches.items():
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "entry").write_bytes(name.encode() * 1000)
    (tmp_path / "out").mkdir()
    done = campaign(tree, {**env, **{k: str(v) for k, v in caches.items()}}, "pack-caches")
    assert done.returncode == 0, done.stderr
    parts = sorted((tmp_path / "out").glob("caches.tgz.part-*"))
    assert parts
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    subprocess.run(f"cat {' '.join(map(str, parts))} | tar -xzf - -C {unpacked}", shell=True, check=True)
    for name, folder in caches.items():
        assert (unpacked / folder.relative_to("/") / "sub" / "entry").read_bytes() == name.encode() * 1000


@pytest.mark.parametrize(("args", "said"), [
    (["start", "everything", "f00ba47", "0123abcd", "900"], "HALF must be attention-same, attention-other"),
    (["start", "attention-other", "f00ba47", "0123abcd", "900"], "attention-other compares with BASELINE"),
    (["start", "attention-same", "f00ba47", "0123abcd", "900", "13"], "attention-same compares with a fresh"),
    (["start", "rest-same", "f00ba47", "0123abcd", "45"], "BUDGET_S must be a number of seconds above 45"),
    (["start", "rest-same", "../up", "0123abcd", "900"], "GATE must be a folder name"),
    (["commands", "rest-same", "f00ba47", "HEAD", "900"], "COMMIT must be a commit id"),
    (["wait", "soon"], "detection_campaign.sh wait SECONDS"),
])
def test_the_campaign_script_refuses_what_it_cannot_run(tmp_path, args, said):
    assert os.access(SCRIPT, os.X_OK)
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LMSYS_CAMPAIGN_JOBS": str(tmp_path / "jobs")})
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_the_campaign_script_compares_the_other_halves_with_the_baseline_it_names(tmp_path):
    tree, env = campaign_tree(tmp_path)
    command = campaign(tree, env, "commands", "attention-other", "f00ba47", "0123abcd", "900", "13").stdout
    assert "--inject 0.1 --inject-memory 1048576 --memory-with-delays --delays-from 0.001 --baseline 13" in command
    assert "-p lmsys.perf.plugin" not in command  # the plugin's entry point is installed here
    done = campaign(tree, env, "start", "attention-other", "f00ba47", "0123abcd", "900", "13")
    assert done.returncode == 2 and "no baseline numbered 13 in baselines/Fake_GPU_80GB" in done.stderr
    # A machine where lmsys is not installed: its tests load the plugin by name.
    stub = Path(env["PATH"].split(os.pathsep)[0]) / "python3"
    stub.write_text(stub.read_text().replace("*get_device_name*)", "*entry_points*) exit 0;; *get_device_name*)"))
    done = campaign(tree, env, "commands", "rest-other", "f00ba47", "0123abcd", "900", "13")
    assert done.stdout.rstrip().endswith(
        "-- perf_tests -k not\\ attention -p no:cacheprovider -p no:hypothesispytest -p lmsys.perf.plugin")


def files(folder: str) -> dict[Path, tuple[bytes, int]]:
    """Every file under folder: its bytes and inode (a file replaced by another of the same bytes shows)."""
    return {path.relative_to(folder): (path.read_bytes(), path.stat().st_ino)
            for path in sorted(Path(folder).rglob("*")) if path.is_file()}


def table_of(capsys, folder: str) -> str:
    """The table --table prints of the runs kept in folder."""
    capsys.readouterr()
    assert detection.main(["--table", folder]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("layout", [[], ["--in-process"]], ids=["per-case", "in-process"])
def test_compact_keeps_every_run_without_its_rounds_and_the_same_table(monkeypatch, tmp_path, capsys, layout):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = [*layout, "--runs", "2", "--inject", "0.05", "--inject-memory", "1048576", "--keep", "src"]
    assert detection.main([*argv, "--", "perf_tests"]) == 0
    capsys.readouterr()
    assert detection.main(["--compact", "src", "dest"]) == 0
    runs = 2 if layout else 6
    err = capsys.readouterr().err
    assert f"--compact: {runs} runs added to dest, 0 already there; " in err
    assert "its references (src/references) are not copied: baselines with every round" in err
    # The manifest as it is and each run; not the references.
    source = files("src")
    assert Path("references/GPU/reference-0.json") in source
    assert list(files("dest")) == [path for path in source if path.parts[0] != "references"]
    assert (tmp_path / "dest" / detection.MANIFEST).read_bytes() == (tmp_path / "src" / detection.MANIFEST).read_bytes()
    kept = [path for path in files("dest") if path.name != detection.MANIFEST]
    assert len(kept) == runs
    for path in kept:
        full, small = (json.loads((tmp_path / folder / path).read_text()) for folder in ("src", "dest"))
        for bench in full["benchmarks"]:  # the rounds, and nothing else, are left out
            del bench["stats"]["data"]
            for key in detection.ROUND_KEYS:
                del bench["extra_info"][key]
        assert json.dumps(small) == json.dumps(full)  # as text: the NaN stddev stays
        assert small["benchmarks"][0]["extra_info"]["machine"] and small["benchmarks"][0]["stats"]["median"] == 1e-3
        assert (tmp_path / "dest" / path).stat().st_size < (tmp_path / "src" / path).stat().st_size
    table = table_of(capsys, "src")
    assert table.splitlines()[-1].split() == ["all", "0/2", "2/2", "2/2"]
    assert table_of(capsys, "dest") == table


def test_compact_adds_only_the_runs_dest_lacks_and_keeps_those_src_lacks(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = ["--inject", "0.05", "--keep", "src", "--", "perf_tests"]
    assert detection.main(["--runs", "2", *argv]) == 0
    assert detection.main(["--compact", "src", "dest"]) == 0
    first = files("dest")
    capsys.readouterr()
    # The same SRC again: nothing to add, nothing rewritten.
    assert detection.main(["--compact", "src", "dest"]) == 0
    assert "--compact: 0 runs added to dest, 4 already there; 0 B written for 0 B in src" in capsys.readouterr().err
    assert files("dest") == first
    # A later SRC, the same runs and a third of each case: only those are added.
    assert detection.main(["--runs", "3", "--resume", *argv]) == 0
    capsys.readouterr()
    assert detection.main(["--compact", "src", "dest"]) == 0
    assert "--compact: 2 runs added to dest, 4 already there" in capsys.readouterr().err
    later = files("dest")
    assert {path: later[path] for path in first} == first
    assert sorted(set(later) - set(first)) == [Path("aa/aa-run-2.json"), Path("delay-0.05/delay-0.05-run-2.json")]
    # Another SRC of the same measurement with fewer runs: its run is there already, and DEST keeps the others.
    assert detection.main(["--runs", "1", *argv[:-3], "other", "--", "perf_tests"]) == 0
    capsys.readouterr()
    assert detection.main(["--compact", "other", "dest"]) == 0
    assert "--compact: 0 runs added to dest, 2 already there" in capsys.readouterr().err
    assert files("dest") == later
    assert table_of(capsys, "dest").splitlines()[-1].split() == ["all", "0/3", "3/3"]


def test_compact_refuses_a_differing_run_another_measurement_or_no_measurement_and_writes_nothing(
        monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = ["--inject", "0.05", "--keep", "src", "--", "perf_tests"]
    assert detection.main(["--runs", "1", *argv]) == 0
    assert detection.main(["--compact", "src", "dest"]) == 0
    assert detection.main(["--runs", "2", "--resume", *argv]) == 0  # runs DEST lacks, which must not be written
    changed = tmp_path / "dest" / "aa" / "aa-run-0.json"
    changed.write_text(changed.read_text().replace('"PASS"', '"SLOWER"'))
    before = files("dest")
    with pytest.raises(SystemExit, match=r"--compact: dest/aa/aa-run-0.json: not what compacting the run of that name "
                       r"or datetime in src gives, and a kept run is never replaced \(nothing was written\)"):
        detection.main(["--compact", "src", "dest"])
    assert files("dest") == before

    # Another measurement: other cases, no gate recorded in DEST, or another gate.
    assert detection.main(["--runs", "1", "--inject", "0.1", "--keep", "other", "--", "perf_tests"]) == 0
    with pytest.raises(SystemExit, match=r"--compact: dest measured .*0\.05.*, other .*0\.1.*: not the same cases: "
                       r"compact into another folder \(nothing was written\)"):
        detection.main(["--compact", "other", "dest"])
    assert files("dest") == before
    manifest = tmp_path / "dest" / detection.MANIFEST
    recorded = json.loads(manifest.read_text())
    gate = recorded.pop("gate")
    manifest.write_text(json.dumps(recorded))
    before = files("dest")
    with pytest.raises(SystemExit, match="--compact: dest records no gate .*, the other does: compact into another"):
        detection.main(["--compact", "src", "dest"])
    assert files("dest") == before
    manifest.write_text(json.dumps({**recorded, "gate": {**gate, "lmsys/perf/verdict.py": "0" * 16}}))
    before = files("dest")
    with pytest.raises(SystemExit, match=r"--compact: dest and src were measured by different gates \(changed "
                       r"lmsys/perf/verdict.py in src\)"):
        detection.main(["--compact", "src", "dest"])
    assert files("dest") == before

    with pytest.raises(SystemExit, match=r"--compact: nowhere holds no measurement \(detection.json is missing\)"):
        detection.main(["--compact", "nowhere", "fresh"])
    assert not (tmp_path / "fresh").exists()


def stamp(folder: str, run: int, when: str) -> None:
    """Gives an in-process run kept in folder the datetime pytest-benchmark records in a real run."""
    path = Path(folder) / "runs" / f"runs-run-{run}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "datetime": when}, indent=4))


def test_compact_renumbers_another_measurement_whose_name_is_taken_and_never_copies_a_run_twice(
        monkeypatch, tmp_path, capsys):
    """A session's copy of the kept runs taken before the last runs were compacted numbers its runs as those: each is
    added under the next free number, once; a run of the same datetime with other contents is refused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = ["--in-process", "--inject", "0.05", "--keep"]
    assert detection.main(["--runs", "1", *argv, "src", "--", "perf_tests"]) == 0
    stamp("src", 0, "2026-11-26T12:00:00")
    shutil.copytree(tmp_path / "src", tmp_path / "session")  # taken when one run was kept
    assert detection.main(["--runs", "2", "--resume", *argv, "src", "--", "perf_tests"]) == 0
    stamp("src", 1, "2026-11-26T12:30:00")
    assert detection.main(["--compact", "src", "dest"]) == 0
    assert detection.main(["--runs", "2", "--resume", *argv, "session", "--", "perf_tests"]) == 0
    stamp("session", 1, "2026-11-26T13:00:00")
    before = files("dest")
    capsys.readouterr()
    assert detection.main(["--compact", "session", "dest"]) == 0
    assert ("--compact: 1 runs added to dest (1 renumbered, their names taken: runs/runs-run-1.json as "
            "runs-run-2.json), 1 already there") in capsys.readouterr().err
    after = files("dest")
    assert {path: after[path] for path in before} == before
    assert sorted(set(after) - set(before)) == [Path("runs/runs-run-2.json")]
    kept = json.loads((tmp_path / "dest" / "runs" / "runs-run-2.json").read_text())
    assert kept == detection.compacted(json.loads((tmp_path / "session" / "runs" / "runs-run-1.json").read_text()))
    assert table_of(capsys, "dest").splitlines()[-1].split() == ["all", "0/3", "3/3"]
    # Again: the renumbered run is there already.
    assert detection.main(["--compact", "session", "dest"]) == 0
    assert "--compact: 0 runs added to dest, 2 already there" in capsys.readouterr().err
    assert files("dest") == after
    # The same run (its datetime) with other contents: refused, naming the run kept under the other name.
    path = tmp_path / "session" / "runs" / "runs-run-1.json"
    path.write_text(path.read_text().replace('"PASS"', '"SLOWER"'))
    with pytest.raises(SystemExit, match=r"--compact: dest/runs/runs-run-2.json: not what compacting the run of that "
                       r"name or datetime in session gives"):
        detection.main(["--compact", "session", "dest"])
    assert files("dest") == after


def test_compact_of_two_sessions_numbered_alike_renumbers_onto_names_no_run_takes(monkeypatch, tmp_path, capsys):
    """Two machines' measurements, each numbered from 0: the second's runs 0 and 1 are renumbered to 2 and 3, and its
    run 2 (whose name the renumbered run 0 took) to 4, not onto the file just written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun([]))
    argv = ["--in-process", "--inject", "0.05", "--keep"]
    assert detection.main(["--runs", "2", *argv, "a", "--", "perf_tests"]) == 0
    assert detection.main(["--runs", "3", *argv, "b", "--", "perf_tests"]) == 0
    for run in range(2):
        stamp("a", run, f"2026-11-28T12:0{run}:00")
    for run in range(3):
        stamp("b", run, f"2026-11-28T13:0{run}:00")
    assert detection.main(["--compact", "a", "dest"]) == 0
    capsys.readouterr()
    assert detection.main(["--compact", "b", "dest"]) == 0
    assert ("3 runs added to dest (3 renumbered, their names taken: runs/runs-run-0.json as runs-run-2.json, "
            "runs/runs-run-1.json as runs-run-3.json, runs/runs-run-2.json as runs-run-4.json)") in capsys.readouterr().err
    kept = {json.loads(path.read_text())["datetime"] for path in Path("dest/runs").glob("*.json")}
    assert len(kept) == 5
    assert table_of(capsys, "dest").splitlines()[-1].split() == ["all", "0/5", "5/5"]


def test_a_compact_folder_is_resumed_with_a_fresh_reference_and_compacted_again(monkeypatch, tmp_path, capsys):
    """What a session does with the runs committed compact: resume a copy of them on the GPU (old runs compact, new
    ones full, no references: the session saves its own), then compact that copy into the committed folder."""
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(detection.reruns, "rerun", keeping_rerun(calls))
    argv = ["--in-process", "--inject", "0.03", "0.05", "--inject-memory", "1048576", "--memory-with-delays", "--keep"]
    assert detection.main(["--runs", "2", *argv, "src", "--", "perf_tests"]) == 0
    assert detection.main(["--compact", "src", "committed"]) == 0
    shutil.copytree(tmp_path / "committed", tmp_path / "session")
    assert not (tmp_path / "session" / detection.REFERENCES).exists()
    calls.clear()
    assert detection.main(["--runs", "3", "--resume", *argv, "session", "--", "perf_tests"]) == 0
    assert [call[0] for call in calls] == ["reference", "runs"] and calls[1] == ("runs", 2)
    assert [p.name for p in (tmp_path / "session" / "references" / "GPU").iterdir()] == ["reference-0.json"]
    table = table_of(capsys, "session")  # two compact runs and a full one
    assert table.splitlines()[-1].split() == ["all", "0/3", "3/3", "3/3", "6/6"]
    assert detection.main(["--compact", "session", "committed"]) == 0
    assert "--compact: 1 runs added to committed, 2 already there" in capsys.readouterr().err
    assert table_of(capsys, "committed") == table


def test_compact_runs_nothing_and_goes_with_nothing_else_and_per_run_only_with_table(capsys):
    with pytest.raises(SystemExit):
        detection.main(["--compact", "a", "b", "--table", "a"])
    assert "argument --table: not allowed with argument --compact" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        detection.main(["--compact", "a", "b", "--", "perf_tests"])
    assert "--compact runs nothing: give it no tests to run, no --keep and no --resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        detection.main(["--compact", "a", "b", "--keep", "c", "--resume"])
    assert "--compact runs nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        detection.main(["--per-run", "--", "perf_tests"])
    assert "--per-run goes with --table" in capsys.readouterr().err


def test_false_alarms_name_the_benchmark_its_change_and_the_throttling_after_it():
    def bench(name, verdict, **info):
        return {"name": name, "extra_info": {"verdict": verdict, **info}}

    aa = [{"benchmarks": [
        bench("test_hot", "SLOWER", time_change=0.0683, time_tolerance=0.025,
              machine={"after": {"throttle": ["sw_power_cap", "sw_thermal_slowdown"]}}),
        bench("test_launch", "SLOWER-HOST", time_change=0.0, time_tolerance=0.025, host_change=0.266,
              machine={"after": {"throttle": []}}),
        bench("test_fine", "PASS", time_change=0.001, time_tolerance=0.025),
        bench("test_new", "NEW"),
    ]}]
    injected = [{"benchmarks": [bench("test_fine", "SLOWER", time_change=0.05, time_tolerance=0.025)]}]
    results = [(detection.AA_COLUMN, aa, detection.failed), ("+5% caught", injected, detection.failed)]
    assert detection.false_alarms(results) == [
        "test_hot: SLOWER, +6.83% against 2.50%; throttled after: sw_power_cap, sw_thermal_slowdown",
        "test_launch: SLOWER-HOST",  # extra_info keeps no host tolerance to set host_change against
    ]
