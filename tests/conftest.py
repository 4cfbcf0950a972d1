"""Test-suite set-up: without CUDA, the Triton kernels run under the Triton interpreter, and the whole suite runs on
every core.

The interpreter must be chosen here, at conftest import, before any test module imports `lmsys.attention`:
`triton.jit` reads TRITON_INTERPRET when it decorates a kernel (at import of `lmsys.attention.flash_triton`), not when
it launches one. `setdefault` leaves an explicit TRITON_INTERPRET=0 alone (used to test the "CPU tensor without the
interpreter" error). Every test also checks the attention launcher's keys (`check_launch_keys`).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest` with no paths (the README's command, CI's: pytest.ini's testpaths) on a machine without CUDA spreads
    the tests over every core with pytest-xdist (-n auto), unless -n, --dist or --pdb is given: most of the suite's
    time is single-threaded (the interpreter, compilers, the pytest runs it starts), and on CI's two cores a second
    worker nearly halves it. Chosen tests (any path given) run in this one process, as without pytest-xdist; on a GPU
    the tests share the device and are not spread. Runs before pytest-xdist's own hook, which starts the workers."""
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and config.option.numprocesses is None and config.option.dist == "no" and not config.option.usepdb
            and not torch.cuda.is_available()):
        config.option.numprocesses = "auto"
        config.option.dist = "worksteal"  # the tests' times differ by 1000x: idle workers take over queued ones


@pytest.fixture(autouse=True)
def check_launch_keys(monkeypatch):
    """Every attention launch in the tests verifies that its key fixes the kernel's specialization and grid
    (lmsys.attention.launcher.CHECK)."""
    from lmsys.attention import launcher

    monkeypatch.setattr(launcher, "CHECK", True)


@pytest.fixture(autouse=True)
def not_an_xdist_worker(monkeypatch):
    """The pytest runs that tests start (pytester, subprocesses) are not pytest-xdist workers, even when this suite runs
    distributed: pytest-benchmark and lmsys.perf read PYTEST_XDIST_WORKER and would stop timing or refuse to compare."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
