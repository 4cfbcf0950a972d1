"""The pieces of a training step: the loss, a batch of random tokens, and forward + backward + optimizer step."""

from collections.abc import Callable

import torch
from torch import nn

from lmsys import profiling


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
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return `step(inputs, targets) -> loss`: forward, cross-entropy, backward, optimizer step, gradients cleared.

    The step runs in the parameters' dtype (fp32) by default; `autocast_dtype=torch.bfloat16` runs the matmuls
    under bf16 autocast (master weights, gradients and optimizer state stay fp32). `compile=True` compiles the
    model once here; the first call of `step` pays the compilation. The loss comes back detached and unsynchronized.
    """
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"autocast_dtype must be None or torch.bfloat16, got {autocast_dtype} (float16 would need a grad scaler)"
        )
    device_type = next(model.parameters()).device.type
    forward = torch.compile(model) if compile else model

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with (
            profiling.range("forward"),
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
        ):
            loss = cross_entropy(forward(inputs), targets)
        with profiling.range("backward"):
            loss.backward()
        with profiling.range("optimizer_step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
