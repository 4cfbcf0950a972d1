"""Masked positions contribute nothing, forward or backward, in the reference implementations (naive, flash_torch) and
the Triton kernels (flash_triton).

A causal query i cannot see key j > i. A NaN or inf planted in v[j] or k[j] must then leave row i of the output and of
dQ as they are on clean inputs (0 * NaN is NaN, so zeroing the masked probabilities is not enough), and dV, which
does not depend on v at all, must stay clean everywhere. Row j itself sees the planted value and must not come out
finite (a fix that silently dropped it would pass the first check), and the entries of the output and of the gradients
that are not finite are those of naive attention (lmsys.attention.masking's semantics). fp16 inputs of magnitude ~300 have
scores past fp16's range: the result, in range, must still be right. The reference is plain float64 arithmetic on the
clean inputs, independent of the implementations under test.

flash_triton keeps a masked non-finite value out by default (flash_triton.GUARD_MASKED; with it off the flash_triton
cases fail): each pass marks the rows whose result is not finite, and a fix-up launch recomputes their blocks with
guarded products in the diagonal tiles. On a Hopper GPU the Gluon kernels (flash_hopper, flash_hopper_bwd) mark the
rows of their results too, which the last test checks. SDPA is PyTorch's and not held to these tests: its
FlashAttention-2 and cuDNN backends let a NaN or inf in a masked key or value of a diagonal tile reach that tile's rows
(docs/attention.md, "Masked NaN and inf").
"""

import math

import pytest
import torch

from lmsys.attention import FlashAttentionTorch, FlashAttentionTriton, flash_hopper, flash_hopper_bwd, flash_triton
from lmsys.attention import naive_attention

HAS_CUDA = torch.cuda.is_available()
# The Triton kernels run interpreted without CUDA (tests/conftest.py): small shapes there.
DEVICES = {"naive": "cpu", "flash_torch": "cpu", "flash_triton": "cuda" if HAS_CUDA else "cpu"}
ATTEND = {
    "naive": naive_attention,
    "flash_torch": FlashAttentionTorch.apply,
    "flash_triton": FlashAttentionTriton.apply,
}
# The implementations whose masked positions take no part even when non-finite.
GUARDED = ("naive", "flash_torch", "flash_triton")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# 72 positions, d = 16: two key tiles of flash_torch (64 wide), several query and key tiles of the Triton kernels
# (32 x 16 under the interpreter). The planted positions sit in the first tile, inside a later diagonal tile, and in
# flash_torch's second tile, never first in their tile, so some rows of the same diagonal tile cannot see them.
SHAPE = (1, 2, 72, 16)
POSITIONS = (5, 40, 66)


def _probabilities(q, k, is_causal):
    """softmax(q k^T / sqrt(d)), query i seeing keys j <= i only when causal, in q's dtype."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _reference(q, k, v, do, is_causal):
    """Output and (dq, dk, dv) of softmax(q k^T / sqrt(d)) v in float64, written out here."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    o = _probabilities(q, k, is_causal) @ v
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do.double()))


def _attend(impl, q, k, v, do, is_causal):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = ATTEND[impl](q, k, v, is_causal)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def _assert_matches(actual, expected, dtype, name, looser=1.0):
    assert torch.isfinite(actual).all(), f"{name} has NaN or inf"
    tol = TOLERANCE[dtype] * looser
    atol = tol * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=atol, msg=lambda m: f"{name}: {m}")


def _inputs(shape, dtype, device, scale=1.0):
    q, k, v, do = (torch.randn(shape, dtype=torch.float64) for _ in range(4))
    return tuple((x * (scale if i < 3 else 1.0)).to(dtype=dtype, device=device) for i, x in enumerate((q, k, v, do)))


def _assert_only_later_rows_see_it(impl, q, planted, do, expected, tensor, j, dtype, where):
    """Rows before j of the output and of dq as on clean inputs, dv clean when v holds the planted value, row j, which
    sees it, not finite, and the non-finite entries of the output and of every gradient those of naive attention."""
    expected_o, expected_dq, expected_dv = expected
    o, dq, dk, dv = _attend(impl, q, planted["k"], planted["v"], do, True)
    _assert_matches(o[..., :j, :], expected_o[..., :j, :], dtype, f"{where}: output rows before {j}")
    _assert_matches(dq[..., :j, :], expected_dq[..., :j, :], dtype, f"{where}: dq rows before {j}")
    if tensor == "v":
        _assert_matches(dv, expected_dv, dtype, f"{where}: dv (independent of v)")
    assert not torch.isfinite(o[..., j, :]).all(), f"{where}: row {j} sees the planted value but is finite"
    naive = _attend("naive", q, planted["k"], planted["v"], do, True)
    for name, actual, reference in zip(("output", "dq", "dk", "dv"), (o, dq, dk, dv), naive, strict=True):
        differ = (torch.isfinite(actual) != torch.isfinite(reference)).nonzero().tolist()
        assert not differ, f"{where}: {name} is finite where naive attention's is not, or not where it is: {differ[:5]}"


