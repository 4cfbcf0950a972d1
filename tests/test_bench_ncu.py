"""`lmsys-bench ncu`: the parser on a stored `ncu --csv` capture (tests/data/ncu_train_step*.csv: a real capture of
one training step of `small` with 2 layers on an H100, trimmed to 57 of its 319 kernels; the checks hold for any real
capture of a training step), the parser's rules on small inline cases, the commands it runs, and the whole command
on the CPU with a stand-in ncu."""

import os
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from lmsys.bench import ncu
from lmsys.bench.__main__ import main
from lmsys.bench.model import MEASURED_RANGE

DATA = Path(__file__).parent / "data"
CAPTURE, CAPTURE_NVTX = DATA / "ncu_train_step.csv", DATA / "ncu_train_step_nvtx.csv"
FAMILY_NAMES = {name for name, _ in ncu.FAMILIES} | {"other"}
H100 = ncu.datasheet_peaks("NVIDIA H100 80GB HBM3", "bf16")


@pytest.fixture(scope="module")
def captured() -> pd.DataFrame:
    return ncu.kernels(CAPTURE.read_text(), CAPTURE_NVTX.read_text())


def test_capture_parses_to_one_row_per_kernel_in_launch_order(captured):
    assert len(captured) > 0
    assert list(captured["id"]) == sorted(captured["id"]) and captured["id"].is_unique
    assert (captured["time_s"] > 0).all()
    assert set(captured["family"]) <= FAMILY_NAMES
    assert (captured[["dram_read_bytes", "dram_write_bytes", "l2_bytes"]].dropna() >= 0).all().all()
    assert captured["tensor_pct"].dropna().between(0, 100).all()


def test_capture_covers_the_phases_of_a_step_in_order(captured):
    assert {"forward", "backward", "optimizer"} <= set(captured["phase"])
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    ranks = [order[p] for p in captured["phase"] if p in order]
    assert ranks == sorted(ranks), "forward, then backward, then optimizer kernels"
    assert (captured["family"] == "gemm").any()
    assert (captured.loc[captured["phase"] == "optimizer", "family"] == "optimizer").all()


def test_summaries_add_up_to_the_total(captured):
    for by in ("family", "phase"):
        summary = ncu.summarize(captured, by, H100)
        groups, total = summary.iloc[:-1], summary.iloc[-1]
        assert total[by] == "total" and total["kernels"] == len(captured)
        assert groups["time_ms"].sum() == pytest.approx(total["time_ms"])
        assert groups["share"].sum() == pytest.approx(1.0)
        assert list(groups["time_ms"]) == sorted(groups["time_ms"], reverse=True)
        assert total["time_ms"] == pytest.approx(captured["time_s"].sum() * 1e3)


def test_efficiency_is_stated_against_the_named_peaks(captured):
    lines = ncu.efficiency(captured, 10**12, H100)
    seconds = captured["time_s"].sum()
    assert lines[1].startswith("peaks: datasheet (lmsys.flops) for NVIDIA H100 80GB HBM3")
    assert f"{10**12 / seconds / 1e12:.4g} TFLOP/s" in lines[2] and "of 989.4 TFLOP/s" in lines[2]
    assert any(line.startswith("DRAM ") and "of 3350 GB/s" in line for line in lines)


HEADER = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'


def details(*rows) -> str:
    lines = ["==PROF== Connected to process 1 (python3)", HEADER]
    lines += [f'"{i}","1","{k}","Command line profiler metrics","{m}","{u}","{v}"' for i, k, m, u, v in rows]
    return "\n".join(lines) + "\nprogram output is not a CSV row\n"


def test_details_page_values_are_converted_to_base_units():
    text = details(
        (0, "k0", "gpu__time_duration.sum", "usecond", "1,500.5"),
        (0, "k0", "dram__bytes_read.sum", "Mbyte", "2.5"),
        (1, "k1", "gpu__time_duration.sum", "nsecond", "800"),
        (1, "k1", "dram__bytes_read.sum", "byte", "n/a"),
    )
    frame = ncu.metrics_frame(text)
    assert list(frame["kernel"]) == ["k0", "k1"]
    assert frame["gpu__time_duration.sum"].tolist() == pytest.approx([1500.5e-6, 800e-9])
    assert frame["dram__bytes_read.sum"][0] == pytest.approx(2.5e6) and pd.isna(frame["dram__bytes_read.sum"][1])


def test_raw_page_with_a_units_row_is_read_too():
    text = textwrap.dedent("""\
        "ID","Kernel Name","launch__grid_size","gpu__time_duration.sum","lts__t_bytes.sum"
        "","","","msecond","Kbyte"
        "0","gemm_a","128","1.25","4"
        "1","elementwise_b","64","0.5","2"
    """)
    frame = ncu.kernels(text)
    assert frame["time_s"].tolist() == pytest.approx([1.25e-3, 0.5e-3])
    assert frame["l2_bytes"].tolist() == pytest.approx([4e3, 2e3])
    assert frame["dram_read_bytes"].isna().all()  # not captured: shown blank, not zero
    assert frame["family"].tolist() == ["gemm", "elementwise"]


def test_a_capture_without_kernel_times_or_rows_is_a_clear_error():
    with pytest.raises(ValueError, match="no CSV rows"):
        ncu.metrics_frame("==ERROR== the profiler could not connect\n")
    with pytest.raises(ValueError, match="gpu__time_duration.sum"):
        ncu.kernels(details((0, "k0", "dram__bytes_read.sum", "byte", "1")))
    with pytest.raises(ValueError, match="unknown ncu unit"):
        ncu.to_base("1", "furlong")


