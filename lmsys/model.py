"""A decoder-only Transformer language model, in one file, in reading order.

Token embedding -> `num_layers` pre-norm blocks -> final RMSNorm -> untied LM head. Each block is
    x = x + attention(rmsnorm(x))     causal multi-head self-attention, RoPE on queries and keys
    x = x + ffn(rmsnorm(x))           SwiGLU: w2(silu(w1 x) * w3 x)
Linear layers have no bias. There are no learned positions (RoPE), so the parameter count does not depend on the
context length: 2 * vocab * d_model + num_layers * (4 d_model^2 + 3 d_model d_ff + 2 d_model) + d_model.

The attention kernel is looked up by name in `lmsys.attention.ATTENTION` (`ModelConfig.attention`), so a new kernel
plugs in without editing this file. Sizes are data: `SIZES` maps preset names to `ModelConfig`s; change one with
`dataclasses.replace(SIZES["large"], context_length=1024, attention="sdpa")`.
"""

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmsys import attention, profiling


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the input dtype, returned in the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite non-negative number, got {eps!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A bf16 mean of squares loses the small components; the norm is cheap, so do it in fp32.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., 2021): rotate each pair (x[2i], x[2i+1]) of a head by the angle pos * theta^(-2i/D).

    After rotation the dot product of a query at m and a key at n depends only on m - n. The rotation is computed
    in the tables' precision (fp32) whatever the input's, and returned in the input's dtype: a bf16 copy of the
    tables would round the angles, and would be a tensor of its own that the compiled step writes at every layer.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float):
        super().__init__()
        # A theta far below 1 overflows float32 below, and cos/sin of inf would fill every query with NaN. Checked
        # in Python so that the meta device (no values) builds too.
        try:
            fastest = max(1.0, theta ** (-(head_dim - 2) / head_dim))
        except OverflowError:
            fastest = math.inf
        if not (context_length - 1) * fastest < torch.finfo(torch.float32).max:
            raise ValueError(f"theta={theta!r} gives rotation angles beyond float32 for {context_length} positions")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float32), inv_freq)  # (T, D/2)
        # Derived from the config, so kept out of the state dict.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H, D), positions on dim -3: the layout of the qkv projection's output, which the rotation
        keeps, so that the attention's output comes back in (B, T, H, D) memory and needs no copy before the
        output projection (nor its gradient before the qkv projection's)."""
        T = x.shape[-3]
        cos, sin = self.cos[:T, None], self.sin[:T, None]  # (T, 1, D/2)
        compute = torch.promote_types(x.dtype, cos.dtype)
        x1, x2 = x[..., 0::2].to(compute), x[..., 1::2].to(compute)  # (B, T, H, D/2) each
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, T, H, D/2, 2)
        return rotated.flatten(-2).to(x.dtype)  # (B, T, H, D), pairs back in their interleaved places


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask; the core (softmax(QK^T / sqrt(D)) V) is a pluggable kernel.

    `rope` is the RotaryEmbedding to use, shared by every layer of a model (one table, one input of a compiled
    graph instead of two per layer); without it the layer builds its own from the config.
    """

    def __init__(self, config: "ModelConfig", rope: RotaryEmbedding | None = None):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)  # one matmul for Q, K and V
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.rope = rope if rope is not None else RotaryEmbedding(config.head_dim, config.context_length,
                                                                  config.rope_theta)
        self.attend = attention.ATTENTION[config.attention]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        with profiling.range("attention"):
            with profiling.range("attention/qkv_proj"):
                qkv = self.qkv(x).view(B, T, 3, self.num_heads, C // self.num_heads)  # (B, T, 3, H, D)
                q, k, v = qkv.unbind(2)  # (B, T, H, D) each
            with profiling.range("attention/rope"):
                q, k = self.rope(q), self.rope(k)
            with profiling.range("attention/kernel"):
                # (B, H, T, D) views of (B, T, H, D) memory: the attention's output has that layout too.
                y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)  # (B, H, T, D)
            with profiling.range("attention/out_proj"):
                return self.out(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class SwiGLU(nn.Module):
    """The gated feed-forward layer of Shazeer (2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with profiling.range("ffn"):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm Transformer block: attention and feed-forward, each added to the residual stream."""

    def __init__(self, config: "ModelConfig", rope: RotaryEmbedding | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config, rope)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a `TransformerLM`; `attention` names an entry of `lmsys.attention.ATTENTION`."""

    vocab_size: int = 10_000
    context_length: int = 512
    d_model: int = 768
    d_ff: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    rope_theta: float = 10_000.0
    attention: str = "naive"

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"d_model ({self.d_model}) must be num_heads ({self.num_heads}) times an even head size (RoPE "
                "rotates pairs)"
            )
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"rope_theta must be a finite positive number, got {theta!r}")
        if self.attention not in attention.ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {sorted(attention.ATTENTION)}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model / num_heads."""
        return self.d_model // self.num_heads


SIZES = {
    "tiny": ModelConfig(context_length=64, d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}


@torch.no_grad()
def init_weights(model: nn.Module, num_layers: int) -> None:
    """GPT-2 style initialisation, by parameter name: norm gains 1, residual output projections (attn.out, ffn.w2)
    N(0, 0.02 / sqrt(2 num_layers)), every other weight N(0, 0.02)."""
    residual_std = 0.02 / math.sqrt(2 * num_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(("attn.out.weight", "ffn.w2.weight")):
            param.normal_(0.0, residual_std)
        else:
            param.normal_(0.0, 0.02)


class TransformerLM(nn.Module):
    """Tokens (B, T) -> next-token logits (B, T, vocab_size).

    Build on the target device without a CPU round trip: `with torch.device("cuda"): TransformerLM(config)`.
    On the meta device it allocates nothing and still runs shapes through.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)  # shared by the layers
        self.layers = nn.ModuleList(Block(config, rope) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._layer_names = [f"layer_{i}" for i in range(config.num_layers)]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style initialisation (init_weights)."""
        init_weights(self, self.config.num_layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.features(tokens)
        with profiling.range("lm_head"):
            return self.lm_head(x)  # (B, T, V)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) -> the final norm's output (B, T, C), the LM head's input: for a loss that fuses the head
        (`lmsys.train.linear_cross_entropy`)."""
        if tokens.shape[-1] > self.config.context_length:
            raise ValueError(
                f"sequence length {tokens.shape[-1]} exceeds the context length {self.config.context_length}"
            )
        x = self.embedding(tokens)  # (B, T, C)
        for name, layer in zip(self._layer_names, self.layers, strict=True):
            with profiling.range(name):
                x = layer(x)
        return self.norm(x)

    def num_parameters(self, embedding: bool = True) -> int:
        """Parameter count; `embedding=False` leaves out the token embedding (a lookup, not a matmul)."""
        total = sum(p.numel() for p in self.parameters())
        return total if embedding else total - self.embedding.weight.numel()
