"""Fixtures shared by the perf tests."""

import sys

import pytest
import torch


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
