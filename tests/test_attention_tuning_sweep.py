"""scripts/attention_tuning_sweep.py without a GPU: it says what it needs and exits with 2, refuses an output it would
overwrite and filters that leave no point, names configs, and sums rows up (ratios to cuDNN, the fastest config that
matched the reference per layout)."""

import pathlib
import runpy

import pandas as pd
import pytest
import torch

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "attention_tuning_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    return runpy.run_path(str(SCRIPT))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU")
def test_needs_a_gpu(sweep, tmp_path, capsys):
    assert sweep["main"]([str(tmp_path / "t.csv")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


def test_refuses_an_existing_output_and_filters_that_leave_no_point(sweep, tmp_path, capsys):
    existing = tmp_path / "t.csv"
    existing.write_text("kept\n")
    with pytest.raises(SystemExit):
        sweep["main"]([str(existing)])
    assert "give a new file ending in .csv" in capsys.readouterr().err
    assert existing.read_text() == "kept\n"
    with pytest.raises(SystemExit):
        sweep["main"]([str(tmp_path / "new.csv"), "--seqs", "777"])
    assert "invalid choice: 777" in capsys.readouterr().err


def test_candidates_are_configs_of_the_kernels(sweep):
    from lmsys.attention import flash_triton

    forward = [c for configs in flash_triton._FWD_CONFIGS.values() for c in configs]
    assert sweep["FWD_CANDIDATES"] and all(c in forward for c in sweep["FWD_CANDIDATES"])
    names = [sweep["config_name"](c) for c in sweep["FWD_CANDIDATES"]]
    assert len(set(names)) == len(names) and "128x64-w4-s2-tma" in names


def test_summary_takes_ratios_and_the_fastest_config_that_matched(sweep):
    point = {"batch": 4, "heads": 32, "seq": 4096, "d": 80, "causal": True}
    rows = [
        {**point, "phase": 1, "variant": "sdpa_cudnn", "mode": "bwd", "config": "", "ms": 2.0},
        {**point, "phase": 1, "variant": "default", "mode": "bwd", "config": "128/32/64-w4-s3", "ms": 3.0, "err": 1e-3,
         "ok": True},
        {**point, "phase": 1, "variant": "split", "mode": "bwd", "config": "128/64/64-w8-s2", "ms": 2.2, "err": 1e-3,
         "ok": True},
        {**point, "phase": 2, "variant": "split", "mode": "bwd", "config": "a", "ms": 1.5, "err": 0.5, "ok": False},
        {**point, "phase": 2, "variant": "split", "mode": "bwd", "config": "b", "ms": 2.1, "err": 1e-3, "ok": True},
        {**point, "phase": 2, "variant": "padded", "mode": "bwd", "config": "c", "ms": 2.9, "err": 1e-3, "ok": True},
    ]
    frame = sweep["with_ratios"](pd.DataFrame(rows).reindex(columns=sweep["COLUMNS"]))
    assert frame["ratio_cudnn"].tolist() == pytest.approx([1.0, 1.5, 1.1, 0.75, 1.05, 1.45])
    [row] = sweep["summary"](frame).to_dict("records")
    assert row["default/cudnn"] == pytest.approx(1.5) and row["split/cudnn"] == pytest.approx(1.1)
    assert (row["best split"], row["best split ms"]) == ("b", 2.1)  # "a" is faster but wrong
    assert (row["best padded"], row["best padded ms"]) == ("c", 2.9)


def test_phase_two_forces_the_configs_of_the_kernels_that_run(sweep):
    settings = sweep["Settings"]()
    split = sweep["phase_two"](80, settings)
    assert [(layout, dims, mode) for layout, dims, mode, _ in split] == [
        ("padded", (), "fwd"), ("padded", (), "bwd"), ("split", (80,), "fwd"), ("split", (80,), "bwd")]
    assert [mode for _, _, mode, _ in sweep["phase_two"](64, settings)] == ["fwd"]
    assert sweep["phase_two"](128, settings) == []
