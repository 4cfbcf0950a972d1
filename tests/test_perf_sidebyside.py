"""lmsys.perf.sidebyside: the side-by-side table and plot of providers from pytest-benchmark JSON."""

import json
from pathlib import Path

import pytest

from lmsys.perf import sidebyside

H100_BASELINE = Path(__file__).parents[1] / "baselines" / "NVIDIA_H100_80GB_HBM3" / "0001_h100.json"


def bench(test, params, median, tflops):
    param = "-".join(str(v) for v in params.values())
    return {
        "name": f"{test}[{param}]",
        "params": params,
        "stats": {"median": median},
        "extra_info": {"tflops": tflops, "peak_allocated_above_start_bytes": 3 * 2**20},
    }


def grid_doc():
    benchmarks = [
        bench("test_grid", {"shape": [1, seq, 64], "causal": True, "provider": provider}, seq * scale * 1e-9, seq / scale)
        for seq in (1024, 2048, 4096)
        for provider, scale in (("ours", 1.0), ("theirs", 2.0))
    ]
    benchmarks.append(bench("test_board", {"provider": "ours"}, 0.004, 390.0))
    benchmarks.append({"name": "test_matmul", "params": None, "stats": {"median": 1e-3}, "extra_info": {}})
    return {"benchmarks": benchmarks}


def test_rows_by_configuration_columns_by_provider():
    data = sidebyside.frame(grid_doc())
    assert len(data) == 7  # the benchmark without a provider is left out
    table = sidebyside.side_by_side(data, "ms")
    assert list(table.columns) == ["ours", "theirs"]
    assert table.loc[("test_grid", "1x2048x64-causal"), "theirs"] == pytest.approx(2048 * 2.0 * 1e-6)
    assert table.loc[("test_grid", "1x4096x64-causal"), "ours"] == pytest.approx(4096 * 1e-6)
    mem = sidebyside.side_by_side(data, "mem")
    assert mem.loc[("test_board", ""), "ours"] == 3


def test_markdown_table():
    table = sidebyside.side_by_side(sidebyside.frame(grid_doc()), "tflops")
    text = sidebyside.markdown(table, "tflops")
    assert text.startswith("TFLOP/s")
    assert "| test | configuration | ours | theirs |" in text
    assert "| test_grid | 1x1024x64-causal | 1024 | 512 |" in text


def test_plot_draws_grids_and_single_configurations(tmp_path):
    path = tmp_path / "providers.png"
    sidebyside.plot(sidebyside.frame(grid_doc()), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_value_is_rejected():
    with pytest.raises(ValueError, match="value must be one of ms, tflops, gbps, mem"):
        sidebyside.side_by_side(sidebyside.frame(grid_doc()), "median")


def test_command_line_on_the_committed_h100_baseline(tmp_path, capsys):
    markdown_path = tmp_path / "table.md"
    assert sidebyside.main([str(H100_BASELINE), "--markdown", str(markdown_path)]) == 0
    out = capsys.readouterr().out
    assert "test_attention_leaderboard" in out and "flash_triton" in out and "sdpa_cudnn" in out
    assert "| test_attention_anchors | 4x16x8192x128-causal-bf16-fwd |" in markdown_path.read_text()


def test_command_line_names_a_file_without_providers(tmp_path, capsys):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(SystemExit) as exit_info:
        sidebyside.main([str(path)])
    assert exit_info.value.code == 2
    assert f"{path} has no benchmark with a 'provider' parameter" in capsys.readouterr().err


def test_exports_never_replace_a_baseline_or_an_existing_file(tmp_path, capsys):
    folder = tmp_path / "baselines" / "GPU"
    folder.mkdir(parents=True)
    results = folder / "0001_h100.json"
    results.write_bytes(H100_BASELINE.read_bytes())
    (folder / "0002_other.json").write_text("{}")
    mine = tmp_path / "table.md"
    mine.write_text("mine")
    refused = [
        (["--markdown", str(results), "--overwrite"], "which holds baselines"),
        (["--markdown", str(folder / "new.md"), "--overwrite"], "which holds baselines"),
        (["--plot", str(folder / "0002_other.json"), "--overwrite"], "which holds baselines"),
        (["--markdown", str(mine)], "exists: choose another name, or ask to overwrite it"),
        (["--markdown", str(tmp_path)], "is a folder"),
    ]
    for args, problem in refused:
        with pytest.raises(SystemExit) as exit_info:
            sidebyside.main([str(results), *args])
        assert exit_info.value.code == 2
        assert problem in capsys.readouterr().err
    assert results.read_bytes() == H100_BASELINE.read_bytes()
    assert mine.read_text() == "mine"
    assert sidebyside.main([str(results), "--markdown", str(mine), "--overwrite"]) == 0
    assert mine.read_text().startswith("median ms")
