"""Data parallelism, four ways: each rank holds the whole model, gradients are averaged across ranks.

Every wrapper has torch DDP's contract: the module's parameters are broadcast from rank 0 when it is wrapped,
`.module` is the wrapped module, `forward` calls it, and after `loss.backward()` and
`finish_gradient_synchronization()` every parameter that requires a gradient holds the average of the ranks'
gradients, the same tensor on every rank. Buffers are left alone. Only parameters with `requires_grad` take part;
a parameter shared by several modules (tied weights) counts once. The training loop is the same for all four:

    loss = loss_fn(model(inputs), targets); loss.backward()
    model.finish_gradient_synchronization(); optimizer.step(); optimizer.zero_grad()

The four differ in when and how gradients travel:
    DDPNaive                  after backward, one blocking all-reduce per parameter
    DDPFlat                   after backward, one all-reduce of all gradients in one flat buffer
    DDPIndividualParameters   during backward, an asynchronous all-reduce per parameter as its gradient is ready
    DDPBucketed               during backward, an asynchronous all-reduce per bucket (parameters in reverse order,
                              at most `bucket_size_mb` per bucket) as soon as all its gradients are ready

A parameter that got no gradient on a rank in a backward (unused there, or unused everywhere) counts as a zero
gradient on that rank: every rank then issues the same collectives in the same order (NCCL pairs collectives by
order, so anything else deadlocks or mixes tensors), and the parameter's gradient after synchronization is the
average, a zero tensor when no rank produced one. Torch DDP's `find_unused_parameters=True` would leave the latter
None, at the price of an extra all-reduce of a usage bitmap every step; with plain SGD and AdamW without weight
decay a zero gradient changes nothing, other optimizers may still move such a parameter.

Gradients as bucket views (torch DDP's `gradient_as_bucket_view`, the cheap version): in the flat and bucketed
variants each parameter's `.grad` becomes a view of its slice of a persistent flat buffer. A freshly allocated
gradient (after `zero_grad(set_to_none=True)`) is copied into its slice once; a gradient that already is the view
(after `zero_grad(set_to_none=False)`) is accumulated into in place by autograd and needs no copy. The all-reduce
then runs on the buffer and nothing is copied back. A parameter that fills a bucket alone skips the buffer: its own
`.grad` is all-reduced.

Reducing in a narrower dtype (DDPBucketed's `reduce_dtype`, torch DDP's bf16 compress hook): each bucket travels
in a flat buffer of `reduce_dtype` (half the bytes of fp32 for bf16) instead of the gradients' own dtype. When the
bucket is launched its gradients are cast into the buffer; after the all-reduce the average is cast back into the
gradients themselves, which stay the tensors autograd produced (no views of a buffer). On a GPU both casts run on side
streams, beside the rest of backward rather than between its kernels: one stream casts in (after the current
stream's work so far) and launches the all-reduce, the other waits for the all-reduce and casts back, and
`finish_gradient_synchronization()` makes the current stream wait for both. Elsewhere the cast in runs at launch
and the cast back in `finish_gradient_synchronization()`. The average carries the narrower dtype's rounding (bf16:
a relative error of about 2^-8 per element).

Launch order: all-reduces launched from gradient hooks go out in a fixed order (bucket 0, 1, ...), a bucket
waiting for its predecessors when its gradients happen to be ready first, so that ranks whose backward passes differ
(a parameter unused on one rank only) still agree. Buckets still incomplete at `finish_gradient_synchronization()`
are completed there with zeros and launched in the same order.

Nothing stays in flight when the process group goes, as in lmsys.distributed.fsdp: `finish_gradient_synchronization()`
waits for every all-reduce it or a gradient hook launched; `wait_for_pending_work()` waits for those a backward left
in flight without it (an abandoned step, an error raised in a gradient hook, which calls it first) and drops that
step's synchronization, so that the next backward starts afresh (the gradients that step left are not averaged, and
may hold a partial sum across ranks: zero them first). The module-level `wait_for_pending_work()` does so for every
wrapper alive in the process, and lmsys.distributed.launch calls it before it destroys a rank's process group.
"""

import weakref

import torch
import torch.distributed as dist
from torch import nn

from lmsys.distributed.collectives import broadcast_coalesced

# Every wrapper alive in this process, for the module-level wait_for_pending_work().
_wrappers: "weakref.WeakSet[_DataParallel]" = weakref.WeakSet()


def wait_for_pending_work() -> None:
    """`wait_for_pending_work()` of every DDP wrapper alive in this process: call it before destroying the process
    group."""
    for wrapper in list(_wrappers):
        wrapper.wait_for_pending_work()


