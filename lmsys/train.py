"""The pieces of a training step: the loss, a batch of random tokens, and forward + backward + optimizer step."""

from collections.abc import Callable

import torch
from torch import nn

from lmsys import profiling
from lmsys.optim import AdamW


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of `targets` (...,) under `logits` (..., V), in fp32 whatever the logits' dtype.

    log softmax(x)_y = x_y - logsumexp(x); `torch.logsumexp` subtracts the row maximum first, so large logits do
    not overflow.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} plus a vocabulary dimension"
        )
    logits = logits.float()
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...,)
    return (torch.logsumexp(logits, dim=-1) - target_logits).mean()


def random_batch(
    batch_size: int,
    context_length: int,
    vocab_size: int,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random tokens as (inputs, targets), both (batch_size, context_length) int64, targets shifted by one.

    A `generator` must live on `device`.
    """
    if min(batch_size, context_length, vocab_size) < 1:
        raise ValueError(
            f"batch_size, context_length and vocab_size must be positive, got {batch_size}, {context_length}, "
            f"{vocab_size}"
        )
    tokens = torch.randint(
        vocab_size, (batch_size, context_length + 1), device=device, generator=generator
    )  # (B, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    autocast_dtype: torch.dtype | None = None,
    compile: bool = False,
    compile_loss: bool = False,
    compile_optimizer: bool = False,
    compile_backend: str = "inductor",
    cuda_graphs: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return `step(inputs, targets) -> loss`: forward, cross-entropy, backward, optimizer step, gradients cleared.

    The step runs in the parameters' dtype (fp32) by default; `autocast_dtype=torch.bfloat16` runs the matmuls
    under bf16 autocast (master weights, gradients and optimizer state stay fp32). `compile=True` compiles the
    model once here (with `compile_backend`); the first call of `step` pays the compilation. The loss comes back
    detached and unsynchronized.

    Options that change what is compiled (same results up to rounding):
    - `compile_loss=True` (with `compile`): the cross-entropy is compiled together with the model, so the compiler
      fuses it into the kernels around the logits: the fp32 copy of the logits and the softmax of the backward are
      never materialized as separate passes.
    - `compile_optimizer=True`: `optimizer.step` is compiled too (torch's recipe for its foreach optimizers; it
      lets inductor fuse the update). Not for `lmsys.optim.AdamW`, which is one fused kernel already.
    """
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"autocast_dtype must be None or torch.bfloat16, got {autocast_dtype} (float16 would need a grad scaler)"
        )
    if compile_loss and not compile:
        raise ValueError("compile_loss=True compiles the loss with the model: it needs compile=True")
    if compile_optimizer and isinstance(optimizer, AdamW):
        raise ValueError(
            "compile_optimizer=True is for torch's optimizers; lmsys.optim.AdamW is one fused kernel already (and its "
            "step builds tables on the host that the compiler cannot trace)"
        )
    device_type = next(model.parameters()).device.type
    if cuda_graphs and not compile:
        raise ValueError("cuda_graphs=True records the compiled model's kernels as CUDA graphs: it needs compile=True")
    if cuda_graphs and device_type != "cuda":
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device_type}")

    def model_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(forward(inputs), targets)

    mode = "reduce-overhead" if cuda_graphs else None
    forward = torch.compile(model, backend=compile_backend, mode=mode) if compile and not compile_loss else model
    loss_of = torch.compile(model_loss, backend=compile_backend, mode=mode) if compile_loss else model_loss
    optimizer_step = torch.compile(optimizer.step, backend=compile_backend) if compile_optimizer else optimizer.step

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with (
            profiling.range("forward"),
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
        ):
            loss = loss_of(inputs, targets)
        with profiling.range("backward"):
            loss.backward()
        with profiling.range("optimizer_step"):
            optimizer_step()
            optimizer.zero_grad(set_to_none=True)
        # A graph's output lives in its memory pool and the next replay overwrites it: hand out a copy.
        return loss.detach().clone() if cuda_graphs else loss.detach()

    return step
