"""lmsys.perf.docs: the per-GPU measurements page, generated from the committed baselines."""

import json
from pathlib import Path

import pytest

from lmsys.perf import docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
GPU_PAGES = [page for page in PAGES if (ROOT / "baselines" / page.stem).is_dir()]


@pytest.mark.parametrize("page", GPU_PAGES, ids=[page.stem for page in GPU_PAGES])
def test_committed_page_matches_its_baselines(page):
    folder = ROOT / "baselines" / page.stem
    assert page.read_text() == docs.page(folder, None), (
        f"{page.relative_to(ROOT)} is out of date: run python -m lmsys.perf.docs baselines/{page.stem} --out docs"
    )


def test_the_h100_has_a_page():
    assert ROOT / "docs" / "NVIDIA_H100_80GB_HBM3.md" in GPU_PAGES


def bench(test, params, median, **info):
    param = "-".join(str(v) for v in params.values())
    name = f"{test}[{param}]" if params else test
    stats = {key: median for key in ("min", "max", "mean", "median", "iqr")}
    stats.update(stddev=0.0, rounds=1, iterations=1, data=[median])
    return {"name": name, "fullname": f"perf_tests/x.py::{name}", "params": params or None, "stats": stats,
            "extra_info": info}


def save(folder: Path, name: str, benchmarks: list, commit: str = "abcdef0123") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"machine_info": {"lmsys": {"schema": 2, "software": {"torch": "2.11.0", "triton": "3.6.0"}}},
           "commit_info": {"id": commit}, "benchmarks": benchmarks, "datetime": "2026-11-22T07:41:37+00:00",
           "version": "5.2.3"}
    (folder / name).write_text(json.dumps(doc))


def test_newest_measurement_wins_and_providers_sit_side_by_side(tmp_path):
    folder = tmp_path / "baselines" / "Fake_GPU"
    grid = [bench("test_grid", {"shape": [1, seq, d], "provider": p}, seq * d * 1e-9, tflops=seq / 100,
                  peak_allocated_above_start_bytes=seq * 1024)
            for d in (128, 16) for seq in (2048, 1024) for p in ("ours", "theirs")]
    save(folder, "0001_first.json", [*grid, bench("test_matmul", {}, 2e-3, tflops=1.0)])
    save(folder, "0002_second.json", [bench("test_matmul", {}, 1e-3, tflops=2.0, fraction_of_peak_tflops=0.5,
                                            precision="bf16", peak_allocated_bytes=3 * 2**20,
                                            peak_allocated_above_start_bytes=2**20)])
    text = docs.page(folder, tmp_path / "docs")
    assert text.startswith("# Measurements on Fake GPU\n")
    assert "| `0001_first.json` | 2026-11-22 07:41 | abcdef01 | 2.11.0 | 3.6.0 | 9 | 8 |" in text
    assert "| `0002_second.json` | 2026-11-22 07:41 | abcdef01 | 2.11.0 | 3.6.0 | 1 | 1 |" in text
    assert "| `test_matmul` | 1 ms | 2 | 50.0% of bf16 | 3 MiB (1 MiB) |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1x")]
    assert [row.split(" | ")[0] for row in rows] == ["| 1x1024x16", "| 1x2048x16", "| 1x1024x128", "| 1x2048x128"]
    assert rows[0] == "| 1x1024x16 | 16.38 us, 10.24 TFLOP/s, 1 MiB | 16.38 us, 10.24 TFLOP/s, 1 MiB |"
    assert "![TFLOP/s per provider, test_grid](Fake_GPU/test_grid.png)" in text
    assert (tmp_path / "docs" / "Fake_GPU" / "test_grid.png").read_bytes()[:4] == b"\x89PNG"


def test_command_writes_the_page(tmp_path, capsys):
    folder = tmp_path / "Fake_GPU"
    save(folder, "0001_a.json", [bench("test_matmul", {}, 1e-3)])
    assert docs.main([str(folder), "--out", str(tmp_path / "docs")]) == 0
    assert (tmp_path / "docs" / "Fake_GPU.md").read_text() == docs.page(folder, None)


def test_an_empty_folder_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        docs.main([str(tmp_path)])
    assert "no baseline files (NNNN_name.json) in" in capsys.readouterr().err


def test_providers_that_state_bytes_show_gb_per_second(tmp_path):
    """A provider test with bytes and no FLOPs (the optimizer step) is a table too, with GB/s in its cells."""
    folder = tmp_path / "baselines" / "Fake_GPU"
    save(folder, "0001_optim.json", [
        bench("test_optimizer_step", {"size": size, "provider": provider}, 1e-3 * n, gbps=100.0 / n,
              peak_allocated_above_start_bytes=0)
        for n, size in ((1, "small"), (2, "large")) for provider in ("ours", "theirs")
    ])
    text = docs.page(folder, tmp_path / "docs")
    assert "| large | 2 ms, 50 GB/s, 0 B | 2 ms, 50 GB/s, 0 B |" in text


def test_times_taken_as_graph_replays_or_queued_say_so(tmp_path):
    folder = tmp_path / "baselines" / "Fake_GPU"
    save(folder, "0001_a.json", [
        bench("test_opt", {"size": "small", "provider": "ours"}, 1e-3, gbps=2000.0, timing="graph"),
        bench("test_opt", {"size": "small", "provider": "theirs"}, 2e-3, gbps=1000.0, timing="queued"),
        bench("test_opt", {"size": "large", "provider": "ours"}, 3e-3, gbps=2000.0),
        bench("test_step", {}, 5e-3, timing="queued"),
    ])
    text = docs.page(folder, None)
    assert "| small | 1 ms (graph), 2000 GB/s | 2 ms (queued), 1000 GB/s |" in text
    assert "| large | 3 ms, 2000 GB/s |  |" in text
    assert "| `test_step` | 5 ms (queued) |" in text
