"""FlashAttention-2 in plain PyTorch: tiled forward with an online softmax, backward by recomputation.

Algorithm (Dao, "FlashAttention-2", 2023, algorithms 1 and 2). The keys and values are cut into tiles of
`BLOCK_K` positions (a multiple of it for more than MAX_KEY_TILES * BLOCK_K keys). The forward walks over the key
tiles keeping, per query row, the running maximum `m`, the running sum `l` of exp(s - m) and the unnormalized output;
each new tile rescales them by exp(m_old - m_new).
It returns the output and the log-sum-exp `L = m + log(l)` of the scaled scores, the only statistics saved for
backward. The backward recomputes P = exp(S - L) tile by tile, with D = rowsum(dO * O):

    dV_j = P^T dO,   dP = dO V_j^T,   dS = P * (dP - D),   dQ += dS K_j * scale,   dK_j = dS^T Q * scale

On a GPU, FlashAttention-2 runs its query tiles as independent programs; here they are one batched matmul over
all query rows, so the only sequential loop is the one over key tiles, and the largest intermediate is a
(rows, BLOCK_K) slab instead of the (seq_q, seq_k) score matrix. With a causal mask, key tile j is skipped by
every query row before its first key, and only its diagonal band is masked.

The loop over key tiles is a static Python loop over a shape known at trace time, so `torch.compile` unrolls it
into one graph without breaks. Low-precision inputs are multiplied in their own dtype (P and dS are cast down
before their products, as the GPU kernels do), except that fp16 scores S and dP are computed in float32: an fp16
matmul would round them to fp16, whose range they leave (at d = 16, inputs of magnitude ~300 do). bf16 has float32's
range, and torch's bf16 matmuls round S and dP to bf16, which the Triton kernels keep in float32; statistics and
accumulators are float32, float64 for float64 inputs.

Masked positions take no part, even a NaN or an inf: the scores of the diagonal band are replaced (not added to), and
the band's products with V (forward) and K (dQ) go through lmsys.attention.masking's `seen_product`, so a non-finite
v[j] or k[j] reaches only the rows that see j; a row that sees a non-finite value gets NaN. The rows below the band
see the whole tile and keep the plain product.
"""

import math

import torch

from lmsys.attention.checks import check_causal, check_inputs, refuse_double_backward
from lmsys.attention.masking import seen_product

BLOCK_K = 64
# Above MAX_KEY_TILES * BLOCK_K keys the tile grows instead, so the unrolled loop (and compile time) stays bounded.
MAX_KEY_TILES = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_block(n_k: int) -> int:
    tiles_of_block_k = math.ceil(n_k / (BLOCK_K * MAX_KEY_TILES))
    return BLOCK_K * max(1, tiles_of_block_k)


def _mask_diagonal_(s: torch.Tensor, fill: float) -> None:
    """Set to `fill` the keys after the query in the diagonal band of a causal slab whose first row and first key
    coincide."""
    size = s.shape[-1]
    above_diagonal = torch.ones(size, size, dtype=torch.bool, device=s.device).triu(1)
    s[:, :size].masked_fill_(above_diagonal, fill)