@pytest.mark.parametrize("kernel,expected", [
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(T1::Params)", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>(Flash_fwd_params)", "attention"),
    ("_flash_bwd_kernel", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>(T1, T2, T3...)", "optimizer"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<...>>>(T3)", "reduction"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "reduction"),
    ("triton_poi_fused_mul_silu_1", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>",
     "memory"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096>)", "nccl"),
    ("some_custom_kernel", "other"),
])
def test_kernel_families(kernel, expected):
    assert ncu.family(kernel) == expected


def test_phases_follow_the_ranges_and_the_launch_order():
    ranges = ["", "forward", "layer_0", "attention/kernel", "", "", "backward", "optimizer_step", "", "layer_0"]
    assert ncu.phases(ranges) == [
        "other", "forward", "forward", "forward", "backward", "backward", "backward", "optimizer", "other", "forward",
    ]


def test_short_names_drop_void_and_the_parameter_list():
    assert ncu.short_name("void a::k<4, f(int)>(int, T2)") == "a::k<4, f(int)>"
    assert ncu.short_name("nvjet_tst") == "nvjet_tst"
    assert ncu.short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    assert len(ncu.short_name("x" * 200, width=20)) == 20


def test_ncu_command_profiles_only_the_measured_step_at_the_gpus_clocks():
    args = argparse_namespace(size="small", context=512, num_layers=4)
    child = ncu.child_command(args)
    command = ncu.ncu_command("ncu", Path("out/step"), "m1,m2", child)
    assert command[:3] == ["ncu", "--clock-control", "none"]
    assert command[command.index("--nvtx-include") + 1] == MEASURED_RANGE and "--nvtx" in command
    assert command[command.index("--metrics") + 1] == "m1,m2"
    assert command[command.index("--export") + 1] == "out/step"
    assert command[-len(child):] == child
    assert child[1:4] == ["-m", "lmsys.bench", "model"]
    for flag, value in (("--steps", "1"), ("--modes", "train"), ("--sizes", "small"), ("--num-layers", "4"),
                        ("--context", "512")):
        assert child[child.index(flag) + 1] == value
    assert "--nvtx" in child
    imported = ncu.import_command("ncu", Path("out/step.ncu-rep"), nvtx_rename=True)
    assert imported[imported.index("--page") + 1] == "details" and imported[-2:] == ["--print-nvtx-rename", "kernel"]


def argparse_namespace(**given):
    import argparse

    from lmsys.bench.__main__ import parser

    args = parser().parse_args(["ncu", "--out", "unused"])
    return argparse.Namespace(**{**vars(args), **given})


FAKE_NCU = """\
#!{python}
# A stand-in for ncu: runs the profiled program, writes the report, prints the stored capture on --import.
import subprocess, sys
args = sys.argv[1:]
if "--import" in args:
    name = "ncu_train_step_nvtx.csv" if "--print-nvtx-rename" in args else "ncu_train_step.csv"
    sys.stdout.write(open({data!r} + "/" + name).read())
    sys.exit(0)
child = args[args.index({python!r}):]
print("==PROF== Connected to process", flush=True)
done = subprocess.run(child)
open(args[args.index("--export") + 1] + ".ncu-rep", "w").write("report")
sys.exit(done.returncode)
"""


def test_the_command_runs_ncu_on_one_step_and_writes_its_tables(tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, data=str(DATA)))
    fake.chmod(0o755)
    out = tmp_path / "out"
    status = main(["ncu", "--out", str(out), "--ncu", str(fake), "--size", "tiny", "--num-layers", "1",
                   "--warmup", "0", "--batch", "1", "--dtype", "fp32", "--device-name", "NVIDIA H100 80GB HBM3"])
    printed = capsys.readouterr().out
    assert status == 0
    for name in ("step.ncu-rep", "ncu.log", "kernels.csv", "kernels_nvtx.csv", "kernels_parsed.csv", "families.csv",
                 "phases.csv", "summary.txt"):
        assert (out / name).stat().st_size > 0, name
    log = (out / "ncu.log").read_text()
    assert "tiny-t64-b1-train-fp32-eager" in log and " ok " in log  # the child ran its one step
    assert "== by kernel family ==" in printed and "== by phase ==" in printed and "model FLOPs" in printed
    parsed = pd.read_csv(out / "kernels_parsed.csv")
    assert len(parsed) == len(ncu.kernels(CAPTURE.read_text()))


@pytest.mark.gpu
def test_measured_peaks_are_plausible(gpu):
    peaks = ncu.measured_peaks("bf16")
    assert 10 < peaks.dram_gbps < 20_000 and 1 < peaks.tflops < 5_000
    assert peaks.source.startswith("measured here on ")


def test_without_ncu_the_command_says_what_to_do(tmp_path, capsys):
    status = main(["ncu", "--out", str(tmp_path), "--ncu", str(tmp_path / "missing-ncu")])
    assert status == 2
    assert "not found: install Nsight Compute or give --ncu PATH" in capsys.readouterr().err


def test_a_stopped_ncu_reports_its_log(tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM: no access to the performance counters'\nexit 1\n")
    fake.chmod(0o755)
    status = main(["ncu", "--out", str(tmp_path / "out"), "--ncu", str(fake)])
    assert status == 2
    error = capsys.readouterr().err
    assert "ncu exited with status 1 (report missing)" in error and "ERR_NVGPUCTRPERM" in error


def test_hanging_ncu_is_stopped_at_the_timeout(tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\nsleep 60\n")
    fake.chmod(0o755)
    status = main(["ncu", "--out", str(tmp_path / "out"), "--ncu", str(fake), "--timeout", "0.5"])
    assert status == 2
    assert "ran longer than --timeout 0.5 s and was stopped" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "step.ncu-rep")
