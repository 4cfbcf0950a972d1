"""FlashAttention forward for Hopper (sm_90) in Gluon, Triton's lower-level language: the FA3 pipeline.

It serves the case where the Triton-language forward falls short of cuDNN on the H100: head dim 128
(docs/attention.md, "Head dim 128, and the floor of one block per multiprocessor"). Triton waits for the Q K^T
product right after issuing it, so the softmax never runs while the tensor cores work. Gluon issues and waits for
the warpgroup MMAs explicitly, which is what FA3 does (Shah et al., "FlashAttention-3", 2024):

* A program owns 128 query rows, split over two consumer warpgroups of 64 rows each (at d=64 on large problems
  192 rows over three, FA3's tile there: `plan`), plus a one-warp producer that issues every TMA load (warp
  specialization). The producer streams K and V through rings of NUM_STAGES shared
  buffers guarded by "ready" and "empty" mbarriers (an empty barrier takes one arrival per consumer warpgroup).
* A consumer's iteration j: issue S_j = Q K_j^T (async), scale O by alpha_{j-1}, issue O += P_{j-1} V_{j-1} (async,
  P from registers), wait for S_j only, release K_j, run the softmax of S_j while P_{j-1} V_{j-1} is still on the
  tensor cores, then wait for it and release V_{j-1}.

Scores are in base 2 (the scale folded into log2(e)); the saved log-sum-exp is the natural log. With a causal
mask, key tiles above the diagonal are never loaded and only the diagonal tiles (and the first one) pay for the
mask. The launch order is the Triton forward's (lmsys.attention.launch_order): heads in groups that keep their keys
and values in L2, heaviest query block first.

FA3 also has its two consumer warpgroups take turns to issue their products ("pingpong"); here each issues as soon
as its operands are ready, since turns kept by an mbarrier per warpgroup measure slower on the H100
(docs/attention.md, "PINGPONG, removed", with the other variants measured).

Scope: CUDA tensors of compute capability 9.0, bf16 or fp16, head dim 128 (or 64 on long sequences:
`plan`), both lengths multiples of 128, enough query blocks to give every multiprocessor one (MIN_PROGRAMS_PER_SM),
each of q, k and v either with its heads one after another (contiguous) or side by side in its rows (the (batch,
heads, seq, d) view of a (batch, seq, heads, d) projection, which the model passes; `_view`). The output is
contiguous. Where the GPU's table holds a measured choice for a problem's bucket
(`lmsys.attention.tuned.measured_choice`, MEASURED), the table says whether it runs here and with how many
warpgroups; `plan`'s thresholds decide the rest. `applies()` says whether inputs qualify; `flash_triton.forward` uses
this kernel for them and its own forward for everything else. There is no interpreter for Gluon (and under
TRITON_INTERPRET=1 Gluon cannot compile at all): tests/test_attention.py compiles the kernel for sm_90 in a process
without the interpreter on any machine, and checks it against float64 on the GPU.
"""

import functools
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmsys.attention import launch_order, launcher, plans, tuned
from lmsys.attention.checks import check_causal

BLOCK_M = 128  # query rows per program of two consumer warpgroups (three at d=64 on large problems: `plan`)
WARPGROUP_ROWS = 64
# The registers of each of three consumer warpgroups (FA3's 192-row tile at d=64): 3 x 128 consumer threads at 160 and
# 128 producer threads at 24 (the one producer warp is given a warpgroup's) fit the 64K. A program's last warpgroups
# may then fall past the queries (lengths are multiples of 128, not of 192): they run, and store nothing.
CONSUMER_REGS_3 = 160
BLOCK_N = 128  # keys per tile
NUM_STAGES = 2  # K and V buffers per ring; 3 measure no faster (docs/attention.md)
HEAD_DIMS = (64, 128)  # what it compiles for; where it runs: `plan`
# Whether a problem in a bucket for which this GPU's table holds a choice (lmsys.attention.tuned.measured_choice: the
# fastest of the Triton forward and this one with two or three consumer warpgroups) runs as the table says; `plan`'s
# thresholds decide the others. Scripts that time each way in turn set it off.
MEASURED = True
# setmaxnreg budgets: 2 x 128 consumer threads at 240 and 32 producer threads at 24 fit the 64K registers.
CONSUMER_REGS = 240
PRODUCER_REGS = 24
LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


