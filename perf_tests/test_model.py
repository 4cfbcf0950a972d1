"""One training step of the LM (forward, cross-entropy, backward, AdamW) per preset, precision and provider.

Providers (a model and an optimizer):
- `reference`: the same architecture written the way a user would (lmsys.reference_model: fused qkv projection,
  SDPA, plain-op RMSNorm and RoPE) with `torch.optim.AdamW(fused=True, capturable=True)`: the plain-PyTorch step to
  beat (capturable: the same fused kernel, whose step count already lives on the device, allowed in a CUDA graph, so
  the gate can time the step's device time; without it the capture fails and an eager step, which the CPU cannot
  queue ahead of the device, is timed by the CPU's speed);
- `ours-torch-adamw`: lmsys.model with SDPA and torch's fused AdamW;
- `ours`: lmsys.model with SDPA and lmsys.optim.AdamW (the fused Triton kernel);
- `ours-flash_triton`: lmsys.model with our Triton FlashAttention and lmsys.optim.AdamW;
- `ours-naive`: lmsys.model with the naive attention reference and lmsys.optim.AdamW;
- `ours-bf16-weights-fused-loss`: `ours` with make_train_step's fastest options (bf16 Linear weights with their fp32
  masters in the optimizer, the LM head and cross-entropy fused): our step as fast as it goes (bf16 autocast only).

On a GPU: batch 4, context 512 (as in the plain-PyTorch reference runs). The default subset: `large` in bf16
autocast + torch.compile with reference and ours-bf16-weights-fused-loss side by side (MFU in the report's "% of
peak"), `large` in fp32 and bf16 eager (reference and ours), `large` with the compiled step replayed as CUDA graphs
(`bf16-graphs`: reference and ours-bf16-weights-fused-loss), `small` in every precision with ours, eager with naive
attention and with flash_triton. A compilation of `large` takes about a minute, so the rest (2.7B with every
provider, medium and xl, `large` compiled with the other providers, naive on large, `small` compiled with naive
attention) runs with --perf-full-grid. On the CPU: the tiny preset, reference and ours.

A compiled step of `large` spends longer launching its kernels than the GPU spends running them, and that launch
time moves with the host from one machine to the next (docs/training-step.md, "The perf suite's steps"): on a GPU
the step is judged on its device time (graph=True), and its eager time, launch cost included, with the eager
tolerance.
"""

import dataclasses
import functools

import pytest
import torch

from lmsys import flops
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.reference_model import ReferenceLM
from lmsys.train import make_train_step, random_batch

PRECISIONS = {
    "fp32": dict(autocast_dtype=None, compile=False),
    "bf16": dict(autocast_dtype=torch.bfloat16, compile=False),
    "bf16-compile": dict(autocast_dtype=torch.bfloat16, compile=True),
    # ... and the compiled forward and backward replayed as CUDA graphs (make_train_step's cuda_graphs)
    "bf16-graphs": dict(autocast_dtype=torch.bfloat16, compile=True, cuda_graphs=True),
}

TORCH_FUSED_ADAMW = functools.partial(torch.optim.AdamW, fused=True, capturable=True)
FASTEST = dict(bf16_weights=True, fused_loss=True)  # make_train_step's options of our fastest step (bf16 autocast only)
# provider -> (model class, attention backend, optimizer class, make_train_step's options)
PROVIDERS = {
    "reference": (ReferenceLM, "sdpa", TORCH_FUSED_ADAMW, {}),
    "ours-torch-adamw": (TransformerLM, "sdpa", TORCH_FUSED_ADAMW, {}),
    "ours": (TransformerLM, "sdpa", AdamW, {}),
    "ours-flash_triton": (TransformerLM, "flash_triton", AdamW, {}),
    "ours-naive": (TransformerLM, "naive", AdamW, {}),
    "ours-bf16-weights-fused-loss": (TransformerLM, "sdpa", AdamW, FASTEST),
}
COMPILED_PROVIDERS = ("reference", "ours-bf16-weights-fused-loss", "ours-torch-adamw", "ours", "ours-flash_triton")
DEFAULT_COMPILED = ("reference", "ours-bf16-weights-fused-loss")


