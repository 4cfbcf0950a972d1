"""AdamW (Loshchilov & Hutter, 2019), the optimizer of the training step; `torch.optim.AdamW` is its reference.

Per parameter p with gradient g, at step t (from 1; a parameter that had no gradient at a step keeps its own t):
    p <- p * (1 - lr * weight_decay)                      decoupled weight decay
    m <- beta1 m + (1 - beta1) g,   v <- beta2 v + (1 - beta2) g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Two implementations of that update, with the same results:
- fused (the default for CUDA tensors): one Triton kernel launch per device and dtype per step, over every
  parameter of every group. The update is memory-bound: it reads p, g, m, v and writes p, m, v, 28 bytes per fp32
  parameter, and the kernel touches each of them once. Tensors are cut into chunks of CHUNK elements, one program
  per chunk (multi_tensor_apply's scheme in torch's `_fused_adamw_`): a chunk table (tensor index, first element)
  is built once per set of tensor sizes and kept on the device; each step copies a small table with every tensor's
  four addresses, size and per-tensor coefficients (its group's hyper-parameters, its own step), staged in pinned
  memory so that the copy does not wait for the device (the host runs ahead into the next step). Loads are
  vectorized when every address is 16-byte aligned. The host's work per step is what a step without CUDA graphs
  waits for, so a step that finds everything as the last one left it (same parameters, storages, state and
  gradient layouts: the training loop's usual case) reuses that step's table and rewrites only the gradients'
  addresses and the coefficients (`_Plan`). Under TRITON_INTERPRET=1 the kernel also runs on CPU tensors,
  when asked for with `fused=True` (slow: for tests).
- foreach (the default elsewhere, `fused=False`): a few `torch._foreach_*` calls per dtype and device.

Parameters and their state are float32 (or float64); bf16/fp16 parameters are refused (keep fp32 master weights and
use autocast), except those made by `keep_master_weights`: an fp32 parameter becomes bf16 in place and its fp32
values move into the optimizer's state as a master weight. Its update reads the bf16 gradient (upcast), updates the
master and the moments in fp32, and writes the master's bf16 rounding back into the parameter in the same pass (in
the fused kernel, in the same launch as the fp32 parameters). Under bf16 autocast the training step is then the one
with fp32 weights, to the bit: autocast would cast the fp32 weight to that same bf16 value in every forward, and
its fp32 gradient is the upcast of the same bf16 gradient. Per parameter and step this saves the cast (4 bytes read,
2 written) and the fp32 copy of the gradient (4 written, and 4 read by the optimizer instead of 2), for 2 bytes
more written by the optimizer. Everything a step needs is validated before any tensor changes: a bad group,
gradient or state raises with nothing updated.
"""

import array
import contextlib
import math
import operator
import struct
from collections import defaultdict

import torch
import triton
import triton.language as tl

CHUNK = 32768  # elements per program
BLOCK = 2048  # elements per iteration of a program
# Four elements of each tensor per thread: the kernel needs about 60 registers and does not spill. Blocks of 4096
# over 8 warps need 255 and spill, and run at 3.4 of the H200's 4.1 TB/s (docs/training-step.md, "The fused AdamW
# kernel's launch configuration").
NUM_WARPS = 16
_INTERPRET = triton.knobs.runtime.interpret
_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
# The per-step tensor table has a row of _ROW int64 per tensor: the addresses of param, grad, exp_avg, exp_avg_sq,
# the size, then _COEFFICIENTS floats stored as the bits of float64s (the kernel's columns 5 to 11), then the address
# of a bf16 parameter whose fp32 master is at column 0 (column 12, _COPY_COLUMN; 0 for a parameter without a
# master), then zeros.
_ROW = 16
_COEFFICIENTS = ("decay", "step_size", "bc2_sqrt", "weight1", "beta2", "weight2", "eps")
_COPY_COLUMN = 12
_ADDRESSES = [0, 1, 2, 3, _COPY_COLUMN]
_PADDING = (0,) * (_ROW - _COPY_COLUMN - 1)


