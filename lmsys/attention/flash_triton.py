"""FlashAttention-2 in Triton: forward and backward kernels.

Algorithm: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (2023).

Forward: one program per (query block, batch*head). The query tile stays in registers while key/value tiles
stream past it; an online softmax keeps a running row maximum ``m`` and row sum ``l`` so that the (T, T) score
matrix never exists in memory. Scores are computed in base 2: the softmax scale is folded together with
log2(e) into one multiplier so every exponential is an ``exp2``. With a causal mask, key tiles above the
diagonal are never loaded; the tiles strictly below it run without any mask (stage 1), and only the diagonal
tiles pay for the mask (stage 2). Programs run heaviest first across a group of heads whose keys and values fit
in L2 (lmsys.attention.launch_order), so a causal launch ends on its cheapest blocks. The forward saves only the
output and the log-sum-exp (natural log, fp32).

Backward: recomputation. A small kernel computes ``D = rowsum(dO * O)``. The main kernel gives each program
one key block, for which it accumulates dK and dV over the query blocks that see it, and one query block, for
which it accumulates dQ over the key blocks it sees. Every gradient tile is owned by exactly one program, so
there are no atomics; with a causal mask the two halves of a program's work add up to the same amount for
every program, which keeps the launch balanced.

On Hopper, 16-bit inputs with head dim 128 (or 64 on long sequences: `flash_hopper.plan`) and lengths multiples of 128
take the Gluon forward of lmsys.attention.flash_hopper instead (FA3's pipeline, which Triton's compiler does not
produce; `flash_hopper.plan`); such inputs at d=64 or 128, on problems of enough programs to fill the GPU
(`flash_hopper_bwd.plan`), take the Gluon backward of lmsys.attention.flash_hopper_bwd (HOPPER_BACKWARD), every other
input the Triton backward below.

Tuning: tile sizes, warps and pipeline depth are autotuned per (length rounded up to a power of two, head dim, causal,
dtype); the forward may load its tiles through tensor descriptors (TMA on Hopper) instead of pointers, whichever is
faster. The choice is kept in triton's on-disk cache (``cache_results``; its key holds the kernel's source, the configs,
triton's version and the GPU's architecture), so later processes take the same config without timing them again: the
perf gate then compares one config's time across runs, not the autotuner's pick among configs a few percent apart. A GPU
whose committed table (lmsys.attention.tuned, ``python -m lmsys.attention.tuned --export``) pins a config for a kernel
at a key gets that config alone from the pruning hook, so a cold cache compiles one config there, not all of them;
``LMSYS_ATTENTION_PINS=0`` turns the pins off. Under
``torch.compile`` the wrappers are ``torch.library`` custom ops, opaque to the compiler; eager calls skip the custom-op
dispatch, every launch after the first of its kind skips triton's wrappers (lmsys.attention.launcher), and what a call
works out from its inputs' signature is kept per signature (lmsys.attention.plans). Any sequence
length works: boundary masks are compiled in only when a length is not a multiple of the tile (``EVEN_*`` heuristics).
Any head dim up to 128 works (the 2.7B model's is 80): tiles are BLOCK_D wide, the head dim rounded up to a power of two
(at least 16), and the padding columns load as zeros, which leaves every product over the head dim unchanged, and are
never stored; a power-of-two head dim compiles without those masks. A head dim in SPLIT_HEAD_DIMS (from 65 to 96) runs
split instead: tiles of its first 64 columns and tiles of the rest, 16 or 32 wide (`_head_chunks`), every product over
the head dim the sum of the two chunks' (the forward's second chunk loads through pointers, not descriptors). With
``TRITON_INTERPRET=1`` the same kernels run on the CPU (small shapes, for tests).
"""

import functools
import math
import os

import torch
import triton
import triton.language as tl

from lmsys.attention import flash_hopper, flash_hopper_bwd, launch_order, launcher, plans, tuned
from lmsys.attention.checks import check_causal, check_inputs, refuse_double_backward

# Any head dim up to 128: the kernels' tiles are BLOCK_D = _block_d(d) wide, zero-padded past d.
HEAD_DIMS = range(1, 129)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# A finite "minus infinity" for masked scores: exp2 of it is 0, and a row whose tile is all masked gives no NaN. It
# replaces a masked score (tl.where) rather than being added to it, so a NaN or inf in a key that a query cannot see
# stays out of that query's row, as in naive attention.
MASKED = tl.constexpr(-1.0e6)

_INTERPRET = triton.knobs.runtime.interpret
# GUARD_MASKED: with a causal mask, a NaN or inf in a key or value that a query cannot see stays out of that query's
# output and dQ row, as in lmsys.attention.masking (docs/attention.md, "Masked NaN and inf"). Each pass marks the rows
# whose result is not finite (the forward by a NaN log-sum-exp, the dQ pass in an int8 row of marks), and a fix-up
# launch (`_flash_fwd_fixup_kernel`, `_flash_bwd_fixup_kernel`) recomputes the blocks of marked rows with guarded
# products in the diagonal tiles (`_seen_dot`). False: no marks, no fix-up.
GUARD_MASKED = True
# The fix-up launches' tiles (fit fp32 up to d=128), the query blocks each program checks (CHUNK: few programs, so
# that a launch over clean blocks, the usual case, costs about one wave of loads; docs/attention.md), and their warps
# and stages.
_FIXUP_FWD = ({"BLOCK_M": 32, "BLOCK_N": 16, "CHUNK": 4} if _INTERPRET
              else {"BLOCK_M": 64, "BLOCK_N": 32, "CHUNK": 32})
_FIXUP_BWD = ({"BLOCK_M": 32, "BLOCK_N2": 16, "CHUNK": 4} if _INTERPRET
              else {"BLOCK_M": 64, "BLOCK_N2": 32, "CHUNK": 32})
_FIXUP_LAUNCH = {"num_warps": 4, "num_stages": 2}
# Inputs that lmsys.attention.flash_hopper takes (Hopper, 16-bit, d=128, or d=64 on long sequences:
# `flash_hopper.plan`; lengths multiples of 128) go to its Gluon forward, measured faster there than the forward
# below; False sends everything to the Triton-language kernels.
HOPPER_FORWARD = True
# The inputs of the Gluon forward with head dim 64 or 128, on problems large enough, take the Gluon backward of
# lmsys.attention.flash_hopper_bwd (measured faster there than the Triton backward below), unless
# LMSYS_HOPPER_BACKWARD=0 is set when lmsys is imported.
HOPPER_BACKWARD = os.environ.get("LMSYS_HOPPER_BACKWARD") != "0"


def _block_d(head_dim):
    """Tile width along the head dim: the next power of two (tl.arange needs one), at least 16 (tl.dot's least)."""
    return max(16, triton.next_power_of_2(head_dim))


# Head dims 80 (the 2.7B model's) and 96 run split along the head dim: tiles of the first 64 columns and tiles of the
# other 16 or 32, so that every product over the head dim does 80 or 96 columns' work rather than a padded 128's. On
# the H200 the split kernels beat the padded ones at every measured point, forward and backward (docs/attention.md,
# "The training grid, and head dims 80 and 96"). A second chunk narrower than its tile (d=72: 8 columns in 16) fails
# the float64 gradient check on the GPU, so only remainders that fill their tile (16, 32) split. SPLIT_HEAD_DIMS: the
# head dims that run so.
SPLIT_HEAD_DIMS = frozenset({80, 96})
_SPLIT_AT = 64


