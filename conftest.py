"""Root fixtures shared by tests/ and perf_tests/: the device, a fresh seed, the dtype. No logic beyond that."""

import random

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """The CUDA device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (inputs are drawn anew every run); recorded so a failure can be replayed."""
    value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def gpu(device) -> torch.device:
    """The CUDA device; skips the test without one."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    return device