@triton.jit
def _to_bf16(x):
    """fp32 to bf16, rounded to nearest even as torch rounds, on the bits: the same on the GPU and under the
    interpreter (whose float casts truncate). NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_block(param, grad, exp_avg, exp_avg_sq, copy, offs, mask, decay, step_size, bc2_sqrt, weight1, beta2,
                 weight2, eps, MASKED: tl.constexpr, COPY: tl.constexpr):
    """The update of elements `offs` of one tensor; with COPY, `param` is the fp32 master of a bf16 parameter:
    `grad` is bf16 and the updated values are also stored, rounded, to `copy` (the parameter)."""
    if MASKED:
        p = tl.load(param + offs, mask=mask)
        g = tl.load(grad + offs, mask=mask).to(p.dtype)
        m = tl.load(exp_avg + offs, mask=mask)
        v = tl.load(exp_avg_sq + offs, mask=mask)
    else:
        p = tl.load(param + offs)
        g = tl.load(grad + offs).to(p.dtype)
        m = tl.load(exp_avg + offs)
        v = tl.load(exp_avg_sq + offs)
    # Each operation rounded as torch.optim.AdamW's rounds it (its foreach and single-tensor paths on the CPU):
    # p *= 1 - lr wd;  m.lerp_(g, 1 - beta1);  v = v beta2 + ((1 - beta2) g) g;  p += (-step_size m) / denom.
    p = p * decay
    if weight1 < 0.5:
        m = m + weight1 * (g - m)
    else:
        m = g - (g - m) * (1 - weight1)
    v = v * beta2 + weight2 * g * g
    if p.dtype == tl.float32:  # correctly rounded square root and divisions (Triton's defaults are approximate)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
    else:
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * m / denom
    if MASKED:
        tl.store(param + offs, p, mask=mask)
        tl.store(exp_avg + offs, m, mask=mask)
        tl.store(exp_avg_sq + offs, v, mask=mask)
        if COPY:
            tl.store(copy + offs, _to_bf16(p), mask=mask)
    else:
        tl.store(param + offs, p)
        tl.store(exp_avg + offs, m)
        tl.store(exp_avg_sq + offs, v)
        if COPY:
            tl.store(copy + offs, _to_bf16(p))


@triton.jit
def _adamw_chunk(param, grad, exp_avg, exp_avg_sq, copy, start, end, decay, step_size, bc2_sqrt, weight1, beta2,
                 weight2, eps, BLOCK: tl.constexpr, COPY: tl.constexpr):
    """Elements [start, end) of one tensor: whole blocks without a mask (a mask on an unknown length would keep the
    loads from being vectorized), then the ragged tail of the tensor with one."""
    full_end = start + (end - start) // BLOCK * BLOCK
    offs = tl.arange(0, BLOCK)
    for lo in range(start, full_end, BLOCK):
        lo = tl.multiple_of(lo, BLOCK)
        _adamw_block(param, grad, exp_avg, exp_avg_sq, copy, lo + offs, None, decay, step_size, bc2_sqrt, weight1,
                     beta2, weight2, eps, False, COPY)
    if full_end < end:
        _adamw_block(param, grad, exp_avg, exp_avg_sq, copy, full_end + offs, full_end + offs < end, decay,
                     step_size, bc2_sqrt, weight1, beta2, weight2, eps, True, COPY)


@triton.jit
def _pointer(row, column, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    pointer = tl.load(row + column).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _coefficient(row, column, DTYPE: tl.constexpr):
    return tl.load(row + column).to(tl.float64, bitcast=True).to(DTYPE)


@triton.jit
def _adamw_kernel(TENSORS, CHUNKS, ROW: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """One program per chunk: elements [start, start + CHUNK) of tensor `index` (CHUNKS holds (index, start) pairs);
    TENSORS holds a row of ROW int64 per tensor (the column constants above)."""
    chunk = tl.program_id(0).to(tl.int64)
    index = tl.load(CHUNKS + 2 * chunk)
    start = tl.multiple_of(tl.load(CHUNKS + 2 * chunk + 1), CHUNK)
    row = TENSORS + index * ROW
    param = _pointer(row, 0, DTYPE, ALIGNED)
    exp_avg = _pointer(row, 2, DTYPE, ALIGNED)
    exp_avg_sq = _pointer(row, 3, DTYPE, ALIGNED)
    end = tl.minimum(start + CHUNK, tl.load(row + 4))
    decay = _coefficient(row, 5, DTYPE)
    step_size = _coefficient(row, 6, DTYPE)
    bc2_sqrt = _coefficient(row, 7, DTYPE)
    weight1 = _coefficient(row, 8, DTYPE)
    beta2 = _coefficient(row, 9, DTYPE)
    weight2 = _coefficient(row, 10, DTYPE)
    eps = _coefficient(row, 11, DTYPE)
    # A bf16 parameter with its master (a bf16 gradient, and a copy to write) or a parameter of DTYPE: the same
    # branch for the whole program, so it costs one test per chunk. Masters are fp32, so a float64 table compiles
    # without the bf16 branch (whose rounding works on fp32 bits).
    if DTYPE == tl.float32 and tl.load(row + 12) != 0:
        _adamw_chunk(param, _pointer(row, 1, tl.bfloat16, ALIGNED), exp_avg, exp_avg_sq,
                     _pointer(row, 12, tl.bfloat16, ALIGNED), start, end, decay, step_size, bc2_sqrt,
                     weight1, beta2, weight2, eps, BLOCK, True)
    else:
        _adamw_chunk(param, _pointer(row, 1, DTYPE, ALIGNED), exp_avg, exp_avg_sq, param, start, end, decay,
                     step_size, bc2_sqrt, weight1, beta2, weight2, eps, BLOCK, False)


def _coefficient_bits(group: dict, step: int) -> tuple[int, ...]:
    """Columns 5 to 11 of a tensor's table row at `step` in `group`: the _COEFFICIENTS as the bits of float64s."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    # In float64 here, as torch computes them in Python: 1 - beta2 in fp32 from fp32(0.999) would be off by 1.3e-5.
    floats = (1.0 - lr * group["weight_decay"], lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), 1.0 - beta1,
              beta2, 1.0 - beta2, group["eps"])
    return struct.unpack(f"{len(floats)}q", struct.pack(f"{len(floats)}d", *floats))


