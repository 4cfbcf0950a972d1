"""Test-suite set-up: without CUDA, the Triton kernels run under the Triton interpreter.

This must happen here, at conftest import, before any test module imports `lmsys.attention`: `triton.jit` reads
TRITON_INTERPRET when it decorates a kernel (at import of `lmsys.attention.flash_triton`), not when it launches
one. `setdefault` leaves an explicit TRITON_INTERPRET=0 alone (used to test the "CPU tensor without the
interpreter" error). Every test also checks the attention launcher's keys (`check_launch_keys`).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def check_launch_keys(monkeypatch):
    """Every attention launch in the tests verifies that its key fixes the kernel's specialization and grid
    (lmsys.attention.launcher.CHECK)."""
    from lmsys.attention import launcher

    monkeypatch.setattr(launcher, "CHECK", True)
