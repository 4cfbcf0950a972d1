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

This leans on triton's internals (3.6): the JIT function returns the compiled kernel it launched, the autotuner
keeps its choice in `best_config`, the heuristics wrapper its rules in `values`, and the JIT function launches with
`kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook,
exit_hook, *arguments)`. tests/test_attention.py checks each of these, so an upgrade that moves one fails a test
(rather than launching wrongly). `DIRECT = False` sends every launch through triton.
"""

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

DIRECT = True
CHECK = False
# Distinct launches kept; past this the table starts over (a program that runs every shape once gains nothing).
MAX_LAUNCHES = 4096

# (kernel, key, constexprs) -> (compiled kernel, (grid_0, grid_1, grid_2), the constexpr arguments after the positional
# ones); with CHECK, also -> (the arguments as triton specializes them, the grid, the meta-parameters)
_launches: dict = {}
_checked: dict = {}


def aligned(*tensors) -> bool:
    """Whether every tensor's address is a multiple of 16 bytes (what triton specializes a pointer on)."""
    return all(x.data_ptr() % 16 == 0 for x in tensors)


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


def launch(kernel, grid, args: tuple, key, **constexprs) -> None:
    """Launches `kernel` (a JIT function, possibly under triton's heuristics and autotuner) on the positional `args`
    and the constexpr keyword arguments `constexprs`, as `kernel[grid](*args, **constexprs)` would. `grid` is a tuple
    or a function of the kernel's arguments by name (the chosen config's meta-parameters included); `key` names the
    launch (see the module docstring: it must fix the arguments' specialization and the grid)."""
    if not DIRECT:
        kernel[grid](*args, **constexprs)
        return
    full_key = (kernel, key, *constexprs.values())
    if CHECK:
        _check(full_key, kernel, grid, args, constexprs)
    known = _launches.get(full_key)
    if known is None:
        known = _first_launch(kernel, grid, args, constexprs)
        if CHECK and full_key not in _checked:
            _checked[full_key] = (tuple(map(_spec, args)), known[1], known[3])
        if known[0] is not None:
            if len(_launches) >= MAX_LAUNCHES:
                _launches.clear()
            _launches[full_key] = known
        return
    compiled, (grid_0, grid_1, grid_2), tail, _ = known
    # What triton's CUDA driver reads: the current device's current stream (a kernel has run, so CUDA is initialized).
    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    hooks = _hooks()
    if hooks is None:
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *tail)
    else:
        metadata = compiled.launch_metadata((grid_0, grid_1, grid_2), stream, *args, *tail)
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, *hooks,
                     *args, *tail)


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


def _first_launch(kernel, grid, args, constexprs):
    """Launches through triton; returns (the compiled kernel, or None when triton did not hand one back (the
    interpreter), the grid, the constexpr arguments after the positional ones, the constexprs and meta-parameters by
    name)."""
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
    return compiled, shape, tuple(values.get(name) for name in names), values
