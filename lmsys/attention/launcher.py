"""Kernel launches that skip triton's Python wrappers once a launch has been seen.

`kernel[grid](*args, **constexprs)` goes through triton's autotuner, its heuristics and the JIT function: each one
rebuilds dicts of every argument, and the JIT function works out the arguments' specialization and looks up the
compiled kernel, all on every call. That is tens of microseconds per launch, more than a small attention problem
runs on the GPU. `launch` does it once per distinct launch: the first call goes through triton (which tunes,
compiles and launches), and keeps what triton chose (the compiled kernel, the grid of the chosen config, the
constexpr arguments); a later call with the same key hands its arguments straight to the compiled kernel's launcher.

The caller names the launch with a key: a hashable that, with the constexprs, fixes everything triton specializes the
kernel on and the grid, and the device (triton compiles per device). Triton looks at each tensor's dtype and whether its
address is 16-byte aligned, and at each int argument (whether it is 1 or a multiple of 16); the caller's key holds the
shapes and strides those ints and the grid come from, the dtype, and the alignment of the tensors it did not allocate
itself (the caching allocator aligns its blocks to 512 bytes). So a hit launches the kernel triton itself would have
launched, on the grid it would have used. `CHECK = True` (the test suite sets it) verifies that on every call: it
records each key's arguments as triton sees them and its grid, and raises when a later call with the same key differs,
naming the kernel.

`launch` returns that kept launch (`Launch`), which a caller may hold and call with later arguments: the wrappers'
plans (lmsys.attention.plans) do, skipping the key's hashing too. It calls the compiled kernel's launcher below
triton's Python layer: what triton's CudaLauncher does (the global scratch a kernel asks for, from triton's allocator)
and what its wrapper for tensor-descriptor arguments does (each descriptor expanded into its encoding, shape and
strides), except that a tensor passed in a descriptor's place is encoded once per address (the first launch's
descriptor over it) and the encoding kept.

This leans on triton's internals (3.6): the JIT function returns the compiled kernel it launched, the autotuner
keeps its choice in `best_config`, the heuristics wrapper its rules in `values`, the JIT function launches with
`kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook,
exit_hook, *arguments)`, and `kernel.run` is a CudaLauncher whose `launch` wraps the compiled launcher as its closure's
`launcher` (driver.wrap_handle_tensordesc). tests/test_attention.py checks each of these (the last by running triton's
CudaLauncher and wrapper beside a `Launch`), so an upgrade that moves one fails a test (rather than launching wrongly).
`DIRECT = False` sends every launch through triton.
"""

import copy

import torch
from triton import knobs
from triton.backends.nvidia.driver import make_tensordesc_arg
from triton.runtime import _allocation
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

from lmsys.attention import plans

DIRECT = True
CHECK = False
# A list to which every launch appends (kernel, constexprs), for tests; None: no tracing.
TRACE = None
# Distinct launches kept; past this the table starts over (a program that runs every shape once gains nothing).
MAX_LAUNCHES = 4096
# Descriptor encodings kept per descriptor argument of a launch (one per address it saw); past this they start over.
MAX_ENCODINGS = 64

# (kernel, key, constexprs) -> its `Launch`; with CHECK, also -> (the arguments as triton specializes them, the grid,
# the meta-parameters)
_launches: dict = {}
_checked: dict = {}


def aligned(*tensors) -> tuple[bool, ...]:
    """Whether each tensor's address is a multiple of 16 bytes (what triton specializes a pointer on)."""
    return tuple(x.data_ptr() % 16 == 0 for x in tensors)


def _spec(arg):
    """One positional argument as far as triton specializes on it (and more: an int's exact value)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if hasattr(arg, "block_shape"):  # a host-side tensor descriptor (Gluon's or triton's)
        return (arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.block_shape), getattr(arg, "layout", None),
                getattr(arg, "padding", None))
    return arg


def _hooks():
    """Triton's launch hooks when any is set (a profiler's), else None: an empty hook chain costs a call per launch."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
        return enter, leave
    return None


