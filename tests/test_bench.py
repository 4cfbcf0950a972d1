"""`lmsys-bench model` and `lmsys-bench attention` on the CPU (tiny preset, short sequences): the table's columns, the
files written, the plots, an out-of-memory case recorded as a row, the profiling options; and the memory-snapshot
analysis on a hand-made snapshot in the format torch.cuda.memory._snapshot() documents."""

import json
import re
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import torch

from lmsys import profiling
from lmsys.bench import attention as attention_bench
from lmsys.bench import memory, sweep
from lmsys.bench import model as model_bench
from lmsys.bench.__main__ import main
from perf_fakes import FakeGpu

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--sizes", "tiny", "--batch", "2", "--warmup", "1", "--steps", "2", "--dtypes", "fp32"]
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_model_table_has_every_column_and_is_written_as_csv_and_json(tmp_path, capsys):
    csv, js = tmp_path / "model.csv", tmp_path / "out" / "model.json"
    status = main(["model", *QUICK, "--compile", "eager", "--context", "32", "-o", str(csv), "-o", str(js)])
    assert status == 0
    table = pd.read_csv(csv)
    assert list(table.columns) == model_bench.COLUMNS
    assert list(table["mode"]) == list(model_bench.MODES)
    assert (table["status"] == "ok").all()
    assert (table["context"] == 32).all() and (table["params"] > 0).all()
    assert (table["mean_ms"] > 0).all() and (table["std_ms"] >= 0).all()
    assert table["tokens_per_s"].tolist() == pytest.approx((2 * 32 / (table["mean_ms"] / 1e3)).tolist())
    # Without a GPU there is no peak to take a fraction of and no memory reading.
    assert table["mfu"].isna().all() and table["peak_memory_gib"].isna().all()
    assert [row["mode"] for row in json.loads(js.read_text())] == list(model_bench.MODES)
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "tiny" in printed


def test_model_forward_flops_are_a_third_of_the_step(tmp_path):
    main(["model", *QUICK, "--compile", "eager", "--modes", "fwd", "train", "-o", str(tmp_path / "m.csv")])
    table = pd.read_csv(tmp_path / "m.csv").set_index("mode")
    work = table["tflop_per_s"] * table["mean_ms"]
    assert work["fwd"] == pytest.approx(work["train"] / 3)


def test_out_of_memory_is_a_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(OOM_MESSAGE)

    monkeypatch.setattr(model_bench, "make_train_step", no_memory)
    status = main(["model", *QUICK, "--compile", "eager", "--modes", "train", "fwd", "-o", str(tmp_path / "m.csv")])
    assert status == 0
    table = pd.read_csv(tmp_path / "m.csv").set_index("mode")
    assert table.loc["train", "status"] == "OOM: tried to allocate 2.00 GiB"
    assert pd.isna(table.loc["train", "mean_ms"]) and table.loc["train", "params"] > 0
    assert table.loc["fwd", "status"] == "ok"


