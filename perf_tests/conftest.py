"""Fixtures shared by the perf tests, and a clear stop when the plugin that runs them is not loaded."""

import sys

import pytest
import torch


def pytest_configure(config):
    """Every perf test takes the plugin's `gpu_benchmark` fixture: without the plugin (lmsys not installed, or
    `-p no:lmsys_perf`) each would error on its own, thousands of times."""
    plugin = sys.modules.get("lmsys.perf.plugin")
    if plugin is None or not config.pluginmanager.is_registered(plugin):
        raise pytest.UsageError(
            "perf_tests need lmsys's pytest plugin, which this run has not loaded: install lmsys (bash .ci/setup, or "
            "pip install -e .) or pass -p lmsys.perf.plugin"
        )


@pytest.fixture
def fresh_compiler():
    """Compile each test's function anew, and free what the compiled graphs hold afterwards: graphs of earlier shapes
    would hit dynamo's recompile limit, and a model's graphs keep its memory (and CUDA graph pools) alive."""
    # A run that compiles nothing never imports dynamo (seconds on a GPU host), so there is nothing to reset.
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
    yield
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