def launch(kernel, grid, args: tuple, key, **constexprs) -> "Launch | None":
    """Launches `kernel` (a JIT function, possibly under triton's heuristics and autotuner) on the positional `args`
    and the constexpr keyword arguments `constexprs`, as `kernel[grid](*args, **constexprs)` would. `grid` is a tuple
    or a function of the kernel's arguments by name (the chosen config's meta-parameters included); `key` names the
    launch (see the module docstring: it must fix the arguments' specialization and the grid). Returns the `Launch`
    that later launches under this key take (a caller may keep it and call it), or None when there is none (the
    interpreter, or DIRECT off)."""
    if TRACE is not None:
        TRACE.append((kernel, constexprs))
    if not DIRECT:
        kernel[grid](*args, **constexprs)
        return None
    full_key = (kernel, key, *constexprs.values())
    if CHECK:
        _check(full_key, kernel, grid, args, constexprs)
    known = _launches.get(full_key)
    if known is None:
        known = _first_launch(kernel, grid, args, key, constexprs)
        if CHECK and full_key not in _checked:
            _checked[full_key] = (tuple(map(_spec, args)), known.grid_shape, known.values)
        if not known.direct:
            return None
        if len(_launches) >= MAX_LAUNCHES:
            _launches.clear()
        _launches[full_key] = known
        return known
    known.run(args)
    return known


class Pending:
    """A launch not made yet: `pending(args)` launches through `launch` and returns what a later call takes in its
    place, the `Launch` that `launch` kept, or itself where there is none (the interpreter, DIRECT off): a caller keeps
    `launch_ = launch_(args)`."""

    __slots__ = ("kernel", "grid", "key", "constexprs")

    def __init__(self, kernel, grid, key, **constexprs):
        self.kernel, self.grid, self.key, self.constexprs = kernel, grid, key, constexprs

    def __call__(self, args: tuple) -> "Launch | Pending":
        kept = launch(self.kernel, self.grid, args, self.key, **self.constexprs)
        return self if kept is None else kept


class Launch:
    """A launch that triton has made once: `launch_ = launch(kernel, grid, args, key, **constexprs)`, then
    `launch_(args)` launches the same kernel on the same grid with new arguments of the same specialization, straight
    to the compiled kernel's launcher. With CHECK it first checks the arguments as `launch` does; with DIRECT off it
    launches through triton.

    Tensor descriptors: in the place of a descriptor argument, a call may pass a tensor instead, meaning the descriptor
    of the first launch over that tensor (its shape, strides, block shape and layout, over the new base); the launch's
    key must then fix those. triton encodes each descriptor it is given (cuTensorMapEncodeTiled, and a Python loop over
    every argument); a tensor in a descriptor's place is encoded once per address and the encoding kept."""

    def __init__(self, kernel, grid, key, constexprs, compiled, grid_shape, tail, values, args):
        self.kernel, self.grid, self.key, self.constexprs = kernel, grid, key, constexprs
        self.full_key = (kernel, key, *constexprs.values())
        self.grid_shape, self.tail, self.values = grid_shape, tail, values
        self.descriptors = ()
        launcher = compiled.run if compiled is not None else None
        # Triton's profiling scratch (proton's instrumentation) is left to triton's own launch path.
        self.direct = launcher is not None and not getattr(launcher, "profile_scratch_size", 0)
        if not self.direct:
            return
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata
        self.flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
        grid_size = grid_shape[0] * grid_shape[1] * grid_shape[2] * launcher.num_ctas
        self.scratch = ((grid_size * launcher.global_scratch_size, launcher.global_scratch_align)
                        if launcher.global_scratch_size > 0 else None)
        self.compiled = compiled
        # The positions of the descriptor arguments, as triton's wrap_handle_tensordesc finds them, and their
        # encoding metadata; each with the first launch's descriptor and the encodings kept by address.
        positions = [i for i, ty in enumerate(compiled.src.signature.values())
                     if isinstance(ty, str) and ty.startswith("tensordesc")]
        if positions and max(positions) >= len(args):
            self.direct = False  # a descriptor among the constexprs: not a launch this class makes
        elif positions:
            metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(positions)
            # The first launch's descriptors, without their tensors (which a template would keep alive).
            self.descriptors = tuple((i, _rebased(args[i], None), meta, {}) for i, meta in zip(positions, metas))
            self.raw = raw_launcher(launcher.launch)
        else:
            self.raw = launcher.launch

    def __call__(self, args: tuple) -> "Launch":
        """Launches on `args`; returns itself (a caller keeps what a launch returns)."""
        if TRACE is not None:
            TRACE.append((self.kernel, self.constexprs))
        if CHECK or not DIRECT:
            described = self._described(args)
            if not DIRECT:
                self.kernel[self.grid](*described, **self.constexprs)
                return self
            _check(self.full_key, self.kernel, self.grid, described, self.constexprs)
        self.run(args)
        return self

    def _described(self, args: tuple) -> tuple:
        """args with each tensor in a descriptor's place replaced by the first launch's descriptor over it."""
        args = list(args)
        for i, template, _, _ in self.descriptors:
            if isinstance(args[i], torch.Tensor):
                args[i] = _rebased(template, args[i])
        return tuple(args)

    def run(self, args: tuple) -> None:
        """The launch itself: what triton's CudaLauncher does for the compiled kernel, the descriptors' encodings
        kept by address for tensors passed in their place, and the launch hooks when a profiler set them."""
        grid_0, grid_1, grid_2 = self.grid_shape
        # What triton's CUDA driver reads: the current device's current stream (a kernel has run, so CUDA is
        # initialized).
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        scratch = None
        if self.scratch is not None:
            scratch = _allocation._allocator.get()(self.scratch[0], self.scratch[1], stream)
        hooks = _hooks()
        metadata = None
        if hooks is not None:
            metadata = self.compiled.launch_metadata(self.grid_shape, stream, *args, *self.tail)
        else:
            hooks = (None, None)
        if self.descriptors:
            args = list(args)
            for i, first, meta, encoded in reversed(self.descriptors):  # from the last: the positions stay true
                arg = args[i]
                if isinstance(arg, torch.Tensor):
                    expanded = encoded.get(arg.data_ptr())
                    if expanded is None:
                        expanded = make_tensordesc_arg(_rebased(first, arg), meta)
                        if meta is not None:  # an encoding, which holds no tensor (without meta: the tensor itself)
                            if len(encoded) >= MAX_ENCODINGS:
                                encoded.clear()
                            encoded[arg.data_ptr()] = expanded
                else:
                    expanded = make_tensordesc_arg(arg, meta)
                args[i:i + 1] = expanded
        self.raw(grid_0, grid_1, grid_2, stream, self.function, *self.flags, scratch, None, self.packed_metadata,
                 metadata, *hooks, *args, *self.tail)