@pytest.mark.parametrize("impl", GUARDED)
@pytest.mark.parametrize("tensor", ["v", "k"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("j", POSITIONS)
def test_a_non_finite_key_or_value_reaches_only_the_rows_that_see_it(impl, tensor, value, j, seed):
    dtype = torch.float32
    q, k, v, do = _inputs(SHAPE, dtype, DEVICES[impl])
    expected_o, expected_dq, _, expected_dv = _reference(q, k, v, do, True)
    planted = {"k": k.clone(), "v": v.clone()}
    planted[tensor][..., j, :] = value
    _assert_only_later_rows_see_it(impl, q, planted, do, (expected_o, expected_dq, expected_dv), tensor, j, dtype,
                                   f"{impl}, {value} in {tensor}[{j}]")


@pytest.mark.parametrize("impl", GUARDED)
@pytest.mark.parametrize("tensor,value", [("v", float("nan")), ("v", float("inf")), ("k", float("nan"))],
                         ids=["v-nan", "v-inf", "k-nan"])
def test_one_non_finite_element_reaches_only_the_rows_that_see_it(impl, tensor, value, seed):
    """One NaN or inf entry (not a whole row) in a diagonal tile of fp16 inputs: in v, it makes one column of the later
    rows NaN. (One inf in k makes a later row's score +inf or -inf, by the sign of q's entry: whether that row stays
    finite is up to the seed, hence no such case.)"""
    dtype, j = torch.float16, 37
    q, k, v, do = _inputs((1, 1, 48, 16), dtype, DEVICES[impl])
    expected_o, expected_dq, _, expected_dv = _reference(q, k, v, do, True)
    planted = {"k": k.clone(), "v": v.clone()}
    planted[tensor][..., j, 3] = value
    _assert_only_later_rows_see_it(impl, q, planted, do, (expected_o, expected_dq, expected_dv), tensor, j, dtype,
                                   f"{impl}, {value} in {tensor}[{j}, 3]")


@pytest.mark.parametrize("impl", GUARDED)
@pytest.mark.parametrize("tensor", ["v", "k"])
@pytest.mark.parametrize("column", [3, 70])
def test_a_non_finite_element_of_a_split_head_dim_reaches_only_the_rows_that_see_it(impl, tensor, column, seed):
    """Head dim 80, which the Triton kernels split into columns [0, 64) and [64, 80) (flash_triton.SPLIT_HEAD_DIMS), a
    length that is no multiple of a tile, and a NaN in either chunk."""
    dtype, j = torch.float32, 21
    q, k, v, do = _inputs((1, 1, 45, 80), dtype, DEVICES[impl])
    expected_o, expected_dq, _, expected_dv = _reference(q, k, v, do, True)
    planted = {"k": k.clone(), "v": v.clone()}
    planted[tensor][..., j, column] = float("nan")
    _assert_only_later_rows_see_it(impl, q, planted, do, (expected_o, expected_dq, expected_dv), tensor, j, dtype,
                                   f"{impl}, NaN in {tensor}[{j}, {column}]")


def _shift_from_rounded_output(q, k, v, do, is_causal, dtype):
    """How far float64's dq and dk move (max abs change of each) when delta = rowsum(dO * O) is taken from O rounded to
    `dtype`, as the flash kernels take it from the output they saved."""
    q, k, v, do = (x.detach().double() for x in (q, k, v, do))
    scale = 1 / math.sqrt(q.shape[-1])
    p = _probabilities(q, k, is_causal)
    o = p @ v
    dp = do @ v.transpose(-2, -1)
    grads = []
    for saved in (o, o.to(dtype).double()):
        ds = p * (dp - (do * saved).sum(-1, keepdim=True))
        grads.append((ds @ k * scale, ds.transpose(-2, -1) @ q * scale))
    return [(a - b).abs().max().item() for a, b in zip(*grads, strict=True)]


@pytest.mark.parametrize("impl", list(ATTEND))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_fp16_scores_past_fp16_range_give_the_right_result(impl, is_causal, seed):
    """q, k, v of magnitude ~300 in fp16 at d = 16: the scores (~1e5 before scaling) are past fp16's largest value
    (65504), while the output and the gradients are in range. Drawn until they are (within half of it): now and then
    a draw's dq is past it in float64 too (93,000 for one), which no fp16 result can match. The gradients are sums of
    fp16-rounded terms times inputs of magnitude 300, hence their tolerance 300 times looser. Drawn also until
    float64's dq and dk move by less than a tenth of that tolerance when delta = rowsum(dO * O) takes O rounded to
    fp16, as a flash backward takes it from its saved output: in 5 of 8,000 draws (causal and not) a row's
    second-largest probability puts O between two fp16 values, and its dq or dk then moves by more than the tolerance
    (dq by 4.08 against 1.52 at seed 2146691883, which flash_triton's dq missed by 4.10); 1.3% of draws move by more
    than a tenth of it."""
    dtype, scale = torch.float16, 300.0
    for _ in range(10):
        q, k, v, do = _inputs((1, 2, 40, 16), dtype, DEVICES[impl], scale=scale)
        expected = _reference(q, k, v, do, is_causal)
        in_range = max(result.abs().max().item() for result in expected) < torch.finfo(dtype).max / 2
        shifts = _shift_from_rounded_output(q, k, v, do, is_causal, dtype)
        tolerances = [TOLERANCE[dtype] * scale * max(grad.abs().max().item(), 1.0) for grad in expected[1:3]]
        if in_range and all(shift < tol / 10 for shift, tol in zip(shifts, tolerances, strict=True)):
            break
    else:
        pytest.fail("ten draws in a row had a result past half of fp16's range, or gradients that the rounding of the "
                    "output moves")
    actual = _attend(impl, q, k, v, do, is_causal)
    for name, a, e in zip(("output", "dq", "dk", "dv"), actual, expected, strict=True):
        _assert_matches(a, e, dtype, f"{impl} {name}", looser=1.0 if name == "output" else scale)


@pytest.mark.gpu
@pytest.mark.parametrize("tensor,value", [("v", float("nan")), ("v", float("inf")), ("k", float("nan"))],
                         ids=["v-nan", "v-inf", "k-nan"])
@pytest.mark.parametrize("backward", ["two-kernels", "fused-dq"])
@pytest.mark.parametrize("head_dim,consumers", [(64, 2), (64, 3), (128, 2)])
def test_the_gluon_kernels_keep_a_masked_non_finite_value_out_gpu(gpu, head_dim, consumers, backward, tensor, value,
                                                                 monkeypatch, seed):
    """On Hopper, the Gluon forward (two or three consumer warpgroups) and the Gluon backward (its two kernels, or dQ
    accumulated by the dK/dV kernel) mark the rows whose result is not finite, and flash_triton's fix-up keeps a NaN or
    inf planted inside a diagonal tile of 128 rows out of that tile's earlier rows."""
    if torch.cuda.get_device_capability(gpu) != (9, 0):
        pytest.skip("the Gluon kernels are for Hopper (compute capability 9.0)")
    for module in (flash_hopper, flash_hopper_bwd):
        monkeypatch.setattr(module, "MEASURED", False)  # the thresholds below decide, not the table
        monkeypatch.setattr(module, "MIN_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_MIN_KEYS", 0)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_BELOW_PROGRAMS_PER_SM", math.inf)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_WIDE_MIN_KEYS", 0)
    monkeypatch.setattr(flash_hopper, "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM", 0 if consumers == 3 else math.inf)
    monkeypatch.setattr(flash_hopper_bwd, "MIN_PROGRAMS_PER_SM_CONCURRENT", 0)
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_DQ", backward == "fused-dq")
    monkeypatch.setattr(flash_hopper_bwd, "FUSED_SPLIT", head_dim == 128)
    ran = []
    hopper_forward, hopper_backward = flash_hopper.forward, flash_hopper_bwd.backward
    monkeypatch.setattr(flash_hopper, "forward", lambda *a: ran.append(("forward", a[-1].consumers))
                        or hopper_forward(*a))
    monkeypatch.setattr(flash_hopper_bwd, "backward", lambda *a: ran.append(("backward", a[-1].fused_dq))
                        or hopper_backward(*a))
    dtype, j = torch.bfloat16, 256 + 37  # inside the diagonal tile of rows 256 to 383, not first in it
    q, k, v, do = _inputs((1, 2, 512, head_dim), dtype, gpu)
    expected_o, expected_dq, _, expected_dv = _reference(q, k, v, do, True)
    planted = {"k": k.clone(), "v": v.clone()}
    planted[tensor][..., j, :] = value
    _assert_only_later_rows_see_it("flash_triton", q, planted, do, (expected_o, expected_dq, expected_dv), tensor, j,
                                   dtype, f"Gluon d={head_dim} {consumers} warpgroups, {backward}: {value} in "
                                   f"{tensor}[{j}]")
    assert set(ran) == {("forward", consumers), ("backward", backward == "fused-dq")}
