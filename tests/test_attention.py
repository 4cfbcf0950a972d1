"""Attention correctness: every implementation against naive attention on float64 copies of its inputs.

Checked: the output, the log-sum-exp, dQ, dK and dV (for a random output gradient), on shapes drawn by hypothesis
(odd lengths, lengths that are not multiples of the tiles, 3-D and 4-D inputs, seq_q != seq_k without a causal
mask). The PyTorch FlashAttention runs on the CPU at full coverage. The Triton kernels run on CUDA, or without
CUDA under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on small shapes in float32 and
float16 only: the interpreter's `tl.dot` does not support bfloat16 (triton-lang/triton#11584).
"""

import dataclasses
import functools
import inspect
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.backends.nvidia
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmsys.attention import (
    ATTENTION,
    FlashAttentionTorch,
    FlashAttentionTriton,
    flash_attention,
    flash_hopper,
    flash_hopper_bwd,
    flash_torch,
    flash_triton,
    launch_order,
    launcher,
    naive_attention,
    plans,
    tuned,
)
from lmsys.attention.checks import check_inputs
from lmsys.bench.attention import TRAINING_HEADS, TRAINING_TOKENS
from lmsys.model import ModelConfig, TransformerLM

# The Triton interpreter (triton 3.6) converts one-element arrays to scalars in a way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

IMPLS = {"torch": flash_torch, "triton": flash_triton}
FUNCTIONS = {"torch": FlashAttentionTorch, "triton": FlashAttentionTriton}
HAS_CUDA = torch.cuda.is_available()
# Without CUDA the Triton kernels run interpreted: slow, so the Triton tests stay small there.
TRITON_DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_DTYPES = (torch.float32, torch.float16) if not HAS_CUDA else (torch.float32, torch.float16, torch.bfloat16)
TRITON_HEAD_DIMS = (16, 24, 32, 64, 80) if not HAS_CUDA else (16, 24, 32, 64, 80, 128)

# Largest error allowed, relative to the largest |value| of the float64 reference tensor, or to 1 if that is smaller:
# inputs are unit normal, so a result that cancels to about 0 (dQ and dK with a single key) still carries
# rounding noise of the inputs' scale.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}

LENGTHS = (1, 2, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129, 200, 257)
SMALL_LENGTHS = (1, 15, 16, 17, 31, 32, 33, 64, 100, 130)


def make_inputs(q_shape, k_shape, dtype, device, generator=None, scale=1.0):
    """q, k, v from a standard normal (q and k times `scale`), drawn in float64 and cast, on `device`."""
    q = torch.randn(q_shape, generator=generator, dtype=torch.float64) * scale
    k = torch.randn(k_shape, generator=generator, dtype=torch.float64) * scale
    v = torch.randn(k_shape, generator=generator, dtype=torch.float64)
    return tuple(x.to(dtype=dtype, device=device) for x in (q, k, v))


def reference(q, k, v, do, is_causal):
    """Output, log-sum-exp and (dq, dk, dv) of naive attention on float64 copies of the inputs."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o = naive_attention(q64, k64, v64, is_causal)
    grads = torch.autograd.grad(o, (q64, k64, v64), do.double())
    with torch.no_grad():
        scores = q64 @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            above_diagonal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(above_diagonal, float("-inf"))
        lse = scores.logsumexp(dim=-1)
    return (o.detach(), lse, *grads)


def assert_matches(actual, expected, dtype, name, looser=1.0):
    """`actual` is finite and within the dtype's tolerance (times `looser`) of the float64 `expected`."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name} has NaN or inf"
    tol = TOLERANCE[dtype] * looser
    atol = tol * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=atol, msg=lambda m: f"{name}: {m}")


def check_flash(impl, q, k, v, is_causal, do, looser=1.0):
    """The impl's forward and backward functions against the float64 reference: o, lse, dq, dk, dv."""
    o, lse = IMPLS[impl].forward(q, k, v, is_causal)
    assert o.dtype == q.dtype
    assert lse.shape == q.shape[:-1]
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    dq, dk, dv = IMPLS[impl].backward(q, k, v, o, lse, do, is_causal)
    for x in (dq, dk, dv):
        assert x.dtype == q.dtype
    expected = reference(q, k, v, do, is_causal)
    for name, actual, exp in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), expected, strict=True):
        assert_matches(actual, exp, q.dtype, f"{impl} {name}", looser)


@st.composite
def problems(draw, lengths, head_dims, max_batch=3, max_heads=3):
    """(q shape, k shape, is_causal, seed): 3-D or 4-D, causal with equal lengths, or any two lengths."""
    batch = draw(st.integers(1, max_batch))
    heads = draw(st.none() | st.integers(1, max_heads))
    is_causal = draw(st.booleans())
    n_q = draw(st.sampled_from(lengths))
    n_k = n_q if is_causal else draw(st.sampled_from(lengths))
    d = draw(st.sampled_from(head_dims))
    lead = (batch,) if heads is None else (batch, heads)
    return (*lead, n_q, d), (*lead, n_k, d), is_causal, draw(st.integers(0, 2**32 - 1))


def run_problem(impl, problem, dtype, device):
    q_shape, k_shape, is_causal, seed = problem
    generator = torch.Generator().manual_seed(seed)
    q, k, v = make_inputs(q_shape, k_shape, dtype, device, generator)
    do = torch.randn(q_shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
    check_flash(impl, q, k, v, is_causal, do)


# ------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize(
    "q_shape, k_shape, is_causal",
    [
        ((2, 3, 17, 16), (2, 3, 17, 16), True),
        ((2, 3, 17, 16), (2, 3, 17, 16), False),
        ((2, 33, 8), (2, 33, 8), True),
        ((1, 2, 5, 24), (1, 2, 40, 24), False),
    ],
)
def test_naive_matches_sdpa_math(q_shape, k_shape, is_causal, seed):
    q, k, v = make_inputs(q_shape, k_shape, torch.float64, "cpu")
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(naive_attention(q, k, v, is_causal), expected)


# -------------------------------------------------------------------------------- against float64, hypothesis


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=30, deadline=None)
@given(problem=problems(LENGTHS, head_dims=(1, 8, 16, 24, 32, 64, 128)))
def test_flash_torch_matches_reference(problem, dtype):
    run_problem("torch", problem, dtype, "cpu")


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@settings(max_examples=8, deadline=None)
@given(problem=problems(SMALL_LENGTHS, head_dims=TRITON_HEAD_DIMS, max_batch=2, max_heads=2))
def test_flash_triton_matches_reference(problem, dtype):
    run_problem("triton", problem, dtype, TRITON_DEVICE)


@pytest.mark.parametrize(
    "q_shape, k_shape, is_causal",
    [
        ((1, 2, 1000, 64), (1, 2, 1000, 64), True),
        ((2, 1000, 32), (2, 777, 32), False),
        # Past MAX_KEY_TILES * BLOCK_K keys the key tile grows.
        ((1, 1100, 16), (1, 1100, 16), True),
        ((1, 3, 50, 16), (1, 3, 1300, 16), False),
    ],
)
def test_flash_torch_long_sequences(q_shape, k_shape, is_causal, seed):
    assert flash_torch.MAX_KEY_TILES * flash_torch.BLOCK_K < 1100
    q, k, v = make_inputs(q_shape, k_shape, torch.float64, "cpu")
    check_flash("torch", q, k, v, is_causal, torch.randn_like(q))


# ------------------------------------------------------------------------------------ both impls, explicit


@pytest.fixture(params=["torch", "triton"])
def impl(request):
    """The FlashAttention implementation under test."""
    return request.param


def impl_device(impl):
    return TRITON_DEVICE if impl == "triton" else torch.device("cpu")


@pytest.mark.parametrize("is_causal", [False, True])
def test_autograd_function_matches_forward_and_backward(impl, is_causal, seed):
    q, k, v = make_inputs((2, 2, 70, 32), (2, 2, 70, 32), torch.float32, impl_device(impl))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    o = flash_attention(q, k, v, is_causal=is_causal, impl=impl)
    grads = torch.autograd.grad(o, (q, k, v), do)
    expected = reference(q, k, v, do, is_causal)
    for name, actual, exp in zip(("o", "dq", "dk", "dv"), (o, *grads), (expected[0], *expected[2:]), strict=True):
        assert_matches(actual.detach(), exp, torch.float32, f"{impl} {name}")


def test_non_contiguous_inputs(impl, seed):
    """Heads split off a (B, T, H, D) projection arrive as strided views, as in the model."""
    device = impl_device(impl)
    q, k, v = (x.transpose(1, 2) for x in make_inputs((2, 50, 3, 16), (2, 50, 3, 16), torch.float32, device))
    assert not q.is_contiguous()
    check_flash(impl, q, k, v, True, torch.randn_like(q))  # randn_like keeps q's strides


def test_large_scores_stay_finite(impl, seed):
    """Scores in the hundreds: the running maximum keeps every exponential finite."""
    q, k, v = make_inputs((1, 2, 80, 32), (1, 2, 80, 32), torch.float32, impl_device(impl), scale=10.0)
    # Rounding a score s in float32 moves exp(s) by about |s| * 6e-8 relative: with |s| in the hundreds the
    # gradients carry ~1e-5 of relative error (5.6e-5 seen in dK), so this test allows 10x the float32 tolerance.
    check_flash(impl, q, k, v, True, torch.randn_like(q), looser=10.0)


def test_saves_no_score_matrix(impl, seed):
    """The forward keeps only inputs, output and log-sum-exp for backward: nothing of size seq_q * seq_k."""
    q, k, v = make_inputs((1, 1, 128, 16), (1, 1, 128, 16), torch.float32, impl_device(impl))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        flash_attention(q, k, v, is_causal=True, impl=impl)
    assert saved and max(saved) <= q.numel()


@pytest.mark.parametrize("shape", [(2, 2, 40, 16), (2, 40, 16)], ids=["4-D", "3-D"])
def test_attention_dict_backends_agree(seed, shape):
    q, k, v = make_inputs(shape, shape, torch.float32, "cpu")
    expected = naive_attention(q.double(), k.double(), v.double(), True)
    assert set(ATTENTION) == {"naive", "sdpa", "flash_torch", "flash_triton"}
    for name, attention in ATTENTION.items():
        device = TRITON_DEVICE if name == "flash_triton" else torch.device("cpu")
        out = attention(q.to(device), k.to(device), v.to(device), True)
        assert_matches(out.cpu(), expected, torch.float32, name)


def test_flash_attention_rejects_unknown_impl():
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="unknown flash attention impl 'cuda'; choose one of: triton, torch"):
        flash_attention(q, q, q, impl="cuda")


@pytest.mark.parametrize("position", [0, 17, 39])
@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash_torch", "flash_triton"])
def test_nan_in_a_key_stays_in_the_rows_that_see_it(backend, position, seed):
    """Causal: a NaN key at `position` reaches only the query rows at or after it; the rows before it match the
    output of the clean inputs. (A NaN value vector reaches every row through 0 * NaN in P V, in naive attention and
    SDPA too, so only keys are checked.) Length 40 is ragged for the tiles of both flash impls."""
    device = TRITON_DEVICE if backend == "flash_triton" else torch.device("cpu")
    q, k, v = make_inputs((2, 2, 40, 16), (2, 2, 40, 16), torch.float32, device)
    poisoned = k.clone()
    poisoned[1, 0, position, 3] = float("nan")
    out = ATTENTION[backend](q, poisoned, v, True)
    clean = ATTENTION[backend](q, k, v, True)
    torch.testing.assert_close(out[:, :, :position], clean[:, :, :position])
    assert torch.isnan(out[1, 0, position:]).any(dim=-1).all()  # the rows that see the NaN key


@pytest.mark.parametrize("is_causal", [False, True])
def test_double_backward_is_refused(impl, is_causal, seed):
    """First derivatives with create_graph=True are still right; differentiating them again raises a clear error
    (the fused backwards are not differentiable: their second derivatives would be silently wrong)."""
    q, k, v = make_inputs((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, impl_device(impl))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    o = flash_attention(q, k, v, is_causal=is_causal, impl=impl)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    expected = reference(q, k, v, do, is_causal)
    for name, actual, exp in zip(("dq", "dk", "dv"), grads, expected[2:], strict=True):
        assert_matches(actual.detach(), exp, torch.float32, f"{impl} {name}")
    with pytest.raises(RuntimeError, match=f"flash_{impl} attention: double backward is not supported"):
        torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))


