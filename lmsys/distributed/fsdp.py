"""Fully sharded data parallelism (ZeRO-3; Rajbhandari et al., 2020; torch's FSDP2 `fully_shard`).

The weights of every `nn.Linear` and `nn.Embedding` (those that require a gradient) are sharded: per *unit* (a
group of layers gathered together) they are flattened, padded to a multiple of the world size N, and each rank
keeps one contiguous 1/N slice in fp32, `flat_shards[i]`, the master copy that the optimizer steps. Other
parameters (norm gains) stay replicated and their gradients are all-reduced, as in DDP; frozen linear and embedding
weights stay replicated too, converted to `compute_dtype` when one is given.

Units. By default every element of every outermost `nn.ModuleList` in the module tree is a unit (the blocks of a
Transformer), and the weights outside all units (embedding, LM head) form the root unit; `units=[...]` names the
unit modules instead. A weight used by modules of two different units (tied across units) goes to the root. Units
must run in the order given (the order of the module tree by default) and in the same order on every rank.

One step, as seen from a unit:
    forward    all-gather its full weights in `compute_dtype` (the fp32 shard is cast first, so bf16 halves the
               bytes), and start the next unit's all-gather (prefetch); after its forward the weights are freed
               (the root keeps them: backward starts with it)
    backward   a hook on the unit's outputs fires before its backward: all-gather again, prefetch the previous
               unit's; when every weight's gradient is accumulated, the gradients (compute dtype) are copied into
               one flat fp32 buffer, the weights freed, and a reduce-scatter launched asynchronously: each rank
               gets the fp32 average of its own slice. The previous unit's reduce-scatter is waited for before the
               next buffer is allocated (one in flight, as in FSDP2), so these buffers do not pile up
    finish_gradient_synchronization()   waits for the reduce-scatters, puts each result in `flat_shards[i].grad`
               (shape (shard numel,), fp32), and all-reduces the replicated parameters' gradients

The gathered weights are views of one flat buffer per unit whose storage is allocated before a gather and resized to
zero after use (FSDP1's trick): the autograd graph keeps pointing at the same tensors, which hold the data again by
the time backward reads them. Each weight is its own autograd leaf (not a view of the flat buffer), so its gradient
is computed in place of a fresh tensor and nothing of full size is zero-filled.

Gradient order and unused weights: reduce-scatters go out in the fixed order of backward (last unit first, root
last) on their own process group, separate from the all-gathers, so that ranks whose backward differs still pair
their collectives; a weight that got no gradient counts as zero (as in the DDP wrappers). `gather_full_params()`
returns every parameter in full (fp32, the original names); `state_dict()` is the wrapper's own (this rank's shards,
the replicated parameters, buffers) and round-trips through `load_state_dict()` at the same world size.

Nothing stays in flight when the process group goes: a collective still pending when the group is destroyed can abort
the process (gloo's worker threads). `finish_gradient_synchronization()` waits for everything it started;
`wait_for_pending_work()` waits for what a backward left in flight without it (an unfinished step, an error raised in
a hook, which calls it first) and drops that step's gradient synchronization. The module-level
`wait_for_pending_work()` does so for every wrapper of the process, and lmsys.distributed.launch calls it before it
destroys a rank's process group.
"""

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from lmsys.distributed.collectives import all_gather_single, broadcast_coalesced, reduce_scatter_single

_MAX_REDUCES_IN_FLIGHT = 1
_reduce_groups: dict[dist.ProcessGroup, dist.ProcessGroup] = {}
# Every FSDP wrapper alive in this process, for the module-level wait_for_pending_work().
_wrappers: "weakref.WeakSet[FSDP]" = weakref.WeakSet()


def wait_for_pending_work() -> None:
    """`FSDP.wait_for_pending_work()` of every FSDP wrapper alive in this process: call it before destroying the
    process group."""
    for wrapper in list(_wrappers):
        wrapper.wait_for_pending_work()


class _Slot:
    """One sharded weight: its name, where it sits in its unit's flat buffer, its leaf, the modules that use it."""

    def __init__(self, name: str, shape: torch.Size, offset: int, uses: list[tuple[nn.Module, str]]):
        self.name, self.shape, self.numel, self.offset, self.uses = name, shape, shape.numel(), offset, uses
        self.leaf: torch.Tensor | None = None


