"""The fused AdamW kernel's launch configuration on this GPU: which CHUNK, BLOCK and warps stream fastest?

Over the parameters of one preset (2.7B by default), fp32 and bf16 with fp32 masters, one process, medians of
`triton.testing.do_bench`: `AdamW.step` as shipped; the shipped kernel launched directly; a copy of its loop without
each tensor's masked tail (the tails are skipped: timing only) over a grid of CHUNK x BLOCK x warps, and with the
shipped loop's pieces put back one at a time (the tail, the `weight1 < 0.5` branch), with approximate square root
and division, and with Triton's loop pipelining; torch's fused AdamW; and `copy_` of 4 GiB, the copy bandwidth.
Registers and spills per compiled kernel. Prints the table sorted by time and writes it to the CSV named.

    PYTHONPATH=. python scripts/adamw_launch_configs.py adamw.csv [--size 2.7B] [--budget-s 400]
"""

import argparse
import functools
import itertools
import time

import pandas as pd
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from lmsys import optim
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW


@triton.jit
def _block(param, grad, exp_avg, exp_avg_sq, copy, offs, decay, step_size, bc2_sqrt, weight1, beta2, weight2, eps,
           COPY: tl.constexpr, EXACT: tl.constexpr, BRANCH: tl.constexpr):
    p = tl.load(param + offs)
    g = tl.load(grad + offs).to(p.dtype)
    m = tl.load(exp_avg + offs)
    v = tl.load(exp_avg_sq + offs)
    p = p * decay
    if BRANCH:
        if weight1 < 0.5:
            m = m + weight1 * (g - m)
        else:
            m = g - (g - m) * (1 - weight1)
    else:
        m = m + weight1 * (g - m)
    v = v * beta2 + weight2 * g * g
    if EXACT:
        p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    else:
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(param + offs, p)
    tl.store(exp_avg + offs, m)
    tl.store(exp_avg_sq + offs, v)
    if COPY:
        tl.store(copy + offs, optim._to_bf16(p))


@triton.jit
def _loop(param, grad, exp_avg, exp_avg_sq, copy, start, end, decay, step_size, bc2_sqrt, weight1, beta2, weight2,
          eps, BLOCK: tl.constexpr, COPY: tl.constexpr, EXACT: tl.constexpr, BRANCH: tl.constexpr,
          TAIL: tl.constexpr, STAGES: tl.constexpr):
    full_end = start + (end - start) // BLOCK * BLOCK
    offs = tl.arange(0, BLOCK)
    for lo in tl.range(start, full_end, BLOCK, num_stages=STAGES):
        lo = tl.multiple_of(lo, BLOCK)
        _block(param, grad, exp_avg, exp_avg_sq, copy, lo + offs, decay, step_size, bc2_sqrt, weight1, beta2,
               weight2, eps, COPY, EXACT, BRANCH)
    if TAIL:
        if full_end < end:
            optim._adamw_block(param, grad, exp_avg, exp_avg_sq, copy, full_end + offs, full_end + offs < end,
                               decay, step_size, bc2_sqrt, weight1, beta2, weight2, eps, True, COPY)


@triton.jit
def _variant(TENSORS, CHUNKS, ROW: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr,
             BRANCH: tl.constexpr, TAIL: tl.constexpr, STAGES: tl.constexpr):
    """The shipped kernel's program (optim._adamw_kernel) with the loop above; fp32 state, aligned tensors."""
    chunk = tl.program_id(0).to(tl.int64)
    index = tl.load(CHUNKS + 2 * chunk)
    start = tl.multiple_of(tl.load(CHUNKS + 2 * chunk + 1), CHUNK)
    row = TENSORS + index * ROW
    param = optim._pointer(row, 0, tl.float32, True)
    exp_avg = optim._pointer(row, 2, tl.float32, True)
    exp_avg_sq = optim._pointer(row, 3, tl.float32, True)
    end = tl.minimum(start + CHUNK, tl.load(row + 4))
    decay = optim._coefficient(row, 5, tl.float32)
    step_size = optim._coefficient(row, 6, tl.float32)
    bc2_sqrt = optim._coefficient(row, 7, tl.float32)
    weight1 = optim._coefficient(row, 8, tl.float32)
    beta2 = optim._coefficient(row, 9, tl.float32)
    weight2 = optim._coefficient(row, 10, tl.float32)
    eps = optim._coefficient(row, 11, tl.float32)
    if tl.load(row + 12) != 0:
        _loop(param, optim._pointer(row, 1, tl.bfloat16, True), exp_avg, exp_avg_sq,
              optim._pointer(row, 12, tl.bfloat16, True), start, end, decay, step_size, bc2_sqrt, weight1, beta2,
              weight2, eps, BLOCK, True, EXACT, BRANCH, TAIL, STAGES)
    else:
        _loop(param, optim._pointer(row, 1, tl.float32, True), exp_avg, exp_avg_sq, param, start, end, decay,
              step_size, bc2_sqrt, weight1, beta2, weight2, eps, BLOCK, False, EXACT, BRANCH, TAIL, STAGES)