def _head_chunks(head_dim):
    """(HEAD_DIM, BLOCK_D, HEAD_DIM1, BLOCK_D1): the kernels' constexprs for the head dim's columns, chunk 0 (its real
    width and tile width) and chunk 1 (HEAD_DIM1 = 0: no second chunk; its tile width is then a placeholder)."""
    if head_dim in SPLIT_HEAD_DIMS and head_dim - _SPLIT_AT in (16, 32):
        return _SPLIT_AT, _SPLIT_AT, head_dim - _SPLIT_AT, head_dim - _SPLIT_AT
    return head_dim, _block_d(head_dim), 0, 16


def _chunk_constexprs(head_dim) -> dict:
    """The kernels' head-dim constexprs (`_head_chunks`) by name."""
    return dict(zip(("HEAD_DIM", "BLOCK_D", "HEAD_DIM1", "BLOCK_D1"), _head_chunks(head_dim), strict=True))


def _autotune_key(n_q, n_k):
    """Sequence lengths rounded up to a power of two: one tuning per size class, not per odd length."""
    return triton.next_power_of_2(max(n_q, n_k))


# ------------------------------------------------------------------------------------------------- forward


# Up to this length a launch takes microseconds and tuning buys little: one config per tile height is
# compiled and timed, not all of them (each config is a compilation per dtype, head dim and mask variant).
_SMALL_PROBLEM = 2048


def _even_flags(rows: str, cols: str) -> dict:
    """The kernels' EVEN_* heuristics: whether the query (key) length is a multiple of the tile's `rows` (`cols`), so
    that no load needs a bounds mask (evaluated by triton's heuristics wrapper, once per distinct launch: see
    lmsys.attention.launcher)."""
    return {"EVEN_M": lambda a: a["N_Q"] % a[rows] == 0, "EVEN_N": lambda a: a["N_K"] % a[cols] == 0}


def _prune_configs(configs, named_args, rows, tiles=None, kernel=None, **kwargs):
    """Drop tiles much taller (`rows`) than the problem, and for fp32 all but the small tiles verified on the H100
    to fit shared memory up to d=128 (fp32 operands take twice the room). With `tiles` (head dim -> configs), keep
    only the configs listed for the tiles' width along the head dim (BLOCK_D, plus BLOCK_D1 when the head dim is
    split: a head dim of 80 has the tiles of 128 either way), in their order. Up to _SMALL_PROBLEM tokens, keep one
    config of each tile height. Of what is left, the config that this GPU's table pins at this key for the kernel
    named `kernel` (a global of this module) is kept alone (lmsys.attention.tuned)."""
    n = max(named_args["N_Q"], named_args["N_K"])
    fp32 = named_args["Q"].element_size() == 4
    if tiles is not None and not _INTERPRET:
        width = kwargs["BLOCK_D"] + (kwargs["BLOCK_D1"] if kwargs["HEAD_DIM1"] else 0)
        configs = [c for c in tiles[min(d for d in tiles if d >= width)] if c in configs]
    kept = [
        c for c in configs
        if c.kwargs[rows] <= max(64, triton.next_power_of_2(n))
        and (not fp32 or (c.kwargs[rows] <= 64 and c.num_stages <= 2))
    ]
    if n <= _SMALL_PROBLEM:
        kept = [next(c for c in kept if c.kwargs[rows] == h) for h in {c.kwargs[rows]: None for c in kept}]
    return kept if kernel is None else tuned.choose(globals()[kernel], kept, named_args, kwargs)


def _fwd_config(bm, bn, warps, stages, tma, maxnreg=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}, num_warps=warps, num_stages=stages,
                         maxnreg=maxnreg)


# (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA[, maxnreg]) per head dim (up to), fastest first: the winners of
# sweeps on the H100 in bf16, causal and not. A short list keeps the autotuner from picking, through timing noise,
# a config that is a few percent slower; 64 x 32 is the tile that fits fp32. maxnreg=128 fits two programs of
# eight warps on one multiprocessor.
_FWD_TILES = {
    64: [(128, 64, 8, 3, False), (128, 128, 4, 3, False), (128, 128, 4, 3, True), (128, 64, 4, 3, False),
         (128, 128, 8, 2, True, 128), (64, 64, 4, 3, False), (64, 32, 4, 2, False)],
    128: [(128, 64, 4, 2, True), (128, 64, 8, 2, True, 128), (128, 64, 8, 2, False, 128), (128, 128, 8, 3, False),
          (64, 64, 4, 3, False), (64, 32, 4, 2, False)],
}
_FWD_CONFIGS = {d: [_fwd_config(*t) for t in tiles] for d, tiles in _FWD_TILES.items()}


def _fwd_configs():
    if _INTERPRET:
        return [_fwd_config(32, 16, 4, 1, False)]
    return list(dict.fromkeys(c for configs in _FWD_CONFIGS.values() for c in configs))