def test_a_sweep_stopped_halfway_keeps_its_rows(tmp_path, monkeypatch):
    real, calls = model_bench.run_case, []

    def run_case(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(model_bench, "run_case", run_case)
    with pytest.raises(KeyboardInterrupt):
        main(["model", *QUICK, "--compile", "eager", "--modes", "fwd", "train", "-o", str(tmp_path / "m.csv")])
    assert pd.read_csv(tmp_path / "m.csv")["mode"].tolist() == ["fwd"]


@pytest.mark.gpu
def test_graphs_cases_replay_cuda_graphs_on_the_gpu(gpu, tmp_path):
    main(["model", "--sizes", "small", "--num-layers", "2", "--context", "128", "--batch", "2", "--dtypes", "bf16",
          "--compile", "graphs", "--modes", "fwd_bwd", "train", "--warmup", "3", "--steps", "2",
          "-o", str(tmp_path / "m.csv")])
    table = pd.read_csv(tmp_path / "m.csv")
    assert table["compile"].tolist() == ["graphs", "graphs"] and (table["status"] == "ok").all()


def test_compiled_cases_are_labelled_and_the_compiler_is_reset(tmp_path, monkeypatch):
    # torch.compile on the CPU takes tens of seconds: here it is the identity, the plumbing is what is tested.
    resets = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    main(["model", *QUICK, "--compile", "eager", "compiled", "--modes", "fwd", "-o", str(tmp_path / "m.csv")])
    assert pd.read_csv(tmp_path / "m.csv")["compile"].tolist() == ["eager", "compiled"]
    assert len(resets) == 1


def test_profile_writes_a_trace_and_operator_tables(tmp_path, capsys):
    main(["model", *QUICK, "--compile", "eager", "--modes", "train", "--profile", str(tmp_path), "--top", "5"])
    name = "tiny-t64-b2-train-fp32-eager"
    trace = json.loads((tmp_path / f"{name}.trace.json").read_text())
    assert {"forward", "backward", "optimizer_step"} <= {e.get("name") for e in trace["traceEvents"]}
    ops = (tmp_path / f"{name}.ops.txt").read_text()
    assert "top operators ==" in ops and "top operators by input shape ==" in ops and "Input Shapes" in ops
    # Operators only: the ranges (forward, layer_N, ...) would top the table with the time of all they hold.
    table = ops.split("top operators ==")[1].split("==")[0]
    # Which operators make the top 5 of a tiny CPU step varies from run to run (aten::mm was missing from one): any.
    assert re.search(r"^\s*aten::\w+", table, re.M)
    assert not re.search(r"^\s*(forward|backward|layer_0|optimizer_step)\s", table, re.M)
    assert "top operators" in capsys.readouterr().out


def test_nvtx_turns_the_ranges_on_for_the_timed_steps_only(monkeypatch):
    seen = []
    timed = sweep.time_steps
    monkeypatch.setattr(sweep, "time_steps", lambda *a: (seen.append(profiling.is_enabled()), timed(*a))[1])
    main(["model", *QUICK, "--compile", "eager", "--modes", "fwd", "--nvtx"])
    assert seen == [True] and not profiling.is_enabled()


@pytest.mark.parametrize("arguments,problem", [
    (["--memory-snapshot", "snap"], "--memory-snapshot records the CUDA caching allocator's history: it needs a CUDA"),
    (["-o", "table.txt"], "--output table.txt: the file must end in .csv or .json"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--compile", "graphs"], "--compile graphs replays the compiled model as CUDA graphs: it needs a CUDA device"),
])
def test_model_usage_errors(arguments, problem, capsys):
    if ("--memory-snapshot" in arguments or "graphs" in arguments) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: what is refused without one is possible")
    assert main(["model", *QUICK, *arguments]) == 2
    assert problem in capsys.readouterr().err


def test_time_steps_reads_the_device_with_launch_delays_alone_or_the_cpu_as_the_clock_says():
    """A call of 1 ms on the device whose launch takes the CPU 3 ms, 0.5 ms of it hidden by the eager clock's sleep."""
    device = FakeGpu("Fake GPU")
    device.sleep_hides = 0.5e-3
    call = device.work(1.0, launch_ms=3.0)
    read = {clock: sweep.time_steps(device, call, 1, 3, clock) for clock in sweep.CLOCKS}
    assert read["eager"] == pytest.approx([3.5e-3] * 3)  # the device waits for the launch the sleep does not hide
    assert read["queued"] == pytest.approx([1e-3] * 3)  # behind a lead longer than the launch: the device alone
    assert read["host"] == pytest.approx([3e-3] * 3)  # the CPU's time to issue it
    with pytest.raises(ValueError, match="clock must be one of eager, queued, host, got 'wall'"):
        sweep.time_steps(device, call, 0, 1, "wall")


def test_attention_on_another_clock_says_so(tmp_path, capsys):
    status = main(["attention", "--providers", "naive", "--seq", "16", "--dims", "16", "--batch", "1", "--warmup", "0",
                   "--steps", "2", "--clock", "host", "-o", str(tmp_path / "a.csv")])
    assert status == 0 and "2 timed calls (host clock)" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "a.csv")
    assert (table["median_ms"] > 0).all() and table["tflop_per_s"].isna().all()  # no TFLOP/s of the CPU's time
    with pytest.raises(SystemExit):
        main(["attention", "--clock", "wall"])
    assert "invalid choice: 'wall'" in capsys.readouterr().err


def test_attention_table_plots_and_unsupported_providers(tmp_path):
    status = main(["attention", "--providers", "naive", "sdpa", "flash_triton", "sdpa_cudnn", "--seq", "32", "64",
                   "--dims", "16", "--batch", "2", "--warmup", "1", "--steps", "2", "--modes", "fwd", "bwd",
                   "-o", str(tmp_path / "a.csv"), "--plots", str(tmp_path / "plots")])
    assert status == 0
    table = pd.read_csv(tmp_path / "a.csv")
    assert list(table.columns) == attention_bench.COLUMNS
    assert len(table) == 4 * 2 * 2
    ran = table[table["provider"].isin(["naive", "sdpa"])]
    assert (ran["status"] == "ok").all() and (ran["median_ms"] > 0).all() and (ran["tflop_per_s"] > 0).all()
    if torch.cuda.is_available():
        assert (ran["peak_memory_mib"] > 0).all()
    if not torch.cuda.is_available():
        skipped = table[table["provider"].isin(["flash_triton", "sdpa_cudnn"])]
        assert skipped["status"].str.startswith("needs CUDA").all() and skipped["median_ms"].isna().all()
    for name in ("attention_time.png", "attention_memory.png"):
        assert png(tmp_path / "plots" / name)


def test_attention_training_grid_preset(tmp_path, capsys):
    grid = attention_bench.training_grid()
    assert {shape[3] for shape, _ in grid} == {64, 80, 96, 128}
    assert {shape[2] for shape, _ in grid} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(batch * seq == 16384 and 1536 <= heads * d <= 2560 for (batch, heads, seq, d), _ in grid)
    assert len(grid) == len(set(grid)) == 4 * 6 * 2  # every (shape, causal) once, causal and not
    # On the CPU both providers are rows saying they need CUDA; on a GPU this would time the whole grid.
    if torch.cuda.is_available():
        pytest.skip("times the whole training grid on a GPU")
    status = main(["attention", "--grid", "training", "--providers", "flash_triton", "sdpa_cudnn", "--modes", "fwd",
                   "fwd_bwd", "-o", str(tmp_path / "a.csv")])
    assert status == 0 and "causal and full" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "a.csv")
    assert len(table) == len(grid) * 2 * 2
    got = {((r.batch, r.heads, r.seq, r.d), r.causal) for r in table.itertuples()}
    assert got == set(grid)
    assert table["status"].str.startswith("needs CUDA").all()
    with pytest.raises(SystemExit):
        main(["attention", "--grid", "inference"])
    assert "invalid choice: 'inference'" in capsys.readouterr().err


