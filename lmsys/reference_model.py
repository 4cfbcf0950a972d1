"""The Transformer LM of lmsys.model written the way a user would, in a page of plain PyTorch: the reference step.

Same architecture, parameter names, shapes and initialisation as `lmsys.model.TransformerLM` for a `ModelConfig`
(so each loads the other's state dict and gives the same logits), in the style of gpt-fast and nanoGPT: one fused
qkv projection, RoPE applied in fp32 on the (B, T, H, D) projection, PyTorch's `scaled_dot_product_attention`,
RMSNorm and SwiGLU from plain tensor ops, no profiler ranges, no attention backend switch (`config.attention` is
ignored). The perf tests time it beside ours, with `torch.optim.AdamW(fused=True, capturable=True)`, so every
report shows how far our step is from what a page of PyTorch gets.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lmsys.model import ModelConfig, init_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table(head_dim: int, context_length: int, theta: float) -> torch.Tensor:
    """(T, D/2, 2): cos and sin of pos * theta^(-2i/D)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(context_length, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) of x (B, T, H, D) by the angles of `table` (T, D/2, 2)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, H, D/2, 2)
    table = table.view(1, pairs.size(1), 1, pairs.size(3), 2)
    rotated = torch.stack(
        (
            pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1],
            pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1],
        ),
        dim=-1,
    )
    return rotated.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads) for t in (q, k, v))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn = FeedForward(config)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.ffn(self.ffn_norm(x))


class ReferenceLM(nn.Module):
    """Tokens (B, T) -> logits (B, T, vocab_size), as `lmsys.model.TransformerLM` computes them."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.register_buffer(
            "rope", rope_table(config.head_dim, config.context_length, config.rope_theta), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The same initialisation as TransformerLM (lmsys.model.init_weights), so a seed gives the same weights."""
        init_weights(self, self.config.num_layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        rope = self.rope[: tokens.shape[-1]]
        for layer in self.layers:
            x = layer(x, rope)
        return self.lm_head(self.norm(x))