# Programs per multiprocessor below which the Triton forward runs instead: with few programs its smaller tiles (more
# programs) win. Each threshold here is where this kernel measures faster than the Triton forward on the H100
# (docs/attention.md, "The Gluon forward (flash_hopper), measured"); sizes not timed keep the Triton forward.
MIN_PROGRAMS_PER_SM = 1
# At d=64 it runs a narrower window: from FORWARD_64_MIN_KEYS keys and below FORWARD_64_BELOW_PROGRAMS_PER_SM programs
# per multiprocessor (few heads of long sequences; the model's 512-token heads stay with the Triton forward).
FORWARD_64_MIN_KEYS = 32768
FORWARD_64_BELOW_PROGRAMS_PER_SM = 4
# And with three consumer warpgroups a program (192 query rows: FA3's tile at d=64) from FORWARD_64_WIDE_MIN_KEYS keys
# and FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM blocks of 128 rows per multiprocessor (`plan` checks this first). With
# fewer blocks the last programs of 192 rows make a second wave and two warpgroups are faster.
FORWARD_64_WIDE_MIN_KEYS = 16384
FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM = 7.5


def plan(head_dim: int, programs_per_sm: float, keys: int) -> int | None:
    """How many consumer warpgroups a program of the forward here has (2, or 3 of 64 query rows each), or None when
    the Triton kernel runs it, for a problem of this head dim, `programs_per_sm` blocks of 128 query rows per
    multiprocessor and `keys` keys, given that this kernel takes the inputs (`views`)."""
    if head_dim not in HEAD_DIMS or programs_per_sm < MIN_PROGRAMS_PER_SM:
        return None
    if head_dim == 64:
        if keys >= FORWARD_64_WIDE_MIN_KEYS and programs_per_sm >= FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM:
            return 3
        return 2 if keys >= FORWARD_64_MIN_KEYS and programs_per_sm < FORWARD_64_BELOW_PROGRAMS_PER_SM else None
    return 2


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _view(x):
    """The 2-D view that the kernel's tensor descriptor spans, for a (batch, heads, seq, d) or (batch, seq, d) input,
    and where each head starts in it: ((rows, columns), row stride, RB, RH, CB, CH), head (b, h) starting at row
    b * RB + h * RH and column b * CB + h * CH; or None when no such view holds the input. The rows are the sequence's
    (one row stride); the batch and head dims each step whole rows (their stride a multiple of the row stride:
    contiguous heads, rows padded or not) or columns within a row (the transposed view of a (B, T, H, d) projection,
    as the model makes them, or of a (T, B, d) tensor), all of a row's heads within the row stride. TMA needs 16-byte
    aligned rows and base."""
    if x.dim() == 3:  # one head (no unsqueeze: a view costs microseconds of CPU per call)
        (batch, n, d), (stride_b, stride_n, stride_d) = x.shape, x.stride()
        heads, stride_h = 1, 0
    else:
        (batch, heads, n, d), (stride_b, stride_h, stride_n, stride_d) = x.shape, x.stride()
    if stride_d != 1 or stride_n < d or (stride_n * x.element_size()) % 16 or x.data_ptr() % 16:
        return None
    rows, cols, steps = n, d, []
    for size, stride in ((batch, stride_b), (heads, stride_h)):
        if size == 1:
            steps += [0, 0]
        elif stride % stride_n == 0:
            rows += (size - 1) * (stride // stride_n)
            steps += [stride // stride_n, 0]
        else:
            cols += (size - 1) * stride
            steps += [0, stride]
    if cols > stride_n:
        return None
    rb, cb, rh, ch = steps
    return (rows, cols), stride_n, rb, rh, cb, ch


def views(q, k, v, head_dims=None):
    """The 2-D views (`_view`) of q, k and v when this kernel's descriptors can take these (batch, heads, seq, d) or
    (batch, seq, d) inputs, of any size, else None. The backward (flash_hopper_bwd) asks with its own head dims
    (by default HEAD_DIMS)."""
    head_dims = HEAD_DIMS if head_dims is None else head_dims
    takes = (
        q.is_cuda
        and _is_hopper(q.device)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in head_dims
        and q.shape[-2] % BLOCK_M == 0
        and k.shape[-2] % BLOCK_N == 0
    )
    found = (_view(q), _view(k), _view(v)) if takes else (None,)
    return None if None in found else found


def blocks_per_sm(q, rows: int = BLOCK_M) -> float:
    """Blocks of `rows` query rows (programs of a grid over them) per multiprocessor of q's CUDA device."""
    return q.numel() // (q.shape[-1] * rows) / _sm_count(q.device)


class ForwardPlan:
    """What `forward` needs beyond the tensors for inputs that this kernel takes: `views` (what `views()` found), the
    consumer warpgroups a program has (`plan`), whether rows whose output is not finite are marked (`mark`, set by
    flash_triton before the first launch) and, once it has launched, the launch (`launcher.Launch`) and its
    arguments that are not tensors. A caller keeps it for later inputs of the same signature (shapes, strides, dtype,
    device, alignment): lmsys.attention.plans."""

    __slots__ = ("views", "consumers", "mark", "is_causal", "launch", "scalars")

    def __init__(self, views, consumers):
        self.views, self.consumers, self.mark = views, consumers, False
        self.is_causal = self.launch = self.scalars = None


def forward_views(q, k, v, is_causal: bool) -> ForwardPlan | None:
    """A `ForwardPlan` when the forward runs these inputs here, else None: as the GPU's table says for the problem's
    bucket (`lmsys.attention.tuned.measured_choice`, MEASURED), else as `plan` says; and when `views` holds them."""
    if not q.is_cuda:
        return None
    per_sm = blocks_per_sm(q)
    choice = tuned.measured_choice("forward", q, is_causal, k.shape[-2], per_sm) if MEASURED else None
    if choice is None:
        consumers = plan(q.shape[-1], per_sm, k.shape[-2])
    else:
        consumers = {"triton": None, "gluon": 2, "gluon-3wg": 3 if q.shape[-1] == 64 else 2}[choice]
    if consumers is None:
        return None
    found = views(q, k, v)
    return None if found is None else ForwardPlan(found, consumers)


def applies(q, k, v, is_causal: bool) -> bool:
    """Whether the forward runs these (batch, heads, seq, d) or (batch, seq, d) inputs here."""
    return forward_views(q, k, v, is_causal) is not None


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, rows, j, BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one raw score tile (fp32): probabilities, rescale factor, new row max and row sum."""
    if MASK:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), s, -float("inf"))
    m_ij = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_ij, 1))
    alpha = gl.exp2(m_i - m_ij)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_ij, l_i


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              q_row, q_col, k_row, k_col, v_row, v_col, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              HALF_M: gl.constexpr):
    consumers: gl.constexpr = q_smem.shape[0]
    mbarrier.expect(q_bar, consumers * q_desc.block_type.nbytes)
    for w in gl.static_range(consumers):
        tma.async_copy_global_to_shared(q_desc, [q_row + w * HALF_M, q_col], q_bar, q_smem.index(w))
    stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, k_col, v_row, v_col, n_tiles,
              BLOCK_N, NUM_STAGES)


@gluon.jit
def stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, k_col, v_row, v_col,
              n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The producer's loads of n_tiles K and V tiles of BLOCK_N rows into their rings (`ring`), each into a buffer
    the consumers have released."""
    for j in range(n_tiles):
        slot = j % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase of parity 1: the first round passes at once.
        phase = ((j // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], k_ready.index(slot),
                                        k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], v_ready.index(slot),
                                        v_smem.index(slot))


@gluon.jit
def _consumer_loop(o, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                   lo, hi, qk_scale, rows, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
                   s_layout: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr):
    """Key tiles [lo, hi): S_j is computed while P_{j-1} V_{j-1} accumulates; the softmax of S_j overlaps the latter."""
    rows_per_wg: gl.constexpr = q_smem.shape[0]
    s_zero = gl.zeros([rows_per_wg, BLOCK_N], gl.float32, s_layout)
    for j in range(lo, hi):
        slot = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
        s_token = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
        o_token = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
        # MMA groups complete in order: waiting for all but the newest one waits for S_j alone.
        s = warpgroup_mma_wait(1, deps=[s_token])
        mbarrier.arrive(k_empty.index(slot))
        p_next, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, rows, j, BLOCK_N, MASK, s_layout)
        p_next = gl.convert_layout(p_next.to(q_smem.dtype), p_layout)
        o, p = warpgroup_mma_wait(0, deps=[o_token, p])
        mbarrier.arrive(v_empty.index(prev))
        p = p_next
    return o, m_i, l_i, p, alpha


@gluon.jit
def _consumer(q_all, WG: gl.constexpr, o_desc, lse_ptr, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              o_block, lse_block, block0, n_full, n_tiles, qk_scale, N_Q,
              CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              MARK: gl.constexpr):
    """Consumer warpgroup WG of a program whose rows start at block0 (output row o_block, log-sum-exp lse_block): the
    WG-th 64 of them, their Q tile in q_all.index(WG). With MARK a row whose output is not finite gets a NaN
    log-sum-exp, for flash_triton's fix-up (GUARD_MASKED)."""
    q_smem = q_all.index(WG)
    rows_per_wg: gl.constexpr = q_smem.shape[0]
    o_row = o_block + WG * rows_per_wg
    row0 = block0 + WG * rows_per_wg
    lse_row = lse_block + WG * rows_per_wg
    warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = row0 + gl.arange(0, rows_per_wg, layout=row_layout)

    # Prologue: S_0 and its softmax (masked when causal; on a tile below the diagonal the mask changes nothing).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_token = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                            gl.zeros([rows_per_wg, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_token])
    mbarrier.arrive(k_empty.index(0))
    m_i = gl.full([rows_per_wg], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([rows_per_wg], gl.float32, row_layout)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, rows, 0, BLOCK_N, CAUSAL, s_layout)
    p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    o = gl.zeros([rows_per_wg, HEAD_DIM], gl.float32, o_layout)

    if CAUSAL:
        # Tiles strictly below the diagonal block unmasked, then the diagonal ones masked.
        o, m_i, l_i, p, alpha = _consumer_loop(o, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_ready, k_empty,
                                               v_ready, v_empty, 1, n_full, qk_scale, rows, BLOCK_N, NUM_STAGES,
                                               False, s_layout, p_layout, o_layout)
        o, m_i, l_i, p, alpha = _consumer_loop(o, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_ready, k_empty,
                                               v_ready, v_empty, gl.maximum(n_full, 1), n_tiles, qk_scale, rows,
                                               BLOCK_N, NUM_STAGES, True, s_layout, p_layout, o_layout)
    else:
        o, m_i, l_i, p, alpha = _consumer_loop(o, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_ready, k_empty,
                                               v_ready, v_empty, 1, n_tiles, qk_scale, rows, BLOCK_N, NUM_STAGES,
                                               False, s_layout, p_layout, o_layout)
    # Last tile: O = alpha * O + P_last V_last.
    last = (n_tiles - 1) % NUM_STAGES
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
    o_token = warpgroup_mma(p, v_smem.index(last), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o_token])
    mbarrier.arrive(v_empty.index(last))

    # Epilogue: O / l through this warpgroup's Q buffer (no longer read) and a TMA store; lse (natural log).
    # With three warpgroups, this one's rows may fall past the queries (then in the next head's rows, or none).
    if row0 < N_Q:
        o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        lse = (m_i + gl.log2(l_i)) * LN2
        if MARK:
            bad = gl.convert_layout(gl.max((o * 0.0 != 0.0).to(gl.int32), 1), row_layout)
            lse = gl.where(bad > 0, float("nan"), lse)
        gl.store(lse_ptr + lse_row + gl.arange(0, rows_per_wg, layout=row_layout), lse)
        q_smem.store(o.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [o_row, 0], q_smem)
        tma.store_wait(0)