def _fused_runs_on(device: torch.device) -> bool:
    # Under the interpreter the kernel reads host memory at the addresses in its tables: CPU tensors only.
    return device.type == "cpu" if _INTERPRET else device.type == "cuda"


def _check_hyperparameters(group: dict) -> None:
    """A ValueError naming the first invalid hyper-parameter or unsupported option of `group`."""
    lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr must be a Python float, got a tensor (tensor learning rates are not supported)")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
            isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag):
            raise ValueError(f"AdamW does not support {flag}=True")


def _check_param(param: torch.Tensor, where: str) -> None:
    if param.dtype not in _DTYPES:
        raise ValueError(
            f"AdamW: {where} is {param.dtype}; parameters must be float32 (or float64): keep fp32 master weights "
            "and run the model under autocast, or make bf16 parameters of fp32 ones with keep_master_weights"
        )


def _step_count(step, where: str) -> int:
    """A saved step count (an int, or torch's 0-dim tensor) as an int; a ValueError if it is not one."""
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0 or step != int(step):
        raise ValueError(f"AdamW: {where} has step {step!r}, not a non-negative integer")
    return int(step)


def _state_fits(param: torch.Tensor, state: dict, fused: bool) -> bool:
    """Whether `state` holds an int step and both moments with param's shape, dtype and device (contiguous if
    `fused`), or, for a bf16 parameter, an fp32 master of its shape and device and fp32 moments: the per-step check,
    which `_check_state` explains when it fails."""
    step, m, v, master = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq"), state.get("master")
    shape, dtype, device = param.shape, param.dtype, param.device
    if master is not None:
        if not (isinstance(master, torch.Tensor) and dtype is torch.bfloat16 and master.dtype is torch.float32
                and master.shape == shape and master.device == device and (not fused or master.is_contiguous())):
            return False
        dtype = master.dtype
    return (
        type(step) is int and step >= 0 and isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)
        and m.shape == shape and v.shape == shape and m.dtype == dtype and v.dtype == dtype
        and m.device == device and v.device == device and (not fused or m.is_contiguous() and v.is_contiguous())
    )