def variants():
    """(CHUNK, BLOCK, warps, EXACT, BRANCH, TAIL, STAGES) to time: the grid, then the shipped loop's pieces."""
    grid = [(c, b, w, True, False, False, 1)
            for c, b, w in itertools.product((32768, 65536, 131072), (2048, 4096, 8192), (4, 8, 16))]
    pieces = [(c, b, w, True, branch, tail, 1) for c, b, w in ((65536, 4096, 8), (32768, 2048, 16))
              for branch in (False, True) for tail in (False, True)]
    pieces += [(c, b, w, exact, False, False, stages) for c, b, w in ((65536, 4096, 8), (32768, 2048, 16))
               for exact in (True, False) for stages in (1, 2, 3)]
    return list(dict.fromkeys(grid + pieces))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--size", default="2.7B", choices=list(SIZES))
    parser.add_argument("--budget-s", type=float, default=400, help="stop starting variants after this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    started, device, rows = time.time(), torch.device("cuda"), []
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

    def record(what, ms, nbytes, **extra):
        rows.append(dict(what=what, ms=ms, tb_per_s=nbytes / ms / 1e9, **extra))
        print(rows[-1], flush=True)

    x = torch.empty(2**30, device=device)
    y = torch.empty_like(x)
    record("copy_ of 4 GiB", do_bench(lambda: y.copy_(x), warmup=50, rep=300), 2 * x.numel() * 4)
    del x, y

    for mode in ("fp32", "bf16 with masters"):
        with torch.device(device):
            model = TransformerLM(SIZES[args.size])
        params = list(model.parameters())
        optimizer = AdamW(params)
        if mode != "fp32":
            optimizer.keep_master_weights([m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)])
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
        optimizer.step()  # the second step makes the plan that later steps repeat
        nbytes = 28 * sum(p.numel() for p in params)  # fp32: 16 read, 12 written; bf16 + master: 14 and 14
        record(f"{mode}: AdamW.step", do_bench(optimizer.step, warmup=100, rep=400), nbytes)
        if mode == "fp32":
            reference = torch.optim.AdamW(params, fused=True)
            reference.step()
            record("fp32: torch fused AdamW", do_bench(reference.step, warmup=100, rep=400), nbytes)
            del reference
        table = optimizer._plan.table.to(device)
        sizes = [p.numel() for p in params if p.numel()]
        chunks = optim.chunk_table(sizes, optim.CHUNK, device)
        shipped = functools.partial(optim._adamw_kernel[(chunks.shape[0],)], table, chunks, ROW=optim._ROW,
                                    CHUNK=optim.CHUNK, BLOCK=optim.BLOCK, DTYPE=tl.float32, ALIGNED=True,
                                    num_warps=optim.NUM_WARPS)
        kernel = shipped()
        record(f"{mode}: shipped kernel", do_bench(shipped, warmup=60, rep=250), nbytes, chunk=optim.CHUNK,
               block=optim.BLOCK, warps=optim.NUM_WARPS, registers=kernel.n_regs, spills=kernel.n_spills)
        for chunk, block, warps, exact, branch, tail, stages in variants():
            if time.time() - started > args.budget_s:
                print(f"--budget-s {args.budget_s:g} reached", flush=True)
                break
            chunks = optim.chunk_table(sizes, chunk, device)
            launch = functools.partial(_variant[(chunks.shape[0],)], table, chunks, ROW=optim._ROW, CHUNK=chunk,
                                       BLOCK=block, EXACT=exact, BRANCH=branch, TAIL=tail, STAGES=stages,
                                       num_warps=warps)
            kernel = launch()
            record(f"{mode}: variant", do_bench(launch, warmup=60, rep=250), nbytes, chunk=chunk, block=block,
                   warps=warps, exact=exact, branch=branch, tail=tail, stages=stages, registers=kernel.n_regs,
                   spills=kernel.n_spills)
        del model, params, optimizer, table
        torch.cuda.empty_cache()
    frame = pd.DataFrame(rows)
    frame.to_csv(args.csv, index=False)
    print(frame.sort_values("ms").to_string(index=False))


if __name__ == "__main__":
    main()