def _rebased(descriptor, base):
    """`descriptor` over `base` (same shape, strides, block shape and layout)."""
    rebased = copy.copy(descriptor)
    rebased.base = base
    return rebased


def raw_launcher(launch_fn):
    """The compiled launcher under triton's wrapper for descriptor arguments (wrap_handle_tensordesc's `inner`, which
    expands each descriptor into its encoding, shape and strides): the `launcher` of its closure."""
    names = launch_fn.__code__.co_freevars
    return launch_fn.__closure__[names.index("launcher")].cell_contents


def _unwrapped(kernel):
    """(the JIT function under triton's wrappers, the autotuner or None, the heuristics or None)."""
    autotuner = kernel if isinstance(kernel, Autotuner) else None
    jit = kernel.fn if autotuner else kernel
    heuristics = jit if isinstance(jit, Heuristics) else None
    return (jit.fn if heuristics else jit), autotuner, heuristics


def _grid(grid, jit, args, values):
    shape = grid({**dict(zip(jit.arg_names, args)), **values}) if callable(grid) else grid
    return (*shape, 1, 1)[:3]


def _check(full_key, kernel, grid, args, constexprs):
    """With CHECK: a key seen before must come with the same specialization and grid (an error naming the kernel)."""
    seen = _checked.get(full_key)
    if seen is None:
        return
    spec, shape, values = seen
    jit = _unwrapped(kernel)[0]
    now_spec, now_shape = tuple(map(_spec, args)), _grid(grid, jit, args, values)
    if (now_spec, now_shape) != (spec, shape):
        raise AssertionError(
            f"launcher key {full_key[1:]!r} of {jit.__name__} does not fix its launch: first seen with arguments "
            f"{spec} on grid {shape}, now {now_spec} on grid {now_shape}"
        )


def _first_launch(kernel, grid, args, key, constexprs) -> Launch:
    """Launches through triton; returns the `Launch` for later calls (not `direct` when triton did not hand back a
    compiled kernel that can be called so: the interpreter)."""
    compiled = kernel[grid](*args, **constexprs)
    jit, autotuner, heuristics = _unwrapped(kernel)
    meta = autotuner.best_config.all_kwargs() if autotuner else {}
    flags = {}
    if heuristics:
        named = {**dict(zip(heuristics.arg_names, args)), **constexprs, **meta}
        flags = {name: rule(named) for name, rule in heuristics.values.items()}
    values = {**constexprs, **meta, **flags}
    names = jit.arg_names[len(args):]
    shape = _grid(grid, jit, args, values)
    usable = isinstance(jit, JITFunction) and hasattr(compiled, "packed_metadata")
    if not usable or any(name not in values for name in names):
        compiled = None
    return Launch(kernel, grid, key, constexprs, compiled, shape, tuple(values.get(name) for name in names), values,
                  args)


plans.watch(__name__)
