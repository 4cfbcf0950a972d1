"""Per-GPU tables of the configs that triton's autotuner chose for the Triton attention kernels, pinned on later runs.

On a GPU without a warm on-disk cache, triton's autotuner compiles and times every candidate config of
flash_triton's kernels at every new key (length class, head dim, mask, dtypes), tens of seconds per shape. A table
committed under lmsys/attention/tuned_configs/, one per GPU model (<device name>.json, the name made file-safe as the
perf plugin names its baseline folders), keeps the autotuner's choices; flash_triton's pruning hook (`choose`) then
hands the autotuner the one pinned config, so a cold start compiles that config alone. The same file says which tiles
each GPU runs.

A table: {"schema": SCHEMA, "device": ..., "kernels": {kernel name: {"fingerprint": ..., "pins": [{"key": {...},
"config": {...}}, ...]}}}. A pin's key holds the values of the autotuner's key arguments by name and, under "dtypes",
the dtype of each argument that has one, in argument order: what triton's Autotuner keys its choices on. Its config
holds what a triton.Config carries (kwargs, num_warps, num_stages, num_ctas, maxnreg). The fingerprint hashes the
kernel's source, the sources of the triton functions it calls (their module-level constexprs included) and its list of
candidate configs: when any of them changes, that kernel's pins are ignored and it autotunes. A pin whose config is
not among the candidates left after pruning is ignored too. LMSYS_ATTENTION_PINS=0 turns pinning off (the tuning
sweeps set it: they must see the autotuner's own choice). A table that cannot be read warns, naming the file, and the
kernels autotune.

    PYTHONPATH=. python -m lmsys.attention.tuned --export       (writes this GPU's table, from the repository root)
    PYTHONPATH=. python -m lmsys.attention.tuned                 (prints it)

`--export` runs flash_triton's forward and backward, pins off, at the shapes the perf suite's default subset gives it
(DEFAULT_SHAPES; `--grid training`: lmsys.bench.attention's training grid too), then merges each autotuner's choices
into the table, written atomically.

The table also holds which kernel runs where on that GPU, per pass ("forward", "backward"): at each shape of those
lists that the Gluon kernels can take (flash_hopper, flash_hopper_bwd: head dims 64 and 128, lengths multiples of
128), `--export` times the Triton kernel and each way the Gluon one runs (CHOICES: the forward with two or three
consumer warpgroups; the backward's two kernels one after the other, side by side, or dQ accumulated by the dK/dV
kernel) and keeps the fastest, under the shape's bucket (`bucket`: head dim, mask, keys rounded up to a power of two,
programs per multiprocessor down to one). A problem in a measured bucket runs as measured (`measured_choice`), every
other problem by the Gluon modules' thresholds. Each pass's choices carry a fingerprint of its kernels' sources and its
Gluon module's settings (`choice_fingerprint`); when it differs they are ignored, with a warning.
`--export --choices-only` measures the choices alone, pins on (the configs already pinned are not tuned again).
"""

import argparse
import ast
import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITCallable

ENV = "LMSYS_ATTENTION_PINS"
# How flash_triton can run a pass that a Gluon kernel can take. The forward: the Triton kernel, or the Gluon one with
# two or (at d=64) three consumer warpgroups. The backward: the Triton kernel, or the Gluon kernels one after the
# other, side by side (not while a CUDA graph is captured: then one after the other), or fused (dQ accumulated by the
# dK/dV kernel).
CHOICES = {"forward": ("triton", "gluon", "gluon-3wg"),
           "backward": ("triton", "gluon", "gluon-concurrent", "gluon-fused")}
SCHEMA = 1
FOLDER = Path(__file__).with_name("tuned_configs")
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")

# (shape, causal, mode) of flash_triton in the default subset of perf_tests/test_attention.py, bf16: the seeds' grid
# point, the causal grid's two, the first anchor (forward only), the leaderboard, the training grid's TRAINING_DEFAULT
# and the launch-cost shape.
DEFAULT_SHAPES = (
    ((8, 4096, 64), False, "fwd_bwd"),
    ((1, 4096, 64), True, "fwd_bwd"),
    ((1, 4096, 128), True, "fwd_bwd"),
    ((4, 16, 8192, 128), True, "fwd"),
    ((16, 16384, 64), True, "fwd_bwd"),
    ((16, 32, 1024, 64), True, "fwd_bwd"),
    ((4, 32, 4096, 80), True, "fwd_bwd"),
    ((8, 16, 2048, 96), True, "fwd_bwd"),
    ((4, 16, 4096, 128), False, "fwd_bwd"),
    ((1, 1, 4096, 64), True, "fwd_bwd"),
)


