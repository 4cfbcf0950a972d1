"""FlashAttention backward for Hopper (sm_90) in Gluon: two warp-specialized kernels in the style of FA3.

The Triton backward (flash_triton) waits for every tensor-core product right after issuing it. Here, as in the Gluon
forward (flash_hopper), a one-warp producer streams the tiles with TMA through rings of shared buffers guarded by
mbarriers, and two consumer warpgroups issue the warpgroup MMAs asynchronously, waiting only for the product the
next step needs:

* `_dkdv_kernel`: a program owns 128 keys (64 per consumer warpgroup), holds their K and V in shared memory (with
  FUSED_DQ at d=64 K in registers too, S^T's A operand: K_IN_REGISTERS) and dK, dV in registers, and visits the query
  tiles (TILES: rows of Q and dO, with their log-sum-exp and delta). On transposed scores: S^T = K Q^T and dP^T = V
  dO^T are issued together; the probabilities P^T = exp2(S^T - lse) are computed while dP^T is still on the tensor
  cores; dV += P^T dO is issued before dS^T = P^T (dP^T - delta) is formed, and dK += dS^T Q after it, both with their
  A operand from registers (dK's from shared memory where `ds_from_shared` says so).
* `_dq_kernel`: a program owns 128 query rows (64 per warpgroup) and visits the key tiles (TILES: rows of K and V):
  S = Q K^T and dP = dO V^T, then dQ += dS K.

Like the Triton backward (and unlike FA3, which accumulates dQ with atomics) the scores are computed twice, once per
kernel: no atomics and no fp32 dQ buffer. FUSED_DQ (by default on long causal problems, at d=64 and 128: `fused`)
takes FA3's way: the dK/dV kernel also forms each query tile's dQ = dS K over its keys and adds it into an fp32
buffer with TMA's bulk reduction, and the dQ kernel does not run. delta = rowsum(dO * O) comes from the Triton
preprocessing kernel. The two kernels share only their inputs: on problems of few programs (CONCURRENT_DQ, `plan`)
the dQ kernel runs on a side stream beside the other, except under CUDA-graph capture.

Scope: what the Gluon forward takes (`flash_hopper.views`: sm_90, bf16 or fp16, lengths multiples of 128, q, k, v
and dO contiguous or the (B, H, T, D) views of (B, T, H, D) tensors), head dims 64 and 128, problems of at least
MIN_PROGRAMS_PER_SM programs per multiprocessor (MIN_PROGRAMS_PER_SM_CONCURRENT with the kernels side by side).
`flash_triton` runs it for such inputs unless `flash_triton.HOPPER_BACKWARD` is off (LMSYS_HOPPER_BACKWARD=0 at
import). Where the GPU's table holds a measured choice for a problem's bucket
(`lmsys.attention.tuned.measured_choice`, MEASURED), the table says whether it runs here and how (one after the other,
side by side, fused); the thresholds below decide the rest. tests/test_attention.py compiles both kernels for sm_90
on any machine (no spilled register) and checks them against float64 on a Hopper GPU.

Why each constant below has its value, with its measurements on the H100 and the variants timed against it:
docs/attention.md, "The Gluon backward (flash_hopper_bwd), measured".
"""

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lmsys.attention import flash_hopper, launch_order, launcher, plans, tuned
from lmsys.attention.checks import check_causal
from lmsys.attention.flash_hopper import ring, stream_kv