@gluon.jit
def ring(desc, NUM_STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, CONSUMERS: gl.constexpr):
    """A ring of NUM_STAGES shared buffers for desc's tiles (rows x HEAD_DIM) and their mbarriers: "ready", one
    arrival (the producer's TMA load), and "empty", one per consumer warpgroup (CONSUMERS), done reading."""
    smem = gl.allocate_shared_memory(desc.dtype, [NUM_STAGES, desc.block_type.shape[0], HEAD_DIM], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return smem, ready, empty


@gluon.jit
def _flash_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, H, BH, GROUP_HEADS, qk_scale,
                             Q_RB, Q_RH, Q_CB, Q_CH, K_RB, K_RH, K_CB, K_CH, V_RB, V_RH, V_CB, V_CH,
                             HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                             NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             CONSUMERS: gl.constexpr, MARK: gl.constexpr):
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]  # rows per consumer warpgroup
    BLOCK_M: gl.constexpr = CONSUMERS * HALF_M
    dtype: gl.constexpr = q_desc.dtype
    off_bh, start_m = launch_order.program_position(N_Q, BH, GROUP_HEADS, BLOCK_M, CAUSAL)
    b = off_bh // H
    h = off_bh % H
    # Where head (b, h) starts in each input's 2-D view (_view): row b * RB + h * RH, column b * CB + h * CH.
    q_row = b * Q_RB + h * Q_RH + start_m * BLOCK_M
    o_row = off_bh * N_Q + start_m * BLOCK_M  # the output is contiguous: a (B*H*N, D) view
    if CAUSAL:
        n_full = (start_m * BLOCK_M) // BLOCK_N  # key tiles strictly below the diagonal block
        n_tiles = gl.minimum(gl.cdiv((start_m + 1) * BLOCK_M, BLOCK_N), N_K // BLOCK_N)
    else:
        n_full = N_K // BLOCK_N
        n_tiles = N_K // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, HALF_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, k_ready, k_empty = ring(k_desc, NUM_STAGES, HEAD_DIM, CONSUMERS)
    v_smem, v_ready, v_empty = ring(v_desc, NUM_STAGES, HEAD_DIM, CONSUMERS)

    row0 = start_m * BLOCK_M
    lse_row = off_bh * N_Q + row0
    k_row, v_row = b * K_RB + h * K_RH, b * V_RB + h * V_RH
    q_col, k_col, v_col = b * Q_CB + h * Q_CH, b * K_CB + h * K_CH, b * V_CB + h * V_CH
    # Consumer warpgroup w (its second argument): the rows from row0 + w * HALF_M, in q_smem.index(w).
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (q_smem, 0, o_desc, LSE, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_row,
                         lse_row, row0, n_full, n_tiles, qk_scale, N_Q, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
            (_consumer, (q_smem, 1, o_desc, LSE, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_row,
                         lse_row, row0, n_full, n_tiles, qk_scale, N_Q, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
            (_consumer, (q_smem, 2, o_desc, LSE, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_row,
                         lse_row, row0, n_full, n_tiles, qk_scale, N_Q, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                         q_row, q_col, k_row, k_col, v_row, v_col, n_tiles, BLOCK_N, NUM_STAGES, HALF_M)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:  # the same without the third consumer
        gl.warp_specialize([
            (_consumer, (q_smem, 0, o_desc, LSE, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_row,
                         lse_row, row0, n_full, n_tiles, qk_scale, N_Q, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
            (_consumer, (q_smem, 1, o_desc, LSE, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_row,
                         lse_row, row0, n_full, n_tiles, qk_scale, N_Q, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES, MARK)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                         q_row, q_col, k_row, k_col, v_row, v_col, n_tiles, BLOCK_N, NUM_STAGES, HALF_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.cache
def _smem_layout(rows, d, dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, d], dtype)


def tma_descriptor(base, shape, strides, block_shape, layout) -> TensorDescriptor:
    """`TensorDescriptor(base, shape, strides, block_shape, layout)` without its __post_init__'s checks (alignment,
    rank, block shape: microseconds of CPU per descriptor, and a backward builds eight; docs/attention.md, "The CPU
    side of a call"), for arguments already known to pass them: views that `_view` returned, tiles of this module's
    constants, new contiguous tensors. The fields are TensorDescriptor's own (tests/test_attention.py compares both
    constructions, so a Triton upgrade that changes the class fails there)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout = base, shape, strides, block_shape, layout
    desc.padding = "zero"
    return desc


def _descriptor(x, view, rows):
    """A TMA descriptor over the 2-D view `view` (_view's first two items) of x, tiles of `rows` x d."""
    (n_rows, n_cols), stride = view[:2]
    d = x.shape[-1]
    return tma_descriptor(x, [n_rows, n_cols], [stride, 1], [rows, d], _smem_layout(rows, d, _gl_dtype(x.dtype)))


def forward(q, k, v, is_causal, forward_plan: ForwardPlan):
    """(o, lse) for inputs that this kernel takes, `forward_plan` being what `forward_views()` returned for inputs of
    their signature: output in q's dtype, contiguous, natural-log log-sum-exp in fp32 of q's shape without d. With the
    plan's `mark` (causal) a row whose output is not finite gets a NaN log-sum-exp (flash_triton's fix-up reads it)."""
    check_causal(is_causal, impl="hopper")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if forward_plan.launch is not None and forward_plan.is_causal == is_causal:
        # The descriptors of the first launch over these tensors (launcher.Launch).
        forward_plan.launch((q, k, v, o, lse, *forward_plan.scalars))
        return o, lse
    d, n_q, n_k = q.shape[-1], q.shape[-2], k.shape[-2]
    heads = q.shape[1] if q.dim() == 4 else 1
    bh = q.numel() // (n_q * d)
    # Key tiles never cross a head: the lengths are multiples of 128 (a program of 3 warpgroups may end past them).
    found = (*forward_plan.views, _view(o))
    consumers = forward_plan.consumers
    block_m = consumers * WARPGROUP_ROWS
    scalars = (n_q, n_k, heads, bh, launch_order.group_heads(k, bh), LOG2E / math.sqrt(d), *found[0][2:],
               *found[1][2:], *found[2][2:])
    forward_plan.launch = launcher.launch(
        _flash_fwd_hopper_kernel, (triton.cdiv(n_q, block_m) * bh,),
        (_descriptor(q, found[0], WARPGROUP_ROWS), _descriptor(k, found[1], BLOCK_N),
         _descriptor(v, found[2], BLOCK_N), _descriptor(o, found[3], WARPGROUP_ROWS), lse, *scalars),
        # _view checked the alignment; o and lse are new. The views fix the descriptors' shapes and strides.
        (q.device, q.dtype, q.shape, n_k, *found),
        HEAD_DIM=d, CAUSAL=is_causal, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
        CONSUMER_REGS=CONSUMER_REGS_3 if consumers == 3 else CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        CONSUMERS=consumers, MARK=forward_plan.mark and is_causal, num_warps=4,
    )
    forward_plan.is_causal, forward_plan.scalars = is_causal, scalars
    return o, lse


plans.watch(__name__)
