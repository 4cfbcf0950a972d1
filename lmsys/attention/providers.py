"""Attention implementations by name, for the benchmarks (perf_tests/test_attention.py, `lmsys-bench attention`):
the library's `ATTENTION` table plus one entry per SDPA backend, any of them compiled, and the call a benchmark
times in each mode.

Providers: `naive`, `flash_torch`, `flash_triton`, `sdpa` (SDPA picks its backend) and `sdpa_flash`, `sdpa_cudnn`,
`sdpa_efficient`, `sdpa_math` (one SDPA backend each); `naive_compiled` and `flash_torch_compiled` are wrapped in
torch.compile. Modes (lmsys.flops.ATTENTION_MODES): "fwd" (no autograd graph), "bwd" (the forward runs once, when the
call is built; each call is one backward through the kept graph) and "fwd_bwd"; gradients are taken with a given dO
through `torch.autograd.grad`, so nothing accumulates into `.grad` from call to call.
"""

from collections.abc import Callable

import torch
from torch._functorch import config as functorch_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmsys.attention import ATTENTION, sdpa_attention

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
PROVIDERS = (
    "naive", "naive_compiled", "flash_torch", "flash_torch_compiled", "flash_triton", "sdpa", *SDPA_BACKENDS
)
# Providers that cannot run on the CPU, and why.
NEEDS_CUDA = {
    "flash_triton": "needs CUDA (the Triton interpreter is for tests, not timing)",
    "sdpa_cudnn": "needs CUDA (SDPA's cuDNN backend)",
}


def sdpa_with(backend: SDPBackend) -> Callable:
    """SDPA restricted to one backend, for (B, H, T, D) or (B, T, D) inputs."""

    def attend(q, k, v, is_causal):
        with sdpa_kernel(backend):
            if q.dim() == 3:  # SDPA's fused backends want (B, H, T, D): add a heads dim of 1 (a view).
                return sdpa_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal).squeeze(1)
            return sdpa_attention(q, k, v, is_causal)

    return attend


def attention_function(provider: str, compile: bool = False) -> Callable:
    """The provider's attention(q, k, v, is_causal); compiled for the `_compiled` providers, or any with compile."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown attention provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    base = provider.removesuffix("_compiled")
    attend = sdpa_with(SDPA_BACKENDS[base]) if base in SDPA_BACKENDS else ATTENTION[base]
    return torch.compile(attend, dynamic=False) if compile or provider.endswith("_compiled") else attend


def timed_call(attend: Callable, q, k, v, is_causal: bool, mode: str, do=None) -> tuple[Callable, tuple]:
    """(fn, args): what a benchmark calls as fn(*args) in `mode`, returning the output ("fwd") or the gradients of
    q, k, v. For the backward modes q, k, v are made to require grad and `do` (random when not given) is the
    output's gradient; for "bwd" the forward runs here, once."""
    if mode == "fwd":

        def forward(q, k, v):
            with torch.no_grad():
                return attend(q, k, v, is_causal)

        return forward, (q, k, v)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q) if do is None else do
    if mode == "fwd_bwd":

        def forward_backward(q, k, v, do):
            return torch.autograd.grad(attend(q, k, v, is_causal), (q, k, v), do)

        return forward_backward, (q, k, v, do)
    if mode != "bwd":
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd_bwd', got {mode!r}")
    # A compiled backward normally frees ("donates") the saved activations; timing it again over the same graph
    # needs them kept. The flag is read when the forward compiles.
    with functorch_config.patch(donated_buffer=False):
        out = attend(q, k, v, is_causal)

    def backward(out, do):
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    return backward, (out, do)