def enabled() -> bool:
    """Whether pins apply: unless LMSYS_ATTENTION_PINS=0 (read at each autotuning, so a script may set it late)."""
    return os.environ.get(ENV, "1") != "0"


def device_file_name(device_name: str) -> str:
    """The table's file name for a GPU: its name with runs of characters other than letters, digits, '.' and '-' made
    '_', as lmsys.perf.baselines names a GPU's baseline folder ('NVIDIA_H200.json')."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", device_name).strip("_") + ".json"


def table_path(device_name: str) -> Path:
    """The committed table of a GPU (it may not exist)."""
    return FOLDER / device_file_name(device_name)


# ------------------------------------------------------------------------------------------------ fingerprint


def _triton_functions(fn, found: dict) -> None:
    """Adds to `found` the raw Python function `fn`'s source (under its qualified name) and, through the names it
    uses, the sources of the triton functions it calls, transitively, and the values of the constexprs it reads
    (triton.language's own left out)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name in found:
        return
    found[name] = inspect.getsource(fn)
    for node in ast.walk(ast.parse(found[name])):
        if isinstance(node, ast.Name):
            label, value = node.id, fn.__globals__.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = fn.__globals__.get(node.value.id)
            if owner is tl or not inspect.ismodule(owner):
                continue
            label, value = f"{node.value.id}.{node.attr}", getattr(owner, node.attr, None)
        else:
            continue
        if isinstance(value, (JITCallable, InterpretedFunction)):
            _triton_functions(value.fn, found)
        elif isinstance(value, tl.constexpr):
            found[f"{fn.__module__}:{label}"] = repr(value.value)


@functools.cache
def _sources(fn) -> tuple:
    """(name, source or constexpr value) of `_triton_functions` from the kernel `fn`, sorted."""
    found = {}
    _triton_functions(fn, found)
    return tuple(sorted(found.items()))


def fingerprint(autotuner) -> str:
    """A hash of what an autotuner's choice depends on in our code: the kernel's source and the sources of the triton
    functions it calls (`_triton_functions`), and its candidate configs in order."""
    text = json.dumps([_sources(autotuner.base_fn), [config_record(c) for c in autotuner.configs]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ keys and configs


def config_record(config: triton.Config) -> dict:
    """A triton.Config as JSON-able data (CONFIG_FIELDS); a config with a pre-hook or an IR override cannot be."""
    if config.pre_hook is not None or config.ir_override is not None:
        raise ValueError(f"config {config} has a pre_hook or an ir_override, which a table cannot hold")
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": config.num_ctas, "maxnreg": config.maxnreg}


def config_from(record: dict) -> triton.Config:
    """The triton.Config of a `config_record`; ValueError naming what is wrong with a malformed one."""
    if not isinstance(record, dict) or sorted(record) != sorted(CONFIG_FIELDS):
        raise ValueError(f"a config must have exactly the fields {', '.join(CONFIG_FIELDS)}, got {record!r}")
    if not isinstance(record["kwargs"], dict):
        raise ValueError(f"a config's kwargs must be an object, got {record['kwargs']!r}")
    return triton.Config(dict(record["kwargs"]), num_warps=record["num_warps"], num_stages=record["num_stages"],
                         num_ctas=record["num_ctas"], maxnreg=record["maxnreg"])


def key_record(autotuner, key: tuple) -> dict:
    """An autotuner's cache key (the values of its key arguments, then a str(dtype) per argument that has one, as
    triton 3.6's Autotuner.run builds it) by name: {key argument: value, ..., "dtypes": [...]}."""
    named = len(autotuner.keys)
    if len(key) < named or not all(isinstance(d, str) for d in key[named:]):
        raise ValueError(f"autotuner key {key!r} is not {autotuner.keys} followed by dtype names")
    return {**dict(zip(autotuner.keys, key[:named])), "dtypes": list(key[named:])}


def call_key(autotuner, named_args: dict, kwargs: dict) -> dict:
    """The `key_record` of the key under which the autotuner keeps its choice for this call (the pruning hook's
    arguments: the positional arguments by name, then the keyword ones)."""
    args = {name: value for name, value in {**named_args, **kwargs}.items() if name in autotuner.arg_names}
    key = [args[name] for name in autotuner.keys if name in args]
    key += [str(value.dtype) for value in args.values() if hasattr(value, "dtype")]
    return key_record(autotuner, tuple(key))


def _canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


# ------------------------------------------------------------------------------------------------ reading a table


class Pins:
    """One kernel's pins in a table: its fingerprint and its configs by key (`_canonical` of a key record)."""

    def __init__(self, fingerprint: str, configs: dict):
        self.fingerprint, self.configs = fingerprint, configs


def _parse(table) -> dict:
    """kernel name -> Pins of a table's JSON; ValueError naming what is wrong."""
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        found = table.get("schema") if isinstance(table, dict) else type(table).__name__
        raise ValueError(f"expected schema {SCHEMA}, found {found!r}")
    kernels = table.get("kernels")
    if not isinstance(kernels, dict):
        raise ValueError("'kernels' must be an object")
    parsed = {}
    for name, entry in kernels.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("fingerprint"), str) \
                or not isinstance(entry.get("pins"), list):
            raise ValueError(f"kernel {name!r} needs a 'fingerprint' string and a 'pins' list")
        configs = {}
        for pin in entry["pins"]:
            if not isinstance(pin, dict) or not isinstance(pin.get("key"), dict) \
                    or not isinstance(pin["key"].get("dtypes"), list):
                raise ValueError(f"a pin of {name!r} needs a 'key' object with a 'dtypes' list, got {pin!r}")
            configs[_canonical(pin["key"])] = config_from(pin.get("config"))
        parsed[name] = Pins(entry["fingerprint"], configs)
    for part in CHOICES:
        _parse_choices(table, part)
    return parsed


BUCKET_FIELDS = ("head_dim", "causal", "keys", "per_sm")


def _parse_choices(table: dict, part: str) -> tuple[str, dict] | None:
    """The fingerprint and the choices (`_canonical` of a bucket -> choice) of a table's part "forward" or "backward",
    None when it has none; ValueError naming what is wrong."""
    found = table.get(part)
    if found is None:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("fingerprint"), str) \
            or not isinstance(found.get("choices"), list):
        raise ValueError(f"'{part}' needs a 'fingerprint' string and a 'choices' list")
    choices = {}
    for entry in found["choices"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict) \
                or sorted(entry["key"]) != sorted(BUCKET_FIELDS) or entry.get("choice") not in CHOICES[part]:
            raise ValueError(f"a {part} choice needs a 'key' of {', '.join(BUCKET_FIELDS)} and a 'choice' among "
                             f"{', '.join(CHOICES[part])}, got {entry!r}")
        choices[_canonical(entry["key"])] = entry["choice"]
    return found["fingerprint"], choices


@functools.cache
def load(path: Path) -> dict:
    """kernel name -> Pins of the table at `path`, read once: {} when there is no such file, and {} with a warning
    naming the file when it cannot be read or parsed."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"cannot read the attention config table {path} ({exc}): the Triton attention kernels autotune",
                      stacklevel=2)
        return {}
    try:
        return _parse(json.loads(text))
    except (ValueError, TypeError) as exc:
        warnings.warn(f"ignoring the attention config table {path}, which is malformed ({exc}): the Triton attention "
                      f"kernels autotune; regenerate it with `python -m lmsys.attention.tuned --export`", stacklevel=2)
        return {}


@functools.cache
def load_choices(path: Path) -> dict:
    """part -> `_parse_choices` of the table at `path`, read once, for the parts it has: {} when there is no such file
    or it cannot be read (`load` warns about that)."""
    load(path)
    try:
        table = json.loads(Path(path).read_text())
        return {part: found for part in CHOICES if (found := _parse_choices(table, part)) is not None}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


@functools.cache
def _stale(path: Path, kernel: str) -> None:
    """Warns once per table and kernel that the table's pins are for another version of the kernel."""
    warnings.warn(f"the attention config table {path} pins {kernel} for another version of its source or configs: it "
                  f"autotunes; regenerate the table with `python -m lmsys.attention.tuned --export`", stacklevel=3)


@functools.cache
def _stale_choices(path: Path, part: str) -> None:
    """Warns once per table and pass that its choices were timed on other kernels or settings."""
    warnings.warn(f"the attention config table {path} holds {part} choices timed on another version of the {part} "
                  f"kernels or their settings: the thresholds decide; measure them again with "
                  f"`python -m lmsys.attention.tuned --export --choices-only`", stacklevel=3)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(named_args: dict) -> str | None:
    """The name of the CUDA device of a call's first tensor argument, or None when it is not on a CUDA device."""
    tensor = next((value for value in named_args.values() if isinstance(value, torch.Tensor)), None)
    if tensor is None or tensor.device.type != "cuda":
        return None
    return _device_name(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def choose(autotuner, candidates: list, named_args: dict, kwargs: dict) -> list:
    """The candidates left for the autotuner to time at this call (an early_config_prune hook's result): the pinned
    config alone when pins are on, the call's tensors are on a GPU whose table pins this kernel at this key, the
    fingerprint matches and the pinned config is among `candidates`; else `candidates` as they are."""
    if not enabled():
        return candidates
    name = gpu_name(named_args)
    if name is None:
        return candidates
    path = table_path(name)
    pins = load(path).get(autotuner.base_fn.__name__)
    if pins is None:
        return candidates
    if pins.fingerprint != fingerprint(autotuner):
        _stale(path, autotuner.base_fn.__name__)
        return candidates
    pinned = pins.configs.get(_canonical(call_key(autotuner, named_args, kwargs)))
    chosen = [c for c in candidates if pinned is not None and c == pinned]
    return chosen[:1] or candidates


def bucket(head_dim: int, causal: bool, keys: int, per_sm: float) -> dict:
    """The bucket of a problem: its head dim and mask, its keys rounded up to a power of two and its programs
    (of 128 query rows) per multiprocessor rounded down to one (1/8 at least)."""
    return {"head_dim": int(head_dim), "causal": bool(causal), "keys": 1 << max(int(keys) - 1, 0).bit_length(),
            "per_sm": 2.0 ** math.floor(math.log2(max(per_sm, 0.125)))}


def _pass_modules(part: str):
    """(the pass's kernels, its Gluon module) whose sources and settings its choices were timed on."""
    from lmsys.attention import flash_hopper, flash_hopper_bwd, flash_triton

    if part == "forward":
        return (flash_triton._flash_fwd_kernel, flash_hopper._flash_fwd_hopper_kernel), flash_hopper
    return (flash_triton._flash_bwd_kernel, flash_triton._flash_bwd_preprocess_kernel, flash_hopper_bwd._dkdv_kernel,
            flash_hopper_bwd._dq_kernel, flash_hopper_bwd._cast_dq_kernel), flash_hopper_bwd


@functools.cache
def choice_fingerprint(part: str) -> str:
    """A hash of what a pass's choices were timed on: the sources of its kernels (the Triton one, with the backward's
    preprocessing, and the Gluon ones) with the functions they call (`_triton_functions`) and its Gluon module's
    settings (its UPPER_CASE names but MEASURED). The Triton kernels' configs have their own pins and fingerprints."""
    kernels, module = _pass_modules(part)
    found = {}
    for kernel in kernels:
        _triton_functions(inspect.unwrap(getattr(kernel, "base_fn", None) or kernel.fn), found)
    settings = {name: repr(value) for name, value in vars(module).items() if name.isupper() and name != "MEASURED"}
    text = json.dumps([sorted(found.items()), sorted(settings.items())], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measured_choice(part: str, q: torch.Tensor, causal: bool, keys: int, per_sm: float) -> str | None:
    """The measured choice (CHOICES[part]) for the pass `part` of q on its GPU's table, or None: pins off, q not on a
    GPU, no table or no choice for this problem's bucket, or choices timed on other sources (a warning, once)."""
    if not enabled() or q.device.type != "cuda":
        return None
    path = table_path(_device_name(q.device.index if q.device.index is not None else torch.cuda.current_device()))
    found = load_choices(path).get(part)
    if found is None:
        return None
    fingerprint_, choices = found
    if fingerprint_ != choice_fingerprint(part):
        _stale_choices(path, part)
        return None
    return choices.get(_canonical(bucket(q.shape[-1], causal, keys, per_sm)))


# ------------------------------------------------------------------------------------------------ writing a table


def kernel_entry(autotuner) -> dict:
    """A table's entry for an autotuner's in-memory choices (its `cache`: key -> the config chosen)."""
    pins = [{"key": key_record(autotuner, key), "config": config_record(config)}
            for key, config in autotuner.cache.items()]
    return {"fingerprint": fingerprint(autotuner), "pins": sorted(pins, key=lambda pin: _canonical(pin["key"]))}


def merged(table: dict | None, device: str, entries: dict, choices: dict | None = None) -> dict:
    """`table` (None: a new one) with each kernel's `entries` merged in: a kernel of the same fingerprint keeps its
    other pins and takes the new ones, a kernel of another fingerprint is replaced, kernels not in `entries` stay. The
    `choices` ({part: [choice entries]}) merge alike: into those of the same fingerprint (the new one at a bucket
    measured twice), else in their place; a part with none new stays as it is."""
    table = table or {}
    kernels = dict(table.get("kernels", {}))
    for name, entry in entries.items():
        old = kernels.get(name)
        if old is not None and old.get("fingerprint") == entry["fingerprint"]:
            pins = {_canonical(pin["key"]): pin for pin in old["pins"]}
            pins.update({_canonical(pin["key"]): pin for pin in entry["pins"]})
            entry = {"fingerprint": entry["fingerprint"], "pins": [pins[k] for k in sorted(pins)]}
        kernels[name] = entry
    merged_table = {"schema": SCHEMA, "device": device, "triton": triton.__version__, "torch": torch.__version__,
                    "kernels": dict(sorted(kernels.items()))}
    for part in CHOICES:
        old, new = table.get(part), (choices or {}).get(part)
        if not new:
            if old is not None:
                merged_table[part] = old
            continue
        kept = {}
        if old is not None and old["fingerprint"] == choice_fingerprint(part):
            kept = {_canonical(entry["key"]): entry for entry in old["choices"]}
        kept.update({_canonical(entry["key"]): entry for entry in new})
        merged_table[part] = {"fingerprint": choice_fingerprint(part), "choices": [kept[key] for key in sorted(kept)]}
    return merged_table


def write(path: Path, table: dict) -> None:
    """Writes the table atomically (a temporary file in the same folder, then renamed), with the umask's permissions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(table, indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    load.cache_clear()
    load_choices.cache_clear()


def _read_existing(path: Path) -> dict | None:
    """The table at `path` to merge into, None when there is none; an error naming the file when it is malformed
    (an export does not overwrite what it cannot read)."""
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
        _parse(table)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"{path} is not a valid attention config table ({exc}): move it away to export anew")
    return table


@contextlib.contextmanager
def _settings(settings: dict):
    """Sets module attributes ({module: {name: value}}) for the block, and restores them after it."""
    saved = [(module, name, getattr(module, name)) for module, names in settings.items() for name in names]
    try:
        for module, names in settings.items():
            for name, value in names.items():
                setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _choice_settings(part: str, choice: str) -> dict:
    """The module settings under which flash_triton runs the pass `part` of every input a Gluon kernel can take as
    `choice` says."""
    from lmsys.attention import flash_hopper, flash_hopper_bwd, flash_triton

    if part == "forward":
        if choice == "triton":
            return {flash_triton: {"HOPPER_FORWARD": False}}
        wide = choice == "gluon-3wg"
        return {flash_triton: {"HOPPER_FORWARD": True}, flash_hopper: {
            "MEASURED": False, "MIN_PROGRAMS_PER_SM": 0, "FORWARD_64_MIN_KEYS": 0,
            "FORWARD_64_BELOW_PROGRAMS_PER_SM": math.inf, "FORWARD_64_WIDE_MIN_KEYS": 0 if wide else math.inf,
            "FORWARD_64_WIDE_MIN_PROGRAMS_PER_SM": 0 if wide else math.inf}}
    if choice == "triton":
        return {flash_triton: {"HOPPER_BACKWARD": False}}
    gluon = {"MEASURED": False, "MIN_PROGRAMS_PER_SM": 0, "MIN_PROGRAMS_PER_SM_CONCURRENT": 0,
             "CONCURRENT_DQ": choice == "gluon-concurrent", "FUSED_DQ": choice == "gluon-fused"}
    return {flash_triton: {"HOPPER_BACKWARD": True}, flash_hopper_bwd: gluon}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a is within 2% of b's largest magnitude everywhere (a wrong kernel is far off)."""
    return bool((a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max())


def measure(part: str, shapes, budget_s: float = math.inf, log=print) -> list[dict]:
    """Times each of CHOICES[part] (the pass "forward" or "backward") at every shape of `shapes` ((shape, causal),
    bf16) that its Gluon kernel can take, in turns (each choice early and late once), and returns a choice entry for
    each (its bucket, the fastest choice, each choice's median ms and the shape), a shape's bucket once. Each choice's
    output or gradients are checked against the Triton kernel's: a choice that disagrees is not chosen (and said).
    Shapes left when `budget_s` seconds have passed are not measured (and said)."""
    from lmsys.attention import flash_hopper, flash_hopper_bwd, flash_triton

    choice_fingerprint(part)  # of the settings as they are, before the choices' settings change them
    start, entries, seen = time.monotonic(), [], set()
    for shape, causal in shapes:
        if time.monotonic() - start > budget_s:
            log(f"{part} choices: budget of {budget_s:.0f} s spent, {shape} and later shapes not measured")
            break
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        rows = flash_hopper.BLOCK_M if part == "forward" else flash_hopper_bwd.BLOCK_ROWS
        per_sm = flash_hopper.blocks_per_sm(q, rows)
        key = bucket(shape[-1], causal, shape[-2], per_sm)
        with _settings(_choice_settings(part, "gluon")):
            takes = (flash_hopper.forward_views(q, k, v, causal) if part == "forward"
                     else flash_hopper_bwd.views(q, k, v, do, causal)) is not None
        if not takes or _canonical(key) in seen:
            continue
        seen.add(_canonical(key))
        choices = [c for c in CHOICES[part] if c != "gluon-3wg" or shape[-1] == 64]
        if part == "forward":
            def call():
                return flash_triton.forward(q, k, v, causal)[:1]
        else:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            o = None

            def call():
                return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        results, times = {}, {choice: [] for choice in choices}
        for turn in (choices, choices[::-1]):
            for choice in turn:
                with _settings(_choice_settings(part, choice)):
                    if part == "backward":
                        o = flash_triton.FlashAttentionTriton.apply(q, k, v, causal)
                    if choice not in results:
                        results[choice] = call()
                    times[choice].append(triton.testing.do_bench(call, warmup=25, rep=60, return_mode="median"))
        agree = [c for c in choices if all(map(_close, results[c], results["triton"]))]
        for choice in sorted(set(choices) - set(agree)):
            log(f"{part} choices: {choice} disagrees with the Triton kernel at {shape} causal={causal}: not chosen")
        ms = {choice: round(sum(t) / len(t), 4) for choice, t in times.items()}
        best = min(agree, key=ms.__getitem__)
        entries.append({"key": key, "choice": best, "ms": ms, "shape": list(shape)})
        log(f"{part} choices: {tuple(shape)} causal={causal}: {best} "
            + " ".join(f"{c}={t:.4f}" for c, t in ms.items()))
    return entries


def export(path: Path | None = None, shapes=DEFAULT_SHAPES, choices_only: bool = False,
           budget_s: float = math.inf) -> tuple[Path, dict]:
    """Runs flash_triton forward (and backward, per `shapes`: ((shape, causal, mode), ...), bf16) on this GPU with
    pins off, then times each pass's choices at `shapes` (`measure`, pins on; the backward's at the shapes with a
    backward; both within `budget_s`), and merges the choices of its autotuners and of the passes into the table at
    `path` (default: this GPU's). `choices_only`: the passes' choices alone. Returns the path and the table written.
    Run it in a fresh process: the autotuners' choices recorded are all those of this process."""
    from lmsys.attention import flash_triton

    device = torch.cuda.get_device_name()
    path = Path(path) if path is not None else table_path(device)
    existing = _read_existing(path)
    previous = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        for shape, causal, mode in () if choices_only else shapes:
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "fwd")
                       for _ in range(3))
            o = flash_triton.FlashAttentionTriton.apply(q, k, v, causal)
            if mode != "fwd":
                o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
    start = time.monotonic()
    choices = {"forward": measure("forward", [(shape, causal) for shape, causal, _ in shapes], budget_s)}
    choices["backward"] = measure("backward", [(shape, causal) for shape, causal, mode in shapes if mode != "fwd"],
                                  max(budget_s - (time.monotonic() - start), 0.0))
    entries = {kernel.base_fn.__name__: kernel_entry(kernel)
               for kernel in (flash_triton._flash_fwd_kernel, flash_triton._flash_bwd_kernel) if kernel.cache}
    table = merged(existing, device, entries, choices)
    write(path, table)
    return path, table


def describe(table: dict) -> str:
    """The table's pins, one line each: kernel, key, config."""
    lines = [f"{'kernel':<18} {'key':<46} config"]
    for name, entry in table["kernels"].items():
        for pin in entry["pins"]:
            key = dict(pin["key"])
            dtypes = key.pop("dtypes")
            key_text = " ".join(f"{k}={v}" for k, v in key.items())
            key_text += " " + "/".join(d.removeprefix("torch.") for d in dtypes)
            config = pin["config"]
            extra = " ".join(f"{k}={config[k]}" for k in CONFIG_FIELDS[1:] if config[k] is not None)
            kwargs = " ".join(f"{k}={v}" for k, v in config["kwargs"].items())
            lines.append(f"{name:<18} {key_text:<46} {kwargs} {extra}")
    for part in CHOICES:
        for entry in table.get(part, {}).get("choices", []):
            key = entry["key"]
            key_text = (f"HEAD_DIM={key['head_dim']} CAUSAL={key['causal']} KEYS<={key['keys']} "
                        f"PROGRAMS_PER_SM>={key['per_sm']:g}")
            lines.append(f"{part:<18} {key_text:<46} {entry['choice']}")
    return "\n".join(lines)


def _seconds(text: str) -> float:
    """A positive number of seconds (argparse type)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def main(argv=None) -> int:
    """`python -m lmsys.attention.tuned`: exports this GPU's table (`--export`) or prints a table; returns the exit
    status (2 without a GPU where one is needed)."""
    parser = argparse.ArgumentParser(prog="python -m lmsys.attention.tuned", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, help="the table (default: this GPU's, under lmsys/attention/"
                        "tuned_configs/)")
    parser.add_argument("--export", action="store_true",
                        help="run the kernels with pins off and merge the autotuner's choices into the table")
    parser.add_argument("--grid", choices=["default", "training"], default="default",
                        help="default: the perf suite's default shapes; training: the training grid's too")
    parser.add_argument("--choices-only", action="store_true",
                        help="with --export: time the passes' choices alone (pins on), not the autotuners' configs")
    parser.add_argument("--budget-s", type=_seconds, default=math.inf, metavar="SECONDS",
                        help="with --export: stop timing the passes' choices after SECONDS (default: no limit)")
    args = parser.parse_args(argv)
    if (args.export or args.path is None) and not torch.cuda.is_available():
        print("no CUDA device: give the table's path to print one, or export on a GPU", file=sys.stderr)
        return 2
    if args.export:
        shapes = DEFAULT_SHAPES
        if args.grid == "training":
            from lmsys.bench.attention import training_grid

            shapes += tuple((shape, causal, "fwd_bwd") for shape, causal in training_grid())
        path, table = export(args.path, shapes, args.choices_only, args.budget_s)
        print(f"wrote {path} ({torch.cuda.get_device_name()}, triton {triton.__version__})")
    else:
        path = args.path or table_path(torch.cuda.get_device_name())
        table = json.loads(Path(path).read_text())
        print(path)
    print(describe(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
