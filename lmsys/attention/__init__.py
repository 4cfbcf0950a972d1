"""Attention: the naive reference, FlashAttention-2 in PyTorch and in Triton, and PyTorch's SDPA for comparison.

Every implementation takes q of shape (B, H, T_q, D) or (B, T_q, D), k and v of shape (B, H, T_k, D) or
(B, T_k, D), scales the scores by 1/sqrt(D), and with `is_causal` lets query i see keys j <= i only.
`ATTENTION` maps a backend name to its function, for the model's `attention` setting and the perf tests.
"""

import torch
import torch.nn.functional as F

from lmsys.attention.flash_torch import FlashAttentionTorch
from lmsys.attention.flash_triton import FlashAttentionTriton
from lmsys.attention.checks import check_causal
from lmsys.attention.naive import naive_attention

_FLASH = {"triton": FlashAttentionTriton, "torch": FlashAttentionTorch}


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """PyTorch's `scaled_dot_product_attention` (it picks its own backend), as a reference and a baseline."""
    check_causal(is_causal, impl="sdpa")
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, impl: str = "triton"
) -> torch.Tensor:
    """FlashAttention-2, differentiable: `impl="triton"` (CUDA, or the Triton interpreter) or `impl="torch"`."""
    if impl not in _FLASH:
        raise ValueError(f"unknown flash attention impl {impl!r}; choose one of: {', '.join(_FLASH)}")
    return _FLASH[impl].apply(q, k, v, is_causal)


def _flash_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    return FlashAttentionTorch.apply(q, k, v, is_causal)


def _flash_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    return FlashAttentionTriton.apply(q, k, v, is_causal)


ATTENTION = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash_torch": _flash_torch,
    "flash_triton": _flash_triton,
}

__all__ = [
    "ATTENTION",
    "FlashAttentionTorch",
    "FlashAttentionTriton",
    "flash_attention",
    "naive_attention",
    "sdpa_attention",
]
