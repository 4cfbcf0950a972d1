"""The detection's injected work (lmsys/perf/spin.py, injection.make_work): the kernel runs every iteration it is
given (under the Triton interpreter without a GPU), and on a GPU it takes the time asked for, in a CUDA graph too."""

import numpy as np
import pytest
import torch

from lmsys.perf.spin import BLOCK, _spin_mma


def _expected(iterations: int) -> float:
    rows = np.arange(BLOCK)
    a = ((rows[:, None] * 7 + rows[None, :]) % 5) * 0.125
    b = ((rows[:, None] + rows[None, :] * 3) % 7) * 0.0625
    return iterations * float((a @ b).sum())


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_the_kernel_runs_every_iteration(device, iterations):
    out = torch.full((2,), float("nan"), device=device)
    _spin_mma[(2,)](out, iterations, BLOCK=BLOCK)
    assert out.tolist() == pytest.approx([_expected(iterations)] * 2, rel=1e-5)


def test_work_takes_the_time_asked_for_on_a_gpu(gpu):
    """Within 10% from 0.1 to 10 ms, in a CUDA graph too; a wait below MIN_WORK_SECONDS within a few microseconds
    (a kernel's start-up: on the H100 a 10 us wait took 13 us)."""
    from lmsys.perf.backend import CudaBackend
    from lmsys.perf.injection import MIN_WORK_SECONDS, make_work

    backend = CudaBackend()
    asked = (100e-6, 1e-3, 10e-3)
    took = [sorted(backend.time_call(make_work(backend, seconds)) for _ in range(5))[2] for seconds in asked]
    assert took == pytest.approx(asked, rel=0.1)
    short = MIN_WORK_SECONDS / 2
    assert sorted(backend.time_call(make_work(backend, short)) for _ in range(5))[2] == pytest.approx(short, abs=5e-6)
    replay, release = backend.capture_graph(make_work(backend, 1e-3))
    assert sorted(backend.time_call(replay) for _ in range(5))[2] == pytest.approx(1e-3, rel=0.1)
    release()