def _check_state(param: torch.Tensor, state: dict, where: str, fused: bool = False, placement: bool = True) -> None:
    """A ValueError unless `state` is empty or holds a step count and both moments of param's shape (and, with
    `placement`, its dtype and device; contiguous if `fused`). A state with a master weight holds it and the moments
    in fp32, of param's shape, and (with `placement`) belongs to a bf16 parameter on the master's device."""
    if not state:
        return
    _step_count(state.get("step"), where)
    dtype = param.dtype
    if "master" in state:
        master = state["master"]
        if not (isinstance(master, torch.Tensor) and master.dtype == torch.float32 and master.shape == param.shape):
            raise ValueError(f"AdamW: {where} has a master weight that is not an fp32 tensor of its shape")
        if placement and (param.dtype != torch.bfloat16 or master.device != param.device):
            raise ValueError(
                f"AdamW: {where} has a master weight on {master.device} for a parameter of {param.dtype} on "
                f"{param.device}; only bf16 parameters have one, on their device"
            )
        if fused and not master.is_contiguous():
            raise ValueError(f"AdamW: {where} has a non-contiguous master weight; the fused update needs contiguous "
                             "state")
        dtype = torch.float32
    for key in ("exp_avg", "exp_avg_sq"):
        moment = state.get(key)
        if not isinstance(moment, torch.Tensor):
            raise ValueError(f"AdamW: {where} has no {key} in its state")
        if moment.shape != param.shape or placement and (moment.dtype != dtype or moment.device != param.device):
            raise ValueError(
                f"AdamW: {where} has {key} of shape {tuple(moment.shape)}, {moment.dtype}, {moment.device} for a "
                f"parameter of shape {tuple(param.shape)}, {param.dtype}, {param.device}"
            )
        if fused and not moment.is_contiguous():
            raise ValueError(f"AdamW: {where} has a non-contiguous {key}; the fused update needs contiguous state")


