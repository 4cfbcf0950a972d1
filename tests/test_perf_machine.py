"""lmsys.perf.machine: NVML readings through a stand-in pynvml module, their absence, and the notes they give."""

import sys
import types

import pytest

from lmsys.perf import machine


class NVMLError(Exception):
    pass


def stub_pynvml(throttle_bits: int = 0, refuse_power: bool = False, processes=(), known=(b"GPU-abc",)):
    """A pynvml with the calls machine.py makes, on one device with the UUID GPU-abc."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM, nvml.NVML_TEMPERATURE_GPU = 1, 2, 0
    nvml.nvmlInit = lambda: None

    def by_uuid(uuid):
        if uuid not in known:
            raise NVMLError("not found")
        return "handle"

    def by_pci(bus):
        raise NVMLError("not found")

    def power(handle):
        if refuse_power:
            raise NVMLError("not supported")
        return 312_500

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetHandleByPciBusId = by_pci
    nvml.nvmlDeviceGetClockInfo = lambda handle, kind: {1: 1755, 2: 2619}[kind]
    nvml.nvmlDeviceGetMaxClockInfo = lambda handle, kind: 1980
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 61
    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: throttle_bits
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [types.SimpleNamespace(pid=p) for p in processes]
    return nvml


def test_a_reading_has_clocks_temperature_power_throttling_and_other_processes(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", stub_pynvml(throttle_bits=0x1 | 0x4 | 0x40, processes=(7, 4242)))
    reader, why = machine.open_device("GPU-abc", "00000000:01:00.0")
    assert why is None
    assert reader.read() == {
        "sm_clock_mhz": 1755, "memory_clock_mhz": 2619, "max_sm_clock_mhz": 1980, "temperature_c": 61,
        "power_w": 312.5, "throttle": ["sw_power_cap", "hw_thermal_slowdown"], "processes": [7, 4242],
        "other_processes": 1,
    }


def test_a_field_nvml_refuses_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", stub_pynvml(refuse_power=True))
    reader, _ = machine.open_device("GPU-abc", None)
    assert reader.read()["power_w"] is None


def test_without_pynvml_or_the_device_there_is_no_reader_and_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert machine.open_device("GPU-abc", None) == (None, "pynvml (the nvidia-ml-py package) is not installed")
    monkeypatch.setitem(sys.modules, "pynvml", stub_pynvml())
    reader, why = machine.open_device("GPU-other", "0000:02:00.0")
    assert reader is None and "NVML does not know the device (uuid GPU-other" in why


@pytest.mark.parametrize(
    ("before", "after", "baseline", "notes"),
    [
        ({}, {"sm_clock_mhz": 1980}, {"sm_clock_mhz": 1980}, []),
        ({"throttle": ["sw_power_cap"]}, {"throttle": []}, None, ["throttled (sw_power_cap)"]),
        (None, {"other_processes": 2}, None, ["2 other process(es) on the GPU"]),
        ({}, {"sm_clock_mhz": 1500}, {"sm_clock_mhz": 1980}, ["SM clock 1500 MHz, the baseline's 1980 MHz"]),
        ({}, {"sm_clock_mhz": 1900}, {"sm_clock_mhz": 1980}, []),
    ],
)
def test_problems_beside_the_verdict(before, after, baseline, notes):
    assert machine.problems(before, after, baseline) == notes


def _readings(*temperatures_and_throttle):
    """A read() that returns these readings in turn (then the last one again), and the sleeps it was asked for."""
    readings = [{"temperature_c": t, "throttle": list(reasons)} for t, reasons in temperatures_and_throttle]
    sleeps = []

    def read():
        return readings.pop(0) if len(readings) > 1 else readings[0]

    return read, sleeps.append, sleeps


HOT = ("sw_thermal_slowdown",)


def test_a_gpu_that_is_not_thermally_throttled_is_not_waited_for():
    read, sleep, sleeps = _readings((70, ("sw_power_cap",)))
    assert machine.cool_down(read, 45, sleep) is None
    assert sleeps == []
    assert machine.cool_down(lambda: None, 45, sleep) is None  # no NVML


def test_a_thermally_throttled_gpu_is_left_idle_until_it_is_cool_and_near_the_baselines_temperature():
    # The throttle reason clears at 62 C, but the baseline started at 45 C: it waits for 50 C.
    read, sleep, sleeps = _readings((76, HOT), (70, HOT), (62, ()), (55, ()), (50, ()), (40, ()))
    note = machine.cool_down(read, 45, sleep, max_wait=60, poll=2)
    assert sleeps == [2, 2, 2, 2]
    assert note == "thermally throttled (sw_thermal_slowdown at 76 C): re-measured after 8 s idle, at 50 C"
    # Without the baseline's temperature, until the reason clears.
    read, sleep, sleeps = _readings((76, HOT), (70, HOT), (62, ()))
    assert machine.cool_down(read, None, sleep, poll=1).endswith("re-measured after 2 s idle, at 62 C")


def test_a_gpu_still_hot_after_the_longest_wait_is_said_so():
    read, sleep, sleeps = _readings((80, HOT), (79, ("hw_thermal_slowdown", "sw_power_cap")))
    note = machine.cool_down(read, 45, sleep, max_wait=3, poll=1)
    assert sleeps == [1, 1, 1]
    assert note == ("thermally throttled (sw_thermal_slowdown at 80 C): re-measured after 3 s, still at 79 C "
                    "(the baseline started at 45 C)")