def test_double_backward_of_naive_attention_matches_float64(seed):
    """The reference the error message points to does support second derivatives."""
    q, k, v = (x.requires_grad_() for x in make_inputs((1, 2, 6, 4), (1, 2, 6, 4), torch.float64, "cpu"))
    assert torch.autograd.gradgradcheck(lambda q, k, v: naive_attention(q, k, v, True), (q, k, v))


# ------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize(
    "impl_name, dtype, on_gpu",
    [
        ("torch", torch.float32, False),
        pytest.param("torch", torch.bfloat16, True, marks=pytest.mark.gpu),
        pytest.param("triton", torch.bfloat16, True, marks=pytest.mark.gpu),
    ],
)
def test_flash_under_torch_compile(impl_name, dtype, on_gpu, device, seed):
    if on_gpu and device.type != "cuda":
        pytest.skip("needs a CUDA device")
    function = FUNCTIONS[impl_name]
    # Without the reset, this test's lambda is still compiled for the previous case's shape, and dynamo retraces it
    # with dynamic shapes, which torch 2.11 cannot do through FlashAttentionTorch's tile loop.
    torch.compiler.reset()
    compiled = torch.compile(lambda q, k, v: function.apply(q, k, v, True), fullgraph=True)
    shape = (2, 4, 1000, 64) if on_gpu else (1, 2, 100, 16)
    q, k, v = (x.requires_grad_() for x in make_inputs(shape, shape, dtype, device if on_gpu else "cpu"))
    do = torch.randn_like(q)
    o = compiled(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    expected = reference(q, k, v, do, True)
    for name, actual, exp in zip(("o", "dq", "dk", "dv"), (o, *grads), (expected[0], *expected[2:]), strict=True):
        assert_matches(actual.detach(), exp, dtype, f"compiled {impl_name} {name}")


def _strided(shape, layout, dtype, device):
    """A tensor of `shape` (3-D or 4-D): contiguous, or a transposed view with the sequence dim outermost after the
    batch, as heads split off a (B, T, H, D) projection arrive ((T, B, D) for 3-D)."""
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype, device=device)
    if len(shape) == 4:
        return torch.randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype, device=device).transpose(1, 2)
    return torch.randn(shape[1], shape[0], shape[2], dtype=dtype, device=device).transpose(0, 1)


# (shape, layout of q, layout of k, v and dO, causal, dtype): 3-D and 4-D, contiguous and transposed, and the model's
# mix (q and k out of RoPE contiguous, v a transposed view).
OP_CASES = [
    pytest.param((2, 2, 20, 16), "contiguous", "contiguous", True, torch.float32, id="4d-contiguous"),
    pytest.param((2, 2, 20, 16), "transposed", "transposed", True, torch.float16, id="4d-transposed"),
    pytest.param((1, 3, 17, 32), "contiguous", "transposed", True, torch.float32, id="4d-mixed"),
    pytest.param((2, 20, 16), "contiguous", "contiguous", False, torch.float16, id="3d-contiguous"),
    pytest.param((2, 20, 16), "transposed", "transposed", False, torch.float32, id="3d-transposed"),
    # Head dims that the kernels pad (to 128 and 64): the 2.7B preset's 80 as the model passes it, and 48.
    pytest.param((1, 2, 19, 80), "contiguous", "transposed", True, torch.float32, id="4d-mixed-d80"),
    pytest.param((2, 19, 48), "transposed", "transposed", False, torch.float16, id="3d-transposed-d48"),
]


@pytest.mark.parametrize("shape, q_layout, kv_layout, is_causal, dtype", OP_CASES)
def test_custom_ops_pass_opcheck(shape, q_layout, kv_layout, is_causal, dtype, seed):
    """torch.library.opcheck on both custom ops (schema, fake tensors against the real outputs' shapes, strides and
    dtypes, AOT dispatch with dynamic shapes): inductor trusts the fake's strides, and asserts them at run time."""
    q = _strided(shape, q_layout, dtype, TRITON_DEVICE)
    k, v, do = (_strided(shape, kv_layout, dtype, TRITON_DEVICE) for _ in range(3))
    torch.library.opcheck(torch.ops.lmsys.flash_attn_fwd.default, (q, k, v, is_causal))
    o, lse = flash_triton.forward(q, k, v, is_causal)
    assert o.is_contiguous() and lse.is_contiguous()
    torch.library.opcheck(torch.ops.lmsys.flash_attn_bwd.default, (q, k, v, o, lse, do, is_causal))
    assert all(g.is_contiguous() for g in flash_triton.backward(q, k, v, o, lse, do, is_causal))


# ------------------------------------------------------------------------- head dims that are not powers of two

# The Triton kernels' tiles are a power of two wide along the head dim (48 -> 64, 8 -> 16): the padding columns must
# load as zeros (so Q K^T, P V and the gradients' products are unchanged) and never be stored. 80 (the 2.7B preset's)
# and 96 (the training grid's) run split, 64 columns and a 16- or 32-wide rest (SPLIT_HEAD_DIMS), here as the model
# calls them: both layouts, causal and not.
PADDED_HEAD_DIMS = [
    pytest.param(80, torch.float32, id="d80-fp32"),
    pytest.param(96, torch.float16, id="d96-fp16"),
    pytest.param(48, torch.float16, id="d48-fp16"),
    pytest.param(8, torch.float32, id="d8-fp32"),
]


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dtype", PADDED_HEAD_DIMS)
def test_flash_triton_padded_head_dim(d, dtype, is_causal, layout, seed):
    """o, lse, dq, dk, dv against float64 at lengths ragged for every tile (and seq_q != seq_k without the mask), on
    contiguous inputs and on heads split off a (B, T, H, D) projection."""
    n_q, n_k = 37, 37 if is_causal else 23
    q, do = (_strided((2, 2, n_q, d), layout, dtype, TRITON_DEVICE) for _ in range(2))
    k, v = (_strided((2, 2, n_k, d), layout, dtype, TRITON_DEVICE) for _ in range(2))
    check_flash("triton", q, k, v, is_causal, do)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dtype, layout", [
    pytest.param(80, torch.float32, "contiguous", id="d80-fp32"),
    pytest.param(96, torch.float16, "transposed", id="d96-fp16"),
])
def test_flash_triton_split_head_dim(d, dtype, layout, is_causal, monkeypatch, seed):
    """SPLIT_HEAD_DIMS: the head dim as a chunk of 64 columns and one of the rest (16 or 32 wide), forward and
    backward, against float64 at lengths ragged for every tile."""
    monkeypatch.setattr(flash_triton, "SPLIT_HEAD_DIMS", frozenset({d}))
    assert flash_triton._head_chunks(d)[2] == d - 64
    n_q, n_k = 37, 37 if is_causal else 23
    q, do = (_strided((2, 2, n_q, d), layout, dtype, TRITON_DEVICE) for _ in range(2))
    k, v = (_strided((2, 2, n_k, d), layout, dtype, TRITON_DEVICE) for _ in range(2))
    check_flash("triton", q, k, v, is_causal, do)


def test_head_chunks(monkeypatch):
    """Only the listed head dims split, and only where the second chunk fills its tile (80 and 96)."""
    assert flash_triton.SPLIT_HEAD_DIMS == {80, 96}
    monkeypatch.setattr(flash_triton, "SPLIT_HEAD_DIMS", frozenset({48, 72, 80, 96, 112, 128}))
    chunks = {d: flash_triton._head_chunks(d) for d in (48, 64, 72, 80, 96, 112, 128)}
    assert chunks == {48: (48, 64, 0, 16), 64: (64, 64, 0, 16), 72: (72, 128, 0, 16), 80: (64, 64, 16, 16),
                      96: (64, 64, 32, 32), 112: (112, 128, 0, 16), 128: (128, 128, 0, 16)}
    monkeypatch.setattr(flash_triton, "SPLIT_HEAD_DIMS", frozenset())
    assert flash_triton._head_chunks(80) == (80, 128, 0, 16)


@pytest.mark.parametrize(
    "shape, layout, dtype, descriptors",
    [
        pytest.param((2, 2, 37, 80), "transposed", torch.float16, True, id="d80-fp16-transposed"),
        pytest.param((2, 2, 37, 80), "contiguous", torch.float32, True, id="d80-fp32-contiguous"),
        pytest.param((1, 3, 37, 48), "contiguous", torch.float16, True, id="d48-fp16-contiguous"),
        # Rows 288 bytes apart (16-byte aligned) but heads 72 bytes apart: a descriptor per head would be misaligned.
        pytest.param((1, 4, 37, 36), "transposed", torch.float16, False, id="d36-fp16-transposed"),
    ],
)
def test_flash_triton_forward_through_tensor_descriptors(shape, layout, dtype, descriptors, monkeypatch, seed):
    """The forward's USE_TMA path, forced (the interpreter runs tensor descriptors with TMA's zero fill out of
    bounds): descriptors span the real head dim and their tiles the padded one, so the padding loads as zeros. Inputs
    whose batch, head or row strides would misalign a descriptor take the pointer path instead."""
    _force_config(monkeypatch, flash_triton._flash_fwd_kernel, flash_triton._fwd_config(32, 16, 4, 1, True))
    q, k, v, do = (_strided(shape, layout, dtype, TRITON_DEVICE) for _ in range(4))
    assert flash_triton._tma_ok(q, k, v) is descriptors
    check_flash("triton", q, k, v, True, do)


def test_block_d_is_the_padded_power_of_two():
    assert [flash_triton._block_d(d) for d in (1, 8, 16, 17, 48, 64, 80, 96, 128)] == [16, 16, 16, 32, 64, 64, 128,
                                                                                       128, 128]


@pytest.mark.parametrize("split", [False, True], ids=["padded", "split"])
@pytest.mark.parametrize("d, table", [(80, 128), (96, 128), (48, 64), (8, 64), (128, 128)])
def test_forward_tiles_are_those_of_the_padded_width(d, table, split, monkeypatch):
    """On a GPU the forward's autotuner keeps the tile table of the tiles' width (BLOCK_D), not of the head dim: a
    head dim of 80 runs 128-wide tiles, and split (SPLIT_HEAD_DIMS, 64 + 16 columns) the configs of 128 too. (The
    interpreter skips the tables; here they are looked up as on a GPU.)"""
    monkeypatch.setattr(flash_triton, "_INTERPRET", False)
    monkeypatch.setattr(flash_triton, "SPLIT_HEAD_DIMS", frozenset({d} if split else ()))
    configs = list(dict.fromkeys(c for cs in flash_triton._FWD_CONFIGS.values() for c in cs))
    q = torch.empty(1, 1, 8192, d, dtype=torch.bfloat16, device="meta")
    kept = flash_triton._prune_configs(configs, {"Q": q, "N_Q": 8192, "N_K": 8192}, rows="BLOCK_M",
                                       tiles=flash_triton._FWD_CONFIGS, **flash_triton._chunk_constexprs(d))
    assert kept == flash_triton._FWD_CONFIGS[table]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape, k_len, layout, is_causal",
    [
        # The 2.7B preset's attention at context 512, as the model calls it (v a transposed view).
        pytest.param((4, 32, 512, 80), 512, "transposed", True, id="d80-2.7B"),
        pytest.param((2, 4, 1000, 80), 1000, "contiguous", True, id="d80-causal-ragged"),
        pytest.param((1, 3, 1537, 80), 1000, "contiguous", False, id="d80-full-ragged"),
        pytest.param((2, 4, 1000, 96), 1000, "transposed", True, id="d96-causal-ragged"),
        pytest.param((2, 4, 2048, 96), 2048, "transposed", False, id="d96-full"),
        pytest.param((3, 1000, 48), 1000, "contiguous", True, id="d48-3d-causal"),
        pytest.param((2, 4, 777, 72), 777, "transposed", True, id="d72-causal"),
        pytest.param((2, 4, 1000, 36), 1000, "transposed", True, id="d36-causal"),  # misaligned for descriptors
        pytest.param((2, 4, 1000, 8), 1000, "contiguous", False, id="d8-full"),
    ],
)
def test_flash_triton_padded_head_dim_gpu(gpu, shape, k_len, layout, is_causal, dtype, seed):
    q, do = (_strided(shape, layout, dtype, gpu) for _ in range(2))
    k, v = (_strided((*shape[:-2], k_len, shape[-1]), layout, dtype, gpu) for _ in range(2))
    check_flash("triton", q, k, v, is_causal, do)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape, k_len, layout, is_causal",
    [
        pytest.param((4, 32, 512, 80), 512, "transposed", True, id="d80-2.7B"),
        pytest.param((1, 3, 1537, 80), 1000, "contiguous", False, id="d80-full-ragged"),
        pytest.param((2, 4, 1000, 96), 1000, "transposed", True, id="d96-causal-ragged"),
    ],
)
def test_flash_triton_split_head_dim_gpu(gpu, shape, k_len, layout, is_causal, dtype, monkeypatch, seed):
    """SPLIT_HEAD_DIMS on the GPU (the config the autotuner chooses) against float64."""
    monkeypatch.setattr(flash_triton, "SPLIT_HEAD_DIMS", frozenset({shape[-1]}))
    q, do = (_strided(shape, layout, dtype, gpu) for _ in range(2))
    k, v = (_strided((*shape[:-2], k_len, shape[-1]), layout, dtype, gpu) for _ in range(2))
    check_flash("triton", q, k, v, is_causal, do)


