"""lmsys.perf.baselines: the on-disk layout, validation and atomic, never-overwriting saves."""

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmsys.perf import baselines


def bench(fullname="test_x.py::test_a", data=(1e-3, 1.1e-3, 0.9e-3), memory=None) -> dict:
    stats = {key: 1e-3 for key in ("min", "max", "mean", "stddev", "median", "iqr")}
    stats.update(rounds=len(data), iterations=1, data=list(data))
    extra = {} if memory is None else {"peak_allocated_above_start_bytes": memory}
    return {"fullname": fullname, "stats": stats, "extra_info": extra}


def doc(*benches, machine_id=None) -> dict:
    info = {"node": "n", "lmsys": {"schema": baselines.SCHEMA}}
    if machine_id:
        info["lmsys"]["machine_id"] = machine_id
    return {"machine_info": info, "benchmarks": list(benches)}


@pytest.mark.parametrize(
    ("name", "is_gpu", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", True, "NVIDIA_H100_80GB_HBM3"),
        ("NVIDIA A100-SXM4-80GB", True, "NVIDIA_A100-SXM4-80GB"),
        ("Intel(R) Xeon(R) CPU @ 2.20GHz", False, "cpu-Intel_R_Xeon_R_CPU_2.20GHz"),
    ],
)
def test_machine_id_is_a_slug_of_the_device(name, is_gpu, expected):
    assert baselines.machine_id(name, is_gpu) == expected


def test_machine_id_needs_a_name():
    with pytest.raises(ValueError, match="device_name"):
        baselines.machine_id("  ", True)


def test_read_baseline_accepts_a_pytest_benchmark_file(tmp_path):
    path = tmp_path / "0001_a.json"
    path.write_text(json.dumps(doc(bench())))
    assert baselines.read_baseline(path)["benchmarks"][0]["fullname"] == "test_x.py::test_a"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{", "is not valid JSON"),
        ("[]", "the top level is not a JSON object"),
        ('{"benchmarks": []}', "'machine_info' is missing"),
        ('{"machine_info": {}}', "'benchmarks' is missing"),
        ('{"machine_info": {}, "benchmarks": [{"fullname": "t"}]}', "benchmark 't' has no 'stats'"),
        ('{"machine_info": {}, "benchmarks": [{"fullname": "t", "stats": {"median": "x"}}]}', "lacks numeric stats"),
    ],
)
def test_read_baseline_names_the_file_and_the_problem(tmp_path, content, problem):
    path = tmp_path / "0001_a.json"
    path.write_text(content)
    with pytest.raises(baselines.BaselineError, match=problem) as raised:
        baselines.read_baseline(path)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"median": 0.0}, "has a median time of 0 s"),
        ({"stddev": -1.0}, "has negative times"),
        ({"rounds": 2.5}, "rounds or iterations that are not positive whole numbers"),
        ({"data": [0.0, 0.0, 1e-3]}, "per-round data whose median is 0 s"),
        ({"max": float("inf")}, "lacks numeric stats"),
    ],
)
def test_read_baseline_rejects_impossible_times(tmp_path, changes, problem):
    entry = bench()
    entry["stats"].update(changes)
    path = tmp_path / "0001_a.json"
    path.write_text(json.dumps(doc(entry)))
    with pytest.raises(baselines.BaselineError, match=problem):
        baselines.read_baseline(path)


def test_read_baseline_rejects_malformed_rounds(tmp_path):
    path = tmp_path / "0001_a.json"
    path.write_text(json.dumps(doc(bench(data=[1e-3, -1.0]))))
    with pytest.raises(baselines.BaselineError, match="malformed per-round data"):
        baselines.read_baseline(path)


def test_launch_rounds_are_handed_out_only_where_they_were_timed_from_an_idle_device():
    graph = bench(data=(1e-3,))
    graph["extra_info"].update(timing="graph", eager_data=[3e-3, 4e-3])
    assert baselines.samples(graph, "launch") is None
    assert baselines.samples(graph, "eager") is None  # nor as eager rounds of another kind
    graph["extra_info"]["eager_timing"] = "launch"
    assert baselines.samples(graph, "launch") == [3e-3, 4e-3]
    assert baselines.samples(bench(data=(1.0, 2.0)), "launch") is None  # an eager-timed baseline has no such rounds


def test_unreadable_baseline_is_a_baseline_error(tmp_path):
    with pytest.raises(baselines.BaselineError, match="cannot read baseline file"):
        baselines.read_baseline(tmp_path / "missing.json")


def test_recorded_machine_id_prefers_the_file_over_its_folder(tmp_path):
    path = tmp_path / "NVIDIA_H100_80GB_HBM3" / "0001_a.json"
    assert baselines.recorded_machine_id(doc(), path) == "NVIDIA_H100_80GB_HBM3"
    assert baselines.recorded_machine_id(doc(machine_id="NVIDIA_H200"), path) == "NVIDIA_H200"


