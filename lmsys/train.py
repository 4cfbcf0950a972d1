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


class _LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(hidden @ weight.T, targets) and its gradients, a chunk of `chunk_size` rows at a time.

    The forward computes the gradients wrt `hidden` and `weight` along with the loss (the softmax is at hand there)
    and saves them; the backward only scales them by the loss's incoming gradient. Per chunk: the logits in
    `compute_dtype`, their logsumexp and the target's logit in fp32 (or float64), the softmax minus the one-hot of
    the target, divided by the number of rows, back in `compute_dtype` for the two gradient matmuls. The weight's
    gradient is summed over the chunks in the weight's dtype, at least fp32, and kept in the weight's dtype: a bf16
    weight (with its fp32 master in the optimizer) gets the one bf16 rounding of the fp32 sum, as a bf16 matmul over
    all the rows would give.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, compute_dtype):
        rows, vocab = hidden.shape[0], weight.shape[0]
        accumulate = torch.promote_types(compute_dtype, torch.float32)
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        w = weight.to(compute_dtype)  # (V, C)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) \
            if want_weight else None
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_size):
                h = hidden[start:start + chunk_size].to(compute_dtype)  # (n, C)
                t = targets[start:start + chunk_size]  # (n,)
                logits = (h @ w.T).to(accumulate)  # (n, V)
                lse = torch.logsumexp(logits, dim=-1)  # (n,)
                total = total + (lse - logits.gather(-1, t.unsqueeze(-1)).squeeze(-1)).sum()
                if want_hidden or want_weight:
                    probs = torch.exp(logits - lse.unsqueeze(-1))
                    is_target = torch.arange(vocab, device=t.device) == t.unsqueeze(-1)  # (n, V)
                    grad_logits = (torch.where(is_target, probs - 1, probs) / rows).to(compute_dtype)
                    if want_hidden:
                        grad_hidden[start:start + chunk_size] = grad_logits @ w
                    if want_weight:
                        grad_weight += grad_logits.T @ h
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total / rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
            # A 0-dim grad_loss scales in its own precision and leaves a bf16 gradient bf16.
            None if grad_weight is None else grad_weight * grad_loss,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets) for hidden (..., C), weight (V, C), targets (...,), without the
    (..., V) logits: `chunk_size` rows of them at a time, each chunk's gradients computed in the forward.

    The matmuls run in the dtype `F.linear` would use: autocast's where it is on for the device, else the inputs'.
    The loss is fp32 (float64 for float64 inputs); the gradients have the dtypes of `hidden` and `weight`. Not
    differentiable twice.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be targets {tuple(targets.shape)} plus a feature dimension"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]})")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk_size, compute_dtype
    )


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


