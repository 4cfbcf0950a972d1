"""ZeRO stage 1 (Rajbhandari et al., 2020): optimizer state sharded across ranks, parameters and gradients not.

Each parameter is owned by one rank. Each rank builds the wrapped optimizer over the parameters it owns only, so its
optimizer state (AdamW's two moments) is about 1/N of the unsharded optimizer's; after its local step, every owner
broadcasts its updated parameters and all ranks hold the whole model again. Gradients must already be the same on
every rank (averaged by one of the DDP wrappers): the sharded step then gives what the unsharded one would.

Shares are balanced by bytes: parameters, largest first, each go to the rank with the fewest bytes so far (the
greedy longest-processing-time rule), across all parameter groups including those added later; every rank computes
the same assignment. Parameters reach the other ranks through `broadcast_coalesced`: large tensors in place,
small ones packed into flat buffers of at most 64 MiB, so the step needs few collectives and little extra memory.
"""

from typing import Any

import torch
import torch.distributed as dist

from lmsys.distributed.collectives import broadcast_coalesced


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls(**kwargs)` over this rank's share of `params`; a `torch.optim.Optimizer` over all of them.

    `param_groups` lists every parameter with its group's hyper-parameters (so learning-rate schedulers and
    `zero_grad` work on the wrapper); changes to them reach the local optimizer at each `step`. `state_dict()`
    holds this rank's share of the state under the global parameter indices of an unsharded optimizer's state dict;
    `load_state_dict` takes such a dict (this rank's, or a whole unsharded optimizer's) and keeps the states of the
    parameters this rank owns.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialized default process group")
        self._optimizer_cls, self._kwargs = optimizer_cls, kwargs
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._loads = [0] * self._world_size  # bytes owned per rank
        self._owner: dict[torch.Tensor, int] = {}
        self._owned: list[list[torch.Tensor]] = [[] for _ in range(self._world_size)]  # per rank, in group order
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its parameters are shared out among the ranks, this rank's go to the local optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for index in sorted(range(len(group["params"])), key=lambda i: -_nbytes(group["params"][i])):
            owner = min(range(self._world_size), key=lambda rank: (self._loads[rank], rank))
            self._owner[group["params"][index]] = owner
            self._loads[owner] += _nbytes(group["params"][index])
        for p in group["params"]:
            self._owned[self._owner[p]].append(p)
        local_group = {**_hyper(group), "params": [p for p in group["params"] if self._owner[p] == self._rank]}
        if self.local is None:
            self.local = self._optimizer_cls([local_group], **self._kwargs)
        else:
            self.local.add_param_group(local_group)
        # The local optimizer filled in its defaults; the wrapper's group shows the same hyper-parameters.
        for key, value in self.local.param_groups[-1].items():
            group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure=None):
        """Step the local optimizer over this rank's share, then broadcast every share from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local_group in zip(self.param_groups, self.local.param_groups, strict=True):
            local_group.update(_hyper(group))
        self.local.step()
        for owner, owned in enumerate(self._owned):
            broadcast_coalesced(owned, src=owner)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, keyed by global parameter index, and every group's hyper-parameters."""
        local_to_global = self._local_to_global()
        state = {local_to_global[index]: value for index, value in self.local.state_dict()["state"].items()}
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({**_hyper(group), "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters and the states of this rank's parameters (states of other parameters are ignored)."""
        saved_sizes = [len(group["params"]) for group in state_dict["param_groups"]]
        sizes = [len(group["params"]) for group in self.param_groups]
        if saved_sizes != sizes:
            raise ValueError(f"the state dict's groups hold {saved_sizes} parameters, this optimizer's {sizes}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(_hyper(saved))
        saved_state = state_dict["state"]
        state = {local: saved_state[glob] for local, glob in self._local_to_global().items() if glob in saved_state}
        local_groups, start = [], 0
        for group, local_group in zip(self.param_groups, self.local.param_groups, strict=True):
            local_groups.append({**_hyper(group), "params": list(range(start, start + len(local_group["params"])))})
            start += len(local_group["params"])
        self.local.load_state_dict({"state": state, "param_groups": local_groups})

    def _local_to_global(self) -> dict[int, int]:
        """Local optimizer's parameter index -> global index (both count parameters group by group, in order)."""
        mapping, local_index, global_index = {}, 0, 0
        for group in self.param_groups:
            for p in group["params"]:
                if self._owner[p] == self._rank:
                    mapping[local_index] = global_index
                    local_index += 1
                global_index += 1
        return mapping


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyper-parameters (everything but its parameters)."""
    return {key: value for key, value in group.items() if key != "params"}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
