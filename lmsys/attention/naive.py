"""Naive attention: the full score matrix in memory. The reference every faster implementation is tested against."""

import math

import torch

from lmsys import profiling
from lmsys.attention.checks import check_inputs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, with query i seeing only keys j <= i when `is_causal`.

    q is (B, T_q, D) or (B, H, T_q, D); k and v are (B, T_k, D) or (B, H, T_k, D). The (T_q, T_k) scores are
    materialized; the softmax runs in float32 (float64 for float64 inputs) and its result is cast back to the
    input dtype before the product with v, as a low-precision kernel would do.
    """
    check_inputs(q, k, v, is_causal, impl="naive", dtypes=_DTYPES)
    with profiling.range("attention/scores"):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        with profiling.range("attention/causal_mask"):
            n_q, n_k = q.shape[-2], k.shape[-2]
            above_diagonal = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(above_diagonal, float("-inf"))
    with profiling.range("attention/softmax"):
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    with profiling.range("attention/value_matmul"):
        return probs @ v
