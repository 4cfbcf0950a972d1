"""AdamW (Loshchilov & Hutter, 2019), the optimizer of the training step; `torch.optim.AdamW` is its reference.

Per parameter p with gradient g, at step t (from 1):
    p <- p * (1 - lr * weight_decay)                      decoupled weight decay
    m <- beta1 m + (1 - beta1) g,   v <- beta2 v + (1 - beta2) g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
The update runs on whole lists of tensors (`torch._foreach_*`): a few kernel launches per group instead of a few
per parameter, which matters for models with hundreds of weight tensors.
"""

import math

import torch


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction; same hyper-parameters and results as torch's."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns `closure()` if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise ValueError("AdamW does not support sparse gradients")
            states = [self._state(p) for p in params]
            for state in states:
                state["step"] += 1
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]

            if group["weight_decay"] != 0:
                torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
            # Parameters can be at different steps (a gradient may have been missing), so corrections are per tensor.
            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2 ** s["step"]) for s in states])
            torch._foreach_add_(denoms, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1.0 - beta1 ** s["step"]) for s in states])
        return loss

    def _state(self, param: torch.Tensor) -> dict:
        """The moments of `param`, created as zeros on its first update."""
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
