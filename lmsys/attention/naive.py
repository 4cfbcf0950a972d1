"""Naive attention: the full score matrix in memory. The reference every faster implementation is tested against."""

import math

import torch

from lmsys import profiling
from lmsys.attention.checks import check_inputs
from lmsys.attention.masking import masked_scores, masked_values

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, with query i seeing only keys j <= i when `is_causal`.

    q is (B, T_q, D) or (B, H, T_q, D); k and v are (B, T_k, D) or (B, H, T_k, D). The (T_q, T_k) scores are
    materialized; fp16 scores are computed in float32 (at d = 16, inputs of magnitude ~300 already give scores past
    fp16's range; bf16 has float32's), the softmax runs in float32 (float64 for float64 inputs) and its result is cast
    back to the input dtype before the product with v, as a low-precision kernel would do. With `is_causal` a key or
    value that a query cannot see takes no part in its row, forward or backward, even a NaN or an inf
    (lmsys.attention.masking); a row that sees a non-finite value gets NaN.
    """
    check_inputs(q, k, v, is_causal, impl="naive", dtypes=_DTYPES)
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_s, k_s = (q.float(), k.float()) if q.dtype == torch.float16 else (q, k)
    with profiling.range("attention/scores"):
        scores = masked_scores(q_s, k_s) * scale if is_causal else (q_s @ k_s.transpose(-2, -1)) * scale
    with profiling.range("attention/softmax"):
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    with profiling.range("attention/value_matmul"):
        return masked_values(probs, v) if is_causal else probs @ v