# --------------------------------------------------------------------------------------- GPU, realistic sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "q_shape, k_shape, is_causal",
    [
        ((2, 8, 2048, 64), (2, 8, 2048, 64), True),
        ((2, 8, 2048, 64), (2, 8, 2048, 64), False),
        ((1, 4, 4096, 128), (1, 4, 4096, 128), True),
        ((1, 4, 4096, 128), (1, 4, 4096, 128), False),
        ((2, 4, 1000, 64), (2, 4, 1000, 64), True),
        ((1, 2, 1537, 128), (1, 2, 1000, 128), False),
        ((4, 1537, 32), (4, 1537, 32), True),
        ((3, 1000, 16), (3, 1537, 16), False),
    ],
)
def test_flash_triton_gpu(gpu, q_shape, k_shape, is_causal, dtype, seed):
    q, k, v = make_inputs(q_shape, k_shape, dtype, gpu)
    check_flash("triton", q, k, v, is_causal, torch.randn_like(q))


# The training grid's shapes (lmsys.bench.attention.training_grid: 16384 tokens a batch, the grid's heads per head dim)
# and odd lengths of the same heads, causal and not, through flash_triton's default routes (this GPU's measured kernel
# choices and pinned configs). Up to 4096 keys at d=80 and 96, whose longer lengths run the same kernels with more
# tiles (and have no pins: each would autotune).
def _training_points():
    lengths = {64: (512, 1024, 2048, 4096, 8192, 16384), 128: (512, 1024, 2048, 4096, 8192, 16384),
               80: (512, 1024, 2048, 4096), 96: (512, 1024, 2048, 4096)}
    return [
        pytest.param((max(1, TRAINING_TOKENS // seq), TRAINING_HEADS[d], seq, d), is_causal,
                     id=f"d{d}-t{seq}-{'causal' if is_causal else 'full'}")
        for d, seqs in lengths.items() for seq in (*seqs, 1000, 3001) for is_causal in (True, False)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, is_causal", _training_points())
def test_training_grid_matches_float64_gpu(gpu, shape, is_causal, seed):
    """bf16 forward and every gradient at the whole shape, the first and the last (batch, head) against float64 (one
    head at a time: the reference holds its T x T scores)."""
    q, k, v = make_inputs(shape, shape, torch.bfloat16, gpu)
    do = torch.randn_like(q)
    o, lse = flash_triton.forward(q, k, v, is_causal)
    dq, dk, dv = flash_triton.backward(q, k, v, o, lse, do, is_causal)
    for b, h in dict.fromkeys(((0, 0), (shape[0] - 1, shape[1] - 1))):
        rows = (slice(b, b + 1), slice(h, h + 1))
        expected = reference(q[rows], k[rows], v[rows], do[rows], is_causal)
        for name, actual, exp in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), expected, strict=True):
            assert_matches(actual[rows], exp, q.dtype, f"{name}[{b}, {h}]")
        del expected
        torch.cuda.empty_cache()


def _config_id(config):
    tiles = "-".join(f"{k}{v}" for k, v in config.kwargs.items())
    return f"{tiles}-w{config.num_warps}-s{config.num_stages}" + (f"-r{config.maxnreg}" if config.maxnreg else "")


def _force_config(monkeypatch, kernel, config):
    """Make the autotuned `kernel` run `config` alone (a single config is launched without tuning or pruning), and
    forget the launches the launcher kept (they hold the configs chosen before)."""
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(launcher, "_launches", {})


# Ragged lengths, causal and not, 3-D and 4-D: every boundary mask variant of a kernel.
FORCED_CONFIG_PROBLEMS = [((2, 3, 1000, 0), (2, 3, 1000, 0), True), ((3, 777, 0), (3, 1537, 0), False)]


TILE_CONFIGS = [
    pytest.param(kernel, config, id=f"{name}-{_config_id(config)}")
    for name, kernel, configs in (
        ("fwd", "_flash_fwd_kernel", flash_triton._fwd_configs()),
        ("bwd", "_flash_bwd_kernel", flash_triton._bwd_configs()),
    )
    for config in configs
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, split", [(64, False), (128, False), (80, False), (80, True), (96, True)],
                         ids=["d64", "d128", "d80", "d80-split", "d96-split"])
@pytest.mark.parametrize("kernel, config", TILE_CONFIGS)
def test_every_tile_config_gpu(gpu, kernel, config, head_dim, split, monkeypatch):
    """Each tile config a kernel's autotuner may pick, forced, against float64 (the autotuner runs only the fastest);
    at d=80 the tiles are 128 wide, the descriptors of the USE_TMA configs 80; split (SPLIT_HEAD_DIMS), 64 + 16 or 32
    wide, through pointers."""
    monkeypatch.setattr(flash_triton, "SPLIT_HEAD_DIMS", frozenset({head_dim} if split else ()))
    _force_config(monkeypatch, getattr(flash_triton, kernel), config)
    for q_shape, k_shape, is_causal in FORCED_CONFIG_PROBLEMS:
        q, k, v = make_inputs(q_shape[:-1] + (head_dim,), k_shape[:-1] + (head_dim,), torch.bfloat16, gpu)
        check_flash("triton", q, k, v, is_causal, torch.randn_like(q))


def _assert_compiled_well(folder, spill_bytes=0):
    """The kernel compiled into `folder` (kernel.cubin, and ptxas.log: the report `ptxas -v` gave triton as it compiled
    the kernel) spills no register (at most `spill_bytes`, for a kernel measured fast all the same), and ptxas kept its
    warpgroup MMAs asynchronous: when a kernel keeps too many registers live (message C7511), or reads an MMA's
    accumulator registers while it may be in flight (C7514), ptxas serializes them (each MMA waited for as soon as
    issued) with no error, and the kernel runs much slower (docs/attention.md, "The first measurements; FA3's dQ and
    PIPELINED, removed")."""
    tools = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", str(folder / "kernel.cubin")],
                           capture_output=True, text=True, check=True).stdout
    if not spill_bytes:
        assert "STACK:0 " in usage and "LOCAL:0" in usage, (folder.name, usage)  # no register spilled
    info = (folder / "ptxas.log").read_text()
    assert "C7511" not in info and "serialized" not in info, (folder.name, info)
    spilled = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info)]
    assert spilled and max(spilled) <= spill_bytes, (folder.name, info)


# What the compile scripts below share: the environment they run in (no interpreter: under it triton's own Triton
# functions, which Gluon's reductions call, are interpreter objects, and Gluon cannot compile; a cache of their own, so
# that ptxas runs for every build, its -v report printed: TRITON_DUMP_PTXAS_LOG), and the compile itself, which keeps
# that report beside the kernel.
def _compile_env(tmp_path):
    return {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
            "TRITON_DUMP_PTXAS_LOG": "1"}


_COMPILE = """
import contextlib, io, pathlib
import triton
from triton.backends.compiler import GPUTarget

def compile_into(out, source):
    report = io.StringIO()
    with contextlib.redirect_stdout(report):  # where triton prints ptxas's report
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out = pathlib.Path(out)
    out.mkdir(parents=True)
    (out / "kernel.ptx").write_text(compiled.asm["ptx"])
    (out / "kernel.cubin").write_bytes(compiled.asm["cubin"])
    (out / "shared").write_text(str(compiled.metadata.shared))
    (out / "ptxas.log").write_text(report.getvalue())
"""


# Compiles the Gluon forward for sm_90 (no GPU needed) in bf16, one build per argument `<full|causal>-<d>-<consumers>`
# after the folder argv[1], and writes each one's PTX, cubin, shared-memory size and ptxas report to argv[1]/<build>.
# One process compiles them all: its imports take as long as a build.
_COMPILE_HOPPER_FORWARD = _COMPILE + """
import sys
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from lmsys.attention import flash_hopper as fh

kernel = fh._flash_fwd_hopper_kernel
for build in sys.argv[2:]:
    mask, d, consumers = build.split("-")
    d, consumers = int(d), int(consumers)
    def descriptor(rows):
        return f"tensordesc<bf16[{rows}, {d}],{gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)!r}>"
    constexprs = dict(HEAD_DIM=d, CAUSAL=mask == "causal", BLOCK_N=fh.BLOCK_N, NUM_STAGES=fh.NUM_STAGES,
                      CONSUMER_REGS=fh.CONSUMER_REGS_3 if consumers == 3 else fh.CONSUMER_REGS,
                      PRODUCER_REGS=fh.PRODUCER_REGS, CONSUMERS=consumers, MARK=mask == "causal")
    types = {"q_desc": descriptor(fh.WARPGROUP_ROWS), "k_desc": descriptor(fh.BLOCK_N),
             "v_desc": descriptor(fh.BLOCK_N), "o_desc": descriptor(fh.WARPGROUP_ROWS), "LSE": "*fp32",
             "qk_scale": "fp32", **dict.fromkeys(constexprs, "constexpr")}
    names = kernel.arg_names
    source = GluonASTSource(kernel, {n: types.get(n, "i32") for n in names},
                            {(names.index(n),): value for n, value in constexprs.items()}, {})
    compile_into(pathlib.Path(sys.argv[1]) / build, source)
"""