BLOCK_KEYS = 128  # keys per _dkdv_kernel program: two consumer warpgroups of 64
BLOCK_ROWS = 128  # query rows per _dq_kernel program: two consumer warpgroups of 64
# The tiles the kernels visit, per head dim: (query rows of a _dkdv_kernel tile, keys of a _dq_kernel tile). Each
# compiles for sm_90 without a spilled register (tests/test_attention.py); so does a dQ tile of 128 keys, at either
# head dim, and 3 stages with tiles of 64 (scripts/attention_backward_variants.py times them).
TILES = {64: (64, 64), 128: (64, 64)}
NUM_STAGES = 2
HEAD_DIMS = (64, 128)
# Programs (of the dQ kernel: 128 query rows each) per multiprocessor from which flash_triton takes this backward, its
# two kernels one after the other: with fewer programs the Triton backward's smaller blocks fill more of the GPU and
# it is faster. With the dQ kernel beside the dK/dV one (CONCURRENT_DQ), from MIN_PROGRAMS_PER_SM_CONCURRENT
# (docs/attention.md).
MIN_PROGRAMS_PER_SM = 1.5
MIN_PROGRAMS_PER_SM_CONCURRENT = 0.75
# Whether a problem in a bucket for which this GPU's table holds a choice (lmsys.attention.tuned.measured_choice: the
# fastest of the Triton backward and this one's three ways of running) runs as the table says; the thresholds here
# decide the others. Scripts that time each way in turn set it off.
MEASURED = True
CONSUMER_REGS = 240
PRODUCER_REGS = 24
# Whether the dQ kernel runs on a side stream beside the dK/dV kernel (they share only their inputs), so that a
# problem of few programs, whose two grids each leave multiprocessors idle, fills the GPU with both: None, by the
# problem's size (below CONCURRENT_BELOW_PROGRAMS_PER_SM programs per multiprocessor and from CONCURRENT_MIN_KEYS
# keys, where it is faster; with more programs each grid fills the GPU alone; shorter problems, such as the model's
# 512-token heads, keep the kernels one after the other: docs/attention.md), True or
# False, always or never. Never while a CUDA graph is captured: there the kernels run one after the other, from
# MIN_PROGRAMS_PER_SM.
CONCURRENT_DQ: bool | None = None
CONCURRENT_BELOW_PROGRAMS_PER_SM = 8
CONCURRENT_MIN_KEYS = 16384
# The problems, as (is_causal, head dim), for which the dK/dV kernel loads each query tile's log-sum-exp and delta
# (from global memory: one latency per step, the step's S^T and softmax waiting on the first, its dS^T on the second)
# one step ahead, into registers kept across the step. It compiles for sm_90 without a spill at d=64 alone (256 bytes
# spill at d=128), and there it makes the dK/dV kernel faster, with the mask and without (docs/attention.md).
PREFETCH_STATS = {(True, 64), (False, 64)}
# Whether both kernels take the forwards' launch order (`launch_order.program_position`: heads in groups whose
# streamed tiles share L2, the heaviest block of every head in the group first) instead of a grid of (blocks, heads),
# which runs the heads one after the other, each from its heaviest block down to its lightest. Slightly faster on many
# heads (docs/attention.md); on one head the two orders launch the same programs.
GROUPED_ORDER = True
# Whether the dK/dV kernel also accumulates dQ, as FA3 does (for head dims in FUSED_HEAD_DIMS; the others keep the dQ
# kernel): each step's dQ tile = dS K over the warpgroup's 64 keys, computed from dS^T written to shared memory, is
# added into an fp32 buffer by TMA's bulk reduction, so the scores are computed once (5 products per step instead of the
# two kernels' 7), at the cost of that traffic (per query tile, an fp32 tile per 64 keys) and of the buffer, cast into
# dq at the end. True or False: always or never (at FUSED_HEAD_DIMS); None, the default: by the problem's size
# (`fused`), causal problems from FUSED_MIN_KEYS keys and FUSED_MIN_PROGRAMS_PER_SM programs per multiprocessor, where
# it is faster than the two kernels; below, the two kernels side by side are faster (docs/attention.md). Its fp32
# buffer adds 4 bytes per dQ element to the backward's peak memory.
FUSED_DQ: bool | None = None
FUSED_MIN_KEYS = 16384
FUSED_MIN_PROGRAMS_PER_SM = 1.9
# With FUSED_DQ, whether each consumer warpgroup forms half of a query tile's dQ columns over all the program's 128
# keys instead of all its columns over its own 64: both warpgroups' dS^T in one shared buffer (two, in turns), an
# mbarrier between them, and K loaded once more as two tiles of half its columns (the B operands). One fp32 reduction
# per query tile and program instead of two (half that traffic), and a dQ tile of half the registers: at least as fast
# as without it (docs/attention.md).
FUSED_SPLIT = True
# With FUSED_DQ and GROUPED_ORDER, heads per group of the dK/dV kernel's launch order (None: as without FUSED_DQ, by
# the bytes of q and dO alone, 6 heads at the leaderboard, whose fp32 dQ then makes the group's streamed and reduced
# tiles about 48 MB, L2's size). One head a group keeps the reduced dQ tiles in L2 and is faster (docs/attention.md).
FUSED_GROUP_HEADS: int | None = 1
# The head dims at which the dK/dV kernel accumulates dQ: 64, and 128 with FUSED_SPLIT and 2 stages only. At d=128 dK
# and dV take 64 fp32 registers each, and a whole dQ tile would take 64 more, which spills; with FUSED_SPLIT (half its
# columns: 32 registers) dK's A operand dS^T is read from the shared buffer dQ's takes anyway, and dQ has one buffer
# (two do not fit shared memory). Its causal sm_90 build spills a little (tests/test_attention.py bounds it) and is
# faster than the two kernels at every size the rule takes (docs/attention.md, "FUSED_DQ at d=128").
FUSED_HEAD_DIMS = (64, 128)
# With FUSED_SPLIT, whether dK's A operand dS^T is read from the shared buffer dQ's is stored in (at d=128 always),
# instead of from registers: None, by the problem's size (`ds_from_shared`: from FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM),
# True or False, always or never at d=64. With K from shared memory (K_IN_REGISTERS off) it is faster on many
# programs and slower on few; with K from registers (the default) never: dS^T from registers is faster there
# (docs/attention.md).
FUSED_DS_SMEM: bool | None = None
FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM = 8
# With FUSED_DQ at d=64, whether the dK/dV kernel reads K, the A operand of S^T = K Q^T, from registers (loaded once
# per program) instead of from shared memory at every step (at d=128 its 32 more registers do not fit): a warpgroup MMA
# of 64 x 64 with both operands in shared memory reads 4 KB per 32 clocks, all of the multiprocessor's 128 bytes a
# clock. Then dK's dS^T comes from registers too (`ds_from_shared`); the backward is faster so (docs/attention.md).
K_IN_REGISTERS = True
# The fp32 dQ tiles' shared buffers and the dQ buffer's TMA descriptor. A row of 64 fp32 (256 bytes) is wider than
# the 128-byte swizzle: triton keeps the tile as two of 32 columns and two warps each issue one's reduction (the
# compiled kernel's descriptor boxes are 64 x 32). Unswizzled, the rows of a warp's stores would fall in the same banks.
DQ_ACC_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA's bulk reduction (cp.reduce.async.bulk.tensor, add) of the shared tile src into tensor_desc's global tile
    at coord, completed like a TMA store (tma.store_wait): Gluon 3.6 builds it (create_async_tma_reduce) but exposes
    no function for it on Hopper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


