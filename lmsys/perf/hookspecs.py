"""Hooks the plugin adds to pytest (registered in plugin.pytest_addhooks)."""

import pytest


@pytest.hookspec(firstresult=True)
def pytest_perf_backend(config):
    """Return the object gpu_benchmark measures through (see lmsys.perf.backend.Backend), or None to leave the
    choice to the next implementation. The plugin's own, called last, picks CUDA when a GPU is visible, else the CPU.
    The plugin's tests implement it in a conftest to get a deterministic clock and fake memory readings."""


@pytest.hookspec
def pytest_perf_measured(item, benchmark, remeasure):
    """Called after a benchmark is measured, judged and recorded (item.stash[RECORD_KEY]; `benchmark`: the
    gpu_benchmark object). `remeasure(injection)` measures it once more with an lmsys.perf.injection.Injection and
    returns that verdict, which fails nothing: how lmsys.perf.injection measures its cases."""