def test_attention_out_of_memory_is_a_row(tmp_path, monkeypatch):
    real = attention_bench.attention_function

    def attention_function(provider):
        if provider != "naive":
            return real(provider)

        def attend(*args):
            raise torch.cuda.OutOfMemoryError(OOM_MESSAGE)

        return attend

    monkeypatch.setattr(attention_bench, "attention_function", attention_function)
    main(["attention", "--providers", "naive", "sdpa", "--seq", "32", "--dims", "16", "--batch", "1", "--warmup", "0",
          "--steps", "1", "-o", str(tmp_path / "a.csv")])
    table = pd.read_csv(tmp_path / "a.csv").set_index("provider")
    assert table.loc["naive", "status"] == "OOM: tried to allocate 2.00 GiB"
    assert table.loc["sdpa", "status"] == "ok"


def test_sdpa_backend_that_refuses_the_inputs_is_a_row_saying_why(tmp_path):
    # SDPA's flash backend takes no fp32 on CUDA; the CPU has no memory-efficient backend at all.
    provider = "sdpa_flash" if torch.cuda.is_available() else "sdpa_efficient"
    main(["attention", "--providers", provider, "--seq", "16", "--dims", "16", "--batch", "1", "--dtype", "fp32",
          "--warmup", "0", "--steps", "1", "-o", str(tmp_path / "a.csv")])
    [status] = pd.read_csv(tmp_path / "a.csv")["status"]
    assert status.startswith("unsupported: ") and len(status) > len("unsupported: ") + 10