def case(size: str, precision: str, provider: str, batch: int = 4, context: int = 512, full_grid: bool = False):
    marks = [pytest.mark.full_grid] if full_grid else []
    return pytest.param(
        size, precision, provider, batch, context, marks=marks, id=f"{size}-{precision}-{provider}-b{batch}-t{context}"
    )


GPU_CASES = [
    *(case("large", "bf16-compile", provider, full_grid=provider not in DEFAULT_COMPILED)
      for provider in COMPILED_PROVIDERS),
    *(case("large", "bf16-graphs", provider) for provider in DEFAULT_COMPILED),
    *(case("large", "bf16-graphs", provider, full_grid=True) for provider in ("ours", "ours-flash_triton")),
    *(case("2.7B", "bf16-graphs", provider, full_grid=True)
      for provider in ("reference", "ours-bf16-weights-fused-loss", "ours", "ours-flash_triton")),
    *(case("large", precision, provider) for precision in ("fp32", "bf16") for provider in ("reference", "ours")),
    *(case("small", precision, "ours") for precision in PRECISIONS),
    *(case("small", precision, "ours-naive", full_grid="compile" in precision or "graphs" in precision)
      for precision in PRECISIONS),
    case("small", "bf16", "ours-flash_triton"),
    *(case("2.7B", "bf16-compile", provider, full_grid=True) for provider in COMPILED_PROVIDERS),
    *(case("2.7B", "bf16", provider, full_grid=True) for provider in ("reference", "ours", "ours-flash_triton")),
    case("large", "bf16", "ours-flash_triton", full_grid=True),
    *(case("large", precision, "ours-naive", full_grid=True) for precision in PRECISIONS),
    *(case(size, precision, "ours", full_grid=True) for size in ("medium", "xl") for precision in PRECISIONS),
]
CPU_CASES = [*(case("tiny", "fp32", provider, batch=2, context=64) for provider in ("reference", "ours")),
             case("tiny", "bf16", "ours-bf16-weights-fused-loss", batch=2, context=64)]


@pytest.mark.parametrize(
    "size,precision,provider,batch,context", GPU_CASES if torch.cuda.is_available() else CPU_CASES
)
def test_train_step(gpu_benchmark, fresh_compiler, device, size, precision, provider, batch, context):
    model_class, attention, optimizer_class, options = PROVIDERS[provider]
    compiled = PRECISIONS[precision]["compile"]
    if attention == "naive" and compiled and device.type == "cuda" and torch.__version__ < "2.13":
        # torch 2.11's inductor raises TypeError in TritonSymbols.get_block_shape on a kernel of this step (the
        # RoPE'd queries and keys read in a reduction without an x dimension); 2.13 handles that case.
        pytest.skip(f"torch {torch.__version__}'s inductor cannot compile the naive-attention step (needs 2.13)")
    config = dataclasses.replace(SIZES[size], context_length=context, attention=attention)
    with torch.device(device):
        model = model_class(config)
    step = make_train_step(model, optimizer_class(model.parameters()), **PRECISIONS[precision], **options)
    inputs, targets = random_batch(batch, context, config.vocab_size, device)
    # The embedding is a lookup; every other weight (the untied LM head included) is a matmul.
    matmul_params = sum(p.numel() for p in model.parameters()) - model.embedding.weight.numel()
    work = flops.training_step_flops(matmul_params, batch, context, config.num_layers, config.d_model)
    # Percent of peak against the matmul precision: "fp32" or "bf16" (eager, compiled or graphed), i.e. the MFU.
    # The gate judges the step's device time (a CUDA-graph replay, or the step queued ahead when it cannot be
    # captured); its eager time, the host's launch cost included, is reported beside it (docs/gate.md, "Graph mode").
    loss = gpu_benchmark(step, inputs, targets, flops=work, precision=precision.split("-")[0],
                         graph=device.type == "cuda")
    assert torch.isfinite(loss)
