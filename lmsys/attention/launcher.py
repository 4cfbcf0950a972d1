"""Kernel launches that skip triton's Python wrappers once a launch has been seen.

`kernel[grid](*args, **constexprs)` goes through triton's autotuner, its heuristics and the JIT function: each one
rebuilds dicts of every argument, and the JIT function works out the arguments' specialization and looks up the
compiled kernel, all on every call. That is tens of microseconds per launch, more than a small attention problem
runs on the GPU. `launch` does it once per distinct launch: the first call goes through triton (which tunes,
compiles and launches), and keeps what triton chose (the compiled kernel, the grid of the chosen config, the
constexpr arguments); a later call with the same key hands its arguments straight to the compiled kernel's launcher.

The key holds everything triton specializes a kernel on, and more: the constexprs, each tensor's dtype and whether
its address is 16-byte aligned, a tensor descriptor's dtype, block shape and layout, and the exact value of every
scalar (triton only looks at whether an int is 1 or a multiple of 16; an exact value also fixes the grid, which the
launch computes from the shapes). So a hit launches the kernel triton itself would have launched, on the grid it
would have used.

This leans on triton's internals (3.6): the JIT function returns the compiled kernel it launched, the autotuner
keeps its choice in `best_config`, the heuristics wrapper its rules in `values`, and the JIT function launches with
`kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook,
exit_hook, *arguments)`. tests/test_attention.py checks each of these, so an upgrade that moves one fails a test
(rather than launching wrongly). `DIRECT = False` sends every launch through triton.
"""

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

DIRECT = True
# Distinct launches kept; past this the table starts over (a program that runs every shape once gains nothing).
MAX_LAUNCHES = 4096

# (kernel, key) -> (compiled kernel, (grid_0, grid_1, grid_2), the constexpr arguments after the positional ones)
_launches: dict = {}


def _spec(arg):
    """What of one positional argument the key holds (see the module docstring)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if hasattr(arg, "block_shape"):  # a host-side tensor descriptor (Gluon's or triton's)
        return arg.base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None), getattr(arg, "padding", None)
    return arg


def launch(kernel, grid, args: tuple, **constexprs) -> None:
    """Launches `kernel` (a JIT function, possibly under triton's heuristics and autotuner) on the positional `args`
    and the constexpr keyword arguments `constexprs`, as `kernel[grid](*args, **constexprs)` would. `grid` is a tuple
    or a function of the kernel's arguments by name (the chosen config's meta-parameters included)."""
    if not DIRECT:
        kernel[grid](*args, **constexprs)
        return
    key = (kernel, *map(_spec, args), *constexprs.values())
    known = _launches.get(key)
    if known is None:
        known = _first_launch(kernel, grid, args, constexprs)
        if known is not None:
            if len(_launches) >= MAX_LAUNCHES:
                _launches.clear()
            _launches[key] = known
        return
    compiled, (grid_0, grid_1, grid_2), tail = known
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    enter = knobs.runtime.launch_enter_hook
    metadata = None if enter is None else compiled.launch_metadata((grid_0, grid_1, grid_2), stream, *args, *tail)
    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 knobs.runtime.launch_exit_hook, *args, *tail)


def _first_launch(kernel, grid, args, constexprs):
    """Launches through triton; returns what a later launch with the same key needs, or None when triton did not hand
    back a compiled kernel (the interpreter) or the wrappers are not the ones this module knows."""
    compiled = kernel[grid](*args, **constexprs)
    jit, meta = kernel, {}
    if isinstance(jit, Autotuner):
        meta = jit.best_config.all_kwargs()
        jit = jit.fn
    flags = {}
    if isinstance(jit, Heuristics):
        named = {**dict(zip(jit.arg_names, args)), **constexprs, **meta}
        flags = {name: rule(named) for name, rule in jit.values.items()}
        jit = jit.fn
    if not isinstance(jit, JITFunction) or not hasattr(compiled, "packed_metadata"):
        return None
    values = {**constexprs, **meta, **flags}
    names = jit.arg_names[len(args):]
    if any(name not in values for name in names):
        return None
    shape = grid({**dict(zip(jit.arg_names, args)), **values}) if callable(grid) else grid
    shape = (*shape, 1, 1)[:3]
    return compiled, shape, tuple(values[name] for name in names)
