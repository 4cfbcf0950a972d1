"""Root fixtures shared by tests/ and perf_tests/: the device, a fresh seed, the dtype. No logic beyond that, and
the two lines that make a seed replayable: a failing test prints the seed it drew, and --seed=N replays it."""

import random

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--seed", type=int, default=None, metavar="N",
        help="Replay: the `seed` fixture returns N instead of a fresh seed (a failing test prints the seed it drew).",
    )


@pytest.fixture
def device() -> torch.device:
    """The CUDA device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (inputs are drawn anew every run), or --seed's; recorded so a failure can be replayed."""
    value = request.config.getoption("seed")
    if value is None:
        value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [value for key, value in item.user_properties if key == "seed"]
    if report.failed and seeds:
        report.sections.append(("random seed", f"seed {seeds[-1]}; replay: pytest '{item.nodeid}' --seed={seeds[-1]}"))
    return report


@pytest.fixture
def gpu(device) -> torch.device:
    """The CUDA device; skips the test without one."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    return device
