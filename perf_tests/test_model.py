"""One training step of the LM (forward, cross-entropy, backward, AdamW) per preset, precision and attention backend.

On a GPU: batch 4, context 512 (as in the plain-PyTorch reference runs), `small` and `large` in fp32, bf16
autocast and bf16 autocast + torch.compile, with SDPA as the attention and the naive reference beside it where it
is affordable, and on `large` torch's fused AdamW beside ours; the rest of the grid (medium, xl, 2.7B, naive on
large, the flash kernels) runs with --full-grid.
On the CPU: the tiny preset in one configuration.
"""

import dataclasses
import functools

import pytest
import torch

from lmsys import flops
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.train import make_train_step, random_batch

PRECISIONS = {
    "fp32": dict(autocast_dtype=None, compile=False),
    "bf16": dict(autocast_dtype=torch.bfloat16, compile=False),
    "bf16-compile": dict(autocast_dtype=torch.bfloat16, compile=True),
}

# Ours, and torch's fused AdamW: the optimizer of a plain-PyTorch training step (the reference runs).
OPTIMIZERS = {"adamw": AdamW, "torch-fused-adamw": functools.partial(torch.optim.AdamW, fused=True)}


def case(
    size: str,
    precision: str,
    attention: str,
    optimizer: str = "adamw",
    batch: int = 4,
    context: int = 512,
    full_grid: bool = False,
):
    marks = [pytest.mark.full_grid] if full_grid else []
    return pytest.param(
        size,
        precision,
        attention,
        optimizer,
        batch,
        context,
        marks=marks,
        id=f"{size}-{precision}-{attention}-{optimizer}-b{batch}-t{context}",
    )


GPU_CASES = [
    *(case("small", precision, attention) for precision in PRECISIONS for attention in ("sdpa", "naive")),
    *(case("large", precision, "sdpa") for precision in PRECISIONS),
    case("large", "fp32", "sdpa", "torch-fused-adamw"),
    case("large", "bf16", "sdpa", "torch-fused-adamw"),
    case("large", "bf16-compile", "sdpa", "torch-fused-adamw", full_grid=True),
    *(case("large", precision, "naive", full_grid=True) for precision in PRECISIONS),
    *(case(size, precision, "sdpa", full_grid=True) for size in ("medium", "xl", "2.7B") for precision in PRECISIONS),
    *(
        case(size, precision, "flash_triton", full_grid=True)
        for size in ("large", "2.7B")
        for precision in ("bf16", "bf16-compile")
    ),
]
CPU_CASES = [case("tiny", "fp32", "sdpa", batch=2, context=64)]


@pytest.fixture
def fresh_compiler():
    """Drop compiled graphs after the test: they hold the model's memory, and every new model would recompile."""
    yield
    torch.compiler.reset()


@pytest.mark.parametrize(
    "size,precision,attention,optimizer,batch,context", GPU_CASES if torch.cuda.is_available() else CPU_CASES
)
def test_train_step(gpu_benchmark, fresh_compiler, device, size, precision, attention, optimizer, batch, context):
    config = dataclasses.replace(SIZES[size], context_length=context, attention=attention)
    with torch.device(device):
        model = TransformerLM(config)
    step = make_train_step(model, OPTIMIZERS[optimizer](model.parameters()), **PRECISIONS[precision])
    inputs, targets = random_batch(batch, context, config.vocab_size, device)
    # The embedding is a lookup; every other weight (the untied LM head included) is a matmul.
    work = flops.training_step_flops(
        model.num_parameters(embedding=False), batch, context, config.num_layers, config.d_model
    )
    # Percent of peak against the matmul precision: "fp32" or "bf16" (with or without compile).
    loss = gpu_benchmark(step, inputs, targets, flops=work, precision=precision.split("-")[0])
    assert torch.isfinite(loss)