class _GradBucket:
    """Some parameters of one dtype and device whose gradients travel in one all-reduce.

    With `reduce_dtype` other than the parameters' dtype, the gradients are cast into one flat buffer of that dtype
    for the all-reduce and the average is cast back into each `.grad` (`compressed`). Otherwise, with `flat`, the
    gradients live in one flat buffer (each `.grad` a view of its slice); without it the bucket holds one parameter
    and its `.grad` is reduced as it is.
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], flat: bool,
                 reduce_dtype: torch.dtype | None = None):
        self.params, self.names = params, names
        self.buffer, self.views = None, None
        first = params[0]
        self.compressed = reduce_dtype is not None and reduce_dtype != first.dtype
        if flat or self.compressed:
            dtype = reduce_dtype if self.compressed else first.dtype
            self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=first.device)
            self.views, offset = [], 0
            for p in params:
                self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
        self.ready: set[int] = set()  # indices into params whose gradient is in place for this step
        self.work: dist.Work | None = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def collect(self, index: int) -> None:
        """Put this rank's gradient of `params[index]` where the all-reduce will read it (zeros when it has none)."""
        param, name = self.params[index], self.names[index]
        if index in self.ready:
            raise RuntimeError(
                f"the gradient of {name!r} became ready twice without finish_gradient_synchronization() in between; "
                "call it after every backward (accumulating over several backward passes is not supported)"
            )
        grad = param.grad
        if grad is not None and grad.is_sparse:
            raise ValueError(f"parameter {name!r} has a sparse gradient; only dense gradients are supported")
        if self.buffer is None:
            if grad is None:
                param.grad = torch.zeros_like(param)
        elif self.compressed:
            if grad is None:
                param.grad = torch.zeros_like(param)
        else:
            view = self.views[index]
            if grad is None:
                view.zero_()
                param.grad = view
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                param.grad = view
        self.ready.add(index)

    def tensor(self) -> torch.Tensor:
        """What the all-reduce reads and writes."""
        return self.buffer if self.buffer is not None else self.params[0].grad

    def gradients(self) -> list[torch.Tensor]:
        """The tensors that hold the average after synchronization (a view of `tensor()` unless compressed)."""
        return [p.grad for p in self.params] if self.compressed else [self.tensor()]

    def pack(self) -> None:
        """Cast the gradients into the buffer (compressed buckets only)."""
        torch._foreach_copy_(self.views, [p.grad for p in self.params])

    def write_back(self) -> None:
        """Cast the reduced buffer back into the gradients (compressed buckets only)."""
        torch._foreach_copy_([p.grad for p in self.params], self.views)


