"""Our AdamW against its reference, torch.optim.AdamW."""

import pytest
import torch

from lmsys.optim import AdamW

SHAPES = [(7,), (33, 5), (3, 1, 17), ()]


def _params(generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(shape, dtype=torch.float64, generator=generator).requires_grad_() for shape in SHAPES]


def _groups(params: list[torch.Tensor], lr: float, weight_decay: float) -> list[dict]:
    # Two groups with different hyper-parameters, as a model with and without decay on its norms would have.
    return [
        dict(params=params[:2]),
        dict(params=params[2:], lr=lr / 3, betas=(0.8, 0.95), weight_decay=weight_decay * 2),
    ]


@pytest.mark.parametrize(
    "lr,betas,eps,weight_decay",
    [(1e-3, (0.9, 0.999), 1e-8, 0.01), (3e-2, (0.5, 0.9), 1e-6, 0.1), (1e-2, (0.0, 0.0), 1e-3, 0.0)],
)
def test_matches_torch_adamw_over_100_steps(seed, lr, betas, eps, weight_decay):
    ours, theirs = _params(torch.Generator().manual_seed(seed)), _params(torch.Generator().manual_seed(seed))
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    optimizers = [
        AdamW(_groups(ours, lr, weight_decay), **hyper),
        torch.optim.AdamW(_groups(theirs, lr, weight_decay), **hyper),
    ]
    grad_generator = torch.Generator().manual_seed(seed + 1)
    for step in range(100):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=grad_generator) for p in ours]
        for index, (mine, reference, grad) in enumerate(zip(ours, theirs, grads, strict=True)):
            # Every fifth step one parameter has no gradient, so parameters reach different step counts.
            has_grad = not (step % 5 == 0 and index == step % len(SHAPES))
            mine.grad = grad.clone() if has_grad else None
            reference.grad = grad.clone() if has_grad else None
        for optimizer in optimizers:
            optimizer.step()
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference)
        mine_state, reference_state = optimizers[0].state[mine], optimizers[1].state[reference]
        torch.testing.assert_close(mine_state["exp_avg"], reference_state["exp_avg"])
        torch.testing.assert_close(mine_state["exp_avg_sq"], reference_state["exp_avg_sq"])


def test_defaults_match_torch():
    param = torch.zeros(1, requires_grad=True)
    ours, theirs = AdamW([param]).defaults, torch.optim.AdamW([param]).defaults
    assert ours == {key: theirs[key] for key in ours}


def test_float32_step_matches_float64(seed):
    param64 = torch.randn(129, 65, dtype=torch.float64, requires_grad=True)
    param32 = param64.detach().float().requires_grad_()
    optimizers = [AdamW([param32], lr=1e-2), AdamW([param64], lr=1e-2)]
    for _ in range(10):
        grad = torch.randn(129, 65, dtype=torch.float64)
        param32.grad, param64.grad = grad.float(), grad
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(param32, param64.float())


def test_closure_is_called_with_grad_enabled():
    param = torch.ones(3, requires_grad=True)
    optimizer = AdamW([param])

    def closure():
        optimizer.zero_grad()
        loss = (param * 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 6.0
    assert torch.all(param < 1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(0.9,)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_invalid_hyperparameters_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW([torch.zeros(1, requires_grad=True)], **kwargs)


def test_sparse_gradient_raises():
    param = torch.zeros(4, requires_grad=True)
    param.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        AdamW([param]).step()