def _product_t(x: torch.Tensor, y: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """x @ y^T in `acc`: fp16 operands are multiplied in float32, whose range the scores need."""
    if x.dtype == torch.float16:
        x, y = x.to(acc), y.to(acc)
    return (x @ y.transpose(1, 2)).to(acc)


def _tile_product(a: torch.Tensor, b: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """a @ b for a causal slab `a` (rows x keys of the tile `b`): its diagonal band through `seen_product`, so that a
    non-finite row of b reaches only the rows that see it, the rows below it by the plain product."""
    if not is_causal:
        return a @ b
    size = a.shape[-1]
    return torch.cat((seen_product(a[:, :size], b), a[:, size:] @ b), dim=1)


def _flatten(x: torch.Tensor) -> torch.Tensor:
    # (B, T, D) or (B, H, T, D) -> (B * H, T, D): heads are independent.
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and log-sum-exp of the scaled scores (shape of q without d; float32, float64 for float64)."""
    check_inputs(q, k, v, is_causal, impl="torch", dtypes=_DTYPES)
    q3, k3, v3 = _flatten(q), _flatten(k), _flatten(v)
    n_k, d = k3.shape[1], q3.shape[2]
    acc = _accumulator_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros(q3.shape, dtype=acc, device=q.device)
    row_max = torch.full(q3.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    row_sum = torch.zeros(q3.shape[:-1], dtype=acc, device=q.device)
    block = _key_block(n_k)
    for start in range(0, n_k, block):
        end = min(start + block, n_k)
        # Causal: rows before `start` see none of these keys; row `start` sees key `start`, so m stays finite.
        rows = slice(start if is_causal else 0, None)
        s = _product_t(q3[:, rows], k3[:, start:end], acc) * scale
        if is_causal:
            _mask_diagonal_(s, float("-inf"))
        m_new = torch.maximum(row_max[:, rows], s.amax(dim=-1))
        p = torch.exp(s - m_new[..., None])
        alpha = torch.exp(row_max[:, rows] - m_new)
        row_sum[:, rows] = row_sum[:, rows] * alpha + p.sum(dim=-1)
        pv = _tile_product(p.to(v.dtype), v3[:, start:end], is_causal)
        out[:, rows] = out[:, rows] * alpha[..., None] + pv.to(acc)
        row_max[:, rows] = m_new
    out = (out / row_sum[..., None]).to(q.dtype).reshape(q.shape)
    lse = (row_max + torch.log(row_sum)).reshape(q.shape[:-1])
    return out, lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention given the forward's output `o` and log-sum-exp `lse`, by recomputation."""
    check_causal(is_causal, impl="torch")
    q3, k3, v3, do3 = _flatten(q), _flatten(k), _flatten(v), _flatten(do)
    n_k, d = k3.shape[1], q3.shape[2]
    acc = _accumulator_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    lse3 = lse.reshape(q3.shape[:-1])
    delta = (do3.to(acc) * _flatten(o).to(acc)).sum(dim=-1)  # D = rowsum(dO * O)
    dq = torch.zeros(q3.shape, dtype=acc, device=q.device)
    dk_tiles, dv_tiles = [], []
    block = _key_block(n_k)
    for start in range(0, n_k, block):
        end = min(start + block, n_k)
        rows = slice(start if is_causal else 0, None)
        k_tile, v_tile, q_rows, do_rows = k3[:, start:end], v3[:, start:end], q3[:, rows], do3[:, rows]
        s = _product_t(q_rows, k_tile, acc) * scale
        if is_causal:
            _mask_diagonal_(s, float("-inf"))
        p = torch.exp(s - lse3[:, rows, None])
        dv_tiles.append(p.to(q.dtype).transpose(1, 2) @ do_rows)
        dp = _product_t(do_rows, v_tile, acc)
        ds = p * (dp - delta[:, rows, None])
        if is_causal:
            _mask_diagonal_(ds, 0.0)  # p is 0 there, but dp may be NaN (a non-finite v[j])
        ds = ds.to(q.dtype)
        dq[:, rows] += _tile_product(ds, k_tile, is_causal).to(acc) * scale
        dk_tiles.append(((ds.transpose(1, 2) @ q_rows).to(acc) * scale).to(q.dtype))
    dk = torch.cat(dk_tiles, dim=1).reshape(k.shape)
    dv = torch.cat(dv_tiles, dim=1).reshape(v.shape)
    return dq.to(q.dtype).reshape(q.shape), dk, dv


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention-2 in PyTorch as an autograd Function: `FlashAttentionTorch.apply(q, k, v, is_causal)`.

    Saves the inputs, the output and the log-sum-exp; the backward recomputes the probabilities tile by tile. Once
    differentiable: a second backward through it raises.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        o, lse = forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        # o and lse carry no history, so a graph of these ops would give wrong second derivatives: build none.
        with torch.no_grad():
            grads = backward(q, k, v, o, lse, do, ctx.is_causal)
        return (*refuse_double_backward("flash_torch", grads, (q, k, v, do)), None)