def plan(programs_per_sm: float, keys: int, capturing: bool) -> bool | None:
    """How this backward runs a problem of `programs_per_sm` dQ programs per multiprocessor and `keys` keys: True, its
    dQ kernel on a side stream beside the dK/dV kernel; False, one after the other; None, not at all (the Triton
    backward runs it). `capturing`: whether a CUDA graph is being captured (then never side by side)."""
    if capturing:
        concurrent = False
    elif CONCURRENT_DQ is None:
        concurrent = programs_per_sm < CONCURRENT_BELOW_PROGRAMS_PER_SM and keys >= CONCURRENT_MIN_KEYS
    else:
        concurrent = CONCURRENT_DQ
    floor = min(MIN_PROGRAMS_PER_SM, MIN_PROGRAMS_PER_SM_CONCURRENT) if concurrent else MIN_PROGRAMS_PER_SM
    return concurrent if programs_per_sm >= floor else None


def fused(head_dim: int, programs_per_sm: float, keys: int, is_causal: bool) -> bool:
    """Whether the dK/dV kernel accumulates dQ (FUSED_DQ) for a problem of this head dim, `programs_per_sm` programs
    per multiprocessor and `keys` keys, causal or not."""
    if not _fusable(head_dim):
        return False
    if FUSED_DQ is not None:
        return FUSED_DQ
    return is_causal and keys >= FUSED_MIN_KEYS and programs_per_sm >= FUSED_MIN_PROGRAMS_PER_SM


def _fusable(head_dim: int) -> bool:
    """Whether the dK/dV kernel can accumulate dQ at this head dim with these settings (FUSED_HEAD_DIMS)."""
    return head_dim in FUSED_HEAD_DIMS and (head_dim == 64 or (FUSED_SPLIT and NUM_STAGES == 2))


def ds_from_shared(head_dim: int, programs_per_sm: float) -> bool:
    """With FUSED_SPLIT, whether dK's A operand dS^T is read from shared memory (FUSED_DS_SMEM) for a problem of this
    head dim and `programs_per_sm` programs per multiprocessor: at d=128 always (from registers it spills more and is
    slower there, FUSED_HEAD_DIMS); at d=64 never with K_IN_REGISTERS (dS^T from registers is faster at every size
    timed: docs/attention.md, "K from registers (K_IN_REGISTERS)"), else from FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM."""
    if head_dim > 64:
        return True
    if FUSED_DS_SMEM is not None:
        return FUSED_DS_SMEM
    return not K_IN_REGISTERS and programs_per_sm >= FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM


class BackwardPlan:
    """How these kernels run a backward (`views`): the 2-D views (`flash_hopper._view`) of q, k, v and do, whether
    the dK/dV kernel reads dK's dS^T from shared memory (`ds_smem`), accumulates dQ (`fused_dq`), and whether the dQ
    kernel runs beside it (`concurrent`); and once `backward` has launched them, the launches (`launcher.Launch`) and
    their arguments that are not tensors. A caller keeps it for later inputs of the same signature (shapes, strides,
    dtype, device, alignment, capture state): lmsys.attention.plans."""

    __slots__ = ("qv", "kv", "vv", "dov", "ds_smem", "fused_dq", "concurrent", "is_causal", "split", "dkdv", "dq",
                 "cast", "dkdv_scalars", "dq_scalars")

    def __init__(self, qv, kv, vv, dov, ds_smem, fused_dq, concurrent):
        self.qv, self.kv, self.vv, self.dov = qv, kv, vv, dov
        self.ds_smem, self.fused_dq, self.concurrent = ds_smem, fused_dq, concurrent
        self.is_causal = self.split = self.dkdv = self.dq = self.cast = self.dkdv_scalars = self.dq_scalars = None


def views(q, k, v, do, is_causal) -> BackwardPlan | None:
    """A `BackwardPlan` when these kernels run this backward, else None."""
    if q.shape[-1] not in HEAD_DIMS or do.shape != q.shape or not q.is_cuda:
        return None
    # The plan before the views: a problem that runs on the Triton backward (the launch-bound ones) leaves without them.
    per_sm = flash_hopper.blocks_per_sm(q, BLOCK_ROWS)
    capturing = torch.cuda.is_current_stream_capturing()
    choice = tuned.measured_choice("backward", q, is_causal, k.shape[-2], per_sm) if MEASURED else None
    if choice == "triton":
        return None
    if choice is None:
        concurrent = plan(per_sm, k.shape[-2], capturing)
    else:
        concurrent = choice == "gluon-concurrent" and not capturing
    found = None if concurrent is None else flash_hopper.views(q, k, v, head_dims=HEAD_DIMS)
    dov = flash_hopper._view(do) if found is not None else None
    if dov is None:
        return None
    if choice is None:
        fused_dq = fused(q.shape[-1], per_sm, k.shape[-2], is_causal)
    else:
        fused_dq = choice == "gluon-fused" and _fusable(q.shape[-1])
    ds_smem = fused_dq and FUSED_SPLIT and ds_from_shared(q.shape[-1], per_sm)
    return BackwardPlan(*found, dov, ds_smem, fused_dq, concurrent and not fused_dq)