def test_samples_and_memory_of_a_baseline_benchmark():
    assert baselines.samples(bench(data=(1.0, 2.0))) == [1.0, 2.0]
    without_rounds = bench()
    del without_rounds["stats"]["data"]
    assert baselines.samples(without_rounds) == [1e-3]

def test_the_gate_compares_requested_bytes_where_both_runs_have_them_else_allocated():
    allocated, both = {"peak_allocated_above_start_bytes": 3 * 2**20}, {
        "peak_allocated_above_start_bytes": 4 * 2**20, "peak_requested_above_start_bytes": 2**20 + 7}
    assert baselines.gated_peaks(both, both) == (2**20 + 7, 2**20 + 7, "requested")
    # A baseline saved before the requested bytes were read is still compared, on the allocator's blocks.
    assert baselines.gated_peaks(both, allocated) == (4 * 2**20, 3 * 2**20, "allocated")
    assert baselines.gated_peaks(allocated, both) == (3 * 2**20, 4 * 2**20, "allocated")
    assert baselines.gated_peaks({}, both) is None
    assert baselines.allocated_peak(both) == 4 * 2**20 and baselines.allocated_peak({}) is None


def test_save_new_numbers_files_and_never_overwrites(tmp_path):
    folder = tmp_path / "GPU"
    first = baselines.save_new(folder, "base", '{"a": 1}')
    second = baselines.save_new(folder, "base", '{"a": 2}')
    assert (first.name, second.name) == ("0001_base.json", "0002_base.json")
    assert first.read_text() == '{"a": 1}'
    assert sorted(p.name for p in folder.iterdir()) == ["0001_base.json", "0002_base.json"]


def test_save_new_moves_on_when_another_process_takes_the_number(tmp_path, monkeypatch):
    folder = tmp_path / "GPU"
    folder.mkdir()
    real_link = os.link

    def racing_link(source, target):
        # Another save creates the same file between the numbering and the link.
        if not os.path.exists(target) and target.name.startswith("0001_"):
            target.write_text("theirs")
        real_link(source, target)

    monkeypatch.setattr(baselines.os, "link", racing_link)
    path = baselines.save_new(folder, "mine", "ours")
    assert path.name == "0002_mine.json"
    assert (folder / "0001_mine.json").read_text() == "theirs"
    assert path.read_text() == "ours"


def test_save_new_rejects_names_that_are_not_file_names(tmp_path):
    with pytest.raises(ValueError, match="baseline name"):
        baselines.save_new(tmp_path, "a/b", "{}")


def test_concurrent_saves_get_different_numbers(tmp_path, monkeypatch):
    folder = tmp_path / "GPU"
    real_next_number = baselines.next_number

    def slow_next_number(folder):
        number = real_next_number(folder)
        time.sleep(0.05)  # every saver has read the folder before any has written into it
        return number

    monkeypatch.setattr(baselines, "next_number", slow_next_number)
    paths = []
    savers = [
        threading.Thread(target=lambda n=n: paths.append(baselines.save_new(folder, f"run{n}", "{}"))) for n in range(4)
    ]
    for saver in savers:
        saver.start()
    for saver in savers:
        saver.join()
    assert sorted(baselines.file_number(path) for path in paths) == [1, 2, 3, 4]


# Run by other processes: PYTHONPATH makes them import this checkout of lmsys.
REPO = Path(__file__).parents[1]
SAVER = """
import sys
from lmsys.perf import baselines
for _ in range(5):
    baselines.save_new(sys.argv[1], sys.argv[2], "{}")
"""


def _python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, **kwargs)


def test_processes_saving_at_once_get_unique_numbers(tmp_path):
    folder = tmp_path / "GPU"
    savers = [_python(SAVER, str(folder), f"p{n}") for n in range(4)]
    assert [saver.wait(timeout=60) for saver in savers] == [0] * 4
    numbers = sorted(baselines.file_number(path) for path in baselines.baseline_files(folder))
    assert numbers == list(range(1, 21))


STUCK_SAVER = """
import os, sys, time
from lmsys.perf import baselines

def stuck(descriptor):
    print("writing", flush=True)
    time.sleep(60)

os.fsync = stuck
baselines.save_new(sys.argv[1], "killed", "{}")
"""


