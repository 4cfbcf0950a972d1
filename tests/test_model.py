"""Correctness of the Transformer LM: shapes and parameter counts of every preset, causality, RoPE, RMSNorm, bf16."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmsys.model import SIZES, ModelConfig, RMSNorm, RotaryEmbedding, TransformerLM
from lmsys.train import cross_entropy

# The counts the issue gives, to the digits it gives them: millions to 0.1M, billions to 0.01B.
EXPECTED_MILLIONS = {"small": 128.6, "medium": 423.2, "large": 969.4}
EXPECTED_BILLIONS = {"xl": 2.00, "2.7B": 3.41}


def tiny(**changes) -> ModelConfig:
    return dataclasses.replace(SIZES["tiny"], **changes)


@pytest.mark.parametrize("name", list(SIZES))
def test_logits_shape_and_dtype_on_meta_device(name):
    config = SIZES[name]
    with torch.device("meta"):
        model = TransformerLM(config)
        tokens = torch.zeros(2, config.context_length, dtype=torch.long)
    logits = model(tokens)
    assert logits.shape == (2, config.context_length, config.vocab_size)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("name", list(EXPECTED_MILLIONS) + list(EXPECTED_BILLIONS))
def test_parameter_count(name):
    with torch.device("meta"):
        count = TransformerLM(SIZES[name]).num_parameters()
    if name in EXPECTED_MILLIONS:
        assert round(count / 1e6, 1) == EXPECTED_MILLIONS[name]
    else:
        assert round(count / 1e9, 2) == EXPECTED_BILLIONS[name]


def test_parameter_count_follows_the_formula():
    config = tiny(vocab_size=37, d_model=24, d_ff=40, num_layers=3, num_heads=3)
    d, f, V, L = config.d_model, config.d_ff, config.vocab_size, config.num_layers
    model = TransformerLM(config)
    assert model.num_parameters() == 2 * V * d + L * (4 * d * d + 3 * d * f + 2 * d) + d
    assert model.num_parameters(embedding=False) == model.num_parameters() - V * d


@pytest.fixture(scope="module")
def tiny_model_fp64() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(tiny(vocab_size=50)).double().eval()


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_changing_later_tokens_never_changes_earlier_logits(tiny_model_fp64, data):
    T = data.draw(st.integers(1, tiny_model_fp64.config.context_length), label="T")
    t = data.draw(st.integers(0, T - 1), label="t")
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, 49), min_size=T, max_size=T), label="tokens"))
    changed = tokens.clone()
    changed[t + 1 :] = torch.tensor(data.draw(st.lists(st.integers(0, 49), min_size=T - t - 1, max_size=T - t - 1)))
    with torch.no_grad():
        before, after = tiny_model_fp64(tokens[None]), tiny_model_fp64(changed[None])
    torch.testing.assert_close(after[0, : t + 1], before[0, : t + 1], rtol=1e-12, atol=1e-12)


def test_each_position_depends_on_the_previous_token(tiny_model_fp64):
    """The other half of causality: the mask must not hide the past (a model ignoring context passes the property)."""
    tokens = torch.randint(50, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 7] = (tokens[0, 7] + 1) % 50
    with torch.no_grad():
        difference = (tiny_model_fp64(changed) - tiny_model_fp64(tokens)).abs().amax(dim=-1)[0]  # (T,)
    assert torch.all(difference[:7] == 0)
    assert torch.all(difference[7:] > 0)


@pytest.mark.parametrize("batch,T", [(1, 1), (3, 17), (2, 64)])
def test_fp32_logits_match_fp64(seed, batch, T):
    model = TransformerLM(SIZES["tiny"])
    tokens = torch.randint(SIZES["tiny"].vocab_size, (batch, T))
    with torch.no_grad():
        logits = model(tokens)
        expected = model.double()(tokens)
    torch.testing.assert_close(logits, expected.float(), rtol=1e-4, atol=1e-5)


def test_bf16_autocast_logits_are_close_to_fp32(seed):
    model = TransformerLM(SIZES["tiny"])
    tokens = torch.randint(SIZES["tiny"].vocab_size, (2, 33))
    with torch.no_grad():
        expected = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    scale = expected.abs().amax().item()
    torch.testing.assert_close(logits.float(), expected, rtol=0.0, atol=0.05 * scale)


def _logits_and_grads(model: TransformerLM, tokens: torch.Tensor, autocast: torch.dtype | None = None, compile=None):
    """Logits and every parameter's gradient of the next-token loss; `compile` names a torch.compile backend."""
    forward = model if compile is None else torch.compile(model, backend=compile, fullgraph=True)
    with torch.autocast(tokens.device.type, dtype=autocast, enabled=autocast is not None):
        logits = forward(tokens)
    cross_entropy(logits, tokens.roll(-1, dims=-1)).backward()
    return logits, {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "flash_torch"])