@gluon.constexpr_function
def _mma_layout(cols):
    """The layout of a consumer warpgroup's MMA result with `cols` columns (its 4 warps along the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _a_layout(cols):
    """The layout of a 16-bit A operand from registers for an MMA whose result has `cols` columns."""
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(cols), k_width=2)


# ------------------------------------------------------------------------------------------------ dK, dV


@gluon.jit
def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, kc_desc, k_smem, v_smem, q_smem, do_smem, kc_smem, kv_bar, ready,
                   empty, k_row, k_col, v_row, v_col, q_row, q_col, do_row, do_col, n_tiles,
                   BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):
    half: gl.constexpr = k_desc.block_type.shape[0]
    if SPLIT:  # and K's columns in two halves, each over the program's keys
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes
                        + 2 * kc_desc.block_type.nbytes)
        for c in gl.static_range(2):
            tma.async_copy_global_to_shared(kc_desc, [k_row, k_col + c * kc_desc.block_type.shape[1]], kv_bar,
                                            kc_smem.index(c))
    else:
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [k_row + w * half, k_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [v_row + w * half, v_col], kv_bar, v_smem.index(w))
    for j in range(n_tiles):
        slot = j % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase of parity 1: the first round passes at once.
        mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + j * BLOCK_M, q_col], ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [do_row + j * BLOCK_M, do_col], ready.index(slot),
                                        do_smem.index(slot))


@gluon.jit
def _issue_dv_dk(p, dp_token, dv, dk, q_tile, do_tile, DELTA, stat_row, cols, delta_ahead, ds_w,
                 a_layout: gl.constexpr, PREFETCH: gl.constexpr, DS_SMEM: gl.constexpr):
    """A query tile's dV += P^T dO issued, then (once dP^T is in, while dV is on the tensor cores) dS^T = P^T (dP^T -
    delta) formed and dK += dS^T Q issued: their tokens, the register operands they read, to keep until waited, and
    dS^T (16-bit, in the MMA layout). delta is loaded here, or with PREFETCH it is delta_ahead, loaded a step
    earlier. With DS_SMEM dS^T is stored into ds_w first and dK's A operand read from there (no register
    operand: the one returned is p_op again)."""
    p_op = gl.convert_layout(p.to(q_tile.dtype), a_layout)
    dv_token = warpgroup_mma(p_op, do_tile, dv, is_async=True)
    if PREFETCH:
        delta = delta_ahead
    else:
        delta = gl.load(DELTA + stat_row + cols)
    dp = warpgroup_mma_wait(1, deps=[dp_token])
    ds = (p * (dp - gl.expand_dims(delta, 0))).to(q_tile.dtype)
    if DS_SMEM:
        ds_w.store(ds)
        fence_async_shared()
        gl.thread_barrier()  # every thread's rows stored before the product reads them
        ds_op = p_op
        dk_token = warpgroup_mma(ds_w, q_tile, dk, is_async=True)
    else:
        ds_op = gl.convert_layout(ds, a_layout)
        dk_token = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
    return dv_token, dk_token, p_op, ds_op, ds


@gluon.jit
def _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys, lo, hi,
               qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M: gl.constexpr,
               NUM_STAGES: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr,
               PREFETCH: gl.constexpr, FUSED: gl.constexpr, SPLIT: gl.constexpr, WG: gl.constexpr,
               DS_SMEM: gl.constexpr):
    """Query tiles [lo, hi) (counted from the first one the program visits, m_first) into dK, dV. Each tile's
    log-sum-exp and delta are loaded from global memory in its step, or with PREFETCH one step ahead
    (PREFETCH_STATS). With FUSED (FUSED_DQ) each tile's dQ = dS K over these keys too, through ds_smem (dS^T) and
    one of the two buffers of dq_smem, added into dq_desc's rows by TMA; with SPLIT (FUSED_SPLIT) the columns of dQ
    in kc_w's (this warpgroup's, WG, half of them) over both warpgroups' keys, their dS^T in one of ds_smem's two
    buffers, each filled once both have arrived on its ds_bar. k_op: S^T's A operand, k_w or its registers
    (K_IN_REGISTERS)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    half: gl.constexpr = k_w.shape[0]
    # With DS_SMEM (SPLIT, `ds_from_shared`) dK's A operand dS^T is read from shared memory (where dQ's is stored
    # anyway), which leaves the registers of its 16-bit copy free; at d=128 dQ has one buffer (two do not fit shared
    # memory there).
    N_DQ: gl.constexpr = dq_smem.shape[0]
    s_zero = gl.zeros([half, BLOCK_M], gl.float32, s_layout)
    if FUSED:
        dq_cols: gl.constexpr = dq_desc.block_type.shape[1]
        dq_zero = gl.zeros([BLOCK_M, dq_cols], gl.float32, _mma_layout(dq_cols))
    if PREFETCH:
        end = (m_first + hi) * BLOCK_M
        ahead = (m_first + lo) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_layout)
        lse_ahead = gl.load(LSE + stat_row + ahead, mask=ahead < end, other=0.0)
        delta_ahead = gl.load(DELTA + stat_row + ahead, mask=ahead < end, other=0.0)
    for j in range(lo, hi):
        slot = j % NUM_STAGES
        cols = (m_first + j) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_layout)
        if PREFETCH:
            lse2 = lse_ahead * LOG2E
            delta = delta_ahead
            ahead = cols + BLOCK_M
            lse_ahead = gl.load(LSE + stat_row + ahead, mask=ahead < end, other=0.0)
            delta_ahead = gl.load(DELTA + stat_row + ahead, mask=ahead < end, other=0.0)
        else:
            lse2 = gl.load(LSE + stat_row + cols) * LOG2E
            delta = 0.0  # _issue_dv_dk loads it
        mbarrier.wait(ready.index(slot), (j // NUM_STAGES) & 1)
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        s_token = warpgroup_mma(k_op, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_token = warpgroup_mma(v_w, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # MMA groups complete in order: waiting for all but the newest waits for S^T alone.
        s = warpgroup_mma_wait(1, deps=[s_token])
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))
        if MASK:
            p = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), p, 0.0)
        if DS_SMEM:  # this warpgroup's rows of the step's dS^T buffer (SPLIT: below)
            ds_w = ds_smem.index(j % 2).slice(WG * half, half)
        else:
            ds_w = ds_smem
        dv_token, dk_token, p_op, ds_op, ds = _issue_dv_dk(p, dp_token, dv, dk, q_tile, do_tile, DELTA, stat_row,
                                                           cols, delta, ds_w, a_layout, PREFETCH, DS_SMEM)
        if FUSED:
            # dQ = dS K, its A operand dS^T from shared memory, transposed.
            if SPLIT:
                # This warpgroup's rows of the step's buffer: the other warpgroup last read it two steps ago, and
                # has since arrived on the other buffer's barrier, after waiting for that product.
                ds_all = ds_smem.index(j % 2)
                if not DS_SMEM:  # else stored for dK already
                    ds_all.slice(WG * half, half).store(ds)
                    fence_async_shared()
                    gl.thread_barrier()  # every thread's rows stored before the warpgroup's one arrival
                mbarrier.arrive(ds_bar.index(j % 2))
                mbarrier.wait(ds_bar.index(j % 2), (j // 2) & 1)
                dq_token = warpgroup_mma(ds_all.permute((1, 0)), kc_w, dq_zero, use_acc=False, is_async=True)
            else:  # the buffer is free: last step's product was waited for
                ds_smem.store(ds)
                fence_async_shared()
                dq_token = warpgroup_mma(ds_smem.permute((1, 0)), k_w, dq_zero, use_acc=False, is_async=True)
            dv, dk, p_op, ds_op, dq = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op, dq_token])
            mbarrier.arrive(empty.index(slot))
            # The reduction issued from this buffer (one of two; at d=128 the only one) two steps (one) ago has read
            # it.
            dq_buffer = dq_smem.index(j % N_DQ)
            tma.store_wait(N_DQ - 1)
            dq_buffer.store(dq * sm_scale)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [stat_row + (m_first + j) * BLOCK_M, WG * dq_cols if SPLIT else 0], dq_buffer)
        else:
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op])
            mbarrier.arrive(empty.index(slot))
    return dk, dv


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, dq_desc, LSE, DELTA, k_w, v_w, q_smem, do_smem, ds_smem, dq_smem, kc_w, ds_bar,
                   kv_bar, ready, empty, out_row, stat_row, key0, m_first, n_masked, n_tiles, qk_scale, sm_scale,
                   CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                   PREFETCH: gl.constexpr, FUSED: gl.constexpr, SPLIT: gl.constexpr, WG: gl.constexpr,
                   DS_SMEM: gl.constexpr, K_REGS: gl.constexpr):
    half: gl.constexpr = k_w.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    a_layout: gl.constexpr = _a_layout(HEAD_DIM)
    keys = key0 + gl.arange(0, half, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([half, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([half, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    if K_REGS:  # K_IN_REGISTERS
        k_op = k_w.load(_a_layout(BLOCK_M))
    else:
        k_op = k_w
    if CAUSAL:
        # The query tiles that overlap the program's keys need the mask; those after them do not.
        dk, dv = _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys,
                            0, n_masked, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M,
                            NUM_STAGES, True, s_layout, a_layout, PREFETCH, FUSED, SPLIT, WG, DS_SMEM)
        dk, dv = _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys,
                            n_masked, n_tiles, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M,
                            NUM_STAGES, False, s_layout, a_layout, PREFETCH, FUSED, SPLIT, WG, DS_SMEM)
    else:
        dk, dv = _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys,
                            0, n_tiles, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M,
                            NUM_STAGES, False, s_layout, a_layout, PREFETCH, FUSED, SPLIT, WG, DS_SMEM)
    # Epilogue: through this warpgroup's K and V buffers (no longer read) and TMA stores; the wait covers the dQ
    # reductions too.
    k_w.store((dk * sm_scale).to(dk_desc.dtype))
    v_w.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [out_row, 0], k_w)
    tma.async_copy_shared_to_global(dv_desc, [out_row, 0], v_w)
    tma.store_wait(0)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, kc_desc, LSE, DELTA, N_Q, N_K, H, BH,
                 GROUP_HEADS, qk_scale, sm_scale,
                 Q_RB, Q_RH, Q_CB, Q_CH, K_RB, K_RH, K_CB, K_CH, V_RB, V_RH, V_CB, V_CH,
                 DO_RB, DO_RH, DO_CB, DO_CH,
                 HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PREFETCH: gl.constexpr,
                 GROUPED: gl.constexpr, FUSED: gl.constexpr, SPLIT: gl.constexpr,
                 DS_SMEM: gl.constexpr, K_REGS: gl.constexpr):
    HALF: gl.constexpr = k_desc.block_type.shape[0]  # keys per consumer warpgroup
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # The heaviest (causal: the first keys, which every later query sees) first.
    if GROUPED:  # in program_position's order without the mask: the first blocks first
        off_bh, block = launch_order.program_position(N_K, BH, GROUP_HEADS, 2 * HALF, False)
    else:
        block = gl.program_id(0)
        off_bh = gl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    key0 = block * 2 * HALF
    if CAUSAL:
        m_first = key0 // BLOCK_M  # earlier queries see none of these keys
        n_masked = 2 * HALF // BLOCK_M
    else:
        m_first = 0
        n_masked = 0
    n_tiles = N_Q // BLOCK_M - m_first

    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # Q and dO tiles share a ring's barriers: a tile's pair arrives, and is released, together.
    q_smem, ready, empty = ring(q_desc, NUM_STAGES, HEAD_DIM, 2)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    # Not read unless FUSED (and SPLIT):
    ds_0, ds_1, dq_0, dq_1, kc_0, kc_1, kc_smem, ds_bar = k_smem, k_smem, k_smem, k_smem, k_smem, k_smem, k_smem, kv_bar
    if FUSED:  # per consumer warpgroup two fp32 dQ tiles (one may still be read by its reduction; d=128: one)
        dq_cols: gl.constexpr = dq_desc.block_type.shape[1]
        N_DQ: gl.constexpr = 1 if HEAD_DIM > 64 else 2
        dq_0 = gl.allocate_shared_memory(gl.float32, [N_DQ, BLOCK_M, dq_cols], dq_desc.layout)
        dq_1 = gl.allocate_shared_memory(gl.float32, [N_DQ, BLOCK_M, dq_cols], dq_desc.layout)
        if SPLIT:  # two buffers of both warpgroups' dS^T, their barriers (an arrival each), K's two column halves
            ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF, BLOCK_M], q_desc.layout)
            ds_0, ds_1 = ds_smem, ds_smem
            ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(ds_bar.index(i), count=2)
            kc_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF, dq_cols], kc_desc.layout)
            kc_0, kc_1 = kc_smem.index(0), kc_smem.index(1)
        else:  # per consumer warpgroup, dS^T
            ds_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_M], q_desc.layout)
            ds_0, ds_1 = ds_smem.index(0), ds_smem.index(1)

    stat_row = off_bh * N_Q  # lse and delta (and the fp32 dQ): contiguous, one row per head
    out_row = off_bh * N_K + key0  # dK and dV are contiguous: (B*H*N_K, D) views
    gl.warp_specialize([
        (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, LSE, DELTA, k_smem.index(0), v_smem.index(0), q_smem, do_smem,
                          ds_0, dq_0, kc_0, ds_bar, kv_bar, ready, empty, out_row, stat_row, key0, m_first, n_masked,
                          n_tiles, qk_scale, sm_scale, CAUSAL, BLOCK_M, HEAD_DIM, NUM_STAGES, PREFETCH, FUSED, SPLIT,
                          0, DS_SMEM, K_REGS)),
        (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, LSE, DELTA, k_smem.index(1), v_smem.index(1), q_smem, do_smem,
                          ds_1, dq_1, kc_1, ds_bar, kv_bar, ready, empty, out_row + HALF, stat_row, key0 + HALF,
                          m_first, n_masked, n_tiles, qk_scale, sm_scale, CAUSAL, BLOCK_M, HEAD_DIM, NUM_STAGES,
                          PREFETCH, FUSED, SPLIT, 1, DS_SMEM, K_REGS)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, kc_desc, k_smem, v_smem, q_smem, do_smem, kc_smem, kv_bar,
                          ready, empty, b * K_RB + h * K_RH + key0, b * K_CB + h * K_CH, b * V_RB + h * V_RH + key0,
                          b * V_CB + h * V_CH, b * Q_RB + h * Q_RH + m_first * BLOCK_M, b * Q_CB + h * Q_CH,
                          b * DO_RB + h * DO_RH + m_first * BLOCK_M, b * DO_CB + h * DO_CH, n_tiles, BLOCK_M,
                          NUM_STAGES, SPLIT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------ dQ


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                 v_ready, v_empty, q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col, n_tiles,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    half: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row + w * half, q_col], q_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [do_row + w * half, do_col], q_bar, do_smem.index(w))
    stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, k_col, v_row, v_col, n_tiles,
              BLOCK_N, NUM_STAGES)