class _Unit:
    """The sharded weights of one unit: the fp32 shard, the gathered flat buffer and its leaves, the step's state.

    `owned` lists (name, parameter, uses) of the unit's weights; each use (module, attribute) gets the leaf.
    """

    def __init__(self, owned: list[tuple[str, nn.Parameter, list]], compute_dtype, rank: int, world_size: int):
        dtypes = {param.dtype for _, param, _ in owned}
        if len(dtypes) > 1:
            raise ValueError(f"the sharded weights of one unit must share a dtype, got {sorted(map(str, dtypes))}")
        self.slots, offset = [], 0
        for name, param, uses in owned:
            self.slots.append(_Slot(name, param.shape, offset, uses))
            offset += param.numel()
        self.rank, self.shard_numel = rank, -(-offset // world_size)
        self.padded_numel = self.shard_numel * world_size
        dtype, device = owned[0][1].dtype, owned[0][1].device
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for slot, (_, param, _) in zip(self.slots, owned, strict=True):
            flat[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
        self.shard = nn.Parameter(flat[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone())
        del flat
        self.full = torch.empty(self.padded_numel, dtype=compute_dtype or dtype, device=device)
        storage = self.full.untyped_storage()
        for slot in self.slots:
            # A tensor of its own on the flat buffer's storage (not a view of it): its own autograd leaf and version
            # counter, so gathering into the buffer does not look like an in-place change to saved weights.
            leaf = torch.empty(0, dtype=self.full.dtype, device=device)
            slot.leaf = leaf.set_(storage, slot.offset, slot.shape, _contiguous_strides(slot.shape)).requires_grad_()
            for owner, attribute in slot.uses:
                del owner._parameters[attribute]
                setattr(owner, attribute, slot.leaf)  # a plain tensor attribute, which F.linear reads like a parameter
        storage.resize_(0)
        self.gathered = False
        self.gather_work: dist.Work | None = None
        self.ready: set[int] = set()  # slots whose gradient has been accumulated this step
        self.reduce_input: torch.Tensor | None = None  # (padded_numel,) fp32, once every gradient is in

    def start_gather(self, group) -> None:
        if self.gathered or self.gather_work is not None:
            return
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        source = self.shard.detach()
        if source.dtype != self.full.dtype:
            # Cast into this rank's own slice of the output and gather in place: no separate input buffer.
            own = self.full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
            source = own.copy_(source)
        self.gather_work = all_gather_single(self.full, source, group=group, async_op=True)

    def wait_gather(self, group) -> None:
        self.start_gather(group)
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
            self.gathered = True

    def free(self) -> None:
        if self.gather_work is not None:  # a prefetch nobody used: it must land before its memory goes
            self.gather_work.wait()
            self.gather_work = None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def collect_gradients(self) -> None:
        """Copy the leaves' gradients (zeros where missing) into one flat fp32 buffer and drop them and the weights."""
        flat = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        flat[sum(slot.numel for slot in self.slots) :].zero_()
        for slot in self.slots:
            view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if slot.leaf.grad is None:
                view.zero_()
            else:
                view.copy_(slot.leaf.grad)
                slot.leaf.grad = None
        self.reduce_input = flat
        self.free()


class FSDP(nn.Module):
    """Shard `module`'s linear and embedding weights across the ranks of the default process group.

    `compute_dtype` (e.g. torch.bfloat16) is the dtype of the gathered weights used in forward and backward; the
    shards, their gradients and the optimizer stay fp32. `units` lists the modules gathered one at a time (default:
    the elements of the outermost `nn.ModuleList`s). Train with any optimizer over `fsdp.parameters()`:

        loss_fn(fsdp(inputs), targets).backward(); fsdp.finish_gradient_synchronization(); optimizer.step()
    """

    def __init__(
        self, module: nn.Module, compute_dtype: torch.dtype | None = None, units: list[nn.Module] | None = None
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialized default process group")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.world_size = dist.get_world_size()
        self._average_op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
        self._gather_group = dist.group.WORLD
        self._reduce_group = _reduce_group()
        with torch.no_grad():
            broadcast_coalesced([p.detach() for p in module.parameters()], src=0)
        self._names = [name for name, _ in module.named_parameters()]
        unit_paths = _unit_paths(module, units)
        assignment = _assign(module, unit_paths)  # unit index (0: root, i: unit_paths[i - 1]) -> its weights
        self._root_sharded = 0 in assignment
        rank = dist.get_rank()
        self._units = [_Unit(owned, compute_dtype, rank, self.world_size) for _, owned in sorted(assignment.items())]
        self.flat_shards = nn.ParameterList([unit.shard for unit in self._units])
        self._replicated = [p for p in module.parameters() if p.requires_grad]
        if compute_dtype is not None:
            # Frozen linear and embedding weights stay replicated; they train no master copy, so keep them in the
            # compute dtype that the layers around them run in.
            for child in module.modules():
                if isinstance(child, (nn.Linear, nn.Embedding)):
                    for param in child.parameters(recurse=False):
                        if not param.requires_grad and param.is_floating_point():
                            param.data = param.data.to(compute_dtype)
        for position, index in enumerate(sorted(assignment)):
            for slot_index, slot in enumerate(self._units[position].slots):
                slot.leaf.register_post_accumulate_grad_hook(self._grad_hook(position, slot_index))
            if index > 0:
                unit_module = module.get_submodule(unit_paths[index - 1])
                unit_module.register_forward_pre_hook(self._pre_forward_hook(position))
                unit_module.register_forward_hook(self._post_forward_hook(position))
        self._next_reduce = 0  # index into the backward order of the next unit to reduce-scatter
        self._reduces: list[tuple[_Unit, dist.Work, torch.Tensor]] = []  # in flight, oldest first
        _wrappers.add(self)

    def forward(self, *args, **kwargs):
        for unit in self._units:  # gathers of an earlier forward hold weights from before the optimizer step
            if unit.gathered or unit.gather_work is not None:
                unit.free()
        first_layer = int(self._root_sharded)
        if self._root_sharded:
            self._units[0].wait_gather(self._gather_group)
        if first_layer < len(self._units):
            self._units[first_layer].start_gather(self._gather_group)
        output = self.module(*args, **kwargs)
        if self._root_sharded:
            self._before_backward(output, 0)
        return output

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter (launching those still missing, with zeros for absent gradients), leave each
        shard's averaged fp32 gradient in its `.grad`, and average the replicated parameters' gradients."""
        order = self._backward_order()
        for position in order[self._next_reduce :]:
            unit = self._units[position]
            if unit.reduce_input is None:
                unit.collect_gradients()
        self._launch_reduces()
        while self._reduces:
            self._finish_oldest_reduce()
        for unit in self._units:
            unit.ready.clear()
        self._next_reduce = 0
        if self._replicated:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._replicated]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=self._average_op, group=self._gather_group)
            if self._average_op == dist.ReduceOp.SUM:
                flat.div_(self.world_size)
            offset = 0
            for param in self._replicated:
                param.grad = flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()

    def wait_for_pending_work(self) -> None:
        """Wait for every all-gather and reduce-scatter still in flight, and drop the current step's gradient
        synchronization (the reduce-scatters' results not yet taken, the gradients collected but not reduced): the
        next backward starts afresh. After `finish_gradient_synchronization()` nothing is in flight and this does
        nothing; after a backward without it, or an error in the middle of one, it leaves nothing pending before the
        process group is destroyed."""
        for unit in self._units:
            if unit.gather_work is not None:  # a prefetch nobody consumed: its weights stay until the next forward
                unit.gather_work.wait()
                unit.gather_work = None
                unit.gathered = True
        while self._reduces:
            _, work, _ = self._reduces.pop(0)
            work.wait()
        for unit in self._units:
            unit.ready.clear()
            unit.reduce_input = None
        self._next_reduce = 0

    def num_parameters(self) -> int:
        """The wrapped model's parameter count, sharded weights at their full size: the module's own `parameters()`
        (and so `TransformerLM.num_parameters()`) do not list the sharded weights, which the wrapper makes plain
        tensors."""
        sharded = sum(slot.numel for unit in self._units for slot in unit.slots)
        return sharded + sum(p.numel() for p in self.module.parameters())

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module in full, by its original name (fp32 copies, on every rank)."""
        full = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        for unit in self._units:
            flat = torch.empty(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
            all_gather_single(flat, unit.shard.detach(), group=self._gather_group)
            for slot in unit.slots:
                full[slot.name] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        return {name: full[name] for name in self._names}

    def _backward_order(self) -> list[int]:
        """Units in the order their gradients complete: the last unit first, the root (index 0) last."""
        return list(reversed(range(len(self._units))))

    def _pre_forward_hook(self, position: int):
        def hook(module, args):
            self._units[position].wait_gather(self._gather_group)
            if position + 1 < len(self._units):
                self._units[position + 1].start_gather(self._gather_group)

        return hook

    def _post_forward_hook(self, position: int):
        def hook(module, args, output):
            self._units[position].free()
            self._before_backward(output, position)

        return hook

    def _before_backward(self, output, position: int) -> None:
        """Hook the output tensors: the first gradient reaching them gathers this unit and prefetches the previous."""
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward_hook(position))

    def _pre_backward_hook(self, position: int):
        # Backward runs the root's head first, then the layer units from the last one down.
        following = len(self._units) - 1 if position == 0 and self._root_sharded else position - 1

        def hook(grad):
            self._units[position].wait_gather(self._gather_group)
            if 0 <= following != position:
                self._units[following].start_gather(self._gather_group)

        return hook

    def _grad_hook(self, position: int, slot_index: int):
        def hook(leaf):
            unit = self._units[position]
            if slot_index in unit.ready:
                self.wait_for_pending_work()  # nothing left in flight behind the error
                raise RuntimeError(
                    f"the gradient of {unit.slots[slot_index].name!r} became ready twice without "
                    "finish_gradient_synchronization() in between; call it after every backward"
                )
            unit.ready.add(slot_index)
            if len(unit.ready) == len(unit.slots):
                self._wait_for_reduce_slot()  # before collect_gradients allocates the next input, as FSDP2 does
                unit.collect_gradients()
                self._launch_reduces()

        return hook

    def _launch_reduces(self) -> None:
        """Reduce-scatter the units whose gradients are collected, in backward order, keeping few in flight."""
        order = self._backward_order()
        while self._next_reduce < len(order) and self._units[order[self._next_reduce]].reduce_input is not None:
            unit = self._units[order[self._next_reduce]]
            self._wait_for_reduce_slot()
            output = torch.empty_like(unit.shard)
            work = reduce_scatter_single(
                output, unit.reduce_input, op=self._average_op, group=self._reduce_group, async_op=True
            )
            self._reduces.append((unit, work, output))
            unit.reduce_input = None  # the work keeps it alive until it is waited for
            self._next_reduce += 1

    def _wait_for_reduce_slot(self) -> None:
        """Finish the oldest reduce-scatters until fewer than the limit are in flight (their inputs are freed)."""
        while len(self._reduces) >= _MAX_REDUCES_IN_FLIGHT:
            self._finish_oldest_reduce()

    def _finish_oldest_reduce(self) -> None:
        unit, work, output = self._reduces.pop(0)
        work.wait()
        if self._average_op == dist.ReduceOp.SUM:
            output.div_(self.world_size)
        if unit.shard.grad is None:
            unit.shard.grad = output
        else:
            unit.shard.grad.add_(output)


def _reduce_group() -> dist.ProcessGroup:
    """A second group of all ranks for the reduce-scatters, made once per default group (making one is collective)."""
    world = dist.group.WORLD
    if world not in _reduce_groups:  # keyed by the group itself: a destroyed default group is never mistaken
        _reduce_groups[world] = dist.new_group()
    return _reduce_groups[world]


def _unit_paths(module: nn.Module, units: list[nn.Module] | None) -> list[str]:
    """Module-tree paths of the units: the given modules, or every element of every outermost ModuleList."""
    if units is None:
        paths = []

        def visit(parent: nn.Module, prefix: str) -> None:
            for name, child in parent.named_children():
                if isinstance(child, nn.ModuleList):
                    paths.extend(f"{prefix}{name}.{index}" for index in range(len(child)))
                else:
                    visit(child, f"{prefix}{name}.")

        visit(module, "")
        return paths
    path_of = {id(m): name for name, m in module.named_modules()}
    missing = [type(unit).__name__ for unit in units if id(unit) not in path_of or unit is module]
    if missing:
        raise ValueError(f"units must be submodules of the wrapped module (not the module itself): {missing}")
    paths = [path_of[id(unit)] for unit in units]
    for outer in paths:
        for inner in paths:
            if inner != outer and inner.startswith(outer + "."):
                raise ValueError(f"units must not nest: {inner!r} is inside {outer!r}")
    return paths


def _assign(module: nn.Module, unit_paths: list[str]) -> dict[int, list[tuple[str, nn.Parameter, list]]]:
    """Sharded weights by unit (1 + index into unit_paths; 0 is the root), each with every (module, name) using it,
    in the order of `module.named_parameters()`."""
    order = {id(p): (index, name) for index, (name, p) in enumerate(module.named_parameters())}
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    unit_of: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for path, child in module.named_modules(remove_duplicate=False):
        if not isinstance(child, (nn.Linear, nn.Embedding)):
            continue
        unit = next((i + 1 for i, u in enumerate(unit_paths) if path == u or path.startswith(u + ".")), 0)
        for attribute, param in child._parameters.items():
            if param is None or not param.requires_grad:
                continue
            key = id(param)
            params[key] = param
            known = uses.setdefault(key, [])
            if not any(owner is child and name == attribute for owner, name in known):
                known.append((child, attribute))
            # Used from two units: only the root is gathered whenever either runs.
            unit_of[key] = unit if unit_of.get(key, unit) == unit else 0
    assignment: dict[int, list] = {}
    for key in sorted(params, key=lambda k: order[k][0]):
        assignment.setdefault(unit_of[key], []).append((order[key][1], params[key], uses[key]))
    return assignment


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