def _explain(param: torch.Tensor, grad: torch.Tensor, state: dict | None, fused: bool, where: str) -> None:
    """Raise the ValueError that names what is wrong with updating `param` from `grad` and `state`."""
    if not (state and "master" in state):
        _check_param(param, where)
    if grad.is_sparse:
        raise ValueError(f"AdamW does not support sparse gradients ({where})")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise ValueError(
            f"AdamW: {where} has a gradient of shape {tuple(grad.shape)}, {grad.dtype}, {grad.device} for a "
            f"parameter of {param.dtype} on {param.device}"
        )
    if fused and not _fused_runs_on(param.device):
        raise ValueError(
            f"AdamW(fused=True) runs a Triton kernel: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; {where} "
            f"is on {param.device}" + (" under the interpreter" if _INTERPRET else "")
        )
    if fused and not param.is_contiguous():
        raise ValueError(f"AdamW: {where} is not contiguous; the fused update needs contiguous parameters")
    _check_state(param, state, where, fused)
    if state:
        state["step"] = _step_count(state["step"], where)  # a tensor step (set by hand) is fine once it is an int


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction; same hyper-parameters and results as torch's.

    `fused=None` runs the Triton kernel on CUDA tensors and torch's foreach ops elsewhere; `fused=True` asks for the
    kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), `fused=False` for the foreach ops. `amsgrad` and
    `maximize` exist only to be refused clearly.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        fused: bool | None = None,
        amsgrad: bool = False,
        maximize: bool = False,
    ):
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        weight_decay=weight_decay)
        _check_hyperparameters({**defaults, "amsgrad": amsgrad, "maximize": maximize})
        self.fused = fused
        self._chunk_tables = {}  # (device, dtype) -> (tensor sizes, device chunk table)
        self._checked, self._checked_under = {}, None  # see _validated_buckets
        self._plan = None  # the last step's fused launch, while it can be repeated (see _Plan)
        super().__init__(params, defaults)

    def __getstate__(self):
        return {**super().__getstate__(), "fused": self.fused}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # torch's load_state_dict calls this with the groups and state only: the implementation choice stays.
        self.fused = state.get("fused", getattr(self, "fused", None))
        self._chunk_tables = {}
        self._checked, self._checked_under = {}, None
        self._plan = None

    def add_param_group(self, param_group: dict) -> None:
        """torch's `add_param_group`, after checking the group's hyper-parameters and parameter dtypes."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_hyperparameters({**self.defaults, **param_group})
        for param in params:
            if isinstance(param, torch.Tensor):
                _check_param(param, f"a parameter of shape {tuple(param.shape)}")
        super().add_param_group({**param_group, "params": params})
        self._plan = None

    @torch.no_grad()
    def keep_master_weights(self, params) -> None:
        """Store each of `params` (fp32 parameters of this optimizer) in bf16 from now on, in place, with its fp32
        values kept in the optimizer's state as its master weight (`state["master"]`).

        The parameter object stays the same (`param.data` becomes bf16; its gradient, if any, is cleared), so a
        model holding it computes in bf16 without a cast per forward and produces bf16 gradients. Each step reads
        the bf16 gradient, updates the master and the fp32 moments as it would an fp32 parameter, and writes the
        master's rounding to bf16 into the parameter, at the same address (valid for CUDA graphs). The parameter's
        values equal bf16(master) at all times, as autocast's cast of an fp32 weight would; nothing changes when
        a parameter is refused.
        """
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        ours = {id(param) for group in self.param_groups for param in group["params"]}
        for position, param in enumerate(params):
            where = f"parameter {position} (shape {tuple(param.shape)})" if isinstance(param, torch.Tensor) else \
                f"parameter {position}"
            if not isinstance(param, torch.Tensor) or id(param) not in ours:
                raise ValueError(f"keep_master_weights: {where} is not a parameter of this optimizer")
            if param.dtype != torch.float32:
                raise ValueError(f"keep_master_weights: {where} is {param.dtype}, not float32")
            _check_state(param, self.state.get(param, {}), where)
        if len({id(param) for param in params}) != len(params):
            raise ValueError("keep_master_weights: a parameter is listed twice")
        for param in params:
            state = self.state[param]
            master = param.detach().clone(memory_format=torch.contiguous_format)
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(master)
                state["exp_avg_sq"] = torch.zeros_like(master)
            state["master"] = master
            param.grad = None
            param.data = master.to(torch.bfloat16)
        self._plan = None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's `load_state_dict`, after checking every group and every parameter's state against this
        optimizer's parameters (nothing changes when something does not fit); steps are kept as ints."""
        saved_groups, masters = state_dict["param_groups"], []
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer {len(self.param_groups)}"
            )
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"loaded group {index} has {len(saved['params'])} parameters, this optimizer's "
                    f"{len(group['params'])}"
                )
            _check_hyperparameters({**saved, "params": None})
            for position, (param, key) in enumerate(zip(group["params"], saved["params"], strict=True)):
                # torch's load_state_dict moves the moments to the parameter's dtype and device, so only shapes matter
                # (the state of a bf16 parameter, kept in fp32, is put back below).
                where = f"parameter {position} of group {index} (shape {tuple(param.shape)})"
                saved_state = state_dict["state"].get(key, {})
                _check_state(param, saved_state, where, placement=False)
                if (param.dtype == torch.bfloat16) != ("master" in saved_state):
                    raise ValueError(
                        f"loaded state of {where} has {'a' if 'master' in saved_state else 'no'} master weight for "
                        f"a {param.dtype} parameter (bf16 parameters have one: call keep_master_weights first)"
                    )
                if "master" in saved_state:
                    masters.append((param, saved_state))
        super().load_state_dict(state_dict)
        for param, saved_state in masters:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                self.state[param][key] = saved_state[key].to(device=param.device, dtype=torch.float32).contiguous()
        for state in self.state.values():
            if "step" in state:
                state["step"] = _step_count(state["step"], "a loaded state")
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].contiguous()

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns `closure()` if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._plan is not None and self._plan.repeat(self):
            return loss
        self._plan = None
        buckets, checked = self._validated_buckets()
        # Nothing has changed so far; from here on nothing raises.
        launches = []
        for (device, dtype, fused), items in buckets.items():
            for item in items:
                group, param, grad, state, fresh = item
                if not state:
                    state = item[3] = self.state[param]
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                if fresh:
                    checked[id(param)] = (param.data_ptr(), param.dtype, state["exp_avg"], state["exp_avg_sq"],
                                          param.shape, param.get_device(), (device, dtype, fused), param,
                                          state.get("master"))
                state["step"] += 1
            if fused:
                launches.append(self._fused_update(device, dtype, items))
            else:
                _foreach_update(device, dtype, items)
        self._checked = checked
        if len(buckets) == 1 and len(launches) == 1 and launches[0] is not None:
            self._plan = _Plan.of(self, *next(iter(buckets)), launches[0])
        return loss

    def _validated_buckets(self) -> tuple[dict, dict]:
        """Every parameter with a gradient, checked, as {(device, dtype, fused): [[group, param, grad, state or None,
        fresh]]}; and what is known of the checked parameters, for the next step.

        The host runs this for every parameter at every step, so a parameter checked at an earlier step whose storage,
        dtype and state are still the ones checked then (`self._checked`) has only its new gradient checked (layout,
        dtype, shape, device); anything else gets every check, and `fresh` asks step() to remember it."""
        known_under = (_INTERPRET, self.fused)
        previous = self._checked if self._checked_under == known_under else {}
        self._checked_under = known_under
        checked, buckets, state_of = {}, {}, self.state
        for index, group in enumerate(self.param_groups):
            _check_hyperparameters(group)
            for position, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                state = state_of.get(param)
                known = previous.get(id(param))
                if (
                    known is not None and known[7] is param and state is not None and known[0] == param.data_ptr()
                    and param.dtype is known[1] and state.get("exp_avg") is known[2]
                    and state.get("exp_avg_sq") is known[3] and state.get("master") is known[8]
                    and type(step := state.get("step")) is int and step >= 0
                    and grad.layout is torch.strided and grad.dtype is known[1] and grad.shape == known[4]
                    and grad.get_device() == known[5]
                ):
                    checked[id(param)] = known
                    key, fresh = known[6], False
                else:
                    key, fresh = self._check(param, grad, state, index, position), True
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = []
                bucket.append([group, param, grad, state, fresh])
        return buckets, checked

    def _check(self, param: torch.Tensor, grad: torch.Tensor, state: dict | None, index: int, position: int) -> tuple:
        """Every check of updating `param` (parameter `position` of group `index`) from `grad` and `state`; its
        bucket, (device, dtype, fused), where dtype is that of its state (fp32 for a bf16 parameter with a master)."""
        fused = self.fused if self.fused is not None else param.device.type == "cuda" and not _INTERPRET
        master = state.get("master") if state else None
        # The cheap test of the usual case first; the checks that name the problem only when it fails.
        if not (
            (param.dtype in _DTYPES or master is not None) and not grad.is_sparse and grad.shape == param.shape
            and grad.dtype == param.dtype and grad.device == param.device
            and (not fused or param.is_contiguous() and _fused_runs_on(param.device))
            and (not state or _state_fits(param, state, fused))
        ):
            _explain(param, grad, state, fused, f"parameter {position} of group {index} (shape {tuple(param.shape)})")
        return param.device, param.dtype if master is None else master.dtype, fused

    def _fused_update(self, device: torch.device, dtype: torch.dtype, items: list) -> torch.Tensor | None:
        """One kernel launch over `items` (same device and state dtype; a bf16 parameter with a master is updated
        through it, column 0, and gets its rounding written back, column 12); returns its table (CPU, before
        pinning), or None when no launch was needed or a gradient had to be made contiguous for it."""
        rows, sizes, grads = [], [], []
        last = None  # (group, step) of the previous tensor, and its row tail: usually shared by a whole group
        for group, param, grad, state, _ in items:
            numel = param.numel()
            if numel == 0:
                continue
            if not grad.is_contiguous():
                grad = grad.contiguous()
                grads.append(grad)  # alive until the launch
            step = state["step"]
            if last is None or last[0] is not group or last[1] != step:
                last = group, step, _coefficient_bits(group, step)
            master = state.get("master")
            rows += ((param if master is None else master).data_ptr(), grad.data_ptr(), state["exp_avg"].data_ptr(),
                     state["exp_avg_sq"].data_ptr(), numel, *last[2], 0 if master is None else param.data_ptr(),
                     *_PADDING)
            sizes.append(numel)
        if not sizes:
            return None
        table = torch.frombuffer(array.array("q", rows), dtype=torch.int64).view(len(sizes), _ROW)
        self._launch(device, dtype, table, self._chunk_table(device, dtype, sizes),
                     bool((table[:, _ADDRESSES] % 16 == 0).all()))
        return None if grads else table

    @staticmethod
    def _launch(device: torch.device, dtype: torch.dtype, table: torch.Tensor, chunks: torch.Tensor,
                aligned: bool) -> None:
        """The kernel over the tensors of `table` (on the CPU) and the chunks of `chunks` (on `device`)."""
        if device.type == "cuda":
            # Staged in pinned memory: a copy from pageable memory would wait for the device to finish all queued
            # work (the forward and backward of the step), so the host could not run ahead into the next step. The
            # caching host allocator keeps the pinned block until the copy that reads it has finished.
            table = table.pin_memory()
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _adamw_kernel[(chunks.shape[0],)](
                table.to(device, non_blocking=True), chunks,
                ROW=_ROW, CHUNK=CHUNK, BLOCK=BLOCK, DTYPE=_DTYPES[dtype], ALIGNED=aligned, num_warps=NUM_WARPS,
            )

    def _chunk_table(self, device: torch.device, dtype: torch.dtype, sizes: list[int]) -> torch.Tensor:
        """(index, first element) of every chunk of tensors of these sizes, on `device`; rebuilt when sizes change."""
        cached = self._chunk_tables.get((device, dtype))
        if cached is not None and cached[0] == sizes:
            return cached[1]
        table = chunk_table(sizes, CHUNK, device)
        self._chunk_tables[device, dtype] = (sizes, table)
        return table


