"""lmsys.perf.baselines: the on-disk layout, validation and atomic, never-overwriting saves."""

import json
import os

import pytest

from lmsys.perf import baselines


def bench(fullname="test_x.py::test_a", data=(1e-3, 1.1e-3, 0.9e-3), memory=None) -> dict:
    stats = {key: 1e-3 for key in ("min", "max", "mean", "stddev", "median", "iqr")}
    stats.update(rounds=len(data), iterations=1, data=list(data))
    extra = {} if memory is None else {"peak_allocated_above_start_bytes": memory}
    return {"fullname": fullname, "stats": stats, "extra_info": extra}


def doc(*benches, machine_id=None) -> dict:
    info = {"node": "n"}
    if machine_id:
        info["lmsys"] = {"machine_id": machine_id}
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


def test_read_baseline_rejects_malformed_rounds(tmp_path):
    path = tmp_path / "0001_a.json"
    path.write_text(json.dumps(doc(bench(data=[1e-3, -1.0]))))
    with pytest.raises(baselines.BaselineError, match="malformed per-round data"):
        baselines.read_baseline(path)


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
    assert baselines.peak_memory(bench(memory=1024)) == 1024
    assert baselines.peak_memory(bench()) is None


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
