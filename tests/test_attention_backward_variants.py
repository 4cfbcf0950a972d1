"""scripts/attention_backward_variants.py on a machine without a Hopper GPU: it says what it needs and exits with 2
(the timings are the GPU's to take), refuses an output it would overwrite, sums each variant's repeats up and each
profiled kernel's device time."""

import pathlib
import runpy
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "attention_backward_variants.py"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), reason="a Hopper GPU")
def test_needs_a_hopper_gpu(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main([str(tmp_path / "variants.csv"), "--points", "leaderboard", "--not-causal"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err
    assert not (tmp_path / "variants.csv").exists()


def test_refuses_an_existing_output_and_an_unknown_variant(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    existing = tmp_path / "variants.csv"
    existing.write_text("kept\n")
    with pytest.raises(SystemExit):
        main([str(existing)])
    assert "give a new file ending in .csv" in capsys.readouterr().err
    assert existing.read_text() == "kept\n"
    with pytest.raises(SystemExit):
        main([str(tmp_path / "new.csv"), "--variants", "nope"])


def test_refuses_point_filters_that_leave_no_point(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "new.csv"), "--points", "leaderboard", "--head-dims", "128"])
    assert "no point of leaderboard has --seqs None and --head-dims [128]" in capsys.readouterr().err
    assert not (tmp_path / "new.csv").exists()


def test_the_table_gives_each_variant_the_median_of_its_repeats_and_their_range():
    summary = runpy.run_path(str(SCRIPT))["summary"]
    point = {"batch": 16, "seq": 16384, "d": 64, "mode": "bwd"}
    rows = [{"variant": "hopper", "repeat": r, **point, "status": "ok", "median_ms": t, "dq_rel_diff": 0.0}
            for r, t in enumerate((3.5, 3.3, 3.4))]
    rows += [{"variant": "triton", "repeat": r, **point, "status": "ok", "median_ms": t}
             for r, t in enumerate((3.6, 3.5, 3.7))]
    rows += [{"variant": "sdpa_flash", "repeat": 0, **point, "status": "out of memory", "median_ms": None}]
    table = summary(pd.DataFrame(rows)).set_index("variant")
    assert table.loc["hopper", ["median_ms", "min_ms", "max_ms"]].tolist() == [3.4, 3.3, 3.5]
    assert table.loc["triton", "median_ms"] == 3.6 and table.loc["hopper", "dq_rel_diff"] == 0.0
    assert table.loc["sdpa_flash", "status"] == "out of memory" and pd.isna(table.loc["sdpa_flash", "median_ms"])
    assert list(table.index) == ["hopper", "triton", "sdpa_flash"]


def test_refuses_no_repeats(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "new.csv"), "--repeats", "0"])
    assert "--repeats and --steps must be at least 1" in capsys.readouterr().err


def test_kernel_rows_sum_each_kernels_launches_and_device_time_per_call():
    kernel_rows = runpy.run_path(str(SCRIPT))["kernel_rows"]
    DeviceType = torch.autograd.DeviceType

    def event(name, us, device_type=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device_type, device_time_total=us)

    events = [event("void _dkdv_kernel(int, float*)", 300.0), event("_dq_kernel", 100.0),
              event("void _dkdv_kernel(int, float*)", 340.0), event("Memset (Device)", 20.0),
              event("aten::empty", 5000.0, DeviceType.CPU), event("_dq_kernel", 140.0)]
    rows = kernel_rows(events, steps=2)
    assert [row["kernel"] for row in rows] == ["_dkdv_kernel", "_dq_kernel", "Memset (Device)"]
    assert rows[0] == {"kernel": "_dkdv_kernel", "calls_per_step": 1.0, "us_per_step": 320.0, "share": 640 / 900}
    assert rows[1]["us_per_step"] == 120.0 and rows[2]["calls_per_step"] == 0.5
    assert kernel_rows([event("aten::mm", 10.0, DeviceType.CPU)], steps=1) == []


@pytest.mark.parametrize("option", ["--kernels", "--power"])
def test_refuses_a_side_output_it_would_overwrite_or_a_negative_count(tmp_path, capsys, option):
    """--kernels and --power write <csv>-kernels.csv and <csv>-power.csv: an existing one is kept, nothing written."""
    main = runpy.run_path(str(SCRIPT))["main"]
    existing = tmp_path / f"variants-{option[2:]}.csv"
    existing.write_text("kept\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "variants.csv"), option, "5"])
    assert f"variants-{option[2:]}.csv: give a new file ending in .csv" in capsys.readouterr().err
    assert existing.read_text() == "kept\n" and not (tmp_path / "variants.csv").exists()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "variants.csv"), option, "-1"])
    assert "--warmup, --kernels and --power at least 0" in capsys.readouterr().err


