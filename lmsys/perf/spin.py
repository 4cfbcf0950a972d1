"""A device-side delay that draws power: tensor-core matrix multiplies on every SM for a chosen number of iterations.

`torch.cuda._sleep` spins on the clock and draws little power; on a GPU at its power cap the clocks can rise while it
runs and the work after it then runs faster, giving back part of the delay. Work that does what a slower kernel does
(keep the tensor cores busy) models a regression better. Each program multiplies two tiles held on chip, `iterations`
times into one accumulator, and stores one number, so the kernel reads nothing from memory and writes almost nothing.
"""

import torch
import triton
import triton.language as tl

BLOCK = 128
PROGRAMS_PER_SM = 2


@triton.jit
def _spin_mma(out_ptr, iterations, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    a = ((rows[:, None] * 7 + rows[None, :]) % 5).to(tl.float16) * 0.125
    b = ((rows[:, None] + rows[None, :] * 3) % 7).to(tl.float16) * 0.0625
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for _ in range(iterations):
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


class MmaSpin:
    """Launches _spin_mma on `device` (PROGRAMS_PER_SM programs per SM) for a number of iterations."""

    def __init__(self, device: torch.device | int):
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._out = torch.empty(PROGRAMS_PER_SM * sms, dtype=torch.float32, device=device)

    def __call__(self, iterations: int) -> None:
        _spin_mma[(self._out.numel(),)](self._out, int(iterations), BLOCK=BLOCK, num_warps=4)
