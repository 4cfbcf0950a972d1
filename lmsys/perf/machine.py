"""The state of the GPU around a benchmark: SM and memory clocks, temperature, power, throttle reasons and other
processes, read through NVML (the `pynvml` module of the nvidia-ml-py package) when it is installed.

NVML is optional: without it `open_device` returns no reader and the reason, which the gate prints once. Readings
are plain dicts (a benchmark stores the ones taken before and after it in extra_info['machine']); `problems` turns
them and the baseline's into the notes printed beside the verdict: throttling, other processes on the GPU, an SM
clock far from the baseline's. No torch here: the CUDA backend passes the device's UUID and PCI bus id.
"""

from collections.abc import Callable
from typing import Any

# Clock-event bits of NVML that mean the GPU is held below the clock it could run at while busy. Idle, application
# clock settings, sync boost and display clocks are left out: they do not slow a busy GPU down.
THROTTLE_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
# An SM clock this far from the baseline's (relative) is reported beside the verdict.
CLOCK_DEVIATION = 0.10
# The throttle reasons of a GPU too hot to run at its clocks (cool_down).
THERMAL = ("sw_thermal_slowdown", "hw_thermal_slowdown")
# cool_down: how long it waits at most, how often it reads the GPU, and how far above the baseline's temperature
# before its rounds it lets the GPU stay: a GPU in sw_thermal_slowdown runs kernels several percent slower
# (docs/gate-measurements.md has the H100 readings).
COOL_WAIT_SECONDS = 60.0
COOL_POLL_SECONDS = 1.0
COOL_MARGIN_C = 5


class Reader:
    """Reads one GPU through pynvml; every field that NVML refuses is None rather than an error."""

    def __init__(self, pynvml, handle):
        self._nvml = pynvml
        self._handle = handle

    def _get(self, function: Callable[..., Any], *args):
        try:
            return function(self._handle, *args)
        except self._nvml.NVMLError:
            return None

    def read(self) -> dict[str, Any]:
        """One reading: clocks in MHz, temperature in C, power in W, throttle reasons by name, the pids of the compute
        processes on the GPU and how many of them are not this one."""
        nvml = self._nvml
        power = self._get(nvml.nvmlDeviceGetPowerUsage)
        events = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = self._get(events or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        processes = self._get(nvml.nvmlDeviceGetComputeRunningProcesses)
        pids = None if processes is None else sorted(p.pid for p in processes)
        return {
            "sm_clock_mhz": self._get(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM),
            "memory_clock_mhz": self._get(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": self._get(nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_SM),
            "temperature_c": self._get(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
            "power_w": None if power is None else power / 1000,
            "throttle": None if reasons is None else [name for bit, name in THROTTLE_REASONS.items() if reasons & bit],
            "processes": pids,
            "other_processes": None if pids is None else _others(pids),
        }


def _others(pids: list[int]) -> int:
    # This process has a CUDA context while it benchmarks, so it is one of them; in a container NVML may report
    # host pids, which never match our own, so it is counted out rather than looked for.
    return max(len(pids) - 1, 0)


def open_device(uuid: str | None, pci_bus_id: str | None) -> tuple[Reader | None, str | None]:
    """A reader for the GPU with this UUID ('GPU-...') or PCI bus id, or (None, why there is none)."""
    try:
        import pynvml  # nvidia-ml-py: optional, only the GPU machines have it
    except ImportError:
        return None, "pynvml (the nvidia-ml-py package) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML did not start: {exc}"
    for finder, key in ((pynvml.nvmlDeviceGetHandleByUUID, uuid), (pynvml.nvmlDeviceGetHandleByPciBusId, pci_bus_id)):
        if key is None:
            continue
        try:
            return Reader(pynvml, finder(key.encode())), None
        except pynvml.NVMLError:
            continue
    return None, f"NVML does not know the device (uuid {uuid}, PCI bus {pci_bus_id})"


def problems(before: dict | None, after: dict | None, baseline_after: dict | None) -> list[str]:
    """Notes about the machine during a benchmark: throttling, other processes, an SM clock far from the
    baseline's (compared on the readings taken after the timed rounds, when the GPU was busy)."""
    readings = [r for r in (before, after) if r]
    notes = []
    throttled = sorted({reason for r in readings for reason in r.get("throttle") or ()})
    if throttled:
        notes.append(f"throttled ({', '.join(throttled)})")
    others = max((r.get("other_processes") or 0 for r in readings), default=0)
    if others:
        notes.append(f"{others} other process(es) on the GPU")
    now = (after or {}).get("sm_clock_mhz")
    then = (baseline_after or {}).get("sm_clock_mhz")
    if now and then and abs(now - then) > CLOCK_DEVIATION * then:
        notes.append(f"SM clock {now} MHz, the baseline's {then} MHz")
    return notes


def thermal(reading: dict | None) -> list[str]:
    """The thermal throttle reasons (THERMAL) of a reading."""
    return [reason for reason in (reading or {}).get("throttle") or () if reason in THERMAL]


def cool_down(read: Callable[[], dict | None], baseline_c: float | None, sleep: Callable[[float], None],
              max_wait: float = COOL_WAIT_SECONDS, poll: float = COOL_POLL_SECONDS) -> str | None:
    """Before a SLOWER verdict is re-measured (timing.judged): when the GPU reads thermally throttled, waits, idle,
    until it reads neither thermally throttled nor hotter than COOL_MARGIN_C above `baseline_c` (the baseline's
    temperature before its rounds, None when unknown), at most max_wait seconds, reading it every `poll` seconds.
    Returns the note for the verdict, or None when the GPU was not thermally throttled (or there is no NVML)."""
    first = read()
    reasons = thermal(first)
    if not reasons:
        return None
    target = None if baseline_c is None else baseline_c + COOL_MARGIN_C

    def cool(reading: dict) -> bool:
        now = reading.get("temperature_c")
        return not thermal(reading) and (target is None or now is None or now <= target)

    waited, reading = 0.0, first
    while not cool(reading) and waited < max_wait:
        sleep(poll)
        waited += poll
        reading = read() or {}
    how = f"{', '.join(reasons)} at {first.get('temperature_c')} C"
    now = reading.get("temperature_c")
    if cool(reading):
        return f"thermally throttled ({how}): re-measured after {waited:.0f} s idle, at {now} C"
    return (f"thermally throttled ({how}): re-measured after {waited:.0f} s, still at {now} C"
            f"{'' if target is None else f' (the baseline started at {baseline_c} C)'}")
