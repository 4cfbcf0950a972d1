"""The detection's injected work (lmsys/perf/spin.py, CudaBackend.make_work): the kernel runs every iteration it is
given (the Triton interpreter on the CPU, the GPU), and on a GPU it takes the time asked for, in a CUDA graph too."""

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
def test_the_kernel_runs_every_iteration(iterations):
    out = torch.full((2,), float("nan"))
    _spin_mma[(2,)](out, iterations, BLOCK=BLOCK)
    assert out.tolist() == pytest.approx([_expected(iterations)] * 2, rel=1e-6)


def test_work_takes_the_time_asked_for_on_a_gpu(gpu):
    from lmsys.perf.backend import MIN_WORK_SECONDS, CudaBackend

    backend = CudaBackend()
    for seconds in (MIN_WORK_SECONDS / 2, 100e-6, 1e-3, 10e-3):
        work = backend.make_work(seconds)
        took = sorted(backend.time_call(work) for _ in range(5))[2]
        assert took == pytest.approx(seconds, rel=0.1), seconds
    work = backend.make_work(1e-3)
    replay, release = backend.capture_graph(work)
    assert sorted(backend.time_call(replay) for _ in range(5))[2] == pytest.approx(1e-3, rel=0.1)
    release()
    spin = backend._mma_spin
    spin(5)
    torch.cuda.synchronize()
    assert spin._out.tolist() == pytest.approx([_expected(5)] * spin._out.numel(), rel=1e-5)
