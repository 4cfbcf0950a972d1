"""The migration of baseline files to the one format the gate reads (lmsys.perf.migrate)."""

import json

import pytest

from lmsys.perf import baselines, migrate


def old_file(path):
    """A baseline as the first version of the gate saved it: no schema, CPU probe times, eager rounds timed behind
    the short sleep beside one graph-timed benchmark, LAUNCH rounds beside another, one benchmark without rounds."""
    stats = {key: 1e-3 for key in ("min", "max", "mean", "stddev", "median", "iqr")}
    stats.update(rounds=2, iterations=1)
    benches = [
        {"fullname": "t::host", "stats": {**stats, "data": [1e-3, 1e-3]},
         "extra_info": {"timing": "host", "cpu_probe_data": [1e-4, 1e-4], "cpu_probe": "adds+autograd"}},
        {"fullname": "t::old_eager", "stats": {**stats, "data": [1e-3, 1e-3]},
         "extra_info": {"timing": "graph", "eager_data": [3e-3, 3e-3], "eager_median": 3e-3}},
        {"fullname": "t::launch", "stats": {**stats, "data": [1e-3, 1e-3]},
         "extra_info": {"timing": "graph", "eager_data": [3e-3, 3e-3], "eager_timing": "launch",
                        "eager_cpu_probe_data": [1e-4, 1e-4], "peak_requested_above_start_bytes": 5}},
        {"fullname": "t::no_rounds", "stats": dict(stats), "extra_info": {}},
    ]
    doc = {"machine_info": {"lmsys": {"machine_id": "GPU"}}, "benchmarks": benches}
    path.write_text(json.dumps(doc, indent=4))
    return path


def test_a_file_of_an_earlier_format_is_refused_with_the_command_that_migrates_it(tmp_path):
    path = old_file(tmp_path / "0001_old.json")
    with pytest.raises(baselines.BaselineError, match=r"earlier format .* python -m lmsys.perf.migrate .* --write"):
        baselines.read_baseline(path)


def test_migration_keeps_what_the_gate_reads_and_drops_what_it_no_longer_does(tmp_path, capsys):
    path = old_file(tmp_path / "0001_old.json")
    before = path.read_text()
    assert migrate.main([str(tmp_path)]) == 0
    assert path.read_text() == before  # without --write nothing is written
    assert "would migrate (schema 1 -> 2; CPU probe times dropped in 2 benchmark(s)" in capsys.readouterr().out
    assert migrate.main([str(tmp_path), "--write"]) == 0
    doc = baselines.read_baseline(path)
    host, old_eager, launch, no_rounds = doc["benchmarks"]
    assert "cpu_probe_data" not in host["extra_info"] and "cpu_probe" not in host["extra_info"]
    assert baselines.samples(host, "host") == [1e-3, 1e-3]
    assert "eager_data" not in old_eager["extra_info"] and "eager_median" not in old_eager["extra_info"]
    assert baselines.samples(launch, "launch") == [3e-3, 3e-3]
    assert launch["extra_info"]["peak_requested_above_start_bytes"] == 5
    assert no_rounds["stats"]["data"] == [1e-3]
    assert not list(tmp_path.glob(".tmp-*"))
    migrated = path.read_text()
    assert migrate.main([str(path), "--write"]) == 0  # a current file is left as it is
    assert path.read_text() == migrated and "current" in capsys.readouterr().out.splitlines()[-1]


def test_the_committed_baselines_are_current():
    root = baselines.Path(__file__).resolve().parents[1] / "baselines"
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in baselines.baseline_files(folder):
            baselines.read_baseline(path)


def test_a_file_that_is_not_a_baseline_is_named_and_the_rest_go_on(tmp_path, capsys):
    (tmp_path / "0001_bad.json").write_text("{")
    old_file(tmp_path / "0002_old.json")
    assert migrate.main([str(tmp_path), "--write"]) == 1
    out, err = capsys.readouterr()
    assert "0001_bad.json is not valid JSON" in err and "0002_old.json: migrated" in out