def bf16_linear_weights(model: nn.Module, optimizer: AdamW) -> list[nn.Parameter]:
    """Make the weight of every `nn.Linear` of `model` a bf16 parameter whose fp32 master lives in `optimizer`
    (`AdamW.keep_master_weights`), in place; returns those parameters.

    Under bf16 autocast the model then computes what it computes with fp32 weights, to the bit, without autocast's
    cast of each weight to bf16 in every forward (the weight already is that bf16 value): the matmuls' bf16 weight
    gradients are kept as they are rather than cast to fp32, and the optimizer reads them and writes the next bf16
    weights in its own pass. Other parameters (norm gains, the embedding, biases) stay fp32.
    """
    if not isinstance(optimizer, AdamW):
        raise ValueError(
            f"bf16 Linear weights keep their fp32 masters in lmsys.optim.AdamW, not in {type(optimizer).__name__}"
        )
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}.values())
    # A weight shared with another kind of module (an LM head tied to the embedding) would turn that module bf16 too.
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    if any(id(w) in shared for w in weights):
        raise ValueError("bf16 Linear weights: a Linear weight is shared with a module that is not a Linear (tied "
                         "embedding?); it would run in bf16 there too")
    optimizer.keep_master_weights(weights)
    return weights


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    autocast_dtype: torch.dtype | None = None,
    compile: bool = False,
    compile_loss: bool = False,
    compile_blocks: bool = False,
    compile_optimizer: bool = False,
    fused_loss: bool = False,
    bf16_weights: bool = False,
    compile_backend: str = "inductor",
    cuda_graphs: bool = False,
    max_autotune: bool = False,
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
    - `compile_blocks=True` (with `compile`): each block of `model.layers` is compiled on its own, in place
      (`nn.Module.compile`, with the step's mode), and the embedding, final norm, LM head and loss run eager. The
      blocks share their code, so the compiler builds one graph for all of them: the first step compiles one block,
      not the whole stack (torchtitan compiles its models so). Nothing fuses across a block's boundary.
    - `compile_optimizer=True`: `optimizer.step` is compiled too (torch's recipe for its foreach optimizers; it
      lets inductor fuse the update). Not for `lmsys.optim.AdamW`, which is one fused kernel already.
    - `fused_loss=True`: the LM head and the cross-entropy are one `linear_cross_entropy` on `model.features`
      (a `lmsys.model.TransformerLM`): the (tokens, vocab) logits are never stored, and the head's gradients are
      computed in the forward. With `compile`, the loss is compiled with the model.
    - `bf16_weights=True` (with bf16 autocast and `lmsys.optim.AdamW`): converts the model's Linear weights to bf16
      parameters here, in place, their fp32 masters kept by the optimizer (`bf16_linear_weights`): the same step
      with less memory traffic per parameter (no cast per forward, bf16 weight gradients, one optimizer pass that
      also writes the bf16 weights). Parameters keep their addresses, so CUDA graphs stay valid. With `fused_loss`
      the LM head's weight is bf16 too: `linear_cross_entropy` sums its gradient over the chunks in fp32 and hands
      back that sum's bf16 rounding (the fp32-weight fused step keeps the fp32 sum), every other gradient as
      without bf16 weights. A head tied to the embedding is refused (the lookup would turn bf16 too).
    - `max_autotune=True` (with `compile`, inductor): inductor benchmarks kernel choices while compiling (matmul
      templates against cuBLAS, and each Triton kernel's launch configuration), torch.compile's max-autotune modes:
      a much longer first step. CUDA graphs stay `cuda_graphs`'s choice (mode "max-autotune" with them,
      "max-autotune-no-cudagraphs" without).
    - `cuda_graphs=True` (with `compile`, on CUDA): inductor records the compiled forward and backward as CUDA graphs
      and replays them (mode "reduce-overhead"); the loss comes back as a copy, out of the graphs' memory pool.
    """
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"autocast_dtype must be None or torch.bfloat16, got {autocast_dtype} (float16 would need a grad scaler)"
        )
    if compile_loss and not compile:
        raise ValueError("compile_loss=True compiles the loss with the model: it needs compile=True")
    has_blocks = isinstance(getattr(model, "layers", None), nn.ModuleList)
    if compile_blocks and (not compile or compile_loss or not has_blocks):
        raise ValueError(
            f"compile_blocks=True compiles each block of model.layers and runs the loss eager: it needs compile=True, "
            f"compile_loss=False and a model with an nn.ModuleList of blocks in `layers`, not compile={compile}, "
            f"compile_loss={compile_loss} and a {type(model).__name__}"
        )
    if compile_optimizer and isinstance(optimizer, AdamW):
        raise ValueError(
            "compile_optimizer=True is for torch's optimizers; lmsys.optim.AdamW is one fused kernel already (and its "
            "step builds tables on the host that the compiler cannot trace)"
        )
    if fused_loss and not (hasattr(model, "features") and isinstance(getattr(model, "lm_head", None), nn.Linear)
                           and model.lm_head.bias is None):
        raise ValueError(
            f"fused_loss=True needs a model with features(tokens) and a bias-free nn.Linear lm_head (such as "
            f"lmsys.model.TransformerLM), not {type(model).__name__}"
        )
    if bf16_weights and autocast_dtype is not torch.bfloat16:
        raise ValueError("bf16_weights=True computes with bf16 Linear weights under bf16 autocast: it needs "
                         "autocast_dtype=torch.bfloat16")
    device_type = next(model.parameters()).device.type
    if cuda_graphs and not compile:
        raise ValueError("cuda_graphs=True records the compiled model's kernels as CUDA graphs: it needs compile=True")
    if cuda_graphs and device_type != "cuda":
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device_type}")
    if max_autotune and not (compile and compile_backend == "inductor"):
        raise ValueError(f"max_autotune=True tunes inductor's kernels: it needs compile=True and "
                         f"compile_backend='inductor', not compile={compile} and compile_backend={compile_backend!r}")

    if bf16_weights:
        bf16_linear_weights(model, optimizer)

    def model_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if fused_loss:
            return linear_cross_entropy(model.features(inputs), model.lm_head.weight, targets)
        return cross_entropy(forward(inputs), targets)

    mode = {(False, False): None, (True, False): "reduce-overhead", (False, True): "max-autotune-no-cudagraphs",
            (True, True): "max-autotune"}[cuda_graphs, max_autotune]
    if compile_blocks:
        for block in model.layers:
            block.compile(backend=compile_backend, mode=mode)
    whole_model = compile and not compile_blocks  # the model compiled as one
    whole = whole_model and (compile_loss or fused_loss)  # ... with the loss
    forward = torch.compile(model, backend=compile_backend, mode=mode) if whole_model and not whole else model
    loss_of = torch.compile(model_loss, backend=compile_backend, mode=mode) if whole else model_loss
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