def test_a_save_killed_by_sigterm_leaves_no_temporary_file(tmp_path):
    folder = tmp_path / "GPU"
    saver = _python(STUCK_SAVER, str(folder), stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline() == "writing\n"
        assert [path.name[:5] for path in folder.iterdir()] == [".tmp-"]
        saver.send_signal(signal.SIGTERM)
        assert saver.wait(timeout=30) != 0
    finally:
        saver.kill()
        saver.stdout.close()
    assert list(folder.iterdir()) == []


def test_a_temporary_file_left_by_a_harder_kill_is_never_read_and_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "GPU"
    folder.mkdir()
    (folder / ".tmp-abcd1234.json").write_text('{"benchmarks": [')  # a save killed with SIGKILL
    (folder / "README.md").write_text("not a baseline")
    assert baselines.baseline_files(folder) == []
    assert baselines.next_number(folder) == 1
    baselines.save_new(folder, "x", "{}")
    assert sorted(path.name for path in folder.iterdir()) == ["0001_x.json", "README.md"]


@pytest.mark.parametrize(
    ("name", "number"), [("0001_a.json", 1), ("0042_h100-attn.json", 42), (".tmp-1.json", None), ("1_a.json", None),
                         ("0001_.json", None), ("0001_a.json.bak", None)],
)
def test_file_number_is_the_one_definition_of_a_baseline_name(name, number):
    assert baselines.file_number(Path(name)) == number
    if number is not None:
        assert baselines.file_name(number, name[5:-5]) == name


def test_baseline_files_are_ordered_by_number(tmp_path):
    for name in ("0010_b.json", "0002_a.json", "0002_0.json", "notes.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in baselines.baseline_files(tmp_path)] == ["0002_0.json", "0002_a.json", "0010_b.json"]
    assert baselines.baseline_files(tmp_path / "missing") == []


def test_named_finds_numbers_prefixes_saved_names_and_paths(tmp_path):
    for name in ("0001_h100.json", "0002_h100-attn.json", "0003_h100.json"):
        (tmp_path / name).write_text("{}")
    names = lambda value: [p.name for p in baselines.named(tmp_path, value)]  # noqa: E731
    assert names("2") == names("0002") == names("0002_") == ["0002_h100-attn.json"]
    assert names("h100") == ["0001_h100.json", "0003_h100.json"]
    assert names("0001_h100") == ["0001_h100.json"]
    assert names(str(tmp_path / "0003_h100.json")) == ["0003_h100.json"]
    with pytest.raises(baselines.NoSuchBaseline, match="it holds: 0001_h100.json, 0002_h100-attn.json, 0003_h100.json"):
        baselines.named(tmp_path, "h200")


def test_newest_per_benchmark_takes_each_benchmark_from_the_newest_file_that_has_it():
    first = doc(bench("t::a"), bench("t::b"))
    partial = doc(bench("t::a", data=(2e-3,)))
    unrelated = doc()
    chosen = baselines.newest_per_benchmark([(Path("1"), first), (Path("2"), partial), (Path("3"), unrelated)])
    assert list(chosen) == [Path("1"), Path("2")]
    assert list(chosen[Path("1")]) == ["t::b"]
    assert chosen[Path("2")]["t::a"]["stats"]["data"] == [2e-3]


def test_save_problem_names_what_cannot_be_written(tmp_path, monkeypatch):
    assert baselines.save_problem(tmp_path / "new" / "GPU", "x") is None
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("")
    assert "is not a folder" in baselines.save_problem(tmp_path / "file" / "GPU", "x")
    assert "longer than the" in baselines.save_problem(tmp_path, "x" * 300)
    assert "baseline name must be non-empty" in baselines.save_problem(tmp_path, "a/b")

    def read_only(**kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(baselines.tempfile, "mkstemp", read_only)
    assert baselines.save_problem(tmp_path, "x") == (
        f"baselines cannot be saved into {tmp_path}: {tmp_path} is not writable (Read-only file system)")
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]


def test_output_problem_protects_baselines_and_existing_files(tmp_path):
    store = tmp_path / "baselines"
    (store / "GPU").mkdir(parents=True)
    (store / "GPU" / "0001_a.json").write_text("{}")
    (tmp_path / "0002_b.json").write_text("{}")
    (tmp_path / "old.csv").write_text("")
    assert baselines.output_problem(tmp_path / "new.csv", False, [store]) is None
    assert "inside" in baselines.output_problem(store / "GPU" / "0001_a.json", True, [store])
    assert "inside" in baselines.output_problem(store / "GPU" / "new.csv", True, [store])
    assert "named like a baseline" in baselines.output_problem(tmp_path / "0002_b.json", True, [store])
    assert "exists" in baselines.output_problem(tmp_path / "old.csv", False, [store])
    assert baselines.output_problem(tmp_path / "old.csv", True, [store]) is None
    assert "is a folder" in baselines.output_problem(tmp_path, True, [])




@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_saved_baselines_and_reports_get_the_permissions_of_the_umask(tmp_path, umask):
    """Written through a temporary file, yet as open() would create them: not mkstemp's 0600."""
    previous = os.umask(umask)
    try:
        saved = baselines.save_new(tmp_path, "x", "{}")
        report = baselines.replace_file(tmp_path / "report.json", "{}")
        baselines.write_new_file(tmp_path / "kept" / "run.json", "{}")
    finally:
        os.umask(previous)
    for path in (saved, report, tmp_path / "kept" / "run.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
