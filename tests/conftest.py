"""Test-suite set-up: without CUDA, the Triton kernels run under the Triton interpreter.

This must happen here, at conftest import, before any test module imports `lmsys.attention`: `triton.jit` reads
TRITON_INTERPRET when it decorates a kernel (at import of `lmsys.attention.flash_triton`), not when it launches
one. `setdefault` leaves an explicit TRITON_INTERPRET=0 alone (used to test the "CPU tensor without the
interpreter" error).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
