"""lmsys.flops: FLOP formulas and the device peak table."""

import pytest

from lmsys import flops


def test_matmul_flops():
    assert flops.matmul_flops(4096, 4096, 4096) == 2 * 4096**3


def test_attention_flops_conventions():
    forward = 4 * 1 * 16 * 16384 * 16384 * 64
    assert flops.attention_flops(1, 16, 16384, 16384, 64, causal=False, mode="fwd") == forward
    assert flops.attention_flops(1, 16, 16384, 16384, 64, causal=True, mode="fwd") == forward // 2
    assert flops.attention_flops(1, 16, 16384, 16384, 64, causal=True, mode="bwd") == 5 * forward // 4
    assert flops.attention_flops(1, 16, 16384, 16384, 64, causal=True, mode="fwd_bwd") == 7 * forward // 4


def test_attention_flops_match_the_anchor_table():
    # SDPA cuDNN, (1, 16, 16384, 64) causal fwd+bwd, measured on an H100 (2026-11-22): 4.712 ms at 408 TFLOP/s.
    work = flops.attention_flops(1, 16, 16384, 16384, 64, causal=True, mode="fwd_bwd")
    assert flops.tflops_per_second(work, 4.712e-3) == pytest.approx(408, rel=0.01)


def test_training_step_flops_is_six_n_t_plus_attention():
    params, batch, seq, layers, d_model = 124_000_000, 4, 512, 12, 768
    attention = layers * 3 * 4 * batch * seq * seq * d_model // 2
    assert flops.training_step_flops(params, batch, seq, layers, d_model) == 6 * params * batch * seq + attention
    assert flops.training_step_flops(params, batch, seq, layers, d_model, causal=False) == (
        6 * params * batch * seq + 2 * attention
    )
    assert isinstance(flops.training_step_flops(params, batch, seq, layers, d_model), int)


@pytest.mark.parametrize(
    "call",
    [
        lambda: flops.matmul_flops(-1, 2, 3),
        lambda: flops.matmul_flops(1.5, 2, 3),
        lambda: flops.attention_flops(1, 1, 1, 1, 1, causal=True, mode="forward"),
        lambda: flops.training_step_flops(True, 1, 1, 1, 1),
        lambda: flops.tflops_per_second(10, 0.0),
        lambda: flops.peak_tflops("NVIDIA H100 80GB HBM3", "int8"),
    ],
)
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_peaks_of_known_and_unknown_gpus():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert flops.peak_tflops("NVIDIA H200", "tf32") == pytest.approx(494.7)
    assert flops.peak_gbps("NVIDIA H200") == pytest.approx(4800)
    assert flops.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    assert flops.peak_tflops("Some Future GPU", "bf16") is None
    assert flops.peak_gbps("Some Future GPU") is None


def test_rates():
    assert flops.tflops_per_second(2 * 10**12, 2.0) == 1.0
    assert flops.gigabytes_per_second(3 * 10**9, 1.0) == 3.0


def test_rates_with_and_without_a_known_peak():
    info = flops.rates(1e-3, "NVIDIA H100 80GB HBM3", flops=int(989.4e9), nbytes=int(3.35e9), precision="bf16")
    assert info["tflops"] == pytest.approx(989.4) and info["fraction_of_peak_tflops"] == pytest.approx(1.0)
    assert info["gbps"] == pytest.approx(3350) and info["fraction_of_peak_gbps"] == pytest.approx(1.0)
    unknown = flops.rates(1e-3, "Some Future GPU", flops=10**9, nbytes=None, precision="bf16")
    assert unknown == {"flops": 10**9, "tflops": pytest.approx(1.0)}
    assert flops.rates(0.0, "NVIDIA H100 80GB HBM3", flops=1, nbytes=1, precision="bf16") == {}