@triton.jit
def _tile_mask(rows, offs_d, n_rows, HEAD_DIM: tl.constexpr, BOUNDS_MASK: tl.constexpr):
    """Which elements of a (len(rows), len(offs_d)) tile exist: rows below n_rows (checked only with BOUNDS_MASK) and
    columns below HEAD_DIM (checked only when the tile is padded wider than the head dim). One of them must apply."""
    if BOUNDS_MASK and offs_d.shape[0] != HEAD_DIM:
        return (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    elif BOUNDS_MASK:
        return rows[:, None] < n_rows
    else:
        return offs_d[None, :] < HEAD_DIM


@triton.jit
def _load_rows(src, start, offs_rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr, BOUNDS_MASK: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows [start, start + len(offs_rows)) of a (n_rows, HEAD_DIM) matrix with unit stride along HEAD_DIM, as a tile
    len(offs_d) wide; rows past the end and the padding columns past HEAD_DIM read as 0 (so they add nothing to a
    dot product over the head dim)."""
    if USE_TMA:
        # A tensor descriptor (TMA on Hopper) zero-fills rows past n_rows and columns past HEAD_DIM by itself.
        return src.load([start, 0])
    else:
        ptrs = src + (start + offs_rows)[:, None] * stride_row + offs_d[None, :]
        if BOUNDS_MASK or offs_d.shape[0] != HEAD_DIM:
            return tl.load(ptrs, mask=_tile_mask(start + offs_rows, offs_d, n_rows, HEAD_DIM, BOUNDS_MASK), other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _store_rows(dst, value, rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr, BOUNDS_MASK: tl.constexpr):
    """Store the tile `value` as `rows` of a (n_rows, HEAD_DIM) matrix, leaving out rows past the end and the padding
    columns past HEAD_DIM."""
    ptrs = dst + rows[:, None] * stride_row + offs_d[None, :]
    value = value.to(dst.dtype.element_ty)
    if BOUNDS_MASK or offs_d.shape[0] != HEAD_DIM:
        tl.store(ptrs, value, mask=_tile_mask(rows, offs_d, n_rows, HEAD_DIM, BOUNDS_MASK))
    else:
        tl.store(ptrs, value)


@triton.jit
def _load_pair(A, B, start, stride_a, stride_b, n_rows, offs_d, offs_d1, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM1: tl.constexpr, BOUNDS_MASK: tl.constexpr):
    """Rows [start, start + ROWS) of two matrices (`_load_rows`) and, for a split head dim (HEAD_DIM1 > 0), of their
    second chunks, columns from HEAD_DIM on; without one the chunks are zero placeholders that nothing reads."""
    rows = tl.arange(0, ROWS)
    a = _load_rows(A, start, rows, offs_d, stride_a, n_rows, HEAD_DIM, BOUNDS_MASK, False)
    b = _load_rows(B, start, rows, offs_d, stride_b, n_rows, HEAD_DIM, BOUNDS_MASK, False)
    if HEAD_DIM1 > 0:
        a1 = _load_rows(A + HEAD_DIM, start, rows, offs_d1, stride_a, n_rows, HEAD_DIM1, BOUNDS_MASK, False)
        b1 = _load_rows(B + HEAD_DIM, start, rows, offs_d1, stride_b, n_rows, HEAD_DIM1, BOUNDS_MASK, False)
    else:
        a1 = tl.zeros([ROWS, offs_d1.shape[0]], dtype=A.dtype.element_ty)
        b1 = a1
    return a, b, a1, b1


@triton.jit
def _seen_dot(a, b, cols, rows, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in a diagonal tile, for an `a` that is zero where row i cannot see position j (j > i, causal), with a
    non-finite b[j, c] reaching only the rows that see j: the product takes b's finite entries, and column c of each
    row at or past the first position whose b[., c] is not finite is NaN (lmsys.attention.masking.seen_product). `cols`
    are b's positions and `rows` a's. No branch: a tile of finite values costs a select and a column minimum."""
    finite = b * 0.0 == 0.0
    out = tl.dot(a.to(b.dtype), tl.where(finite, b, 0.0), acc, input_precision=DOT_PRECISION)
    first = tl.min(tl.where(finite, 2**30, cols[:, None]), 0)  # per column, the first non-finite position
    return tl.where(rows[:, None] >= first[None, :], float("nan"), out)


@triton.jit
def _not_finite_rows(x):
    """Per row of the fp32 tile x, whether an entry is NaN or inf: then the row's sum is (times 0, NaN). A sum past
    fp32's range marks a finite row too, which costs the fix-up time, not correctness."""
    return tl.sum(x, 1) * 0.0 != 0.0


@triton.jit
def _pv(p, v, v1, acc, acc1, HEAD_DIM1: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + p @ v, and acc1 + p @ v1 for the head dim's second chunk (HEAD_DIM1 > 0; else acc1 as it is)."""
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    if HEAD_DIM1 > 0:
        acc1 = tl.dot(p.to(v1.dtype), v1, acc1, input_precision=DOT_PRECISION)
    return acc, acc1


@triton.jit
def _fwd_inner(
    acc, acc1, l_i, m_i, q, q1, K, V, K1, V1,
    stride_kn, stride_vn,
    offs_m, offs_d, offs_d1, lo, hi, N_K, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    BOUNDS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, GUARD: tl.constexpr,
):
    """The online softmax over the key tiles [lo, hi). With HEAD_DIM1 the head dim is split: q1, acc1 and K1, V1 (the
    columns from HEAD_DIM on, through pointers; offs_d1 wide, HEAD_DIM1 real) are its second chunk. With GUARD (and
    CAUSAL_MASK) a non-finite value that a row cannot see stays out of that row (GUARD_MASKED); a non-finite key needs
    nothing: its masked scores are replaced, not multiplied."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(K, start_n, offs_n, offs_d, stride_kn, N_K, HEAD_DIM, BOUNDS_MASK, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if HEAD_DIM1 > 0:
            k1 = _load_rows(K1, start_n, offs_n, offs_d1, stride_kn, N_K, HEAD_DIM1, BOUNDS_MASK, False)
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)
        if CAUSAL_MASK or BOUNDS_MASK:
            if CAUSAL_MASK and BOUNDS_MASK:
                keep = (offs_m[:, None] >= cols[None, :]) & (cols[None, :] < N_K)
            elif CAUSAL_MASK:
                keep = offs_m[:, None] >= cols[None, :]
            else:
                keep = cols[None, :] < N_K
            qk = tl.where(keep, qk * qk_scale, MASKED)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_rows(V, start_n, offs_n, offs_d, stride_vn, N_K, HEAD_DIM, BOUNDS_MASK, USE_TMA)
        if HEAD_DIM1 > 0:
            acc1 = acc1 * alpha[:, None]
            v1 = _load_rows(V1, start_n, offs_n, offs_d1, stride_vn, N_K, HEAD_DIM1, BOUNDS_MASK, False)
        else:
            v1 = v
        if GUARD and CAUSAL_MASK:
            acc = _seen_dot(p, v, cols, offs_m, acc, DOT_PRECISION)
            if HEAD_DIM1 > 0:
                acc1 = _seen_dot(p, v1, cols, offs_m, acc1, DOT_PRECISION)
        else:
            acc, acc1 = _pv(p, v, v1, acc, acc1, HEAD_DIM1, DOT_PRECISION)
        m_i = m_ij
    return acc, acc1, l_i, m_i


@triton.jit
def _fwd_block(
    Q, K, V, O, LSE, off_bh, start_m, N_Q, N_K, H, qk_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, MARK: tl.constexpr, GUARD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Output and log-sum-exp of query block start_m (BLOCK_M rows) of batch * head off_bh. With MARK (causal) a row
    whose output is not finite gets a NaN log-sum-exp; with GUARD (causal) the diagonal tiles take guarded products."""
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    O += off_b * stride_ob + off_h * stride_oh
    LSE += off_bh.to(tl.int64) * N_Q

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # The head dim's second chunk (columns HEAD_DIM to HEAD_DIM + HEAD_DIM1) when it is split; else placeholders that
    # nothing reads.
    offs_d1 = tl.arange(0, BLOCK_D1)
    acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    K1 = K + HEAD_DIM
    V1 = V + HEAD_DIM
    if TMA:
        # Global shapes of the real head dim, tiles of the padded one: the padding columns load as zeros.
        q_src = tl.make_tensor_descriptor(Q, [N_Q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D])
        K = tl.make_tensor_descriptor(K, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, [N_K, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])
    else:
        q_src = Q
    q = _load_rows(q_src, start_m * BLOCK_M, tl.arange(0, BLOCK_M), offs_d, stride_qm, N_Q, HEAD_DIM, not EVEN_M, TMA)
    if HEAD_DIM1 > 0:
        q1 = _load_rows(Q + HEAD_DIM, start_m * BLOCK_M, tl.arange(0, BLOCK_M), offs_d1, stride_qm, N_Q, HEAD_DIM1,
                        not EVEN_M, False)
    else:
        q1 = acc1.to(Q.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        # Stage 1: key tiles strictly below the diagonal, no mask at all.
        diag = start_m * BLOCK_M
        acc, acc1, l_i, m_i = _fwd_inner(
            acc, acc1, l_i, m_i, q, q1, K, V, K1, V1, stride_kn, stride_vn,
            offs_m, offs_d, offs_d1, 0, diag, N_K, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_N, False, False, DOT_PRECISION, TMA, False,
        )
        # Stage 2: the diagonal tiles, masked (and bounds-checked when the length is ragged).
        acc, acc1, l_i, m_i = _fwd_inner(
            acc, acc1, l_i, m_i, q, q1, K, V, K1, V1, stride_kn, stride_vn,
            offs_m, offs_d, offs_d1, diag, tl.minimum(diag + BLOCK_M, N_K), N_K, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_N, True, not EVEN_N, DOT_PRECISION, TMA, GUARD,
        )
    else:
        n_full = (N_K // BLOCK_N) * BLOCK_N
        acc, acc1, l_i, m_i = _fwd_inner(
            acc, acc1, l_i, m_i, q, q1, K, V, K1, V1, stride_kn, stride_vn,
            offs_m, offs_d, offs_d1, 0, n_full, N_K, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_N, False, False, DOT_PRECISION, TMA, False,
        )
        if not EVEN_N:
            acc, acc1, l_i, m_i = _fwd_inner(
                acc, acc1, l_i, m_i, q, q1, K, V, K1, V1, stride_kn, stride_vn,
                offs_m, offs_d, offs_d1, n_full, N_K, N_K, qk_scale,
                HEAD_DIM, HEAD_DIM1, BLOCK_N, False, True, DOT_PRECISION, TMA, False,
            )

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2  # back from base 2 to the natural log
    if MARK:
        bad = _not_finite_rows(acc)
        if HEAD_DIM1 > 0:
            bad = bad | _not_finite_rows(acc1)
        lse = tl.where(bad, float("nan"), lse)
    if EVEN_M:
        tl.store(LSE + offs_m, lse)
    else:
        tl.store(LSE + offs_m, lse, mask=offs_m < N_Q)
    _store_rows(O, acc, offs_m, offs_d, stride_om, N_Q, HEAD_DIM, not EVEN_M)
    if HEAD_DIM1 > 0:
        _store_rows(O + HEAD_DIM, acc1 / l_i[:, None], offs_m, offs_d1, stride_om, N_Q, HEAD_DIM1, not EVEN_M)


@triton.autotune(
    configs=_fwd_configs(),
    key=["N_BUCKET", "HEAD_DIM", "HEAD_DIM1", "CAUSAL"],
    prune_configs_by={"early_config_prune": functools.partial(_prune_configs, rows="BLOCK_M", tiles=_FWD_CONFIGS,
                                                              kernel="_flash_fwd_kernel")},
    cache_results=True,
)
@triton.heuristics(_even_flags("BLOCK_M", "BLOCK_N"))
@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE,
    N_Q, N_K, H, BH, GROUP_HEADS, N_BUCKET, qk_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_OK: tl.constexpr, MARK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """One program per query block (`launch_order.program_position`); with MARK (causal) the rows whose output is not
    finite get a NaN log-sum-exp, for `_flash_fwd_fixup_kernel`."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    off_bh, start_m = launch_order.program_position(N_Q, BH, GROUP_HEADS, BLOCK_M, CAUSAL)
    _fwd_block(
        Q, K, V, O, LSE, off_bh, start_m, N_Q, N_K, H, qk_scale,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
        HEAD_DIM, BLOCK_D, HEAD_DIM1, BLOCK_D1, CAUSAL, DOT_PRECISION, MARK, False,
        BLOCK_M, BLOCK_N, USE_TMA and TMA_OK, EVEN_M, EVEN_N,
    )


@triton.jit
def _marked_blocks(MARKS, n_rows, BH, per_head, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NAN: tl.constexpr):
    """This program's CHUNK blocks of the marks (BH heads of n_rows rows, per_head blocks of BLOCK_M rows each,
    numbered head by head): their numbers, and per block 1 where a row of it is marked (NAN: a NaN log-sum-exp; else
    a non-zero int8 mark), with each marked block's rank among them (1, 2, ...), from one load of the whole chunk."""
    blocks = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    rows = (blocks % per_head)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    ptrs = MARKS + (blocks // per_head).to(tl.int64)[:, None] * n_rows + rows
    marks = tl.load(ptrs, mask=(blocks < BH * per_head)[:, None] & (rows < n_rows), other=0)
    if NAN:
        marked = tl.max((marks != marks).to(tl.int32), 1)
    else:
        marked = tl.max((marks != 0).to(tl.int32), 1)
    return blocks, marked, tl.cumsum(marked, 0)


@triton.jit
def _nth_marked(blocks, marked, rank, i):
    """The number of the (i+1)-th marked block of `_marked_blocks`' chunk."""
    return tl.sum(tl.where((marked != 0) & (rank == i + 1), blocks, 0), 0)


@triton.heuristics(_even_flags("BLOCK_M", "BLOCK_N"))
@triton.jit
def _flash_fwd_fixup_kernel(
    Q, K, V, O, LSE,
    N_Q, N_K, H, BH, qk_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """GUARD_MASKED's forward fix-up (causal): each program checks the log-sum-exps of CHUNK query blocks in one load
    and recomputes the blocks with a NaN among them, with guarded diagonal products. Few programs, so that a launch
    whose blocks are all clean costs about one wave of loads."""
    per_head = tl.cdiv(N_Q, BLOCK_M)
    blocks, marked, rank = _marked_blocks(LSE, N_Q, BH, per_head, BLOCK_M, CHUNK, True)
    for i in range(tl.sum(marked, 0)):
        block = _nth_marked(blocks, marked, rank, i)
        _fwd_block(
            Q, K, V, O, LSE, block // per_head, block % per_head, N_Q, N_K, H, qk_scale,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
            HEAD_DIM, BLOCK_D, HEAD_DIM1, BLOCK_D1, CAUSAL, DOT_PRECISION, False, True,
            BLOCK_M, BLOCK_N, False, EVEN_M, EVEN_N,
        )


# ------------------------------------------------------------------------------------------------ backward


@triton.jit
def _flash_bwd_preprocess_kernel(
    O, DO, DELTA, DQ_ACC,
    N_Q, H,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    """D = rowsum(dO * O), in fp32; with ZERO_DQ also zeroes the same rows of DQ_ACC, an fp32 (batch * heads *
    N_Q, HEAD_DIM) buffer (the Gluon backward's dQ accumulator), which saves the backward a launch and an allocation's
    dispatch."""
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = _tile_mask(offs_m, offs_d, N_Q, HEAD_DIM, True)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    rows = off_bh.to(tl.int64) * N_Q + offs_m
    tl.store(DELTA + rows, delta, mask=offs_m < N_Q)
    if ZERO_DQ:
        tl.store(DQ_ACC + rows[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=mask)


def _bwd_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_BIG": 32, "BLOCK_M1": 16, "BLOCK_N2": 16}, num_warps=4, num_stages=1)]
    # (BLOCK_BIG, BLOCK_M1, BLOCK_N2, num_warps, num_stages): the winners of a wide sweep on the H100.
    tiles = [
        (128, 32, 64, 4, 3), (128, 32, 64, 4, 4), (128, 32, 32, 4, 3), (128, 32, 32, 4, 4),
        (128, 64, 64, 8, 2), (128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 64, 32, 8, 4),
        (64, 32, 32, 4, 3), (64, 32, 32, 4, 4), (64, 16, 16, 4, 2), (64, 16, 16, 4, 3),
    ]
    return [
        triton.Config({"BLOCK_BIG": big, "BLOCK_M1": m1, "BLOCK_N2": n2}, num_warps=w, num_stages=st)
        for big, m1, n2, w, st in tiles
    ]


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, dk1, dv1, k, v, k1, v1, Q, DO, LSE, DELTA,
    stride_qm, stride_dom,
    offs_n, offs_d, offs_d1, lo, hi, N_Q, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    BOUNDS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over the query tiles [lo, hi). Works on transposed scores (keys x queries).
    With HEAD_DIM1 the head dim is split: dk1, dv1, k1, v1 and the columns of Q and dO from HEAD_DIM on are its
    second chunk."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q = _load_rows(Q, start_m, offs_m0, offs_d, stride_qm, N_Q, HEAD_DIM, BOUNDS_MASK, False)
        if BOUNDS_MASK:
            rows = offs_m < N_Q
            # lse = +inf on padding rows makes their probabilities exactly 0.
            lse2 = tl.load(LSE + offs_m, mask=rows, other=float("inf")) * LOG2E
        else:
            lse2 = tl.load(LSE + offs_m) * LOG2E
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if HEAD_DIM1 > 0:
            q1 = _load_rows(Q + HEAD_DIM, start_m, offs_m0, offs_d1, stride_qm, N_Q, HEAD_DIM1, BOUNDS_MASK, False)
            qkT = tl.dot(k1, tl.trans(q1), qkT, input_precision=DOT_PRECISION)
        else:
            q1 = q
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if CAUSAL_MASK:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = _load_rows(DO, start_m, offs_m0, offs_d, stride_dom, N_Q, HEAD_DIM, BOUNDS_MASK, False)
        if BOUNDS_MASK:
            delta = tl.load(DELTA + offs_m, mask=rows, other=0.0)
        else:
            delta = tl.load(DELTA + offs_m)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HEAD_DIM1 > 0:
            do1 = _load_rows(DO + HEAD_DIM, start_m, offs_m0, offs_d1, stride_dom, N_Q, HEAD_DIM1, BOUNDS_MASK, False)
            dv1 = tl.dot(pT.to(do1.dtype), do1, dv1, input_precision=DOT_PRECISION)
            dpT = tl.dot(v1, tl.trans(do1), dpT, input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if HEAD_DIM1 > 0:
            dk1 = tl.dot(dsT.to(q1.dtype), q1, dk1, input_precision=DOT_PRECISION)
    return dk, dv, dk1, dv1


@triton.jit
def _bwd_dq_inner(
    dq, dq1, q, q1, do, do1, lse2, delta, K, V,
    stride_kn, stride_vn,
    offs_m, offs_d, offs_d1, lo, hi, N_K, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    BOUNDS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, GUARD: tl.constexpr,
):
    """Accumulate dQ of one query tile over the key tiles [lo, hi). With HEAD_DIM1 the head dim is split: dq1, q1,
    do1 and the columns of K and V from HEAD_DIM on are its second chunk. With GUARD (and CAUSAL_MASK) a non-finite
    key or value that a row cannot see stays out of that row's dQ (GUARD_MASKED): a masked dS entry is 0 even where
    dP, through a non-finite value, is not, and dS @ K takes K's finite entries."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n0
        k = _load_rows(K, start_n, offs_n0, offs_d, stride_kn, N_K, HEAD_DIM, BOUNDS_MASK, False)
        v = _load_rows(V, start_n, offs_n0, offs_d, stride_vn, N_K, HEAD_DIM, BOUNDS_MASK, False)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HEAD_DIM1 > 0:
            k1 = _load_rows(K + HEAD_DIM, start_n, offs_n0, offs_d1, stride_kn, N_K, HEAD_DIM1, BOUNDS_MASK, False)
            v1 = _load_rows(V + HEAD_DIM, start_n, offs_n0, offs_d1, stride_vn, N_K, HEAD_DIM1, BOUNDS_MASK, False)
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)
            dp = tl.dot(do1, tl.trans(v1), dp, input_precision=DOT_PRECISION)
        else:
            k1 = k
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if CAUSAL_MASK and BOUNDS_MASK:
            keep = (offs_m[:, None] >= cols[None, :]) & (cols[None, :] < N_K)
            p = tl.where(keep, p, 0.0)
        elif CAUSAL_MASK:
            keep = offs_m[:, None] >= cols[None, :]
            p = tl.where(keep, p, 0.0)
        elif BOUNDS_MASK:
            p = tl.where(cols[None, :] < N_K, p, 0.0)
        ds = p * (dp - delta[:, None])
        if GUARD and CAUSAL_MASK:
            # A masked dS entry is 0 even where dP, through a non-finite value, is not; dS @ K takes K's finite entries.
            ds = tl.where(keep, ds, 0.0)
            dq = _seen_dot(ds, k, cols, offs_m, dq, DOT_PRECISION)
            if HEAD_DIM1 > 0:
                dq1 = _seen_dot(ds, k1, cols, offs_m, dq1, DOT_PRECISION)
        else:
            dq, dq1 = _pv(ds, k, k1, dq, dq1, HEAD_DIM1, DOT_PRECISION)
    return dq, dq1


@triton.jit
def _dq_block(
    Q, K, V, DO, DQ, LSE, DELTA, MARKS, start_m, N_Q, N_K, qk_scale, sm_scale,
    stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, MARK: tl.constexpr, GUARD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """dQ of the BLOCK_M query rows from start_m of one head (every pointer at that head's rows): key tiles of BLOCK_N2
    rows. With MARK (causal) MARKS[row] (int8) says whether the row's dQ is not finite; with GUARD (causal) the diagonal
    tiles take guarded products."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q, do, q1, do1 = _load_pair(Q, DO, start_m, stride_qm, stride_dom, N_Q, offs_d, offs_d1, BLOCK_M, HEAD_DIM,
                                HEAD_DIM1, not EVEN_M)
    dq1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    if EVEN_M:
        lse2 = tl.load(LSE + offs_m) * LOG2E
        delta = tl.load(DELTA + offs_m)
    else:
        rows = offs_m < N_Q
        lse2 = tl.load(LSE + offs_m, mask=rows, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + offs_m, mask=rows, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        dq, dq1 = _bwd_dq_inner(
            dq, dq1, q, q1, do, do1, lse2, delta, K, V, stride_kn, stride_vn,
            offs_m, offs_d, offs_d1, 0, start_m, N_K, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_N2, False, False, DOT_PRECISION, False,
        )
        dq, dq1 = _bwd_dq_inner(
            dq, dq1, q, q1, do, do1, lse2, delta, K, V, stride_kn, stride_vn,
            offs_m, offs_d, offs_d1, start_m, tl.minimum(start_m + BLOCK_M, N_K), N_K, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_N2, True, not EVEN_N, DOT_PRECISION, GUARD,
        )
    else:
        dq, dq1 = _bwd_dq_inner(
            dq, dq1, q, q1, do, do1, lse2, delta, K, V, stride_kn, stride_vn,
            offs_m, offs_d, offs_d1, 0, N_K, N_K, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_N2, False, not EVEN_N, DOT_PRECISION, False,
        )
    if MARK:
        bad = _not_finite_rows(dq)
        if HEAD_DIM1 > 0:
            bad = bad | _not_finite_rows(dq1)
        tl.store(MARKS + offs_m, bad.to(tl.int8), mask=offs_m < N_Q)
    _store_rows(DQ, dq * sm_scale, offs_m, offs_d, stride_dqm, N_Q, HEAD_DIM, not EVEN_M)
    if HEAD_DIM1 > 0:
        _store_rows(DQ + HEAD_DIM, dq1 * sm_scale, offs_m, offs_d1, stride_dqm, N_Q, HEAD_DIM1, not EVEN_M)


@triton.autotune(
    configs=_bwd_configs(),
    key=["N_BUCKET", "HEAD_DIM", "HEAD_DIM1", "CAUSAL"],
    prune_configs_by={"early_config_prune": functools.partial(_prune_configs, rows="BLOCK_BIG",
                                                              kernel="_flash_bwd_kernel")},
    cache_results=True,
)
@triton.heuristics(_even_flags("BLOCK_BIG", "BLOCK_BIG"))
@triton.jit
def _flash_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, MARKS,
    N_Q, N_K, H, N_BUCKET, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, MARK: tl.constexpr,
    BLOCK_BIG: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """With MARK (causal) MARKS[row] (int8, one row per head) says whether the row's dQ is not finite, for
    `_flash_bwd_fixup_kernel`."""
    # dK/dV: a key tile of BLOCK_BIG rows visits query tiles of BLOCK_M1 rows.
    # dQ: a query tile of BLOCK_BIG rows visits key tiles of BLOCK_N2 rows.
    # A split head dim (HEAD_DIM1 > 0): every tile along it is two, columns [0, HEAD_DIM) and [HEAD_DIM, HEAD_DIM +
    # HEAD_DIM1) (`_head_chunks`); without one the second chunk's values are placeholders that nothing reads.
    tl.static_assert(BLOCK_BIG % BLOCK_M1 == 0)
    tl.static_assert(BLOCK_BIG % BLOCK_N2 == 0)
    pid = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    DO += off_b * stride_dob + off_h * stride_doh
    DQ += off_b * stride_dqb + off_h * stride_dqh
    DK += off_b * stride_dkb + off_h * stride_dkh
    DV += off_b * stride_dvb + off_h * stride_dvh
    LSE += off_bh.to(tl.int64) * N_Q
    DELTA += off_bh.to(tl.int64) * N_Q
    offs_d = tl.arange(0, BLOCK_D)
    offs_d1 = tl.arange(0, BLOCK_D1)

    start_n = pid * BLOCK_BIG
    if start_n < N_K:
        offs_n = start_n + tl.arange(0, BLOCK_BIG)
        k, v, k1, v1 = _load_pair(K, V, start_n, stride_kn, stride_vn, N_K, offs_d, offs_d1, BLOCK_BIG, HEAD_DIM,
                                  HEAD_DIM1, not EVEN_N)
        dk = tl.zeros([BLOCK_BIG, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_BIG, BLOCK_D], dtype=tl.float32)
        dk1 = tl.zeros([BLOCK_BIG, BLOCK_D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_BIG, BLOCK_D1], dtype=tl.float32)
        lo = 0
        if CAUSAL:
            # Query tiles on the diagonal need the mask; those above it (earlier queries) are skipped entirely.
            lo = start_n + BLOCK_BIG
            dk, dv, dk1, dv1 = _bwd_dkdv_inner(
                dk, dv, dk1, dv1, k, v, k1, v1, Q, DO, LSE, DELTA, stride_qm, stride_dom,
                offs_n, offs_d, offs_d1, start_n, tl.minimum(lo, N_Q), N_Q, qk_scale,
                HEAD_DIM, HEAD_DIM1, BLOCK_M1, True, not EVEN_M, DOT_PRECISION,
            )
        dk, dv, dk1, dv1 = _bwd_dkdv_inner(
            dk, dv, dk1, dv1, k, v, k1, v1, Q, DO, LSE, DELTA, stride_qm, stride_dom,
            offs_n, offs_d, offs_d1, lo, N_Q, N_Q, qk_scale,
            HEAD_DIM, HEAD_DIM1, BLOCK_M1, False, not EVEN_M, DOT_PRECISION,
        )
        _store_rows(DK, dk * sm_scale, offs_n, offs_d, stride_dkn, N_K, HEAD_DIM, not EVEN_N)
        _store_rows(DV, dv, offs_n, offs_d, stride_dvn, N_K, HEAD_DIM, not EVEN_N)
        if HEAD_DIM1 > 0:
            _store_rows(DK + HEAD_DIM, dk1 * sm_scale, offs_n, offs_d1, stride_dkn, N_K, HEAD_DIM1, not EVEN_N)
            _store_rows(DV + HEAD_DIM, dv1, offs_n, offs_d1, stride_dvn, N_K, HEAD_DIM1, not EVEN_N)

    start_m = pid * BLOCK_BIG
    if start_m < N_Q:
        if MARK:
            MARKS += off_bh.to(tl.int64) * N_Q
        _dq_block(
            Q, K, V, DO, DQ, LSE, DELTA, MARKS, start_m, N_Q, N_K, qk_scale, sm_scale,
            stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
            HEAD_DIM, BLOCK_D, HEAD_DIM1, BLOCK_D1, CAUSAL, DOT_PRECISION, MARK, False,
            BLOCK_BIG, BLOCK_N2, EVEN_M, EVEN_N,
        )


@triton.heuristics(_even_flags("BLOCK_M", "BLOCK_M"))
@triton.jit
def _flash_bwd_fixup_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, MARKS,
    N_Q, N_K, H, BH, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, CHUNK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """GUARD_MASKED's dQ fix-up (causal): each program checks the marks of CHUNK query blocks in one load and
    recomputes the dQ of the blocks with a mark among them, with guarded diagonal products."""
    tl.static_assert(BLOCK_M % BLOCK_N2 == 0)
    per_head = tl.cdiv(N_Q, BLOCK_M)
    blocks, marked, rank = _marked_blocks(MARKS, N_Q, BH, per_head, BLOCK_M, CHUNK, False)
    for i in range(tl.sum(marked, 0)):
        block = _nth_marked(blocks, marked, rank, i)
        off_bh = block // per_head
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        _dq_block(
            Q + off_b * stride_qb + off_h * stride_qh, K + off_b * stride_kb + off_h * stride_kh,
            V + off_b * stride_vb + off_h * stride_vh, DO + off_b * stride_dob + off_h * stride_doh,
            DQ + off_b * stride_dqb + off_h * stride_dqh, LSE + off_bh.to(tl.int64) * N_Q,
            DELTA + off_bh.to(tl.int64) * N_Q, MARKS, (block % per_head) * BLOCK_M, N_Q, N_K, qk_scale, sm_scale,
            stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
            HEAD_DIM, BLOCK_D, HEAD_DIM1, BLOCK_D1, CAUSAL, DOT_PRECISION, False, True,
            BLOCK_M, BLOCK_N2, EVEN_M, EVEN_N,
        )


# ------------------------------------------------------------------------------------------------ wrappers


def _unit_stride(x):
    """x, or a contiguous copy when its last dim is not unit-stride (the kernels read rows as contiguous vectors)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _dims(x):
    """(batch, heads, seq, d) and the batch, head and row strides of x read as 4-D, a 3-D x being one head. No view is
    made: a view costs microseconds of CPU, which a small problem notices."""
    if x.dim() == 4:
        return x.shape, x.stride()[:3]
    batch, n, d = x.shape
    stride_b, stride_n, _ = x.stride()
    return (batch, 1, n, d), (stride_b, 0, stride_n)


def _new_strides(shape):
    """`_dims`'s strides of a new contiguous tensor of this shape (the kernels' outputs)."""
    if len(shape) == 4:
        return shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3]
    return shape[1] * shape[2], 0, shape[2]


def _tma_ok(*tensors):
    """Tensor descriptors need 16-byte aligned base addresses and row strides; the kernel moves the base by the batch
    and head strides, so those must keep it aligned too (a 16-bit head dim that is not a multiple of 8 breaks this
    for heads split off a (B, T, H, D) projection)."""
    return all(
        x.data_ptr() % 16 == 0 and all(stride * x.element_size() % 16 == 0 for stride in x.stride()[:-1])
        for x in tensors
    )


def _scratch(size, alignment, stream):
    # Global memory in which kernels build their tensor descriptors.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _dot_precision(dtype):
    # fp32 inputs: three tf32 products per dot give near-fp32 accuracy on the tensor cores.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _check(q, k, v, is_causal):
    check_inputs(q, k, v, is_causal, impl="triton", head_dims=HEAD_DIMS)
    if _INTERPRET and q.dtype == torch.bfloat16:
        # Its tl.dot returns wrong values for bf16 operands (around 8e8 seen) rather than failing.
        raise ValueError(
            "dtype torch.bfloat16 is not supported by triton under the Triton interpreter (TRITON_INTERPRET=1), "
            "which cannot multiply bf16 (triton-lang/triton#11584); use float32 or float16, or a CUDA device"
        )
    if q.device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"the Triton attention kernels need CUDA tensors, got tensors on {q.device}; "
            "set TRITON_INTERPRET=1 before importing lmsys to run them on the CPU (slow, for tests)"
        )


# Per signature of the inputs, what _fwd_impl and _bwd_impl work out from it (lmsys.attention.plans).
_FORWARD_PLANS = plans.cache()
_BACKWARD_PLANS = plans.cache()


def _fixup_grid(n_q, bh, tiles) -> tuple:
    """A fix-up's grid: a program per CHUNK of the query blocks of `tiles`' BLOCK_M rows, over `bh` heads."""
    return (triton.cdiv(triton.cdiv(n_q, tiles["BLOCK_M"]) * bh, tiles["CHUNK"]),)


class _ForwardPlan:
    """How _fwd_impl runs inputs of one signature: on the Gluon forward (`hopper`, its `flash_hopper.ForwardPlan`),
    or on the Triton kernel with these arguments after the tensors (`launch`), then, causal with GUARD_MASKED, the
    fix-up (`fixup`, with `fixup_scalars`; else None). Each launch is a `launcher.Pending`, then the `launcher.Launch`
    it made."""

    __slots__ = ("hopper", "tma", "scalars", "fixup_scalars", "launch", "fixup")

    def __init__(self, q, k, v, is_causal):
        self.hopper = flash_hopper.forward_views(q, k, v, is_causal) if HOPPER_FORWARD else None
        (batch, heads, n_q, head_dim), q_strides = _dims(q)
        n_k = k.shape[-2]
        k_strides, v_strides = _dims(k)[1], _dims(v)[1]
        # The interpreter runs tensor descriptors too (zero-filling out of bounds as TMA does), for tests that force
        # a config with USE_TMA; its own config has none.
        # A split head dim reads its second chunk through pointers: descriptors only without one.
        self.tma = (q.is_cuda or _INTERPRET) and _tma_ok(q, k, v) and _head_chunks(head_dim)[2] == 0
        qk_scale = LOG2E.value / math.sqrt(head_dim)
        strides = (*q_strides, *k_strides, *v_strides, *_new_strides(q.shape))
        self.scalars = (n_q, n_k, heads, batch * heads, launch_order.group_heads(k, batch * heads),
                        _autotune_key(n_q, n_k), qk_scale, *strides)
        self.fixup_scalars = (n_q, n_k, heads, batch * heads, qk_scale, *strides)
        # o and lse are new (aligned, contiguous): the rest of a launch follows from these.
        key = (q.device, q.dtype, q.shape, n_k, q_strides, k_strides, v_strides, launcher.aligned(q, k, v))
        common = dict(**_chunk_constexprs(head_dim), CAUSAL=is_causal, DOT_PRECISION=_dot_precision(q.dtype))
        mark = is_causal and GUARD_MASKED
        self.launch = launcher.Pending(
            _flash_fwd_kernel, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * batch * heads,), key,
            **common, TMA_OK=self.tma, MARK=mark,
        )
        self.fixup = launcher.Pending(
            _flash_fwd_fixup_kernel, _fixup_grid(n_q, batch * heads, _FIXUP_FWD), key,
            **common, **_FIXUP_FWD, **_FIXUP_LAUNCH,
        ) if mark else None
        if self.hopper is not None:
            self.hopper.mark = mark


def _fwd_impl(q, k, v, is_causal):
    signature = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, is_causal,
                 q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)
    plan = _FORWARD_PLANS.get(signature)
    if plan is None:
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return _fwd_impl(_unit_stride(q), _unit_stride(k), _unit_stride(v), is_causal)
        plan = plans.keep(_FORWARD_PLANS, signature, _ForwardPlan(q, k, v, is_causal))
    if plan.hopper is not None:
        o, lse = flash_hopper.forward(q, k, v, is_causal, plan.hopper)
    else:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        if plan.tma and q.is_cuda:
            triton.set_allocator(_scratch)
        plan.launch = plan.launch((q, k, v, o, lse, *plan.scalars))
    if plan.fixup is not None:
        plan.fixup = plan.fixup((q, k, v, o, lse, *plan.fixup_scalars))
    return o, lse


def _fwd_fake(q, k, v, is_causal):
    # Contiguous whatever the inputs' strides, as _fwd_impl allocates them: inductor checks the real strides
    # against these.
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


class _BackwardPlan:
    """How _bwd_impl runs inputs of one signature: the preprocess kernel (`preprocess`, with its arguments after the
    tensors), then the Gluon backward (`hopper`, its `flash_hopper_bwd.BackwardPlan`, with `dq_acc`, the shape of its
    fp32 dQ buffer when it accumulates dQ) or the Triton kernel (`launch`, with `scalars`), then, causal with
    GUARD_MASKED (`mark`), the dQ fix-up (`fixup`, with `fixup_scalars`; else None). Each launch is a
    `launcher.Pending`, then the `launcher.Launch` it made."""

    __slots__ = ("hopper", "dq_acc", "pre_scalars", "preprocess", "mark", "scalars", "fixup_scalars", "launch",
                 "fixup")

    def __init__(self, q, k, v, o, lse, do, is_causal):
        self.hopper = flash_hopper_bwd.views(q, k, v, do, is_causal) if HOPPER_BACKWARD else None
        fused = self.hopper is not None and self.hopper.fused_dq
        self.dq_acc = (q.numel() // q.shape[-1], q.shape[-1]) if fused else None
        (batch, heads, n_q, head_dim), o_strides = _dims(o)
        do_strides = _dims(do)[1]
        pre_block = 64
        aligned = launcher.aligned(q, k, v, o, do, lse)
        self.pre_scalars = (n_q, heads, *o_strides, *do_strides)
        self.preprocess = launcher.Pending(
            _flash_bwd_preprocess_kernel, (triton.cdiv(n_q, pre_block), batch * heads),
            (q.device, q.dtype, o.shape, o_strides, do_strides, aligned),  # delta and dq_acc are new
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=pre_block, ZERO_DQ=fused,
        )
        q_strides, k_strides, v_strides = _dims(q)[1], _dims(k)[1], _dims(v)[1]
        n_k = k.shape[-2]
        sm_scale = 1.0 / math.sqrt(head_dim)
        self.scalars = (n_q, n_k, heads, _autotune_key(n_q, n_k), sm_scale * LOG2E.value, sm_scale, *q_strides,
                        *k_strides, *v_strides, *do_strides, *_new_strides(q.shape), *_new_strides(k.shape),
                        *_new_strides(k.shape))
        # dq, dk, dv, delta and the marks are new; lse is contiguous, one row per head.
        key = (q.device, q.dtype, q.shape, k.shape, q_strides, k_strides, v_strides, do_strides, aligned)
        common = dict(**_chunk_constexprs(head_dim), CAUSAL=is_causal, DOT_PRECISION=_dot_precision(q.dtype))
        self.mark = is_causal and GUARD_MASKED
        self.fixup_scalars = (n_q, n_k, heads, batch * heads, sm_scale * LOG2E.value, sm_scale, *q_strides,
                              *k_strides, *v_strides, *do_strides, *_new_strides(q.shape))
        self.fixup = launcher.Pending(
            _flash_bwd_fixup_kernel, _fixup_grid(n_q, batch * heads, _FIXUP_BWD), key,
            **common, **_FIXUP_BWD, **_FIXUP_LAUNCH,
        ) if self.mark else None
        self.launch = None if self.hopper is not None else launcher.Pending(
            _flash_bwd_kernel, lambda meta: (triton.cdiv(max(n_q, n_k), meta["BLOCK_BIG"]), batch * heads), key,
            **common, MARK=self.mark,
        )


def _bwd_impl(q, k, v, o, lse, do, is_causal):
    signature = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(), lse.shape,
                 lse.stride(), do.shape, do.stride(), q.dtype, q.device, is_causal, q.data_ptr() % 16 == 0,
                 k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, o.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0,
                 do.data_ptr() % 16 == 0, q.is_cuda and torch.cuda.is_current_stream_capturing())
    plan = _BACKWARD_PLANS.get(signature)
    if plan is None:
        unit_stride = all(x.stride(-1) == 1 for x in (q, k, v, o, do))
        if not unit_stride or lse.shape != q.shape[:-1] or not lse.is_contiguous():
            # The kernels read rows as contiguous vectors, and lse as one row per head.
            return _bwd_impl(_unit_stride(q), _unit_stride(k), _unit_stride(v), _unit_stride(o),
                             lse.reshape(q.shape[:-1]).contiguous(), _unit_stride(do), is_causal)
        plan = plans.keep(_BACKWARD_PLANS, signature, _BackwardPlan(q, k, v, o, lse, do, is_causal))
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    # The fused Gluon backward's fp32 dQ accumulator, zeroed by the preprocess kernel.
    dq_acc = None if plan.dq_acc is None else torch.empty(plan.dq_acc, dtype=torch.float32, device=q.device)
    # Per row, whether its dQ is not finite (written by the dQ pass, read by the fix-up).
    marks = torch.empty(lse.shape, dtype=torch.int8, device=q.device) if plan.mark else None
    plan.preprocess = plan.preprocess((o, do, delta, dq_acc, *plan.pre_scalars))
    if plan.hopper is not None:
        dq = flash_hopper_bwd.backward(q, k, v, do, lse, delta, dk, dv, dq_acc, marks, is_causal, plan.hopper)
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan.launch = plan.launch((q, k, v, do, dq, dk, dv, lse, delta, marks, *plan.scalars))
    if plan.fixup is not None:
        plan.fixup = plan.fixup((q, k, v, do, dq, lse, delta, marks, *plan.fixup_scalars))
    return dq, dk, dv


def _bwd_fake(q, k, v, o, lse, do, is_causal):
    # Contiguous, as _bwd_impl allocates them (not the strides of q, k, v, which are often transposed views).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# The custom ops that keep the kernels opaque to torch.compile (its graphs call them). Defined through
# torch.library.Library, the dispatcher calls _fwd_impl and _bwd_impl directly; torch.library.custom_op puts its Python
# wrappers around them (an autograd kernel that redispatches, the backend's wrapper with dynamo disabled and an aliasing
# check), which cost more CPU time per call than the forward's own launch path (docs/attention.md). Their autograd is
# FlashAttentionTriton's: the compiled graphs call them below autograd, and eager calls do not go through them.
_LIB = torch.library.Library("lmsys", "FRAGMENT")
_LIB.define("flash_attn_fwd(Tensor q, Tensor k, Tensor v, bool is_causal) -> (Tensor, Tensor)")
_LIB.define(
    "flash_attn_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool is_causal) "
    "-> (Tensor, Tensor, Tensor)"
)
for _key in ("CUDA", "CPU"):  # CPU: under the Triton interpreter
    _LIB.impl("flash_attn_fwd", _fwd_impl, _key)
    _LIB.impl("flash_attn_bwd", _bwd_impl, _key)
torch.library.register_fake("lmsys::flash_attn_fwd", _fwd_fake, lib=_LIB)
torch.library.register_fake("lmsys::flash_attn_bwd", _bwd_fake, lib=_LIB)


def forward(q, k, v, is_causal=False):
    """Attention output and log-sum-exp (natural log, fp32, shape of q without its last dim)."""
    _check(q, k, v, is_causal)
    # The custom ops keep the kernels opaque to torch.compile; eager calls skip their dispatch.
    if torch.compiler.is_compiling():
        return torch.ops.lmsys.flash_attn_fwd(q, k, v, is_causal)
    return _fwd_impl(q, k, v, is_causal)


def backward(q, k, v, o, lse, do, is_causal=False):
    """Gradients (dq, dk, dv) of attention, given the forward's output, log-sum-exp and the output's gradient."""
    check_causal(is_causal, impl="triton")
    if torch.compiler.is_compiling():
        return torch.ops.lmsys.flash_attn_bwd(q, k, v, o, lse, do, is_causal)
    return _bwd_impl(q, k, v, o, lse, do, is_causal)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with Triton kernels: ``FlashAttentionTriton.apply(q, k, v, is_causal)``.

    q, k, v: (batch, seq, d) or (batch, heads, seq, d), fp16/bf16/fp32 on CUDA, any head dim d up to 128;
    causal needs equal query and key lengths. Softmax scale 1/sqrt(d). The output and the gradients are contiguous
    whatever the inputs' strides. Once differentiable: a second backward through it raises.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = backward(q, k, v, o, lse, do, ctx.is_causal)
        return (*refuse_double_backward("flash_triton", grads, (q, k, v, do)), None)


plans.watch(__name__)
