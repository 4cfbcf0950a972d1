"""Input validation shared by every attention implementation (one `ValueError` per problem, naming it; a `TypeError`
for an `is_causal` that is not a bool), and the refusal of double backward that the fused implementations share."""

import torch

_NAMES = ("q", "k", "v")


def _describe(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, {x.dtype}, {x.device}"


def check_causal(is_causal, *, impl: str) -> None:
    """Raise a `TypeError` unless `is_causal` is a Python bool.

    Anything else is refused, truthy or not: a string such as "no" would otherwise read as causal, and numpy or torch
    booleans (a 0-d tensor) would take a different path through the kernels' specialization and caches.
    """
    if type(is_causal) is not bool:
        raise TypeError(
            f"{impl} attention: is_causal must be True or False, got {is_causal!r} ({type(is_causal).__name__})"
        )


def check_inputs(
    q,
    k,
    v,
    is_causal: bool,
    *,
    impl: str,
    head_dims=None,
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
) -> None:
    """Raise a `ValueError` naming the problem if `q`, `k`, `v` are not valid attention inputs for `impl`.

    Valid inputs are tensors shaped (batch, seq, d) or (batch, heads, seq, d), all with the same number of
    dimensions, the same batch (and heads), one dtype among `dtypes`, one device; `k` and `v` have the same
    shape; `q` and `k` share the head dim, which must be in `head_dims` (a collection or a range) when that is
    given; no sequence is empty; causal attention needs as many queries as keys. Device support beyond "all on one
    device" is left to the caller (the Triton wrapper checks for CUDA or the interpreter itself). `is_causal` must be a
    bool (`check_causal`).
    """
    check_causal(is_causal, impl=impl)
    for name, x in zip(_NAMES, (q, k, v), strict=True):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{impl} attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in zip(_NAMES, (q, k, v), strict=True):
        if x.ndim not in (3, 4):
            raise ValueError(
                f"{impl} attention: {name} must be shaped (batch, seq, d) or (batch, heads, seq, d); "
                f"got {x.ndim} dimensions, shape {tuple(x.shape)}"
            )
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(
            f"{impl} attention: q, k and v must have the same number of dimensions; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    lead = "batch and heads" if q.ndim == 4 else "batch"
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(
            f"{impl} attention: q, k and v must have the same {lead}; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{impl} attention: k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{impl} attention: q and k must have the same head dim; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if head_dims is not None and q.shape[-1] not in head_dims:
        if isinstance(head_dims, range):
            supported = f"{head_dims[0]} to {head_dims[-1]}"
        else:
            supported = ", ".join(str(d) for d in head_dims)
        raise ValueError(f"head dim {q.shape[-1]} is not supported by {impl}; supported: {supported}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"{impl} attention: q, k and v must have one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.dtype not in dtypes:
        supported = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"dtype {q.dtype} is not supported by {impl}; supported: {supported}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"{impl} attention: q, k and v must be on one device; got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    for name, x in zip(_NAMES, (q, k, v), strict=True):
        if x.numel() == 0:
            raise ValueError(f"{impl} attention: {name} is empty ({_describe(x)}); every dimension must be at least 1")
    if is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"{impl} attention: causal attention with {q.shape[-2]} queries and {k.shape[-2]} keys is not supported; "
            "causal needs seq_q == seq_k (use is_causal=False for different lengths)"
        )


def refuse_double_backward(impl: str, grads: tuple, inputs: tuple) -> tuple:
    """`grads` as they are, or, in a backward run with `create_graph=True` over inputs that require grad, aliases of
    them whose own backward raises "double backward is not supported".

    The fused backwards compute their gradients from saved statistics (the output and the log-sum-exp) that carry no
    autograd history, so differentiating those gradients again would give wrong second derivatives or an unrelated
    error. The mechanism is `torch.autograd.function.once_differentiable`'s, which only looks at the incoming
    gradient and so misses the usual case of a gradient that does not itself require grad.
    """
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs):
        return grads
    refuse = torch._C._functions.DelayedError(
        f"{impl} attention: double backward is not supported (its gradients are not differentiable); use naive "
        "attention for second derivatives",
        len(grads) + len(inputs),
    )
    # The inputs go through the raising node too, so that autograd.grad(..., inputs) finds a path to them (and
    # raises this error rather than "appears to not have been used in the graph").
    return refuse(*(g.detach() for g in grads), *inputs)[: len(grads)]