def snapshot() -> dict:
    """A snapshot as torch.cuda.memory._snapshot() documents it: 1 GiB allocated before recording, then a 512 MiB
    and a 256 MiB allocation, the 512 MiB one freed."""
    frames = [
        {"filename": "/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": "/repo/lmsys/model.py", "line": 97, "name": "forward"},
        {"filename": "/repo/lmsys/train.py", "line": 70, "name": "step"},
    ]
    frames[0]["filename"] = memory._TORCH_DIR + "/nn/modules/linear.py"
    mib = 2**20
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2048 * mib, "stream": 0, "frames": [], "time_us": 1000},
        {"action": "alloc", "addr": 1, "size": 512 * mib, "stream": 0, "frames": frames, "time_us": 2000},
        {"action": "alloc", "addr": 2, "size": 256 * mib, "stream": 0, "frames": frames[1:], "time_us": 3000},
        {"action": "free_requested", "addr": 1, "size": 512 * mib, "stream": 0, "frames": [], "time_us": 4000},
        {"action": "free_completed", "addr": 1, "size": 512 * mib, "stream": 0, "frames": [], "time_us": 4000},
    ]
    blocks = [{"size": 1024 * mib, "state": "active_allocated"}, {"size": 256 * mib, "state": "active_allocated"},
              {"size": 768 * mib, "state": "inactive"}]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


def test_snapshot_timeline_is_anchored_at_what_was_allocated_before_recording():
    data = memory.timeline(snapshot())
    gib = 2**30
    assert list(data["allocated_bytes"]) == [1.5 * gib, 1.75 * gib, 1.25 * gib]
    assert list(data["time_ms"]) == [0.0, 1.0, 2.0]


def test_largest_allocations_come_with_the_stack_outside_torch():
    largest = memory.largest_allocations(snapshot(), count=1)
    assert [a["size"] for a in largest] == [512 * 2**20]
    assert [f["filename"] for f in largest[0]["frames"]] == ["/repo/lmsys/model.py", "/repo/lmsys/train.py"]
    text = memory.format_allocations(largest)
    assert "512.0 MiB" in text and "/repo/lmsys/model.py:97 forward" in text


def test_snapshot_timeline_plot(tmp_path):
    memory.plot_timeline(memory.timeline(snapshot()), tmp_path / "memory.png", "test")
    assert png(tmp_path / "memory.png")


@pytest.mark.gpu
def test_memory_snapshot_of_a_step_on_the_gpu(gpu, tmp_path, capsys):
    assert main(["model", *QUICK, "--compile", "eager", "--modes", "train", "--memory-snapshot", str(tmp_path)]) == 0
    name = "tiny-t64-b2-train-fp32-eager"
    assert (tmp_path / f"{name}.pickle").stat().st_size > 0 and png(tmp_path / f"{name}.png")
    assert "MiB" in (tmp_path / f"{name}.allocations.txt").read_text()
    assert "largest allocations of one step" in capsys.readouterr().out


def test_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["lmsys-bench"] == "lmsys.bench.__main__:main"