def test_hopper_forward_compiles_with_softmax_under_the_mma(tmp_path):
    """On any machine: the Gluon forward compiles for sm_90 with the installed triton, fits shared memory, spills
    nothing, and waits for the score MMA while the P V MMA is still in flight (`wgmma.wait_group 1`), at both head dims
    it runs, causal and not, with two consumer warpgroups and (at d=64, `flash_hopper.plan`) three."""
    builds = [f"{mask}-{d}-{consumers}" for mask in ("full", "causal") for d, consumers in ((64, 2), (64, 3), (128, 2))]
    result = subprocess.run([sys.executable, "-c", _COMPILE_HOPPER_FORWARD, str(tmp_path), *builds],
                            env=_compile_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    for build in builds:
        folder = tmp_path / build
        assert int((folder / "shared").read_text()) <= 227 * 1024, build
        assert "wgmma.wait_group.sync.aligned 1;" in (folder / "kernel.ptx").read_text(), build
        _assert_compiled_well(folder)


# Compiles the two kernels of the Gluon backward for sm_90 (no GPU needed), causal and not, at each head dim they take
# (and the dK/dV kernel at d=64 with the other PREFETCH setting: causal without it, not causal with it, and
# accumulating dQ, FUSED_DQ, causal and not, with and without FUSED_SPLIT, and causal with it at d=128; and each kernel,
# causal at d=64, in the other launch order, GROUPED_ORDER: variants scripts/attention_backward_variants.py times), and
# writes each one's PTX, cubin, shared-memory size and ptxas report to argv[2]/<kernel>-<causal>-<d>/<default,
# other-prefetch, fused, fused-split or other-order>.
_COMPILE_HOPPER_BACKWARD = _COMPILE + """
import sys
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from lmsys.attention import flash_hopper_bwd as hb

which = sys.argv[1]
kernel = hb._dkdv_kernel if which == "dkdv" else hb._dq_kernel
builds = [(causal, d, "default") for causal in (False, True) for d in hb.HEAD_DIMS]
builds += [(causal, 64, variant) for causal in (False, True) for variant in ("other-prefetch", "fused", "fused-split")
           if which == "dkdv"]
builds += [(True, 128, "fused-split")] if which == "dkdv" else []
builds += [(True, 64, "other-order")]
for causal, d, variant in builds:
    def descriptor(rows):
        return f"tensordesc<bf16[{rows}, {d}],{gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)!r}>"
    if which == "dkdv":
        half = hb.BLOCK_KEYS // 2
        descs = {"q_desc": descriptor(hb.TILES[d][0]), "k_desc": descriptor(half), "v_desc": descriptor(half),
                 "do_desc": descriptor(hb.TILES[d][0]), "dk_desc": descriptor(half), "dv_desc": descriptor(half)}
    else:
        half = hb.BLOCK_ROWS // 2
        keys = hb.TILES[d][1]
        descs = {"q_desc": descriptor(half), "k_desc": descriptor(keys), "v_desc": descriptor(keys),
                 "do_desc": descriptor(half), "dq_desc": descriptor(half)}
    constexprs = dict(HEAD_DIM=d, CAUSAL=causal, NUM_STAGES=hb.NUM_STAGES, CONSUMER_REGS=hb.CONSUMER_REGS,
                      PRODUCER_REGS=hb.PRODUCER_REGS, GROUPED=hb.GROUPED_ORDER != (variant == "other-order"))
    if which == "dq":
        constexprs["MARK"] = causal
    if which == "dkdv":
        constexprs["PREFETCH"] = ((causal, d) in hb.PREFETCH_STATS) != (variant == "other-prefetch")
        constexprs["FUSED"] = variant.startswith("fused")
        constexprs["SPLIT"] = variant == "fused-split"
        constexprs["DS_SMEM"] = constexprs["SPLIT"] and hb.ds_from_shared(d, 15.5)  # as at the leaderboard
        constexprs["K_REGS"] = constexprs["FUSED"] and hb.K_IN_REGISTERS and d == 64
        dq_cols = d // 2 if constexprs["SPLIT"] else d
        if constexprs["FUSED"]:
            descs["dq_desc"] = f"tensordesc<fp32[{hb.TILES[d][0]}, {dq_cols}],{hb.DQ_ACC_LAYOUT!r}>"
        else:
            constexprs["dq_desc"] = None
        if constexprs["SPLIT"]:
            layout = gl.NVMMASharedLayout.get_default_for([hb.BLOCK_KEYS, dq_cols], gl.bfloat16)
            descs["kc_desc"] = f"tensordesc<bf16[{hb.BLOCK_KEYS}, {dq_cols}],{layout!r}>"
        else:
            constexprs["kc_desc"] = None
    types = {**descs, "LSE": "*fp32", "DELTA": "*fp32", "MARKS": "*i8", "qk_scale": "fp32", "sm_scale": "fp32",
             **dict.fromkeys(constexprs, "constexpr")}
    names = kernel.arg_names
    source = GluonASTSource(kernel, {n: types.get(n, "i32") for n in names},
                            {(names.index(n),): value for n, value in constexprs.items()}, {})
    compile_into(pathlib.Path(sys.argv[2]) / f"{which}-{causal}-{d}" / variant, source)
"""


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_hopper_backward_compiles_with_the_softmax_under_an_mma(kernel, tmp_path):
    """On any machine: each kernel of the Gluon backward compiles for sm_90 with the installed triton at both head dims,
    causal and not, fits shared memory, spills no register, and works on the probabilities while a product is still
    in flight (`wgmma.wait_group 1`); the dK/dV kernel at d=64 with the other PREFETCH_STATS setting too, and
    accumulating dQ (FUSED_DQ) by TMA's bulk reduction, its dS^T read transposed from shared memory, each warpgroup's
    over its own keys or (FUSED_SPLIT) half of dQ's columns over both warpgroups' keys."""
    result = subprocess.run([sys.executable, "-c", _COMPILE_HOPPER_BACKWARD, kernel, str(tmp_path)],
                            env=_compile_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    built = sorted(tmp_path.glob(f"{kernel}-*/*"))
    variants = [folder.name for folder in built]
    assert variants.count("default") == 4
    assert variants.count("other-prefetch") == variants.count("fused") == (2 if kernel == "dkdv" else 0)
    assert variants.count("fused-split") == (3 if kernel == "dkdv" else 0)
    assert variants.count("other-order") == 1
    for folder in built:
        assert int((folder / "shared").read_text()) <= 227 * 1024, folder.name
        ptx = (folder / "kernel.ptx").read_text()
        assert "wgmma.wait_group.sync.aligned 1;" in ptx, folder.name
        reductions = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)
        # Per consumer warpgroup, one in the loop without the mask and (causal) one in the loop with it.
        expected = (4 if "True" in folder.parent.name else 2) if folder.name.startswith("fused") else 0
        assert len(reductions) == expected, folder
        # dQ accumulated in the dK/dV kernel spills, causal, measured faster all the same: at d=128 (FUSED_HEAD_DIMS),
        # and at d=64 with K from registers (K_IN_REGISTERS: one register, stored before the loops).
        spill_bytes = {"dkdv-True-128": 104, "dkdv-True-64": 4}.get(folder.parent.name, 0)
        _assert_compiled_well(folder, spill_bytes=spill_bytes if folder.name == "fused-split" else 0)


# Compiles flash_triton's two fix-up kernels (GUARD_MASKED) for sm_90 (no GPU needed) in bf16, causal, at head dims 64,
# 80 (split) and 128, with their launch's tiles, warps and stages, into argv[1]/<fwd|bwd>-<d>.
_COMPILE_FIXUP = _COMPILE.replace('options={"num_warps": 4}', "options=options").replace(
    "def compile_into(out, source):", "def compile_into(out, source, options):") + """
import sys
from triton.compiler import ASTSource
from lmsys.attention import flash_triton as ft

pointers = {**dict.fromkeys(("Q", "K", "V", "O", "DO", "DQ"), "*bf16"), "LSE": "*fp32", "DELTA": "*fp32", "MARKS": "*i8"}
for kind, heuristics, tiles in (("fwd", ft._flash_fwd_fixup_kernel, ft._FIXUP_FWD),
                                ("bwd", ft._flash_bwd_fixup_kernel, ft._FIXUP_BWD)):
    kernel = heuristics.fn
    for d in (64, 80, 128):
        constexprs = dict(**ft._chunk_constexprs(d), CAUSAL=True, DOT_PRECISION="tf32", **tiles, EVEN_M=True,
                          EVEN_N=True)
        names = kernel.arg_names
        types = {n: "constexpr" if n in constexprs else "fp32" if n.endswith("_scale")
                 else pointers.get(n, "i32") for n in names}
        source = ASTSource(kernel, types, {(names.index(n),): value for n, value in constexprs.items()})
        compile_into(pathlib.Path(sys.argv[1]) / f"{kind}-{d}", source, dict(ft._FIXUP_LAUNCH))
"""


def test_the_fix_up_kernels_compile_for_sm_90(tmp_path):
    """On any machine: flash_triton's fix-up kernels, which the interpreter runs on the CPU and no test there compiles,
    compile for sm_90 with the installed triton at head dims 64, 80 and 128, fit shared memory, and spill little (the
    dQ fix-up at d=128 28 bytes, at d=80 4, when built on 2026-12-02)."""
    result = subprocess.run([sys.executable, "-c", _COMPILE_FIXUP, str(tmp_path)],
                            env=_compile_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    for kind in ("fwd", "bwd"):
        for d in (64, 80, 128):
            folder = tmp_path / f"{kind}-{d}"
            assert int((folder / "shared").read_text()) <= 227 * 1024, folder.name
            _assert_compiled_well(folder, spill_bytes=32 if kind == "bwd" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dq", ["two-kernels", "fused-dq", "fused-split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "q_shape, k_shape, is_causal, layout",
    [
        ((2, 3, 1024, 128), (2, 3, 1024, 128), True, "contiguous"),
        ((2, 3, 1024, 128), (2, 3, 1024, 128), False, "contiguous"),
        ((3, 128, 64), (3, 128, 64), True, "contiguous"),
        ((1, 2, 256, 64), (1, 2, 640, 64), False, "contiguous"),
        ((1, 2, 640, 128), (1, 2, 256, 128), False, "contiguous"),
        ((1, 2, 640, 64), (1, 2, 256, 64), False, "contiguous"),
        ((2, 3, 1024, 64), (2, 3, 1024, 64), True, "transposed"),
        ((3, 384, 128), (3, 384, 128), True, "transposed"),
        ((2, 3, 512, 128), (2, 3, 512, 128), True, "packed"),
    ],
)
def test_hopper_backward_gpu(gpu, q_shape, k_shape, is_causal, layout, dtype, dq, monkeypatch, seed):
    """The Gluon backward (HOPPER_BACKWARD) against float64, forward and every gradient, on inputs it takes:
    contiguous, transposed views and the model's packed q, k, v, head dims 64 and 128, causal and not, more queries
    than keys and fewer; its two kernels, and dQ accumulated by the dK/dV kernel (FUSED_DQ, each warpgroup's over its
    keys or, FUSED_SPLIT, half of its columns over the program's) at the head dims that take it; and it is the backward
    that ran."""
    monkeypatch.setattr(flash_hopper_bwd, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (compute capability 9.0)")
    if dq != "two-kernels" and q_shape[-1] not in flash_hopper_bwd.FUSED_HEAD_DIMS:
        pytest.skip(f"FUSED_DQ is for head dims {flash_hopper_bwd.FUSED_HEAD_DIMS}")
    if dq == "fused-dq" and q_shape[-1] > 64:
        pytest.skip("FUSED_DQ at d=128 only with FUSED_SPLIT")
    monkeypatch.setattr(flash_triton, "HOPPER_BACKWARD", True)
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_DQ", dq != "two-kernels")
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_SPLIT", dq == "fused-split")
    # Small problems, which it would leave (they run with the dQ kernel beside the other).
    monkeypatch.setattr(flash_hopper_bwd, "MIN_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(flash_hopper_bwd, "MIN_PROGRAMS_PER_SM_CONCURRENT", 0)
    calls, planned = [], []
    hopper_backward, plan_launches = flash_hopper_bwd.backward, flash_hopper_bwd._launches
    monkeypatch.setattr(flash_hopper_bwd, "backward", lambda *a: calls.append(a) or hopper_backward(*a))
    monkeypatch.setattr(flash_hopper_bwd, "_launches", lambda *a: planned.append(a) or plan_launches(*a))
    for _ in range(2):  # the second on fresh inputs of the same signature: through the launches its plan kept
        if layout == "packed":
            q, k, v = _packed_qkv(q_shape[0], q_shape[1], q_shape[2], q_shape[3], dtype, gpu)
        else:
            q = _strided(q_shape, layout, dtype, gpu)
            k, v = (_strided(k_shape, layout, dtype, gpu) for _ in range(2))
        do = _strided(q_shape, layout if layout != "packed" else "transposed", dtype, gpu)
        check_flash("triton", q, k, v, is_causal, do)
    assert len(calls) == 2 and len(planned) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("settings", [
    {"CONCURRENT_DQ": True}, {"CONCURRENT_DQ": False}, {"TILES": {64: (64, 128), 128: (64, 128)}}, {"NUM_STAGES": 3},
    {"PREFETCH_STATS": set()}, {"GROUPED_ORDER": not flash_hopper_bwd.GROUPED_ORDER},
    {"FUSED_DQ": True, "FUSED_SPLIT": False, "FUSED_GROUP_HEADS": None},
    {"FUSED_DQ": True, "FUSED_SPLIT": True, "FUSED_GROUP_HEADS": None},
    {"FUSED_DQ": True, "FUSED_SPLIT": True, "FUSED_GROUP_HEADS": 1},
    {"FUSED_DQ": True, "FUSED_SPLIT": False, "FUSED_GROUP_HEADS": 5},
    {"FUSED_DQ": True, "NUM_STAGES": 3},
    {"FUSED_DQ": True, "FUSED_SPLIT": True, "FUSED_DS_SMEM": True},
    {"FUSED_DQ": True, "FUSED_SPLIT": True, "FUSED_DS_SMEM": False},
    {"FUSED_DQ": True, "FUSED_SPLIT": True, "FUSED_DS_SMEM": True, "K_IN_REGISTERS": True},
    {"FUSED_DQ": True, "FUSED_SPLIT": True, "FUSED_DS_SMEM": False, "K_IN_REGISTERS": True},
    {"FUSED_DQ": True, "K_IN_REGISTERS": False},
], ids=["concurrent-dq", "serial-dq", "dq-tiles-128", "3-stages", "no-prefetch", "other-order", "fused-dq",
        "fused-split", "fused-split-g1", "fused-dq-g5", "fused-3-stages", "fused-ds-shared", "fused-ds-registers",
        "fused-ds-shared-k-registers", "fused-ds-registers-k-registers", "fused-k-shared"])
@pytest.mark.parametrize("q_shape, is_causal", [((2, 3, 1024, 64), True), ((1, 2, 512, 128), False),
                                                ((2, 3, 640, 64), False)])
def test_hopper_backward_variants_gpu(gpu, settings, q_shape, is_causal, monkeypatch, seed):
    """Each variant of the Gluon backward that scripts/attention_backward_variants.py times, against float64."""
    monkeypatch.setattr(flash_hopper_bwd, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (compute capability 9.0)")
    monkeypatch.setattr(flash_triton, "HOPPER_BACKWARD", True)
    monkeypatch.setattr(flash_hopper_bwd, "MIN_PROGRAMS_PER_SM", 0)
    for setting, value in settings.items():
        monkeypatch.setattr(flash_hopper_bwd, setting, value)
    # Groups of 4 heads at d=64 and 1024 rows: the 6 heads of a batch of 2 end short, in the forward too. The group is
    # an argument the launcher's keys leave out (in a program it follows from them), so fresh launch tables.
    monkeypatch.setattr(launch_order, "_GROUP_BYTES", 2**20)
    monkeypatch.setattr(launcher, "_launches", {})
    monkeypatch.setattr(launcher, "_checked", {})
    q, k, v = make_inputs(q_shape, q_shape, torch.bfloat16, gpu)
    check_flash("triton", q, k, v, is_causal, torch.randn_like(q))


@pytest.mark.parametrize(
    "per_sm, keys, capturing, expected",
    [
        (0.5, 65536, False, None),  # the Triton backward's
        (0.75, 16384, False, True),  # side by side from MIN_PROGRAMS_PER_SM_CONCURRENT and CONCURRENT_MIN_KEYS
        (3.9, 65536, False, True),
        (8, 16384, False, False),  # one after the other from CONCURRENT_BELOW_PROGRAMS_PER_SM
        (15.5, 16384, False, False),
        (1, 8192, False, None),  # shorter: one after the other, so from MIN_PROGRAMS_PER_SM
        (1.94, 512, False, False),  # the model's heads (large, batch 4, context 512)
        (1, 16384, True, None),  # under capture never side by side, so from MIN_PROGRAMS_PER_SM
        (1.5, 16384, True, False),
        (3.9, 65536, True, False),
    ],
)
def test_hopper_backward_plan(per_sm, keys, capturing, expected):
    """Which backward runs a problem of `per_sm` dQ programs per multiprocessor and `keys` keys, by default: the
    Triton one (None), the Gluon one with its dQ kernel beside the dK/dV one (True) or after it (False)."""
    assert flash_hopper_bwd.CONCURRENT_DQ is None
    assert flash_hopper_bwd.plan(per_sm, keys, capturing) is expected


@pytest.mark.parametrize("forced", [True, False])
def test_hopper_backward_plan_forced(forced, monkeypatch):
    """CONCURRENT_DQ forced either way holds at any size (the floor follows it), except under capture."""
    monkeypatch.setattr(flash_hopper_bwd, "CONCURRENT_DQ", forced)
    assert flash_hopper_bwd.plan(15.5, 512, capturing=False) is forced
    assert flash_hopper_bwd.plan(1, 512, capturing=False) is (True if forced else None)
    assert flash_hopper_bwd.plan(15.5, 65536, capturing=True) is False


@pytest.mark.parametrize(
    "head_dim, per_sm, keys, is_causal, expected",
    [
        (64, 15.5, 16384, True, True),  # the leaderboard
        (64, 1.94, 32768, True, True),  # one head of 32768 and 65536 tokens
        (64, 3.9, 65536, True, True),
        (64, 0.97, 16384, True, False),  # one head of 16384: the two kernels side by side
        (64, 15.5, 8192, True, False),  # shorter, not timed
        (64, 1.94, 512, True, False),  # the model's heads (large, batch 4, context 512)
        (64, 7.75, 16384, False, False),  # without the mask (the seeds' grid, batch 8), not timed
        (128, 1.94, 32768, True, True),  # at d=128 too (with FUSED_SPLIT)
        (128, 3.9, 65536, True, True),
        (128, 15.5, 16384, True, True),  # the leaderboard's shape at d=128
        (128, 0.97, 16384, True, False),
        (32, 15.5, 16384, True, False),  # a head dim it does not take (FUSED_HEAD_DIMS)
    ],
)
def test_hopper_backward_fused_by_size(head_dim, per_sm, keys, is_causal, expected, monkeypatch):
    """By default (FUSED_DQ None) the dK/dV kernel accumulates dQ for causal problems from FUSED_MIN_KEYS keys and
    FUSED_MIN_PROGRAMS_PER_SM programs per multiprocessor, at the head dims that take it; forced either way it holds
    at any size there."""
    assert flash_hopper_bwd.FUSED_DQ is None and flash_hopper_bwd.FUSED_SPLIT
    assert flash_hopper_bwd.fused(head_dim, per_sm, keys, is_causal) is expected
    for forced in (True, False):
        monkeypatch.setattr(flash_hopper_bwd, "FUSED_DQ", forced)
        takes = head_dim in flash_hopper_bwd.FUSED_HEAD_DIMS
        assert flash_hopper_bwd.fused(head_dim, per_sm, keys, is_causal) is (forced and takes)
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_DQ", True)
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_SPLIT", False)  # d=128 takes it only with FUSED_SPLIT
    assert flash_hopper_bwd.fused(head_dim, per_sm, keys, is_causal) is (head_dim == 64)


@pytest.mark.parametrize("head_dim, per_sm, expected, expected_k_shared",
                         [(64, 15.5, False, True), (64, 8, False, True), (64, 3.9, False, False),
                          (128, 1.9, True, True)])
def test_hopper_backward_ds_from_shared_by_size(head_dim, per_sm, expected, expected_k_shared, monkeypatch):
    """By default (FUSED_DS_SMEM None, K_IN_REGISTERS) dK's dS^T comes from registers at d=64, from shared memory at
    d=128; with K from shared memory (K_IN_REGISTERS off) at d=64 from FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM programs per
    multiprocessor (the leaderboard's 15.5), from registers below (one head of 65536 tokens: 3.9); forced either way at
    d=64, at d=128 always from shared memory."""
    assert flash_hopper_bwd.FUSED_DS_SMEM is None and flash_hopper_bwd.K_IN_REGISTERS
    assert flash_hopper_bwd.ds_from_shared(head_dim, per_sm) is expected
    monkeypatch.setattr(flash_hopper_bwd, "K_IN_REGISTERS", False)
    assert flash_hopper_bwd.ds_from_shared(head_dim, per_sm) is expected_k_shared
    for forced in (True, False):
        monkeypatch.setattr(flash_hopper_bwd, "FUSED_DS_SMEM", forced)
        assert flash_hopper_bwd.ds_from_shared(head_dim, per_sm) is (forced or head_dim > 64)


@pytest.mark.parametrize(
    "head_dim, per_sm, keys, expected",
    [
        (128, 0.5, 65536, None),  # below MIN_PROGRAMS_PER_SM: the Triton forward's
        (128, 1, 4096, 2),
        (128, 15.5, 512, 2),
        (64, 1.94, 32768, 2),  # one head of 32768 and 65536 tokens, where two warpgroups were measured faster
        (64, 3.9, 65536, 2),
        (64, 0.97, 16384, None),  # shorter, not timed
        (64, 1.94, 512, None),  # the model's heads (large, batch 4, context 512)
        (64, 15.5, 16384, 3),  # the leaderboard: three warpgroups measured faster
        (64, 7.76, 16384, 3),  # from FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM (8 heads of 16384 tokens)
        (64, 15.5, 8192, None),  # shorter, not timed
        (64, 4, 65536, None),  # from FORWARD_64_BELOW_PROGRAMS_PER_SM to the wide window's start, not timed
        (80, 4, 65536, None),  # a head dim it does not compile for
    ],
)
def test_hopper_forward_plan(head_dim, per_sm, keys, expected):
    """Where the Gluon forward runs by default, and with how many consumer warpgroups a program: d=128 from one query
    block per multiprocessor, with two; d=64 on long problems of few blocks with two and on large problems of long
    sequences with three (measured faster there than the Triton forward)."""
    assert flash_hopper.plan(head_dim, per_sm, keys) == expected


@pytest.mark.gpu
def test_the_gluon_forward_at_head_dim_64_is_the_default_from_its_measured_sizes_gpu(gpu, monkeypatch, seed):
    """By default (`flash_hopper.plan`) a d=64 forward runs on the Gluon kernel for one head of about 32768 tokens
    (two query blocks per multiprocessor) with two consumer warpgroups a program, and for the leaderboard's shape with
    three, on the Triton kernel for one head of about 16384; its output against float32 SDPA."""
    monkeypatch.setattr(flash_hopper, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (compute capability 9.0)")
    assert flash_triton.HOPPER_FORWARD
    calls = []
    hopper_forward = flash_hopper.forward
    monkeypatch.setattr(flash_hopper, "forward", lambda *a: calls.append(a[-1].consumers) or hopper_forward(*a))
    sms = torch.cuda.get_device_properties(gpu).multi_processor_count
    for shape, expected in (((1, 1, 2 * sms * 128, 64), [2]), ((1, 1, sms * 128, 64), []), ((16, 1, 16384, 64), [3])):
        calls.clear()
        q, k, v = make_inputs(shape, shape, torch.bfloat16, gpu)
        out = flash_attention(q, k, v, is_causal=True, impl="triton")
        assert calls == expected, shape
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def _assert_sdpa_gradients(grads, q, k, v, do, is_causal):
    """bf16 gradients of q, k, v within 2% of the largest entry of float32 SDPA's (bf16 rounding)."""
    ref = torch.autograd.grad(
        F.scaled_dot_product_attention(*(t.float() for t in (q, k, v)), is_causal=is_causal), (q, k, v), do.float())
    for got, want in zip(grads, ref, strict=True):
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.gpu
def test_the_gluon_backward_is_the_default_from_its_measured_sizes_gpu(gpu, monkeypatch, seed):
    """By default (HOPPER_BACKWARD, `flash_hopper_bwd.plan`) a backward the Gluon kernels take runs on them, its dQ
    kernel beside the dK/dV one, from 0.75 programs of 128 query rows per multiprocessor and 16384 tokens, where it was
    measured faster (from 1.9 programs the dK/dV kernel accumulates dQ, `flash_hopper_bwd.fused`: no dQ kernel beside
    it), and on the Triton kernel below that (shorter problems from 1.5); both checked against float32 SDPA (the
    float64 tests run the Gluon kernels on small problems)."""
    monkeypatch.setattr(flash_hopper_bwd, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (compute capability 9.0)")
    assert flash_triton.HOPPER_BACKWARD and flash_hopper_bwd.CONCURRENT_DQ is None
    calls = []
    hopper_backward = flash_hopper_bwd.backward
    monkeypatch.setattr(flash_hopper_bwd, "backward", lambda *a: calls.append(a) or hopper_backward(*a))
    sms = torch.cuda.get_device_properties(gpu).multi_processor_count
    # 0.5, 1 and 2 programs per multiprocessor (batch 1, one head; on the H100's 132 multiprocessors 8448 rows, 16896
    # and 33792): the backward's last argument (its `BackwardPlan`) says how it ran.
    for rows, expected in ((sms * 64, []), (sms * 128, [True]), (2 * sms * 128, [False])):
        assert (rows >= flash_hopper_bwd.CONCURRENT_MIN_KEYS) == bool(expected)
        calls.clear()
        q, k, v = make_inputs((1, 1, rows, 64), (1, 1, rows, 64), torch.bfloat16, gpu)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        grads = torch.autograd.grad(flash_attention(q, k, v, is_causal=True, impl="triton"), (q, k, v), do)
        assert [call[-1].concurrent for call in calls] == expected
        _assert_sdpa_gradients(grads, q, k, v, do, True)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("part, choice", [(part, c) for part, choices in tuned.CHOICES.items() for c in choices])
def test_each_pass_runs_as_the_gpus_table_measured_gpu(gpu, part, choice, head_dim, is_causal, tmp_path, monkeypatch,
                                                       seed):
    """A problem in a bucket of this GPU's table (lmsys.attention.tuned) runs as the table says: the forward on the
    Triton kernel or the Gluon one with two or three consumer warpgroups, the backward on the Triton kernel or the
    Gluon kernels one after the other, side by side, or with dQ accumulated by the dK/dV kernel; the output and
    gradients against float64."""
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon kernels are for Hopper (compute capability 9.0)")
    if choice == "gluon-3wg" and head_dim != 64:
        pytest.skip("three consumer warpgroups at d=64 only")
    q, k, v, do = (torch.randn(2, 4, 1024, head_dim, device=gpu, dtype=torch.bfloat16) for _ in range(4))
    per_sm = flash_hopper.blocks_per_sm(q, 128)
    table = {"schema": tuned.SCHEMA, "device": torch.cuda.get_device_name(gpu), "kernels": {}, part: {
        "fingerprint": tuned.choice_fingerprint(part),
        "choices": [{"key": tuned.bucket(head_dim, is_causal, 1024, per_sm), "choice": choice}]}}
    monkeypatch.setattr(tuned, "FOLDER", tmp_path)
    tuned.write(tuned.table_path(torch.cuda.get_device_name(gpu)), table)
    plans.forget()
    try:
        if part == "forward":
            found = flash_hopper.forward_views(q, k, v, is_causal)
            assert (found and found.consumers) == {"triton": None, "gluon": 2, "gluon-3wg": 3}[choice]
        else:
            found = flash_hopper_bwd.views(q, k, v, do, is_causal)
            if choice == "triton":
                assert found is None
            else:
                assert (found.concurrent, found.fused_dq) == (choice == "gluon-concurrent", choice == "gluon-fused")
        check_flash("triton", q, k, v, is_causal, do)
    finally:
        tuned.load.cache_clear()
        tuned.load_choices.cache_clear()
        plans.forget()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_gluon_backward_accumulates_dq_by_size_gpu(gpu, head_dim, monkeypatch, seed):
    """By default (FUSED_DQ None, FUSED_SPLIT, groups of one head) the dK/dV kernel accumulates dQ for one causal head
    of about 32768 tokens (two programs per multiprocessor), not for one of about 16384 nor without the mask, at both
    head dims; the gradients against float32 SDPA."""
    monkeypatch.setattr(flash_hopper_bwd, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (compute capability 9.0)")
    defaults = (flash_hopper_bwd.FUSED_DQ, flash_hopper_bwd.FUSED_SPLIT, flash_hopper_bwd.FUSED_GROUP_HEADS)
    assert defaults == (None, True, 1)
    launches = []
    monkeypatch.setattr(launcher, "TRACE", launches)
    sms = torch.cuda.get_device_properties(gpu).multi_processor_count
    for rows, is_causal, expected in ((sms * 128, True, False), (2 * sms * 128, True, True),
                                      (2 * sms * 128, False, False)):
        launches.clear()
        q, k, v = make_inputs((1, 1, rows, head_dim), (1, 1, rows, head_dim), torch.bfloat16, gpu)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        grads = torch.autograd.grad(flash_attention(q, k, v, is_causal=is_causal, impl="triton"), (q, k, v), do)
        dkdv = [c for kernel, c in launches if kernel is flash_hopper_bwd._dkdv_kernel]
        assert [c["FUSED"] for c in dkdv] == [expected], (rows, is_causal)
        assert any(kernel is flash_hopper_bwd._dq_kernel for kernel, _ in launches) is not expected
        _assert_sdpa_gradients(grads, q, k, v, do, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_dq", [False, True], ids=["two-kernels", "fused-dq"])
def test_the_gluon_backward_under_graph_capture_gpu(gpu, fused_dq, monkeypatch, seed):
    """Captured in a CUDA graph, the Gluon backward runs its kernels one after the other (never on the side stream),
    from MIN_PROGRAMS_PER_SM; replayed, it gives the eager call's gradients: the same bits from the two kernels, and
    within bf16 rounding with dQ accumulated by the dK/dV kernel (FUSED_DQ, whose fp32 reductions land in any order;
    its buffer's zeroing is captured too)."""
    monkeypatch.setattr(flash_hopper_bwd, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon backward is for Hopper (compute capability 9.0)")
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_DQ", fused_dq)
    sms = torch.cuda.get_device_properties(gpu).multi_processor_count
    q, k, v, do = (torch.randn(1, 2, sms * 128, 64, device=gpu, dtype=torch.bfloat16) for _ in range(4))
    o, lse = flash_triton.forward(q, k, v, True)
    # eager at 2 programs per multiprocessor: the dQ kernel beside the dK/dV one, or no dQ kernel
    found = flash_hopper_bwd.views(q, k, v, do, True)
    assert (found.fused_dq, found.concurrent) == (fused_dq, not fused_dq)
    eager = flash_triton.backward(q, k, v, o, lse, do, True)
    side = torch.cuda.Stream(gpu)
    side.wait_stream(torch.cuda.current_stream(gpu))
    with torch.cuda.stream(side):
        flash_triton.backward(q, k, v, o, lse, do, True)  # compiled and cached outside the capture
    torch.cuda.current_stream(gpu).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        found = flash_hopper_bwd.views(q, k, v, do, True)
        assert (found.fused_dq, found.concurrent) == (fused_dq, False)
        captured = tuple(t.clone() for t in flash_triton.backward(q, k, v, o, lse, do, True))
    for t in captured:
        t.fill_(float("nan"))  # the replay must write every element
    graph.replay()
    torch.cuda.synchronize(gpu)
    for got, want in zip(captured, eager, strict=True):
        if fused_dq:
            assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
        else:
            assert torch.equal(got, want)


def _packed_qkv(batch, heads, n, d, dtype, device):
    """q, k, v as the model makes them: (batch, heads, n, d) views of one (batch, n, 3, heads, d) projection."""
    qkv = torch.randn(batch, n, 3, heads, d, dtype=dtype, device=device)
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "q_shape, k_shape, is_causal, layout",
    [
        ((2, 3, 1024, 128), (2, 3, 1024, 128), True, "contiguous"),
        ((2, 3, 1024, 128), (2, 3, 1024, 128), False, "contiguous"),
        ((3, 128, 128), (3, 128, 128), True, "contiguous"),
        ((1, 2, 256, 128), (1, 2, 640, 128), False, "contiguous"),
        ((2, 3, 1024, 128), (2, 3, 1024, 128), True, "transposed"),
        ((1, 2, 256, 128), (1, 2, 640, 128), False, "transposed"),
        ((3, 384, 128), (3, 384, 128), True, "transposed"),
        ((2, 3, 512, 128), (2, 3, 512, 128), True, "packed"),
    ],
)
def test_hopper_forward_gpu(gpu, q_shape, k_shape, is_causal, layout, dtype, monkeypatch, seed):
    """The Gluon forward (and the Triton backward after it) against float64, on inputs it takes: contiguous, the
    (B, H, T, D) views of (B, T, H, D) tensors, and the model's q, k, v split off one packed projection. (Small
    problems, which it would leave to the Triton forward for speed.)"""
    monkeypatch.setattr(flash_hopper, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (compute capability 9.0)")
    monkeypatch.setattr(flash_hopper, "MIN_PROGRAMS_PER_SM", 0)
    if layout == "packed":
        q, k, v = _packed_qkv(q_shape[0], q_shape[1], q_shape[2], q_shape[3], dtype, gpu)
    else:
        q = _strided(q_shape, layout, dtype, gpu)
        k, v = (_strided(k_shape, layout, dtype, gpu) for _ in range(2))
    assert flash_hopper.applies(q, k, v, is_causal)
    check_flash("triton", q, k, v, is_causal, torch.randn_like(q))


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize(
    "q_shape, k_shape, is_causal, layout",
    [
        ((2, 3, 1024, 64), (2, 3, 1024, 64), False, "contiguous"),
        ((2, 3, 1024, 64), (2, 3, 1024, 64), True, "contiguous"),  # 3 warpgroups: the last program's 2 past the rows
        ((3, 384, 64), (3, 384, 64), True, "transposed"),  # 3 warpgroups: programs of whole rows
        ((1, 2, 640, 64), (1, 2, 256, 64), False, "contiguous"),
        ((2, 3, 512, 64), (2, 3, 512, 64), True, "packed"),
    ],
)
def test_hopper_forward_at_head_dim_64_gpu(gpu, q_shape, k_shape, is_causal, layout, consumers, monkeypatch, seed):
    """The Gluon forward at d=64 against float64 (on problems smaller than those it runs at d=64: `plan`), with two
    consumer warpgroups per program and with three (`flash_hopper.plan`), whose programs of 192 rows may end past
    the queries of a head: the rows there must not be stored over the next head's."""
    monkeypatch.setattr(flash_hopper, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (compute capability 9.0)")
    monkeypatch.setattr(flash_hopper, "MIN_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_MIN_KEYS", 0)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_BELOW_PROGRAMS_PER_SM", math.inf)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_WIDE_MIN_KEYS", 0)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM", 0 if consumers == 3 else math.inf)
    calls = []
    hopper_forward = flash_hopper.forward
    monkeypatch.setattr(flash_hopper, "forward", lambda *a: calls.append(a[-1].consumers) or hopper_forward(*a))
    if layout == "packed":
        q, k, v = _packed_qkv(q_shape[0], q_shape[1], q_shape[2], q_shape[3], torch.bfloat16, gpu)
    else:
        q = _strided(q_shape, layout, torch.bfloat16, gpu)
        k, v = (_strided(k_shape, layout, torch.bfloat16, gpu) for _ in range(2))
    assert flash_hopper.applies(q, k, v, is_causal)
    check_flash("triton", q, k, v, is_causal, torch.randn_like(q))
    assert calls and set(calls) == {consumers}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "why, make",
    [
        ("ragged length", lambda gpu: make_inputs((1, 2, 1000, 128), (1, 2, 1000, 128), torch.bfloat16, gpu)),
        ("fewer blocks than multiprocessors", lambda gpu: make_inputs((1, 4096, 128), (1, 4096, 128), torch.bfloat16,
                                                                     gpu)),
        ("head dim 80", lambda gpu: make_inputs((1, 2, 1024, 80), (1, 2, 1024, 80), torch.bfloat16, gpu)),
        ("fp32", lambda gpu: make_inputs((1, 2, 1024, 128), (1, 2, 1024, 128), torch.float32, gpu)),
        ("head dim not unit-stride", lambda gpu: tuple(
            x.transpose(-1, -2) for x in make_inputs((1, 2, 128, 1024), (1, 2, 128, 1024), torch.bfloat16, gpu))),
        ("heads past the row", lambda gpu: tuple(
            torch.randn(2**18, dtype=torch.bfloat16, device=gpu).as_strided((1, 2, 1024, 128), (0, 64, 128, 1))
            for _ in range(3))),
    ],
)
def test_hopper_forward_declines_what_it_does_not_take(gpu, why, make, monkeypatch):
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (compute capability 9.0)")
    # Each case small, declined for its own reason alone, by the thresholds (not the table).
    monkeypatch.setattr(flash_hopper, "MEASURED", False)
    monkeypatch.setattr(flash_hopper, "MIN_PROGRAMS_PER_SM", 1 if why.startswith("fewer blocks") else 0)
    q, k, v = make(gpu)
    assert not flash_hopper.applies(q, k, v, True), why


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: torch.empty(2, 3, 256, 128), ((2 * 3 * 256, 128), 128, 3 * 256, 256, 0, 0)),
        (lambda: torch.empty(2, 256, 128), ((2 * 256, 128), 128, 256, 0, 0, 0)),
        (lambda: torch.empty(2, 256, 3, 128).transpose(1, 2), ((2 * 256, 3 * 128), 3 * 128, 256, 0, 0, 128)),
        (lambda: _packed_qkv(2, 3, 256, 128, torch.float32, "cpu")[2], ((2 * 256, 3 * 128), 9 * 128, 256, 0, 0, 128)),
        (lambda: torch.empty(256, 3, 128).transpose(0, 1), ((256, 3 * 128), 3 * 128, 0, 0, 128, 0)),
        (lambda: torch.empty(2, 3, 256, 256)[..., :128], ((2 * 3 * 256, 128), 256, 3 * 256, 256, 0, 0)),
        (lambda: torch.empty(2, 4, 256, 128)[:, :3], ((256 + 4 * 256 + 2 * 256, 128), 128, 4 * 256, 256, 0, 0)),
        (lambda: torch.empty(2, 3, 128, 256).transpose(-1, -2), None),  # the head dim is not unit-stride
        (lambda: torch.empty(1, 1, 256, 130)[..., 1:129], None),  # 4 bytes off a 16-byte boundary
        (lambda: torch.empty(2**16).as_strided((1, 2, 256, 128), (0, 64, 128, 1)), None),  # heads past the row
    ],
    ids=["contiguous", "3-D", "transposed", "packed-v", "3-D-transposed", "padded-rows", "batches-apart", "strided-d",
         "misaligned", "overlapping-heads"],
)
def test_hopper_view_of_each_layout(make, expected):
    """The 2-D view the Gluon forward's descriptors span, and where each head starts in it (batch b, head h from row
    b * RB + h * RH, column b * CB + h * CH)."""
    assert flash_hopper._view(make()) == expected


@pytest.mark.parametrize(
    "shape, transposed", [((2, 3, 256, 64), False), ((2, 3, 256, 128), True), ((3, 128, 64), False)]
)
def test_hopper_descriptors_skip_only_triton_checks(shape, transposed):
    """`flash_hopper.tma_descriptor` (no __post_init__) builds what Triton's TensorDescriptor does from the same
    arguments, field for field: a Triton upgrade that adds, renames or derives a field fails here."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    if transposed:
        x = torch.empty(shape[0], shape[2], shape[1], shape[3], dtype=torch.bfloat16).transpose(1, 2)
    (rows, cols), stride = flash_hopper._view(x)[:2]
    layout = flash_hopper._smem_layout(64, x.shape[-1], flash_hopper._gl_dtype(x.dtype))
    args = (x, [rows, cols], [stride, 1], [64, x.shape[-1]], layout)
    fast, checked = flash_hopper.tma_descriptor(*args), flash_hopper.TensorDescriptor(*args)
    assert type(fast) is type(checked) and vars(fast).keys() == vars(checked).keys()
    assert all(getattr(fast, name) is getattr(checked, name) or getattr(fast, name) == getattr(checked, name)
               for name in vars(checked))


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_model_attention_runs_the_hopper_forward(gpu, train, monkeypatch, seed):
    """The model's heads (q and k out of RoPE, v a view of the packed projection) take the Gluon forward, and the
    model's logits and gradients match those of the same model with SDPA."""
    monkeypatch.setattr(flash_hopper, "MEASURED", False)  # the thresholds decide, not the table
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon forward is for Hopper (compute capability 9.0)")
    calls = []
    hopper_forward = flash_hopper.forward
    monkeypatch.setattr(flash_hopper, "forward", lambda *a: calls.append(a) or hopper_forward(*a))
    # Head dim 128, and 4 x 4 heads of 2048 tokens: 256 query blocks, enough to fill an H100's 132 multiprocessors.
    config = ModelConfig(vocab_size=512, context_length=2048, d_model=512, num_layers=2, num_heads=4, d_ff=1024,
                         attention="flash_triton")
    ours = TransformerLM(config).to(gpu, torch.bfloat16)
    reference = TransformerLM(dataclasses.replace(config, attention="sdpa")).to(gpu, torch.bfloat16)
    reference.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, config.vocab_size, (4, 2048), device=gpu)
    with torch.set_grad_enabled(train):
        logits = ours(tokens)
        expected = reference(tokens)
    assert len(calls) == config.num_layers
    q, k, v = calls[0][:3]
    assert not v.is_contiguous()  # the model's v is a view of the packed projection, taken as it is
    torch.testing.assert_close(logits.float(), expected.float(), atol=0.05, rtol=0.05)
    if train:
        logits.float().square().mean().backward()
        expected.float().square().mean().backward()
        for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
            error = (a.grad.float() - b.grad.float()).norm() / b.grad.float().norm()
            assert error < 0.05, f"{name}: gradient {error:.3f} off SDPA's (relative to its norm)"


def _flat(source):
    return " ".join(source.split())


@pytest.mark.parametrize("kernel_name", ["_flash_fwd_kernel", "_flash_bwd_kernel"])
def test_triton_still_has_what_the_direct_launch_relies_on(kernel_name):
    """lmsys.attention.launcher reaches into triton: the autotuner's `best_config`, the heuristics' `values`, the JIT
    function returning the compiled kernel it launched, and the launch call it makes. If a triton upgrade moves any of
    these, this fails and names it (and the launcher needs a look), rather than launches going wrong."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = getattr(flash_triton, kernel_name)
    assert isinstance(kernel, Autotuner), f"{kernel_name} is a {type(kernel)}, not triton's Autotuner"
    assert isinstance(kernel.fn, Heuristics), f"{kernel_name}.fn is a {type(kernel.fn)}, not triton's Heuristics"
    assert set(kernel.fn.values) == {"EVEN_M", "EVEN_N"}, "the heuristics' rules moved"
    jit = InterpretedFunction if flash_triton._INTERPRET else JITFunction  # what triton.jit makes in this session
    assert isinstance(kernel.fn.fn, jit), f"{kernel_name}.fn.fn is a {type(kernel.fn.fn)}, not a {jit.__name__}"
    autotune = _flat(inspect.getsource(Autotuner.run))
    assert "self.best_config = config" in autotune and "ret = self.fn.run( *args, **kwargs, **config.all_kwargs(), )" \
        in autotune and "return ret" in autotune, "triton's Autotuner.run no longer keeps or passes its config so"
    assert "heur({**dict(zip(self.arg_names, args)), **kwargs})" in _flat(inspect.getsource(Heuristics.run)), (
        "triton's Heuristics.run evaluates its rules on other arguments")
    run = _flat(inspect.getsource(JITFunction.run))
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())") in run, (
        "triton's JITFunction.run launches differently: update lmsys.attention.launcher")
    assert run.endswith("return kernel"), "triton's JITFunction.run no longer returns the compiled kernel"
    # bound_args holds every parameter, constexprs included, in the kernel's order: the launcher passes them so.
    assert "for name in sig.parameters.keys()" in inspect.getsource(create_function_from_signature)
    assert list(inspect.signature(CompiledKernel.launch_metadata).parameters) == ["self", "grid", "stream", "args"]
    assert isinstance(CompiledKernel.run, property)


@pytest.mark.parametrize("is_causal", [False, True])
def test_launches_after_the_first_skip_triton(is_causal, monkeypatch, seed):
    """On a GPU, the second launch of each kernel with the same shapes goes straight to the compiled kernel (no
    triton wrapper runs) and gives the same results as the first. Under the interpreter every launch goes through
    triton (there is no compiled kernel to keep)."""
    monkeypatch.setattr(launcher, "_launches", {})
    calls = []
    for kernel in (flash_triton._flash_fwd_kernel, flash_triton._flash_bwd_preprocess_kernel,
                   flash_triton._flash_bwd_kernel):
        through_triton = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, run=through_triton, **kw: calls.append(run) or run(*a, **kw))
    # Ragged lengths and a head dim below the tile: the EVEN_* flags the launcher evaluates must be False here.
    for _ in range(2):
        q, k, v = make_inputs((2, 2, 40, 24), (2, 2, 40, 24), torch.float16, TRITON_DEVICE)
        check_flash("triton", q, k, v, is_causal, torch.randn_like(q))
    assert len(calls) == (3 if HAS_CUDA else 6)
    assert len(launcher._launches) == (3 if HAS_CUDA else 0)


def test_launcher_keys_tell_apart_what_triton_specializes_on():
    """Tensors differing in dtype or in 16-byte alignment, and ints differing at all, make different keys; the
    tensors' addresses beyond that do not."""
    x = torch.zeros(64, dtype=torch.float16)
    assert launcher._spec(x) == launcher._spec(torch.zeros(64, dtype=torch.float16))
    assert launcher._spec(x) != launcher._spec(x.float())
    assert launcher._spec(x) != launcher._spec(x[1:])  # 2 bytes off a 16-byte boundary
    assert launcher._spec(16) != launcher._spec(17)


def _fake_compiled(launch_fn, signature, tensordesc_meta=None):
    """A stand-in for a compiled kernel whose launcher is triton's CudaLauncher (its __call__, unchanged) over
    `launch_fn` wrapped as triton wraps a launcher whose signature has tensor descriptors."""
    from triton.backends.nvidia import driver

    cuda_launcher = object.__new__(driver.CudaLauncher)
    cuda_launcher.launch = driver.wrap_handle_tensordesc(launch_fn, signature, tensordesc_meta)
    cuda_launcher.num_ctas, cuda_launcher.launch_cooperative_grid, cuda_launcher.launch_pdl = 1, False, False
    cuda_launcher.global_scratch_size = cuda_launcher.profile_scratch_size = 0
    cuda_launcher.global_scratch_align = cuda_launcher.profile_scratch_align = 1
    return types.SimpleNamespace(run=cuda_launcher, function=1234, packed_metadata=("packed",),
                                 src=types.SimpleNamespace(signature=signature),
                                 metadata=types.SimpleNamespace(tensordesc_meta=tensordesc_meta))


def test_a_kept_launch_hands_the_compiled_launcher_what_triton_would(monkeypatch):
    """`launcher.Launch` calls the compiled launcher under triton's CudaLauncher and its wrapper for descriptor
    arguments: it must pass what they would, for descriptors given and for tensors in their places (the first
    launch's descriptors over them), the constexprs after the arguments. Runs triton's own wrapper and
    CudaLauncher.__call__ beside it (without encodings: those need the GPU), so a triton upgrade that changes what
    they pass fails here."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # a CPU build has neither
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    signature = {"a": "tensordesc<fp32[8, 16]>", "n": "i32", "x": "*fp32", "b": "tensordesc<fp32[4, 16]>",
                 "C": "constexpr"}
    received = []
    compiled = _fake_compiled(lambda *args: received.append(args), signature)
    x, y, z = (torch.zeros(32, 16) for _ in range(3))
    first = (TensorDescriptor(x, [32, 16], [16, 1], [8, 16]), 5, y, TensorDescriptor(y, [32, 16], [16, 1], [4, 16]))
    kept = launcher.Launch("kernel", (3,), "key", {"C": 7}, compiled, (3, 1, 1), (7,), {"C": 7}, first)
    assert kept.direct and launcher.raw_launcher(compiled.run.launch) is compiled.run.launch.__closure__[
        compiled.run.launch.__code__.co_freevars.index("launcher")].cell_contents
    later = (TensorDescriptor(z, [32, 16], [16, 1], [8, 16]), 6, x, TensorDescriptor(x, [32, 16], [16, 1], [4, 16]))
    for args in (first, later, (z, 6, x, x)):  # the last: tensors in the descriptors' places
        received.clear()
        compiled.run(3, 1, 1, 77, compiled.function, compiled.packed_metadata, None, None, None,
                     *kept._described(args), 7)
        kept.run(args)
        by_triton, ours = received
        assert len(ours) == len(by_triton) and all(a is b or a == b for a, b in zip(ours, by_triton)), (ours, by_triton)
    assert received[0][13] is z and received[0][13 + 1 + 2 + 2 + 1 + 2 + 2 + 2] is x  # the last call's bases


def test_kept_launch_templates_hold_no_tensor():
    """A kept launch's descriptor templates drop their tensors (which would stay allocated otherwise)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    compiled = _fake_compiled(lambda *args: None, {"a": "tensordesc<fp32[8, 16]>"})
    x = torch.zeros(32, 16)
    kept = launcher.Launch("kernel", (1,), "key", {}, compiled, (1, 1, 1), (), {},
                           (TensorDescriptor(x, [32, 16], [16, 1], [8, 16]),))
    assert [template.base for _, template, _, _ in kept.descriptors] == [None]


@pytest.mark.parametrize("module", [flash_triton, flash_hopper, flash_hopper_bwd, launcher])
def test_a_setting_changed_forgets_the_plans(module, seed):
    """The wrappers keep one plan per signature of inputs; setting (or deleting) any attribute of a module they follow
    from forgets them all, as monkeypatch does for tests."""
    q, k, v = make_inputs((1, 2, 40, 16), (1, 2, 40, 16), torch.float32, TRITON_DEVICE)
    o, lse = flash_triton.forward(q, k, v, True)
    flash_triton.backward(q, k, v, o, lse, torch.randn_like(q), True)
    assert flash_triton._FORWARD_PLANS and flash_triton._BACKWARD_PLANS
    module.SOME_SETTING = 1
    assert not flash_triton._FORWARD_PLANS and not flash_triton._BACKWARD_PLANS
    flash_triton.forward(q, k, v, True)
    del module.SOME_SETTING
    assert not flash_triton._FORWARD_PLANS


def test_one_plan_per_signature(seed):
    """Calls with inputs of one signature share a plan; strides, alignment, dtype or the mask make another, and
    each gives the float64 reference's output."""
    plans_before = dict(flash_triton._FORWARD_PLANS)
    flash_triton._FORWARD_PLANS.clear()
    try:
        base = torch.randn(1, 2, 41, 16, dtype=torch.float32, device=TRITON_DEVICE)
        packed = torch.randn(1, 41, 2, 20, dtype=torch.float32, device=TRITON_DEVICE)
        cases = [
            (base, False), (base.clone(), False),  # one signature
            (base, True),  # the mask
            (packed[..., :16].transpose(1, 2), False),  # strides
            (packed[..., 4:].transpose(1, 2), False),  # 16 bytes off: still aligned, the same strides as the last
            (packed[..., 1:17].transpose(1, 2), False),  # 4 bytes off: not aligned
            (base.half(), False),
        ]
        for x, is_causal in cases:
            o, _ = flash_triton.forward(x, x, x, is_causal)
            want = F.scaled_dot_product_attention(x.double(), x.double(), x.double(), is_causal=is_causal)
            assert (o.double() - want).abs().max() < TOLERANCE[x.dtype] * 10
        assert len(flash_triton._FORWARD_PLANS) == 5
    finally:
        flash_triton._FORWARD_PLANS.clear()
        flash_triton._FORWARD_PLANS.update(plans_before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_torch_gpu(gpu, is_causal, dtype, seed):
    q, k, v = make_inputs((2, 4, 2048, 64), (2, 4, 2048, 64), dtype, gpu)
    check_flash("torch", q, k, v, is_causal, torch.randn_like(q))


# -------------------------------------------------------------------------------------------- bad inputs


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


BAD_INPUTS = {
    "not a tensor": (lambda: ([[0.0] * 16] * 4, _t(1, 4, 16), _t(1, 4, 16)), False, "q must be a torch.Tensor, got"),
    "2-D": (lambda: (_t(4, 16), _t(4, 16), _t(4, 16)), False, r"got 2 dimensions, shape \(4, 16\)"),
    "5-D": (lambda: (_t(1, 1, 1, 4, 16),) * 3, False, "got 5 dimensions"),
    "3-D and 4-D": (lambda: (_t(1, 1, 4, 16), _t(1, 4, 16), _t(1, 4, 16)), False, "same number of dimensions"),
    "batch": (lambda: (_t(2, 4, 16), _t(3, 4, 16), _t(3, 4, 16)), False, "must have the same batch;"),
    "heads": (lambda: (_t(1, 2, 4, 16), _t(1, 3, 4, 16), _t(1, 3, 4, 16)), False, "same batch and heads"),
    "k and v lengths": (lambda: (_t(1, 4, 16), _t(1, 4, 16), _t(1, 5, 16)), False, "k and v must have the same shape"),
    "v head dim": (lambda: (_t(1, 4, 16), _t(1, 4, 16), _t(1, 4, 32)), False, "k and v must have the same shape"),
    "q and k head dims": (lambda: (_t(1, 4, 32), _t(1, 4, 16), _t(1, 4, 16)), False, "same head dim"),
    "mixed dtypes": (
        lambda: (_t(1, 4, 16), _t(1, 4, 16, dtype=torch.float16), _t(1, 4, 16)),
        False,
        "must have one dtype; got q torch.float32, k torch.float16",
    ),
    "integer dtype": (lambda: (_t(1, 4, 16, dtype=torch.int64),) * 3, False, "dtype torch.int64 is not supported"),
    "devices": (
        lambda: (_t(1, 4, 16), _t(1, 4, 16, device="meta"), _t(1, 4, 16)),
        False,
        "must be on one device; got q on cpu, k on meta",
    ),
    "causal lengths": (
        lambda: (_t(1, 4, 16), _t(1, 5, 16), _t(1, 5, 16)),
        True,
        "causal attention with 4 queries and 5 keys is not supported",
    ),
    "empty queries": (lambda: (_t(1, 0, 16), _t(1, 4, 16), _t(1, 4, 16)), False, "q is empty"),
    "empty keys": (lambda: (_t(1, 4, 16), _t(1, 0, 16), _t(1, 0, 16)), False, "k is empty"),
}


@pytest.mark.parametrize("backend", ["naive", "flash_torch", "flash_triton"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_value_error(backend, case):
    make, is_causal, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        ATTENTION[backend](*make(), is_causal)


def _causal_entry_points():
    """Every function that takes `is_causal`, as f(q, is_causal) on a (1, 2, 4, 16) float32 q used as q, k and v."""
    from lmsys.attention.providers import PROVIDERS, attention_function

    def backward(module):
        def call(q, is_causal):
            o, lse = module.forward(q, q, q, False)
            return module.backward(q, q, q, o, lse, q, is_causal)

        return call

    calls = {name: functools.partial(lambda f, q, c: f(q, q, q, c), fn) for name, fn in ATTENTION.items()}
    calls |= {f"flash_attention[{impl}]": functools.partial(lambda i, q, c: flash_attention(q, q, q, c, impl=i), impl)
              for impl in FUNCTIONS}
    calls |= {f"provider[{name}]": functools.partial(lambda f, q, c: f(q, q, q, c), attention_function(name))
              for name in PROVIDERS if not name.endswith("_compiled")}  # compiled: the same functions, traced
    calls |= {f"{name}.backward": backward(IMPLS[name]) for name in IMPLS}
    # The Gluon kernels check the flag before they look at the plan or the device.
    calls["flash_hopper.forward"] = lambda q, c: flash_hopper.forward(q, q, q, c, None)
    calls["flash_hopper_bwd.backward"] = lambda q, c: flash_hopper_bwd.backward(q, q, q, q, q, q, q, q, None, None, c, None)
    return calls


CAUSAL_ENTRY_POINTS = _causal_entry_points()


@pytest.mark.parametrize("entry", list(CAUSAL_ENTRY_POINTS))
@pytest.mark.parametrize(
    "flag, shown",
    [("no", "'no' (str)"), (1, "1 (int)"), (None, "None (NoneType)"), (torch.tensor(True), "tensor(True) (Tensor)")],
    ids=["str", "int", "None", "tensor"],
)
def test_is_causal_that_is_not_a_bool_is_refused(entry, flag, shown):
    """A truthy non-bool such as "no" would read as causal: every entry point refuses anything but True or False,
    naming the argument."""
    q = _t(1, 2, 4, 16, device=TRITON_DEVICE)
    with pytest.raises(TypeError, match=re.escape(f"is_causal must be True or False, got {shown}")):
        CAUSAL_ENTRY_POINTS[entry](q, flag)


def test_is_causal_numpy_bool_is_refused():
    numpy = pytest.importorskip("numpy")
    q = _t(1, 4, 16)
    with pytest.raises(TypeError, match=r"is_causal must be True or False, got .*True.* \(bool_?\)"):
        naive_attention(q, q, q, numpy.bool_(True))


@pytest.mark.parametrize(
    "dtype, d, message",
    [
        (torch.float32, 129, "head dim 129 is not supported by triton; supported: 1 to 128"),
        (torch.float16, 256, "head dim 256 is not supported by triton; supported: 1 to 128"),
        (torch.float64, 64, "dtype torch.float64 is not supported by triton; supported: float16, bfloat16, float32"),
    ],
)
def test_triton_rejects_head_dim_and_dtype(dtype, d, message):
    q = _t(1, 4, d, dtype=dtype, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=message):
        FlashAttentionTriton.apply(q, q, q, False)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's limits; on a GPU bf16 runs")
def test_triton_interpreter_rejects_bf16():
    """The interpreter's tl.dot returns wrong values for bf16 (around 8e8): refused, never returned."""
    q = _t(1, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 is not supported by triton under the Triton interpreter"):
        FlashAttentionTriton.apply(q, q, q, True)


def test_check_inputs_accepts_valid_inputs():
    q = _t(2, 3, 5, 16)
    check_inputs(q, _t(2, 3, 7, 16), _t(2, 3, 7, 16), False, impl="test", head_dims=(16,))
    check_inputs(q, q, q, True, impl="test")


def test_triton_without_interpreter_rejects_cpu_tensors():
    """With TRITON_INTERPRET=0 and no CUDA device, a CPU tensor gets a ValueError, not a Triton crash."""
    code = (
        "import torch\n"
        "from lmsys.attention import flash_attention\n"
        "q = torch.zeros(1, 4, 16)\n"
        "try:\n"
        "    flash_attention(q, q, q, impl='triton')\n"
        "except ValueError as error:\n"
        "    raise SystemExit(str(error))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "the Triton attention kernels need CUDA tensors, got tensors on cpu" in result.stderr


@pytest.mark.parametrize("n_q, d", [(100, 64), (64, 48)])
def test_the_preprocess_kernel_zeroes_the_dq_buffer(n_q, d, seed):
    """With ZERO_DQ the backward's preprocess kernel also zeroes the fp32 dQ accumulator of the fused Gluon backward
    (which runs on Hopper only), every row and column of it and nothing past it, beside D = rowsum(dO * O)."""
    o, do = (torch.randn(2, 3, n_q, d, device=TRITON_DEVICE) for _ in range(2))
    delta = torch.empty(2, 3, n_q, device=TRITON_DEVICE)
    buffer = torch.full((2 * 3 * n_q + 1, d), float("nan"), device=TRITON_DEVICE)  # one row past the accumulator
    args = (o, do, delta, buffer, n_q, 3, *o.stride()[:3], *do.stride()[:3])
    launcher.launch(flash_triton._flash_bwd_preprocess_kernel, (triton.cdiv(n_q, 64), 6), args, ("zeroing", n_q, d),
                    HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_M=64, ZERO_DQ=True)
    torch.testing.assert_close(delta, (o.double() * do.double()).sum(-1).float())
    assert (buffer[:-1] == 0).all() and buffer[-1].isnan().all()


def test_a_launch_key_that_does_not_fix_the_launch_is_an_error(monkeypatch):
    """With CHECK, two launches under one key whose arguments or grids differ raise, naming the kernel: the caller's
    key left something out (here the batch, which sets the grid)."""
    monkeypatch.setattr(launcher, "_launches", {})
    monkeypatch.setattr(launcher, "_checked", {})
    kernel = flash_triton._flash_bwd_preprocess_kernel
    for batch in (1, 2):
        o = torch.randn(batch, 2, 64, 16, device=TRITON_DEVICE)
        delta = torch.empty(batch, 2, 64, device=TRITON_DEVICE)
        args = (o, o, delta, None, 64, 2, *o.stride()[:3], *o.stride()[:3])
        launch = functools.partial(launcher.launch, kernel, (1, batch * 2), args, ("no batch here",), HEAD_DIM=16,
                                   BLOCK_D=16, BLOCK_M=64, ZERO_DQ=False)
        if batch == 1:
            launch()
        else:
            with pytest.raises(AssertionError, match="launcher key .* of _flash_bwd_preprocess_kernel does not fix"):
                launch()
