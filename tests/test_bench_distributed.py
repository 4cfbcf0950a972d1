"""`lmsys-bench allreduce` and `lmsys-bench ddp` on the CPU: two gloo ranks spawned by the command (small tensors, the
tiny model, few rounds), the columns and the files written; ddp's --graph option down to every rank (on the CPU the
capture fails on every rank and the note says so) and into the gate's settings (a fake launch); an out-of-memory
rank as a row (a fake launch); the usage errors; and allreduce under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from lmsys.bench import allreduce as allreduce_bench
from lmsys.bench import ddp as ddp_bench
from lmsys.bench import ranks
from lmsys.bench.__main__ import main
from lmsys.distributed.collectives import bus_bandwidth
from lmsys.distributed.launch import RankError

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = ["--warmup", "1", "--steps", "2"]
OOM_DETAILS = ("Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
               "2.00 GiB. GPU 1 has a total capacity of 139.81 GiB")

GPU = torch.cuda.is_available()
TRANSPORT = "nccl" if GPU else "gloo"
pytestmark = pytest.mark.skipif(GPU and torch.cuda.device_count() < 2,
                                reason="on a GPU machine the ranks take NCCL, one GPU each: needs 2 GPUs")


def test_allreduce_spawns_its_ranks_and_writes_the_table(tmp_path, capsys):
    csv, js = tmp_path / "ar.csv", tmp_path / "out" / "ar.json"
    status = main(["allreduce", "--world-size", "2", "--sizes", "64KiB", "1MiB", *ROUNDS, "-o", str(csv),
                   "-o", str(js)])
    assert status == 0
    table = pd.read_csv(csv)
    assert list(table.columns) == allreduce_bench.COLUMNS
    assert table["size"].tolist() == ["64KiB", "1MiB"] and table["bytes"].tolist() == [2**16, 2**20]
    assert (table["status"] == "ok").all() and (table["world_size"] == 2).all()
    assert (table["transport"] == TRANSPORT).all()
    seconds = table["median_ms"] / 1e3
    assert table["algbw_gbps"].tolist() == pytest.approx((table["bytes"] / seconds / 1e9).tolist())
    assert table["busbw_gbps"].tolist() == pytest.approx(
        [bus_bandwidth(n, s, 2) for n, s in zip(table["bytes"], seconds, strict=True)])
    assert [row["size"] for row in json.loads(js.read_text())] == ["64KiB", "1MiB"]
    printed = capsys.readouterr().out
    assert "busbw GB/s" in printed and "2 x " in printed


def test_ddp_rows_per_wrapper_with_scaling_efficiency_against_single(tmp_path):
    csv, js = tmp_path / "ddp.csv", tmp_path / "ddp.json"
    status = main(["ddp", "--world-size", "2", "--size", "tiny", "--context", "32", "--batch", "2",
                   "--wrappers", "single", "bucketed-1mb", "fsdp", "--optimizer-state", "replicated", "sharded",
                   *ROUNDS, "-o", str(csv), "-o", str(js)])
    assert status == 0
    table = pd.read_csv(csv)
    assert list(table.columns) == ddp_bench.COLUMNS
    # single runs on one rank and never sharded; fsdp shards the optimizer state itself.
    assert list(zip(table["wrapper"], table["optimizer_state"], table["world_size"], strict=True)) == [
        ("single", "replicated", 1), ("bucketed-1mb", "replicated", 2), ("bucketed-1mb", "sharded", 2),
        ("fsdp", "replicated", 2),
    ]
    assert (table["status"] == "ok").all() and (table["context"] == 32).all() and (table["median_ms"] > 0).all()
    single, rest = table.iloc[0], table.iloc[1:]
    assert pd.isna(single["scaling_efficiency"]) and pd.isna(single["comm_wait_share"])
    assert rest["scaling_efficiency"].tolist() == pytest.approx((single["median_ms"] / rest["median_ms"]).tolist())
    # Our wrappers wait for their gradients after backward: a part of the step, timed on each rank.
    assert ((rest["comm_wait_share"] > 0) & (rest["comm_wait_share"] < 1)).all()
    assert table["tokens_per_s"].tolist() == pytest.approx(
        (table["world_size"] * 2 * 32 / (table["median_ms"] / 1e3)).tolist())
    assert (table["tflop_per_s"] > 0).all()
    if GPU:
        assert (table["peak_memory_gib"] > 0).all() and (table["mfu"] > 0).all()
    else:  # no memory reading on the CPU, and no peak to take a fraction of
        assert table["peak_memory_gib"].isna().all() and table["mfu"].isna().all()
    assert len(json.loads(js.read_text())) == 4
    if not GPU:  # eager by default on the CPU: no eager rounds beside, no capture to note
        assert (table["timing"] == "eager").all() and table["eager_ms"].isna().all() and table["note"].isna().all()


def test_ddp_graph_option_captures_the_step_on_every_rank_or_notes_why_not(tmp_path, capsys):
    csv = tmp_path / "ddp.csv"
    status = main(["ddp", "--world-size", "2", "--size", "tiny", "--context", "32", "--batch", "2",
                   "--wrappers", "bucketed-1mb", "--graph", *ROUNDS, "-o", str(csv)])
    assert status == 0
    (row,) = pd.read_csv(csv).to_dict("records")
    printed = capsys.readouterr().out
    assert row["status"] == "ok" and row["median_ms"] > 0
    if GPU:  # replays timed, the eager rounds beside
        assert row["timing"] == "graph" and row["eager_ms"] > 0 and pd.isna(row["note"])
        assert "CUDA graphs, eager rounds beside" in printed
    else:  # each rank tried the capture; the CPU has no CUDA graphs, so the rounds are eager and the note says why
        assert row["timing"] == "eager" and pd.isna(row["eager_ms"])
        assert row["note"] == ("timed eagerly: the CUDA graph capture failed on rank 0 "
                               "(RuntimeError: CUDA graphs need a CUDA device)")
        assert "eager (no CUDA graphs on the CPU)" in printed
        assert f"note: fp32-bucketed-1mb-ws2: {row['note']}" in printed
    assert (row["comm_wait_share"] > 0) and (row["comm_wait_share"] < 1)


@pytest.mark.parametrize("arguments, graph", [([], GPU), (["--graph"], True), (["--no-graph"], False)])
def test_ddp_graph_option_reaches_every_case_as_the_gate_sets_it(arguments, graph, monkeypatch):
    seen = []

    def launch(fn, world_size, settings, backend, timeout):
        seen.append(settings)
        return [{"samples": [1e-3], "readings": [(None, {})] * world_size, "spans": {}}, None]

    monkeypatch.setattr(ranks, "launch_ranks", launch)
    assert main(["ddp", "--dtypes", "fp32", "--wrappers", "single", "fsdp", *arguments, *ROUNDS]) == 0
    assert [(s.setup_kwargs["wrapper"], s.graph) for s in seen] == [("single", graph), ("fsdp", graph)]
    # Graph mode is the gate's: a step that cannot be captured is timed queued on a GPU, as perf_tests time it.
    assert all(s.queued == (graph and GPU) for s in seen)


def fake_launch(fail_first_with: str):
    """A launch whose first case fails on rank 1 with `fail_first_with` and whose later cases take 1, 2, 3 ms."""
    calls = []

    def launch(fn, world_size, settings, backend, timeout):
        calls.append(settings.setup_kwargs)
        if len(calls) == 1:
            raise RankError(1, world_size, fail_first_with)
        return [{"samples": [1e-3, 3e-3, 2e-3], "readings": [(None, {})] * world_size, "spans": {}}, None]

    return launch, calls


def test_a_rank_out_of_memory_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    launch, calls = fake_launch(OOM_DETAILS)
    monkeypatch.setattr(ranks, "launch_ranks", launch)
    assert main(["allreduce", "--sizes", "1GiB", "1MiB", *ROUNDS, "-o", str(tmp_path / "ar.csv")]) == 0
    assert [kwargs["nbytes"] for kwargs in calls] == [2**30, 2**20]
    table = pd.read_csv(tmp_path / "ar.csv").set_index("size")
    assert table.loc["1GiB", "status"] == "OOM: tried to allocate 2.00 GiB on rank 1"
    assert pd.isna(table.loc["1GiB", "median_ms"])
    assert table.loc["1MiB", "median_ms"] == pytest.approx(2.0)
    assert table.loc["1MiB", "busbw_gbps"] == pytest.approx(2**20 / 2e-3 / 1e9)


def test_any_other_rank_failure_ends_the_run(monkeypatch):
    launch, _ = fake_launch("Traceback (most recent call last):\nValueError: no such wrapper")
    monkeypatch.setattr(ranks, "launch_ranks", launch)
    with pytest.raises(RankError, match="no such wrapper"):
        main(["ddp", "--wrappers", "torch-ddp", *ROUNDS])


@pytest.mark.parametrize("size,problem", [
    ("6", "'6': the tensor holds fp32 values, so a positive multiple of 4 bytes"),
    ("1TiB", "'1TiB': give a size such as 1MiB, 512KiB, 1GiB or a number of bytes"),
])
def test_a_bad_size_is_refused_by_the_parser(size, problem, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["allreduce", "--sizes", size])
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("command,arguments,torchrun_ranks,problem", [
    ("allreduce", ["--world-size", "0"], None, "--world-size must be at least 1, got 0"),
    ("allreduce", ["-o", "ar.txt"], None, "--output ar.txt: the file must end in .csv or .json"),
    ("allreduce", ["--world-size", "4"], "2", "--world-size 4: torchrun started 2 processes"),
    ("ddp", ["--wrappers", "single", "fsdp"], "2", "single runs on one rank and torchrun started 2 processes"),
    ("ddp", ["--wrappers", "fsdp", "--optimizer-state", "sharded"], None, "no case to run"),
    ("ddp", ["--batch", "0"], None, "--batch must be at least 1, got 0"),
])
def test_usage_errors_before_any_rank_starts(command, arguments, torchrun_ranks, problem, monkeypatch, capsys):
    if torchrun_ranks is not None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", torchrun_ranks)
    assert main([command, *arguments]) == 2
    assert problem in capsys.readouterr().err
    assert not dist.is_initialized()


def test_allreduce_under_torchrun_rank_0_prints_and_writes(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build of torch")
    csv = tmp_path / "ar.csv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "lmsys.bench",
         "allreduce", "--sizes", "64KiB", *ROUNDS, "-o", str(csv)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("busbw GB/s") == 1 and "under torchrun" in done.stdout
    table = pd.read_csv(csv)
    assert table["size"].tolist() == ["64KiB"] and table["world_size"].tolist() == [2]
    assert table["status"].tolist() == ["ok"] and table["busbw_gbps"].iloc[0] > 0
