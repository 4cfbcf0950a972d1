"""What the attention wrappers derive from their inputs' signature, kept per signature and forgotten when a setting
changes.

A call of `flash_triton.forward` or `backward` works out, from the inputs' shapes, strides, dtype, device and alignment,
which kernels run, their grids, launch keys, views and every argument that is not a tensor; then it allocates its
outputs and launches. The working out costs more CPU time than the rest, while the device waits for its launches
(docs/attention.md, "The CPU side of a call"), and a training step repeats the same signatures: each is worked out
once into a plan (a `cache()` dict keyed by the signature), and later calls allocate and launch.

A plan also follows from the modules' settings (`flash_hopper_bwd.FUSED_DQ`, the forward's `HOPPER_FORWARD`, the
launcher's tables, ...), which tests and scripts set. `watch(module)` makes every attribute set or deleted on the module
(`module.X = ...`, monkeypatch's setattr and its undo) forget every plan. Not seen: an assignment inside the module
through `global` (the watched modules make none), a setting changed in place (an item of `flash_hopper_bwd.TILES`:
set the attribute to a new dict instead), and lmsys.attention.launch_order, whose module triton's kernels read and
which therefore stays a plain module.
"""

import sys
import types

# Plans kept per cache; past this a cache starts over (a program that runs every shape once gains nothing).
MAX_PLANS = 1024

_caches: list[dict] = []


def cache() -> dict:
    """A new dict of plans that `forget` empties."""
    plans: dict = {}
    _caches.append(plans)
    return plans


def keep(plans: dict, signature, plan):
    """Stores `plan` under `signature` in `plans` (starting the dict over when full) and returns it."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[signature] = plan
    return plan


def forget() -> None:
    """Forgets every plan (a setting they follow from changed)."""
    for plans in _caches:
        plans.clear()


class _Watched(types.ModuleType):
    # triton records the globals its kernels read, deep-copied, and skips modules by their exact type: a watched module
    # is its own copy.
    def __deepcopy__(self, memo):
        return self

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        forget()

    def __delattr__(self, name):
        super().__delattr__(name)
        forget()


def watch(module_name: str) -> None:
    """Forget every plan whenever an attribute of the module `module_name` is set or deleted from outside it."""
    sys.modules[module_name].__class__ = _Watched
