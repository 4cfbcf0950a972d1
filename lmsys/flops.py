"""FLOP formulas and device peaks: turn a measured time into TFLOP/s, GB/s and a fraction of what the GPU can do.

Pure functions of ints and floats (no torch), so reports and tests can use them anywhere.

FLOP conventions (a multiply-add is 2 FLOPs):
- matmul (m, k) @ (k, n): 2*m*n*k.
- attention forward: two matmuls, QK^T and PV, 4*b*h*sq*sk*d; halved when causal (the masked half is skipped);
  backward 2.5x the forward (five matmuls, including the recomputation of QK^T as in FlashAttention-2);
  forward + backward 3.5x. These are the numbers of the FlashAttention-2 paper and the Triton tutorial.
- training step: 6 * params * tokens (PaLM / Chinchilla: 2 forward + 4 backward per parameter per token), plus
  the attention matmuls, counted as model FLOPs: 3x the causal forward (no recomputation), so MFU stays comparable
  across implementations that do or do not recompute.

Peaks are NVIDIA's datasheet numbers for dense math (no 2:4 sparsity), keyed by the name CUDA reports
(torch.cuda.get_device_name). An unknown GPU has no peak: reports then show no fraction rather than a wrong one.
"""

from dataclasses import dataclass
from typing import Any

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")
ATTENTION_MODES = ("fwd", "bwd", "fwd_bwd")


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak throughput of one GPU model: TFLOP/s per precision and memory bandwidth in GB/s (1e9 bytes)."""

    bf16: float
    fp16: float
    tf32: float
    fp32: float
    memory_gbps: float


_H100_SXM = DevicePeak(bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9, memory_gbps=3350.0)

DEVICE_PEAKS: dict[str, DevicePeak] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": DevicePeak(bf16=756.5, fp16=756.5, tf32=378.0, fp32=51.2, memory_gbps=2000.0),
    "NVIDIA H100 NVL": DevicePeak(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, memory_gbps=3900.0),
    # The H200 has the H100 SXM's compute with faster, larger HBM3e.
    "NVIDIA H200": DevicePeak(bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9, memory_gbps=4800.0),
    "NVIDIA A100-SXM4-80GB": DevicePeak(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, memory_gbps=2039.0),
    "NVIDIA A100-SXM4-40GB": DevicePeak(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, memory_gbps=1555.0),
    "NVIDIA A100 80GB PCIe": DevicePeak(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, memory_gbps=1935.0),
    "NVIDIA A100-PCIE-40GB": DevicePeak(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, memory_gbps=1555.0),
}


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m, k) @ (k, n) matrix product."""
    for name, value in (("m", m), ("n", n), ("k", k)):
        _check_count(name, value)
    return 2 * m * n * k


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool, mode: str) -> int:
    """FLOPs of scaled dot-product attention: forward 4*b*h*sq*sk*d (halved when causal), backward 2.5x, both 3.5x."""
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k), ("head_dim", head_dim)):
        _check_count(name, value)
    if mode not in ATTENTION_MODES:
        raise ValueError(f"mode must be one of {ATTENTION_MODES}, got {mode!r}")
    forward = 4 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        forward //= 2
    # forward is even, so the 2.5x and 3.5x products are exact integers.
    return {"fwd": forward, "bwd": 5 * forward // 2, "fwd_bwd": 7 * forward // 2}[mode]


def training_step_flops(params: int, batch: int, seq_len: int, n_layers: int, d_model: int, causal: bool = True) -> int:
    """Model FLOPs of one training step of a decoder-only Transformer (forward + backward).

    6 * params * tokens for the weight matmuls plus, per layer, 3x the attention forward over
    d_model = heads * head_dim.
    Pass as `params` the weights that take part in matmuls (an input-embedding lookup does no FLOPs; a tied output
    projection does).
    """
    sizes = {"params": params, "batch": batch, "seq_len": seq_len, "n_layers": n_layers, "d_model": d_model}
    for name, value in sizes.items():
        _check_count(name, value)
    attention = n_layers * 3 * attention_flops(batch, 1, seq_len, seq_len, d_model, causal, "fwd")
    return 6 * params * batch * seq_len + attention


def tflops_per_second(flops: int, seconds: float) -> float:
    """Achieved TFLOP/s (1e12 FLOP per second)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return flops / seconds / 1e12


def gigabytes_per_second(nbytes: int, seconds: float) -> float:
    """Achieved bandwidth in GB/s (1e9 bytes per second)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return nbytes / seconds / 1e9


def device_peak(device_name: str) -> DevicePeak | None:
    """The peak table entry for a GPU by the name CUDA reports, or None when the GPU is not in the table."""
    return DEVICE_PEAKS.get(device_name)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of a GPU in one precision ('bf16', 'fp16', 'tf32', 'fp32'); None for an unknown GPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    peak = device_peak(device_name)
    return None if peak is None else getattr(peak, precision)


def peak_gbps(device_name: str) -> float | None:
    """Peak memory bandwidth of a GPU in GB/s; None for an unknown GPU."""
    peak = device_peak(device_name)
    return None if peak is None else peak.memory_gbps


def rates(
    seconds: float, device_name: str, flops: int | None, nbytes: int | None, precision: str | None
) -> dict[str, Any]:
    """TFLOP/s and GB/s of one call that took `seconds`, with their fractions of the device's peak when it is known
    (`precision` picks the FLOP peak; None leaves the fraction out). Empty for a zero time."""
    out: dict[str, Any] = {}
    if seconds <= 0:
        return out
    if flops is not None:
        out["flops"] = flops
        out["tflops"] = tflops_per_second(flops, seconds)
        peak = peak_tflops(device_name, precision) if precision else None
        if peak:
            out.update(precision=precision, peak_tflops=peak, fraction_of_peak_tflops=out["tflops"] / peak)
    if nbytes is not None:
        out["bytes"] = nbytes
        out["gbps"] = gigabytes_per_second(nbytes, seconds)
        peak = peak_gbps(device_name)
        if peak:
            out.update(peak_gbps=peak, fraction_of_peak_gbps=out["gbps"] / peak)
    return out