class _DataParallel(nn.Module):
    """What the four variants share: the broadcast at wrap, forward, the buckets and the synchronization."""

    def __init__(self, module: nn.Module, buckets: list[list[tuple[str, nn.Parameter]]], flat: bool, overlap: bool,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialized default process group")
        self.module = module
        self.world_size = dist.get_world_size()
        # gloo and old NCCL lack an averaging all-reduce: sum, then divide after the wait.
        self._average_op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
        with torch.no_grad():
            broadcast_coalesced([p.detach() for p in module.parameters()], src=0)
        self._buckets = [
            _GradBucket([p for _, p in bucket], [name for name, _ in bucket], flat=flat and len(bucket) > 1,
                        reduce_dtype=reduce_dtype)
            for bucket in buckets
        ]
        self._next_launch = 0  # the buckets before it have been launched this step
        # Compressed buckets on a GPU are cast in and launched on one side stream and cast back on another as soon as
        # their all-reduce is done (an averaging all-reduce, so that nothing is left to do after the wait).
        self._pack_stream = self._write_back_stream = None
        compressed = [bucket for bucket in self._buckets if bucket.compressed]
        if compressed and self._average_op == dist.ReduceOp.AVG and compressed[0].buffer.device.type == "cuda":
            device = compressed[0].buffer.device
            self._pack_stream, self._write_back_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self._hook_handles = []
        if overlap:
            # The hooks hold the wrapper weakly: deleting the wrapper removes them instead of keeping it alive.
            this = weakref.ref(self)
            for index, bucket in enumerate(self._buckets):
                for position, param in enumerate(bucket.params):
                    hook = _make_hook(this, index, position)
                    self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))
            weakref.finalize(self, _remove_hooks, self._hook_handles)
        _wrappers.add(self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        return [list(bucket.names) for bucket in self._buckets]

    def finish_gradient_synchronization(self) -> None:
        """Complete and launch every bucket not yet launched, wait for all, and leave the averaged gradients."""
        for bucket in self._buckets[self._next_launch :]:
            for index in range(len(bucket.params)):
                if index not in bucket.ready:
                    bucket.collect(index)
        self._launch_ready()
        for bucket in self._buckets:
            bucket.work.wait()
            if bucket.compressed and not self._on_side_streams(bucket):
                bucket.write_back()
            if self._average_op == dist.ReduceOp.SUM:
                torch._foreach_div_(bucket.gradients(), self.world_size)
            bucket.work = None
            bucket.ready.clear()
        self._join_side_streams()
        self._next_launch = 0

    def wait_for_pending_work(self) -> None:
        """Wait for every all-reduce still in flight and drop the current step's synchronization: the next backward
        starts afresh. After `finish_gradient_synchronization()` nothing is in flight and this does nothing; after a
        backward without it, or an error raised in a gradient hook, it leaves nothing pending before the process group
        is destroyed. The gradients of the dropped step are not averaged (an all-reduce may have summed them in place):
        zero them before the next step."""
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.ready.clear()
        self._join_side_streams()
        self._next_launch = 0

    def _join_side_streams(self) -> None:
        """Make the current stream wait for the side streams' casts and launches (compressed buckets on a GPU)."""
        if self._write_back_stream is not None:
            current = torch.cuda.current_stream(self._write_back_stream.device)
            current.wait_stream(self._pack_stream)
            current.wait_stream(self._write_back_stream)

    def _on_side_streams(self, bucket: _GradBucket) -> bool:
        return bucket.compressed and self._write_back_stream is not None

    def _on_grad_ready(self, bucket_index: int, position: int) -> None:
        bucket = self._buckets[bucket_index]
        try:
            bucket.collect(position)
        except Exception:
            self.wait_for_pending_work()  # nothing left in flight behind the error
            raise
        if bucket.complete and bucket_index == self._next_launch:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, asynchronously, the complete buckets at the head of the launch order."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].complete:
            bucket = self._buckets[self._next_launch]
            if self._on_side_streams(bucket):
                # The side streams wait on the device, never the host: the cast in for what the current stream has
                # computed so far, the cast back for the all-reduce; the current stream goes on with backward.
                self._pack_stream.wait_stream(torch.cuda.current_stream(self._pack_stream.device))
                with torch.cuda.stream(self._pack_stream):
                    bucket.pack()
                    bucket.work = dist.all_reduce(bucket.tensor(), op=self._average_op, async_op=True)
                with torch.cuda.stream(self._write_back_stream):
                    bucket.work.wait()
                    bucket.write_back()
            else:
                if bucket.compressed:
                    bucket.pack()
                bucket.work = dist.all_reduce(bucket.tensor(), op=self._average_op, async_op=True)
            self._next_launch += 1


def _make_hook(this: weakref.ref, bucket_index: int, position: int):
    def hook(param: torch.Tensor) -> None:
        wrapper = this()
        if wrapper is not None:
            wrapper._on_grad_ready(bucket_index, position)

    return hook


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that requires a gradient, once each, in registration order."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _split_by_dtype(named: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    groups: dict[tuple, list] = {}
    for name, p in named:
        groups.setdefault((p.dtype, p.device), []).append((name, p))
    return list(groups.values())


class DDPNaive(_DataParallel):
    """After backward, a blocking all-reduce of each parameter's gradient, in registration order."""

    def __init__(self, module: nn.Module):
        super().__init__(module, [[item] for item in _trainable(module)], flat=False, overlap=False)

    def finish_gradient_synchronization(self) -> None:
        """All-reduce every gradient, one parameter at a time, and average."""
        for bucket in self._buckets:
            bucket.collect(0)
            dist.all_reduce(bucket.tensor(), op=self._average_op)
            if self._average_op == dist.ReduceOp.SUM:
                bucket.tensor().div_(self.world_size)
            bucket.ready.clear()


class DDPFlat(_DataParallel):
    """After backward, one all-reduce of every gradient, flattened into one buffer (one per dtype and device)."""

    def __init__(self, module: nn.Module):
        super().__init__(module, _split_by_dtype(_trainable(module)), flat=True, overlap=False)


class DDPIndividualParameters(_DataParallel):
    """During backward, an asynchronous all-reduce of each parameter's gradient as soon as it is accumulated."""

    def __init__(self, module: nn.Module):
        super().__init__(module, [[item] for item in reversed(_trainable(module))], flat=False, overlap=True)


class DDPBucketed(_DataParallel):
    """During backward, an asynchronous all-reduce per bucket of at most `bucket_size_mb` MiB of gradients.

    Buckets take the parameters in reverse registration order (roughly the order backward produces their
    gradients), one dtype and device per bucket; a parameter larger than the bucket size gets a bucket of its own.
    The size counts the gradients' own bytes. With `reduce_dtype` (e.g. torch.bfloat16 for fp32 gradients), each
    bucket is all-reduced in that dtype and the average cast back into the gradients (module docstring).
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float, reduce_dtype: torch.dtype | None = None):
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise ValueError(f"reduce_dtype must be a floating-point torch.dtype or None, got {reduce_dtype!r}")
        limit = bucket_size_mb * 2**20
        buckets: list[list[tuple[str, nn.Parameter]]] = []
        size = 0
        for name, p in reversed(_trainable(module)):
            nbytes = p.numel() * p.element_size()
            last = buckets[-1][-1][1] if buckets else None
            if last is None or size + nbytes > limit or (p.dtype, p.device) != (last.dtype, last.device):
                buckets.append([])
                size = 0
            buckets[-1].append((name, p))
            size += nbytes
        super().__init__(module, buckets, flat=True, overlap=True, reduce_dtype=reduce_dtype)
        self.bucket_size_mb = bucket_size_mb
        self.reduce_dtype = reduce_dtype