def test_model_with_other_attention_matches_naive_in_fp64(seed, attention):
    reference = TransformerLM(tiny()).double()
    model = TransformerLM(tiny(attention=attention)).double()
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(SIZES["tiny"].vocab_size, (2, 45))
    logits, grads = _logits_and_grads(model, tokens)
    expected_logits, expected_grads = _logits_and_grads(reference, tokens)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(grads, expected_grads)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_torch", "flash_triton"])
def test_model_with_other_attention_matches_naive_on_gpu_in_bf16(gpu, seed, attention):
    with torch.device(gpu):
        reference = TransformerLM(tiny())
        model = TransformerLM(tiny(attention=attention))
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(SIZES["tiny"].vocab_size, (3, 61), device=gpu)
    logits, grads = _logits_and_grads(model, tokens, torch.bfloat16)
    expected_logits, expected_grads = _logits_and_grads(reference, tokens, torch.bfloat16)
    # Both run in bf16; the kernels round differently, so compare against each tensor's own scale.
    _assert_close_to_scale(logits, expected_logits, "logits")
    for name, expected in expected_grads.items():
        _assert_close_to_scale(grads[name], expected, f"gradient of {name}")


# The Triton interpreter (triton 3.6) converts one-element arrays to scalars in a way NumPy deprecates.
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize(
    "backend, on_gpu",
    [("aot_eager", False), pytest.param("inductor", True, marks=pytest.mark.gpu)],
)
def test_compiled_model_with_flash_triton_matches_sdpa(backend, on_gpu, device, seed):
    """The Triton kernels under torch.compile, as the training step runs them: through the custom ops, whose fake
    implementations must describe the real outputs (inductor asserts their strides on the GPU). On the CPU
    (interpreter; aot_eager, as inductor's CPU compile takes over ten seconds) in fp32 against eager SDPA; on the GPU
    with inductor under bf16 autocast, head dim 64, against SDPA compiled the same way."""
    if on_gpu and device.type != "cuda":
        pytest.skip("needs a CUDA device")
    config = tiny(d_model=256, num_heads=4, context_length=256) if on_gpu else tiny(num_layers=1)
    reference, model = _sdpa_and_flash_triton(config, device)
    tokens = torch.randint(config.vocab_size, (4, 256) if on_gpu else (2, 45), device=device)
    autocast = torch.bfloat16 if on_gpu else None
    torch.compiler.reset()
    logits, grads = _logits_and_grads(model, tokens, autocast, compile=backend)
    reference_backend = backend if on_gpu else None
    expected_logits, expected_grads = _logits_and_grads(reference, tokens, autocast, compile=reference_backend)
    _assert_same_training_signal(logits, grads, expected_logits, expected_grads, low_precision=on_gpu)


# The Triton interpreter (triton 3.6) converts one-element arrays to scalars in a way NumPy deprecates.
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["fp32", "gpu-bf16"])
def test_model_with_flash_triton_at_head_dim_80_matches_sdpa(on_gpu, device, seed):
    """The 2.7B preset's head dim, 80 (2560 / 32), which the Triton kernels pad to 128, in a one-layer model: logits
    and every gradient against SDPA: in fp32 to fp32 rounding (without CUDA through the interpreter), and on a GPU also
    under bf16 autocast, to each tensor's scale."""
    if on_gpu and device.type != "cuda":
        pytest.skip("needs a CUDA device")
    config = tiny(d_model=160, num_heads=2, num_layers=1)
    assert config.head_dim == SIZES["2.7B"].head_dim == 80
    reference, model = _sdpa_and_flash_triton(config, device)
    tokens = torch.randint(config.vocab_size, (2, 45), device=device)
    autocast = torch.bfloat16 if on_gpu else None
    logits, grads = _logits_and_grads(model, tokens, autocast)
    expected_logits, expected_grads = _logits_and_grads(reference, tokens, autocast)
    _assert_same_training_signal(logits, grads, expected_logits, expected_grads, low_precision=on_gpu)


def _sdpa_and_flash_triton(config, device) -> tuple[TransformerLM, TransformerLM]:
    """Two models of `config` with the same weights: attention by SDPA (the reference) and by flash_triton."""
    with torch.device(device):
        reference = TransformerLM(dataclasses.replace(config, attention="sdpa"))
        model = TransformerLM(dataclasses.replace(config, attention="flash_triton"))
    model.load_state_dict(reference.state_dict())
    return reference, model


