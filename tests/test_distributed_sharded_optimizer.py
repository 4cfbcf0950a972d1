"""ZeRO-1 sharded optimizer against the unsharded optimizer, on gloo CPU ranks with uneven shares."""

import copy

import pytest
import torch
from torch import nn

from lmsys.distributed.launch import init_process_group, launch_ranks
from lmsys.distributed.sharded_optimizer import ShardedOptimizer
from lmsys.optim import AdamW

# Seven tensors: neither their count nor their sizes split evenly over 2 or 3 ranks.
SHAPES = [(7,), (33, 5), (3, 1, 17), (), (129,), (4, 4), (65, 3)]
OPTIMIZERS = {"torch_adamw": torch.optim.AdamW, "lmsys_adamw": AdamW}
HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
STEPS = 10
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _params(seed: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(device).requires_grad_() for shape in SHAPES]


def _set_grads(params_lists: list[list[torch.Tensor]], generator: torch.Generator, step: int) -> None:
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    for params in params_lists:
        for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
            # Now and then a parameter has no gradient and its optimizer skips it.
            param.grad = None if (step + index) % 6 == 0 else grad.to(param.device)


def _sharded_like_unsharded(seed: int, optimizer_names: list[str]) -> dict:
    """For each optimizer: STEPS steps of sharded and unsharded side by side (the gradients are the same on every
    rank, as after DDP), a group added at step 3 and a state-dict round trip at step 6; assert equality."""
    device = init_process_group()
    state_sizes = {}
    for name in optimizer_names:
        optimizer_cls = OPTIMIZERS[name]
        mine, theirs = _params(seed, device), _params(seed, device)
        sharded = ShardedOptimizer(mine[:4], optimizer_cls, **HYPER)
        unsharded = optimizer_cls(theirs[:4], **HYPER)
        generator = torch.Generator().manual_seed(seed + 1)
        for step in range(STEPS):
            if step == 3:
                sharded.add_param_group(dict(params=mine[4:], lr=3e-2, weight_decay=0.0))
                unsharded.add_param_group(dict(params=theirs[4:], lr=3e-2, weight_decay=0.0))
            if step == 6:
                saved = sharded.state_dict()
                groups = [dict(params=mine[:4]), dict(params=mine[4:], lr=3e-2, weight_decay=0.0)]
                sharded = ShardedOptimizer(groups, optimizer_cls, **{**HYPER, "lr": 0.5})  # lr comes from `saved`
                sharded.load_state_dict(saved)
            for group in (*sharded.param_groups, *unsharded.param_groups):
                group["lr"] *= 0.9  # a schedule changes the wrapper's groups; the local optimizer must follow
            _set_grads([mine, theirs], generator, step)
            sharded.step()
            unsharded.step()
        for index, (param, expected) in enumerate(zip(mine, theirs, strict=True)):
            torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name} p{index}: {m}")
        state_sizes[name] = _state_numel(sharded.local), _state_numel(unsharded)
        _check_full_state_dict_loads(seed, optimizer_cls, unsharded.state_dict(), mine, theirs)
    return state_sizes


def _check_full_state_dict_loads(seed, optimizer_cls, full_state, mine, theirs) -> None:
    """An unsharded optimizer's state dict loads into a sharded one, which then steps like the unsharded one."""
    groups = [dict(params=mine[:4]), dict(params=mine[4:])]
    sharded = ShardedOptimizer(groups, optimizer_cls, **HYPER)
    # load_state_dict keeps the loaded tensors (torch's does too): each optimizer gets its own copy.
    sharded.load_state_dict(copy.deepcopy(full_state))
    unsharded = optimizer_cls([dict(params=theirs[:4]), dict(params=theirs[4:])], **HYPER)
    unsharded.load_state_dict(copy.deepcopy(full_state))
    _set_grads([mine, theirs], torch.Generator().manual_seed(seed + 2), step=1)
    sharded.step()
    unsharded.step()
    for param, expected in zip(mine, theirs, strict=True):
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(value.numel() for state in optimizer.state.values() for key, value in state.items() if key != "step")


@pytest.mark.parametrize(
    "world_size,backend", [(2, "gloo"), (3, "gloo"), pytest.param(2, "nccl", marks=TWO_GPUS)], ids=str
)
def test_sharded_matches_unsharded_adamw_over_10_steps(seed, world_size, backend):
    results = launch_ranks(_sharded_like_unsharded, world_size, seed, list(OPTIMIZERS), backend=backend, timeout=120)
    total_params = sum(torch.Size(shape).numel() for shape in SHAPES)
    largest = max(torch.Size(shape).numel() for shape in SHAPES)
    for name in OPTIMIZERS:
        local_sizes = [result[name][0] for result in results]
        assert all(result[name][1] == 2 * total_params for result in results)  # two moments per element
        # The shares partition the state, each within one parameter of an even split.
        assert sum(local_sizes) == 2 * total_params
        assert max(local_sizes) <= 2 * (total_params / world_size + largest)


def _bad_state_dict() -> str:
    params = [nn.Parameter(torch.ones(3)) for _ in range(3)]
    sharded = ShardedOptimizer(params, torch.optim.AdamW)
    saved = sharded.state_dict()
    other = ShardedOptimizer(params[:2], torch.optim.AdamW)
    try:
        other.load_state_dict(saved)
    except ValueError as error:
        return str(error)
    return "no error"


def test_state_dict_of_other_parameters_is_refused():
    messages = launch_ranks(_bad_state_dict, 2, timeout=60)
    assert all("the state dict's groups hold [3] parameters, this optimizer's [2]" in m for m in messages), messages


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="ShardedOptimizer needs an initialized default process group"):
        ShardedOptimizer([nn.Parameter(torch.ones(1))], torch.optim.AdamW)