@gluon.jit
def _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, lo, hi,
             qk_scale, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
             s_layout: gl.constexpr, a_layout: gl.constexpr):
    """Key tiles [lo, hi) into dQ."""
    half: gl.constexpr = q_w.shape[0]
    s_zero = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    for j in range(lo, hi):
        slot = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        k_tile = k_smem.index(slot)
        s_token = warpgroup_mma(q_w, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp_token = warpgroup_mma(do_w, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_token])
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if MASK:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp_token])
        mbarrier.arrive(v_empty.index(slot))
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(k_tile.dtype), a_layout)
        dq_token = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=[dq_token, ds_op])
        mbarrier.arrive(k_empty.index(slot))
    return dq


@gluon.jit
def _dq_consumer(dq_desc, LSE, DELTA, MARKS, q_w, do_w, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                 out_row, row0, stat_row, n_full, n_tiles, qk_scale, sm_scale,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                 MARK: gl.constexpr):
    """With MARK, MARKS[row] (int8) says whether the row's dQ is not finite, for flash_triton's fix-up."""
    half: gl.constexpr = q_w.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    a_layout: gl.constexpr = _a_layout(HEAD_DIM)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = row0 + gl.arange(0, half, layout=row_layout)
    lse2 = gl.load(LSE + stat_row + rows) * LOG2E
    delta = gl.load(DELTA + stat_row + rows)
    dq = gl.zeros([half, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(q_bar, 0)
    if CAUSAL:
        # Key tiles wholly before the program's first row unmasked, then those that overlap its rows masked.
        dq = _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, 0,
                      n_full, qk_scale, BLOCK_N, NUM_STAGES, False, s_layout, a_layout)
        dq = _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, n_full,
                      n_tiles, qk_scale, BLOCK_N, NUM_STAGES, True, s_layout, a_layout)
    else:
        dq = _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, 0,
                      n_tiles, qk_scale, BLOCK_N, NUM_STAGES, False, s_layout, a_layout)
    if MARK:
        bad = gl.convert_layout(gl.max((dq * 0.0 != 0.0).to(gl.int32), 1), row_layout)
        gl.store(MARKS + stat_row + rows, bad.to(gl.int8))
    q_w.store((dq * sm_scale).to(dq_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [out_row, 0], q_w)
    tma.store_wait(0)


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, MARKS, N_Q, N_K, H, BH, GROUP_HEADS, qk_scale,
               sm_scale, Q_RB, Q_RH, Q_CB, Q_CH, K_RB, K_RH, K_CB, K_CH, V_RB, V_RH, V_CB, V_CH, DO_RB, DO_RH, DO_CB,
               DO_CH, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, GROUPED: gl.constexpr, MARK: gl.constexpr):
    HALF: gl.constexpr = q_desc.block_type.shape[0]  # query rows per consumer warpgroup
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # The heaviest (causal: the last rows, which see every key) first.
    if GROUPED:
        off_bh, block = launch_order.program_position(N_Q, BH, GROUP_HEADS, 2 * HALF, CAUSAL)
    else:
        block = gl.program_id(0)
        if CAUSAL:
            block = N_Q // (2 * HALF) - 1 - block
        off_bh = gl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    row0 = block * 2 * HALF
    if CAUSAL:
        n_full = row0 // BLOCK_N
        n_tiles = (row0 + 2 * HALF) // BLOCK_N
    else:
        n_full = N_K // BLOCK_N
        n_tiles = N_K // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], do_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, k_ready, k_empty = ring(k_desc, NUM_STAGES, HEAD_DIM, 2)
    v_smem, v_ready, v_empty = ring(v_desc, NUM_STAGES, HEAD_DIM, 2)

    stat_row = off_bh * N_Q
    out_row = off_bh * N_Q + row0  # dQ is contiguous: a (B*H*N_Q, D) view
    gl.warp_specialize([
        (_dq_consumer, (dq_desc, LSE, DELTA, MARKS, q_smem.index(0), do_smem.index(0), k_smem, v_smem, q_bar,
                        k_ready, k_empty, v_ready, v_empty, out_row, row0, stat_row, n_full, n_tiles, qk_scale,
                        sm_scale, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
        (_dq_consumer, (dq_desc, LSE, DELTA, MARKS, q_smem.index(1), do_smem.index(1), k_smem, v_smem, q_bar,
                        k_ready, k_empty, v_ready, v_empty, out_row + HALF, row0 + HALF, stat_row, n_full, n_tiles,
                        qk_scale, sm_scale, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                        v_ready, v_empty, b * Q_RB + h * Q_RH + row0, b * Q_CB + h * Q_CH,
                        b * DO_RB + h * DO_RH + row0, b * DO_CB + h * DO_CH, b * K_RB + h * K_RH,
                        b * K_CB + h * K_CH, b * V_RB + h * V_RH, b * V_CB + h * V_CH, n_tiles, BLOCK_N,
                        NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


CAST_ROWS = 64  # rows per program of the cast of a fused dQ (a length is a multiple of 128)


@triton.jit
def _cast_dq_kernel(DQ_ACC, DQ, MARKS, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, MARK: tl.constexpr):
    """dQ in its dtype from the fp32 accumulator of FUSED_DQ (rows of HEAD_DIM, a program per BLOCK_ROWS), and with
    MARK each row's mark (int8: whether it is not finite) for flash_triton's fix-up."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offsets = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    dq = tl.load(DQ_ACC + offsets)
    tl.store(DQ + offsets, dq.to(DQ.dtype.element_ty))
    if MARK:
        tl.store(MARKS + rows, tl.max((dq * 0.0 != 0.0).to(tl.int8), 1))


# ------------------------------------------------------------------------------------------------ wrapper


def backward(q, k, v, do, lse, delta, dk, dv, dq_acc, marks, is_causal, backward_plan: BackwardPlan) -> torch.Tensor:
    """Writes dK and dV into dk, dv (new, contiguous, of q's dtype) and returns dQ (new, contiguous) for inputs these
    kernels take (`backward_plan`: what `views()` returned for inputs of this signature, under the same capture
    state), given the forward's natural-log log-sum-exp and delta = rowsum(dO * O), both fp32 and contiguous, one row
    per head, and with `fused_dq` the fp32 buffer in which the dK/dV kernel accumulates dQ, (rows of q, d), zeroed
    (else None). With `marks` (int8, a row per query row; causal) each row's mark says whether its dQ is not finite,
    for flash_triton's fix-up; a plan keeps whether its first call had marks. dQ is allocated after the dK/dV kernel's
    launch: the device may be waiting for it, and an allocation costs the CPU tens of microseconds.
    The first call for a plan works out its launches' arguments that are not tensors and launches through triton;
    later ones pass the tensors to the kept launches (`launcher.Launch`: in the descriptors' places, the first launch's
    descriptors over them)."""
    check_causal(is_causal, impl="hopper")
    p = backward_plan
    first = p.is_causal != is_causal
    if first:
        dkdv, dq_launch = _launches(q, k, v, do, dk, dv, dq_acc, marks, is_causal, p)
    if p.concurrent:
        current, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(current)  # the inputs, delta included, are ready on it
    if first:
        p.dkdv = dkdv(lse, delta)
    else:  # with FUSED_SPLIT, K's halves are the eighth descriptor, over k
        p.dkdv((q, k, v, do, dk, dv, dq_acc, k if p.split else None, lse, delta, *p.dkdv_scalars))
    if p.fused_dq:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        p.cast = p.cast((dq_acc, dq, marks))
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        with torch.cuda.stream(side) if p.concurrent else contextlib.nullcontext():
            if first:
                p.dq = dq_launch(dq, lse, delta, marks)
            else:
                p.dq((q, k, v, do, dq, lse, delta, marks, *p.dq_scalars))
        if p.concurrent:
            # dq, allocated on the current stream, is written on the side one: the current stream waits for it
            # before anything there (a free by the caching allocator included) can touch it.
            current.wait_stream(side)
    if first:  # later calls take the kept launches (none without the launcher's DIRECT: then every call is a first)
        kept = p.dkdv is not None and (p.fused_dq or p.dq is not None)
        p.is_causal = is_causal if kept else None
    return dq


def _launches(q, k, v, do, dk, dv, dq_acc, marks, is_causal, p: BackwardPlan):
    """Works out the launches of plan `p` for these inputs, storing their arguments that are not tensors in `p`, and
    with `fused_dq` the cast of dQ (`p.cast`, a `launcher.Pending`); returns functions that make the others through
    `launcher.launch`, with descriptors: dkdv(lse, delta) and dq(dq, lse, delta, marks), each returning the
    `launcher.Launch` for later calls (None when there is none)."""
    d, n_q, n_k = q.shape[-1], q.shape[-2], k.shape[-2]
    bh = q.numel() // (n_q * d)
    heads = q.shape[1] if q.dim() == 4 else 1
    qv, kv, vv, dov, fused_dq = p.qv, p.kv, p.vv, p.dov, p.fused_dq
    strides = (*qv[2:], *kv[2:], *vv[2:], *dov[2:])
    sm_scale = 1.0 / math.sqrt(d)
    qk_scale = sm_scale * LOG2E.value
    desc = flash_hopper._descriptor
    half = BLOCK_KEYS // 2
    block_m, block_n = TILES[d]
    common = dict(HEAD_DIM=d, CAUSAL=is_causal, NUM_STAGES=NUM_STAGES, CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS, GROUPED=GROUPED_ORDER, num_warps=4)
    # With GROUPED_ORDER, heads per group: the dK/dV kernel streams q and dO, the dQ kernel k and v.
    groups = (launch_order.group_heads(q, bh), launch_order.group_heads(k, bh)) if GROUPED_ORDER else (1, 1)
    # dq, dk, dv are new; lse and delta contiguous. The tiles are the descriptors' block shapes, not constexprs; the
    # views fix the descriptors' shapes and strides.
    key = (q.device, q.dtype, q.shape, k.shape, block_m, block_n, qv, kv, vv, dov)
    split = fused_dq and FUSED_SPLIT
    if fused_dq and GROUPED_ORDER and FUSED_GROUP_HEADS is not None:  # in the launch's key: not set by the shapes
        groups = (max(1, min(bh, FUSED_GROUP_HEADS)), groups[1])
        key += (groups,)
    dq_desc = kc_desc = None
    if fused_dq:
        dq_desc = flash_hopper.tma_descriptor(dq_acc, [bh * n_q, d], [d, 1], [block_m, d // 2 if split else d],
                                              DQ_ACC_LAYOUT)
    if split:  # K's tiles of the program's keys and half of d, in the layout their MMA reads
        (n_rows, n_cols), stride = kv[:2]
        layout = flash_hopper._smem_layout(BLOCK_KEYS, d // 2, flash_hopper._gl_dtype(k.dtype))
        kc_desc = flash_hopper.tma_descriptor(k, [n_rows, n_cols], [stride, 1], [BLOCK_KEYS, d // 2], layout)
    p.split = split
    if fused_dq:
        p.cast = launcher.Pending(_cast_dq_kernel, (bh * n_q // CAST_ROWS,), (q.device, q.dtype, q.shape),
                                  HEAD_DIM=d, BLOCK_ROWS=CAST_ROWS, MARK=marks is not None)
    p.dkdv_scalars = (n_q, n_k, heads, bh, groups[0], qk_scale, sm_scale, *strides)
    p.dq_scalars = (n_q, n_k, heads, bh, groups[1], qk_scale, sm_scale, *strides)

    def dkdv(lse, delta):
        return launcher.launch(
            _dkdv_kernel, (n_k // BLOCK_KEYS * bh,) if GROUPED_ORDER else (n_k // BLOCK_KEYS, bh),
            (desc(q, qv, block_m), desc(k, kv, half), desc(v, vv, half), desc(do, dov, block_m),
             desc(dk, flash_hopper._view(dk), half), desc(dv, flash_hopper._view(dv), half), dq_desc, kc_desc, lse,
             delta, *p.dkdv_scalars),
            ("dkdv", *key), PREFETCH=(is_causal, d) in PREFETCH_STATS, FUSED=fused_dq, SPLIT=split,
            DS_SMEM=p.ds_smem, K_REGS=fused_dq and K_IN_REGISTERS and d == 64, **common,
        )

    def dq_launch(dq, lse, delta, marks):
        rows = BLOCK_ROWS // 2
        return launcher.launch(
            _dq_kernel, (n_q // BLOCK_ROWS * bh,) if GROUPED_ORDER else (n_q // BLOCK_ROWS, bh),
            (desc(q, qv, rows), desc(k, kv, block_n), desc(v, vv, block_n), desc(do, dov, rows),
             desc(dq, flash_hopper._view(dq), rows), lse, delta, marks, *p.dq_scalars),
            ("dq", *key), MARK=marks is not None, **common,
        )

    return dkdv, dq_launch


@functools.cache
def _side_stream(device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


plans.watch(__name__)
