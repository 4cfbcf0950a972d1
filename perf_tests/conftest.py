"""Fixtures shared by the perf tests."""

import pytest
import torch


@pytest.fixture
def fresh_compiler():
    """Compile each test's function anew, and free what the compiled graphs hold afterwards: graphs of earlier shapes
    would hit dynamo's recompile limit, and a model's graphs keep its memory (and CUDA graph pools) alive."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
