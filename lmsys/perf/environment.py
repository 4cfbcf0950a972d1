"""The environment a measurement was taken in, for the JSON's machine_info: the device, the driver, the CUDA, cuDNN,
NCCL, torch and triton versions, and the git commit. Also which of these differ between a baseline and now."""

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from lmsys.perf.baselines import SCHEMA

# A change in these can move timings by itself; a baseline that differs is still compared, with a warning.
VERSION_KEYS = ("torch", "triton", "cuda", "cudnn", "driver")


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a short command, or None when it is missing, fails or hangs."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def driver_version(is_gpu: bool) -> str | None:
    """The NVIDIA driver version from nvidia-smi; else the CUDA driver API version torch sees; None without a GPU."""
    if not is_gpu:
        return None
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip()
    api = getattr(torch._C, "_cuda_getDriverVersion", None)
    return f"CUDA driver API {api()}" if api else None


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def software_versions(is_gpu: bool) -> dict[str, str | None]:
    """Versions of the software stack that decides kernel speed."""
    nccl = None
    if is_gpu and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if is_gpu and torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": None if cudnn is None else str(cudnn),
        "nccl": nccl,
        "driver": driver_version(is_gpu),
        "python": platform.python_version(),
        "pytest_benchmark": _package_version("pytest-benchmark"),
    }


# A copy of the tree without .git (a GPU machine that gets the working tree) names its commit here.
COMMIT_VARIABLE = "LMSYS_GIT_COMMIT"


def git_commit(root: Path) -> str | None:
    """The commit measured: $LMSYS_GIT_COMMIT when set, else the commit checked out at root, else None."""
    return os.environ.get(COMMIT_VARIABLE) or _run(["git", "rev-parse", "HEAD"], cwd=root)


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_start(device: dict[str, Any] | None = None) -> str | None:
    """This boot of the machine (Linux's boot id: every start of a lent GPU machine, or a reboot, gets another) and,
    for a GPU, its UUID ('<boot id>/GPU-...'): the GPUs of one machine differ by up to 2% on kernels at the power cap
    (docs/gate-measurements.md), so a baseline saved on another GPU of this machine is from another start. None where
    there is no boot id to read."""
    try:
        boot = BOOT_ID.read_text().strip() or None
    except OSError:
        return None
    uuid = (device or {}).get("uuid")
    return boot if boot is None or uuid is None else f"{boot}/{uuid}"


def collect(backend, machine_id: str, root: Path) -> dict[str, Any]:
    """Everything above for one backend, as the dict stored under machine_info['lmsys']."""
    device = backend.describe()
    return {
        "machine_id": machine_id,
        "schema": SCHEMA,
        "machine_start": machine_start(device),
        "device": device,
        "software": software_versions(backend.is_gpu),
        "git_commit": git_commit(root),
    }


def version_differences(baseline_info: dict, current: dict) -> list[str]:
    """'torch 2.11.0 -> 2.13.0'-style lines for each VERSION_KEYS entry that differs between a baseline and now."""
    before = ((baseline_info.get("lmsys") or {}).get("software")) or {}
    if not before:
        return ["the baseline records no software versions"]
    after = current.get("software") or {}
    return [f"{key} {before.get(key)} -> {after.get(key)}" for key in VERSION_KEYS if before.get(key) != after.get(key)]
