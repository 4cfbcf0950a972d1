"""scripts/host_timing_study.py: the spread table from fake processes, its refusals, and a small run on the CPU."""

import json
import pathlib
import runpy

import pandas as pd
import pytest

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "host_timing_study.py"


def _process(setting: str, wall: float, adds: float, second_block_factor: float = 1.0) -> dict:
    def block(factor: float) -> dict:
        return {"sdpa-fwd": {"wall": [wall * factor] * 3, "thread": [wall * factor] * 3, "instructions": [0] * 3,
                             "adds": [adds * factor] * 3, "autograd": [adds * factor] * 3,
                             "python": [1e-5] * 3}}

    return {"setting": setting, "counter": "none", "blocks": [block(1.0), block(second_block_factor)]}


def test_the_table_gives_each_measures_spread_between_processes_and_within_one():
    table = runpy.run_path(str(SCRIPT))["table"]
    # Two processes whose CPU ran at 1x and 2x: the wall clock spreads 2x, its ratio to the probes not at all; the
    # second process's second block ran 1.5x slower than its first.
    rows = {(row["call"], row["measure"]): row for row in table([_process("free", 1e-4, 1e-5),
                                                                 _process("free", 2e-4, 2e-5, 1.5)])}
    assert rows["sdpa-fwd", "wall"]["max/min"] == pytest.approx(2.0)
    assert rows["sdpa-fwd", "wall"]["within max/min"] == pytest.approx(1.5)
    assert rows["sdpa-fwd", "wall/adds"]["max/min"] == pytest.approx(1.0)
    assert rows["sdpa-fwd", "wall/adds"]["within max/min"] == pytest.approx(1.0)
    assert rows["sdpa-fwd", "wall/python"]["max/min"] == pytest.approx(2.0)  # the loop did not slow down with it
    assert pd.isna(rows["sdpa-fwd", "instructions"]["max/min"])  # no counter: no spread, not a spread of 1


def test_refuses_too_few_processes_and_an_existing_output(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "s.csv"), "--processes", "1"])
    existing = tmp_path / "s.csv"
    existing.write_text("kept\n")
    with pytest.raises(SystemExit):
        main([str(existing)])
    assert "give a new file ending in .csv" in capsys.readouterr().err
    assert existing.read_text() == "kept\n"


def test_a_small_run_on_the_cpu(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "s.csv"
    assert main([str(out), "--processes", "2", "--rounds", "1", "--gap", "0"]) == 0
    frame = pd.read_csv(out)
    assert set(frame["measure"]) == {"wall", "thread", "instructions", "wall/adds", "wall/autograd", "wall/python"}
    assert {"sdpa-fwd", "sdpa-fwd_bwd"} <= set(frame["call"])
    assert (frame.loc[frame["measure"] == "wall", "median"] > 0).all()
    processes = json.loads(out.with_suffix(".json").read_text())
    assert [len(p["blocks"]) for p in processes] == [2, 2]