def test_the_variants_take_turns_first_and_last():
    """Each repeat times every variant; odd repeats in the reverse order, so that over an even number of repeats no
    variant is always timed first (the machine's drift and the position in a turn fall on all alike)."""
    turns = runpy.run_path(str(SCRIPT))["turns"]
    variants = ["default", "grouped", "sdpa_cudnn"]
    orders = [turns(variants, repeat) for repeat in range(4)]
    assert orders == [variants, variants[::-1], variants, variants[::-1]]
    for name in variants:  # a variant's places in two turns mirror each other: first and last, middle and middle
        assert orders[0].index(name) + orders[1].index(name) == len(variants) - 1
    assert variants == ["default", "grouped", "sdpa_cudnn"]  # not reordered in place


class FakeNvml:
    """A GPU whose energy counter grows by `mj` per call made, read back (clock, temperature, throttle reasons) as
    given, in turn."""

    def __init__(self, mj: float, readings: list[tuple[float, float, list[str]]]):
        self.mj, self.readings, self.calls = mj, readings, 0

    def call(self):
        self.calls += 1

    def energy_mj(self) -> float:
        return 1000.0 + self.mj * self.calls

    def reading(self) -> dict:
        """As lmsys.perf.machine.Reader.read gives it (the fields sustained reads)."""
        clock, temperature, throttle = self.readings[min(len(self.readings) - 1, self.calls // 10 - 1)]
        return {"sm_clock_mhz": clock, "temperature_c": temperature, "throttle": throttle}


def test_sustained_gives_energy_watts_clock_and_throttling_per_call():
    sustained = runpy.run_path(str(SCRIPT))["sustained"]
    nvml = FakeNvml(mj=2.5, readings=[(1980.0, 40.0, []), (1755.0, 52.0, ["sw_power_cap"]),
                                      (1740.0, 51.0, ["sw_power_cap", "sw_thermal_slowdown"])])
    clock = iter(0.001 * i for i in range(1000))  # each read of the clock 1 ms later
    waits = []
    row = sustained(nvml.call, 0.0025, nvml.energy_mj, nvml.reading, lambda: waits.append(nvml.calls),
                    now=lambda: next(clock), batch=10)
    assert nvml.calls == 30 and waits == [0, 10, 20, 30]  # a wait before the window and after each batch
    assert row["calls"] == 30 and row["mj_per_call"] == 2.5 and row["sm_clock_mhz"] == 1755.0
    assert row["max_temperature_c"] == 52.0 and row["held_by"] == "sw_power_cap 67%, sw_thermal_slowdown 33%"
    # the clock read at the start (0 ms), after each batch (1, 2, 3 ms: 3 ms ends the window) and at the end (4 ms)
    assert row["ms_per_call"] == pytest.approx(4.0 / 30)
    assert row["power_w"] == pytest.approx(75.0 / 1e3 / 0.004)


def test_sustained_makes_one_batch_however_short_the_window():
    sustained = runpy.run_path(str(SCRIPT))["sustained"]
    nvml = FakeNvml(mj=1.0, readings=[(1500.0, 60.0, [])])
    row = sustained(nvml.call, 0.0, nvml.energy_mj, nvml.reading, lambda: None, now=iter([0.0, 5.0, 5.0]).__next__,
                    batch=4)
    assert row["calls"] == 4 and row["ms_per_call"] == 1250.0 and row["held_by"] == "-"


def test_the_power_table_averages_both_windows_and_keeps_both_reasons():
    power_summary = runpy.run_path(str(SCRIPT))["power_summary"]
    point = {"batch": 16, "seq": 16384, "d": 64, "mode": "bwd", "calls": 700, "max_temperature_c": 50.0}
    rows = [{"variant": "default", "repeat": 0, **point, "status": "ok", "ms_per_call": 4.0, "mj_per_call": 2500.0,
             "power_w": 625.0, "sm_clock_mhz": 1500.0, "held_by": "sw_power_cap 40%"},
            {"variant": "default", "repeat": 1, **point, "status": "ok", "ms_per_call": 4.2, "mj_per_call": 2300.0,
             "power_w": 550.0, "sm_clock_mhz": 1440.0, "held_by": "-"}]
    rows += [{"variant": "sdpa_flash", "repeat": r, "batch": 16, "seq": 16384, "d": 64, "mode": "bwd",
              "status": "OOM: tried to allocate 2.00 GiB"} for r in (0, 1)]
    table = power_summary(pd.DataFrame(rows)).set_index("variant")
    assert table.loc["default", ["ms_per_call", "mj_per_call", "sm_clock_mhz"]].tolist() == [4.1, 2400.0, 1470.0]
    assert table.loc["default", "held_by"] == "sw_power_cap 40% / -" and table.loc["default", "status"] == "ok"
    assert table.loc["sdpa_flash", "status"].startswith("OOM") and pd.isna(table.loc["sdpa_flash", "mj_per_call"])
    assert table.loc["sdpa_flash", "held_by"] == ""
    assert list(table.index) == ["default", "sdpa_flash"]


def test_the_energy_counter_says_why_it_cannot_read(monkeypatch):
    EnergyCounter = runpy.run_path(str(SCRIPT))["EnergyCounter"]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import pynvml raises ImportError
    nvml, why = EnergyCounter.open()
    assert nvml is None and "nvidia-ml-py" in why