def chunk_table(sizes: list[int], chunk: int, device: torch.device) -> torch.Tensor:
    """(tensor index, first element) of every chunk of `chunk` elements of tensors of these sizes, (chunks, 2) int64
    on `device`: the kernel's program ids."""
    counts = torch.tensor([triton.cdiv(n, chunk) for n in sizes])
    index = torch.repeat_interleave(torch.arange(len(sizes)), counts)  # (chunks,)
    first_chunk = torch.cumsum(counts, 0) - counts
    start = (torch.arange(index.numel()) - first_chunk[index]) * chunk
    return torch.stack((index, start), dim=1).to(device)


class _Plan:
    """A fused step to repeat: the table of the last step's one launch, with what it was built from.

    `repeat` does the next step with it when the optimizer is as that step left it: the same groups holding the
    same parameters, every one with a gradient, storages and state unchanged, one step count shared by all, and
    gradients of the parameters' dtype, shape and device, contiguous (the parameters may mix fp32 ones and bf16
    ones with masters: one launch). Then the checks of `_validated_buckets`
    hold without being made again; `repeat` makes its own over whole lists, one tensor attribute at a time, and
    writes only the gradients' addresses and the coefficients into the table. Anything else (a missing gradient,
    new state, `p.data = ...`, another mode) falls back to the full step, which raises the error that names the
    problem, or builds a new plan.
    """

    __slots__ = ("under", "state_of", "state_values", "groups", "params", "states", "moments", "param_ptrs",
                 "shapes", "grad_dtypes", "dtype", "device", "step", "table", "chunks", "aligned")

    @classmethod
    def of(cls, optimizer: "AdamW", device: torch.device, dtype: torch.dtype, fused: bool,
           table: torch.Tensor) -> "_Plan | None":
        """The plan of the step `optimizer` has just made with `table` (one row per parameter with elements, in
        group order), or None when it cannot be repeated."""
        params, groups = [], []
        for group in optimizer.param_groups:
            groups.append((group, group["params"], len(group["params"]), slice(len(params), None)))
            params += group["params"]
            groups[-1] = (*groups[-1][:3], slice(groups[-1][3].start, len(params)))
        if not fused or any(p.grad is None or p.numel() == 0 for p in params) or table.shape[0] != len(params):
            return None  # an empty parameter has no row, so rows would not be parameters' indices
        states = [optimizer.state[param] for param in params]
        steps = {state["step"] for state in states}
        if len(steps) != 1:
            return None
        plan = cls()
        plan.under, plan.state_of = optimizer._checked_under, optimizer.state
        plan.state_values = list(optimizer.state.values())
        plan.groups, plan.params, plan.states = groups, params, states
        plan.moments = [(state["exp_avg"], state["exp_avg_sq"], state.get("master")) for state in states]
        plan.param_ptrs, plan.shapes = [p.data_ptr() for p in params], [p.shape for p in params]
        plan.grad_dtypes = [p.dtype for p in params]
        plan.dtype, plan.device, plan.step = dtype, device, steps.pop()
        plan.table, plan.chunks = table.clone(), optimizer._chunk_tables[device, dtype][1]
        plan.aligned = bool((plan.table[:, [0, 2, 3, _COPY_COLUMN]] % 16 == 0).all())
        return plan

    def repeat(self, optimizer: "AdamW") -> bool:
        """The next step through this plan, if it applies (True); False, with nothing changed, if it does not.
        An invalid hyper-parameter raises, also with nothing changed."""
        if optimizer._checked_under != (_INTERPRET, optimizer.fused) or optimizer.state is not self.state_of:
            return False
        if len(optimizer.param_groups) != len(self.groups):
            return False
        for group, (known, params, count, _) in zip(optimizer.param_groups, self.groups):
            if group is not known or group["params"] is not params or len(params) != count:
                return False
            _check_hyperparameters(group)
        params, states, is_ = self.params, self.states, operator.is_
        # The state dicts (a replaced one is new state), their moments, masters and step counts.
        if len(self.state_of) != len(self.state_values) or not all(map(is_, self.state_of.values(),
                                                                        self.state_values)):
            return False
        if not all(m is state.get("exp_avg") and v is state.get("exp_avg_sq") and master is state.get("master")
                   and type(state.get("step")) is int and state["step"] == self.step
                   for (m, v, master), state in zip(self.moments, states)):
            return False
        if list(map(torch.Tensor.data_ptr, params)) != self.param_ptrs:
            return False
        # The gradients: present, of the parameters' dtype, device and shape, and contiguous (a sparse gradient
        # has no is_contiguous and raises: the full step names the problem).
        grads = [param.grad for param in params]
        if any(grad is None for grad in grads):
            return False
        device = -1 if self.device.type == "cpu" else self.device.index
        try:
            if (
                not all(map(is_, map(operator.attrgetter("dtype"), grads), self.grad_dtypes))
                or any(grad.get_device() != device for grad in grads)
                or list(map(operator.attrgetter("shape"), grads)) != self.shapes
                or not all(map(torch.Tensor.is_contiguous, grads))
            ):
                return False
        except RuntimeError:
            return False
        # Everything a full step checks holds: from here on nothing raises.
        step = self.step = self.step + 1
        for state in states:
            state["step"] = step
        grad_ptrs = torch.tensor(list(map(torch.Tensor.data_ptr, grads)), dtype=torch.int64)
        table = self.table
        table[:, 1] = grad_ptrs
        for group, _, _, rows in self.groups:
            table[rows, 5:_COPY_COLUMN] = torch.tensor(_coefficient_bits(group, step), dtype=torch.int64)
        # On CUDA the launch reads a pinned copy of the table, and under the interpreter it has finished when it
        # returns: the next step can rewrite this one.
        optimizer._launch(self.device, self.dtype, table, self.chunks,
                          self.aligned and bool((grad_ptrs % 16 == 0).all()))
        return True

def _foreach_update(device: torch.device, dtype: torch.dtype, items: list) -> None:
    """The update with torch's foreach ops, one call per operation for `items` (same device and dtype)."""
    by_group, copies, masters = defaultdict(list), [], []
    for group, param, grad, state, _ in items:
        master = state.get("master")
        if master is not None:  # the update runs on the fp32 master, then rounds it into the bf16 parameter
            copies.append(param)
            masters.append(master)
            param, grad = master, grad.to(master.dtype)
        by_group[id(group)].append((group, param, grad, state))
    for entries in by_group.values():
        group = entries[0][0]
        params = [param for _, param, _, _ in entries]
        grads = [grad for _, _, grad, _ in entries]
        exp_avgs = [state["exp_avg"] for _, _, _, state in entries]
        exp_avg_sqs = [state["exp_avg_sq"] for _, _, _, state in entries]
        steps = [state["step"] for _, _, _, state in entries]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
        # Parameters can be at different steps (a gradient may have been missing), so corrections are per tensor.
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2**step) for step in steps])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1.0 - beta1**step) for step in steps])
    if copies:
        torch._foreach_copy_(copies, masters)