def _assert_same_training_signal(logits, grads, expected_logits, expected_grads, low_precision: bool) -> None:
    """Logits and every gradient as expected: to fp32 rounding, or with `low_precision` (bf16) to each one's scale."""
    if low_precision:
        _assert_close_to_scale(logits, expected_logits, "logits")
        for name, expected in expected_grads.items():
            _assert_close_to_scale(grads[name], expected, f"gradient of {name}")
    else:
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads, expected_grads, rtol=1e-4, atol=1e-5)


def _assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, what: str, fraction: float = 0.03) -> None:
    atol = fraction * expected.abs().amax().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0.0, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("shape", [(5,), (3, 7, 33), (2, 1, 4, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_fp64_and_keeps_dtype(seed, shape, dtype):
    norm = RMSNorm(shape[-1])
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(shape) * 3).to(dtype)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype))  # default tolerances of `dtype`


def test_rope_keeps_norms_and_makes_scores_depend_only_on_offset(seed):
    D, T = 16, 40
    rope = RotaryEmbedding(D, T, 10_000.0).double()
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    rotated_q = rope(q.expand(1, T, 1, D))[0, :, 0]  # (T, D): the same query at every position
    rotated_k = rope(k.expand(1, T, 1, D))[0, :, 0]
    torch.testing.assert_close(rotated_q.norm(dim=-1), q.norm().expand(T))
    scores = rotated_q @ rotated_k.T  # (T, T), entry (m, n) for query at m, key at n
    for offset in (0, 3, 17):
        diagonal = torch.diagonal(scores, offset=offset)
        # The angle tables are fp32, so the property holds to fp32 precision.
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=1e-5, atol=1e-5)


def test_rope_position_zero_is_identity(seed):
    x = torch.randn(2, 1, 3, 8)  # (B, T, H, D)
    torch.testing.assert_close(RotaryEmbedding(8, 4, 10_000.0)(x), x)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(d_model=30, num_heads=4), "d_model"),
        (dict(d_model=12, num_heads=4), "even head size"),
        (dict(num_layers=0), "num_layers"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(rope_theta=float("inf")), "rope_theta must be a finite positive number, got inf"),
        (dict(rope_theta=float("nan")), "rope_theta must be a finite positive number, got nan"),
        (dict(rope_theta=True), "rope_theta"),
        (dict(d_ff=256.5), "d_ff must be a positive integer, got 256.5"),
        (dict(num_layers=float("inf")), "num_layers must be a positive integer, got inf"),
        (dict(vocab_size=True), "vocab_size must be a positive integer"),
        (dict(attention="nope"), "unknown attention 'nope'"),
    ],
)
def test_invalid_config_raises(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny(**changes)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1e-5])
def test_rmsnorm_rejects_a_non_finite_or_negative_eps(eps):
    with pytest.raises(ValueError, match="eps must be a finite non-negative number"):
        RMSNorm(8, eps=eps)


def test_rope_theta_whose_angles_overflow_is_rejected():
    # theta = 1e-60 passes as positive and finite, but theta^(-2i/D) overflows float32: cos/sin would be NaN.
    with pytest.raises(ValueError, match="rotation angles beyond float32"):
        TransformerLM(tiny(rope_theta=1e-60))


def test_sequence_longer_than_context_raises():
    model = TransformerLM(SIZES["tiny"])
    with pytest.raises(ValueError, match="exceeds the context length"):
        model(torch.zeros(1, SIZES["tiny"].context_length + 1, dtype=torch.long))


def test_rope_of_bf16_input_is_rounded_once(seed):
    """A bf16 input is rotated in fp32 with the fp32 tables and rounded to bf16 once at the end: every element within
    half a bf16 unit of the float64 rotation (bf16 tables and products would round the angles and each product)."""
    B, T, H, D = 2, 64, 3, 32
    rope = RotaryEmbedding(D, T, 10_000.0)
    x = torch.randn(B, T, H, D).bfloat16()
    out = rope(x)
    assert out.dtype == torch.bfloat16
    exact = rope.double()(x.double())
    torch.testing.assert_close(out.double(), exact, rtol=2.0**-8, atol=1e-6)


def test_layers_share_one_rope_table():
    model = TransformerLM(dataclasses.replace(SIZES["tiny"], num_layers=3))
    ropes = {id(layer.attn.rope) for layer in model.layers}
    assert len(ropes) == 1
    assert [name for name, _ in model.named_buffers()] == ["layers.0.attn.rope.cos", "layers.0.attn.rope.sin"]
