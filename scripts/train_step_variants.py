"""Variants of the training step, timed side by side in one process: which of them pays? (issue 11)

For each size (large and 2.7B by default): bf16 autocast + torch.compile, batch 4, context 512, random tokens;
CUDA events around each step, the median of 20 steps after 8 warmup steps (how the plain-PyTorch reference numbers
were taken). Each step is timed from an idle device, so that time holds the host's work before the step's first
kernel; `loop ms` is the time per step of 20 steps issued back to back (events around all of them), a training
loop's steady state, in which the host issues a step while the device still runs the one before. Prints a markdown
table (ms, loop ms, tokens/s, TFLOP/s, MFU, peak memory, the first step's wall time, which holds the compilation),
then each of our variants beside the plain-PyTorch step with the same CUDA-graph, max-autotune and per-block compile
settings from the same run, and writes every row to the CSV file named on the command line.

    PYTHONPATH=. python scripts/train_step_variants.py variants.csv          (from the repository root)
    PYTHONPATH=. python scripts/train_step_variants.py variants.csv --sizes large --variants ours ours-compile-loss

Variants (model, attention, optimizer, make_train_step options):
    reference                     the plain-PyTorch model (lmsys.reference_model), SDPA, torch's fused AdamW
    ours-torch-adamw              lmsys.model, SDPA, torch's fused AdamW
    ours                          lmsys.model, SDPA, lmsys AdamW (the fused Triton kernel)
    ours-unplanned                ... with every step of lmsys AdamW taking its full path (no _Plan): what the plan saves
    ours-cuda-graphs              lmsys.model, SDPA, lmsys AdamW, forward and backward replayed as CUDA graphs
    ours-flash_triton-cuda-graphs ... with our Triton FlashAttention as the attention
    reference-cuda-graphs         the plain-PyTorch model and torch's fused AdamW, with the same CUDA graphs
  not in the default set (each adds a compilation; run them with --variants):
    ours-compile-loss             lmsys.model, SDPA, lmsys AdamW, the cross-entropy compiled with the model
    ours-flash_triton-compile-loss  ... with our Triton FlashAttention as the attention
    ours-flash_triton             lmsys.model, flash_triton, lmsys AdamW, the loss outside the compiled model
    ours-compiled-foreach         lmsys.model, SDPA, torch's foreach AdamW with its step compiled (compile_optimizer)
    ours-fused-loss               lmsys.model, SDPA, lmsys AdamW, the LM head and cross-entropy fused
                                  (linear_cross_entropy, fused_loss), compiled with the model
    ours-fused-loss-cuda-graphs   ... replayed as CUDA graphs
    ours-compile-loss-cuda-graphs lmsys.model, SDPA, lmsys AdamW, the plain cross-entropy compiled with the model,
                                  replayed as CUDA graphs
    ours-bf16-weights             lmsys.model, SDPA, lmsys AdamW, Linear weights as bf16 parameters with their fp32
                                  masters in the optimizer (bf16_weights): no weight casts, bf16 weight gradients
    ours-bf16-weights-cuda-graphs ... replayed as CUDA graphs
    ours-bf16-weights-fused-loss  lmsys.model, SDPA, lmsys AdamW, bf16 Linear weights (the LM head's too) and the
                                  fused LM head + cross-entropy (bf16_weights, fused_loss)
    ours-bf16-weights-fused-loss-cuda-graphs  ... replayed as CUDA graphs
    ours-bf16-weights-max-autotune-cuda-graphs  ours-bf16-weights-cuda-graphs compiled with inductor's max-autotune
                                  (max_autotune: matmul templates and kernel configurations benchmarked while
                                  compiling: a longer first step)
    ours-bf16-weights-fused-loss-max-autotune-cuda-graphs  ... the same for ours-bf16-weights-fused-loss-cuda-graphs
    reference-max-autotune-cuda-graphs  reference-cuda-graphs compiled with max-autotune: the plain step that the
                                  max-autotune variants are printed beside
    reference-blocks              the plain-PyTorch step with each block compiled on its own (compile_blocks: one
                                  block's compilation, the rest eager): the step the *-blocks variants are beside
    reference-blocks-cuda-graphs  ... replayed as CUDA graphs
    ours-bf16-weights-fused-loss-blocks  ours-bf16-weights-fused-loss with each block compiled on its own
    ours-bf16-weights-fused-loss-blocks-cuda-graphs  ... replayed as CUDA graphs

With `--top N`, each variant's timing is followed by the torch.profiler table of one more step (the N operators
with the most device time), to see where two variants differ. With `--profile`, each variant also gets a row of
what one step launches and what the host spends on it: kernels per step (by kind), the device's busy time and the
step's span in one profiled step, and the host's time to issue the forward, backward and optimizer step (no
profiler; medians over --steps steps, each started on an idle device).

Variants without CUDA graphs that share a model (class and attention) run on one model object, one after the other,
each with a fresh optimizer; dynamo reuses the model's compiled graph where it can. Each CUDA-graph variant, and
each variant that converts its model's weights to bf16, has a model of its own. Models are freed between groups and
sizes. Without CUDA the script runs on the CPU (wall-clock timing, no MFU), for a smoke test with `--sizes tiny`.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import statistics
import sys
import time
import traceback
import types
from collections import defaultdict

import pandas as pd
import torch

import lmsys.train
from lmsys import flops, profiling
from lmsys.bench import sweep
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.perf.report import markdown_table
from lmsys.reference_model import ReferenceLM
from lmsys.train import make_train_step, random_batch

class UnplannedAdamW(AdamW):
    """lmsys AdamW with every step on its full path (validation of every parameter, a new table): no `_Plan`."""

    def step(self, closure=None):
        self._plan = None
        return super().step(closure)


OPTIMIZERS = {
    "torch-fused": functools.partial(torch.optim.AdamW, fused=True),
    "torch-foreach": functools.partial(torch.optim.AdamW, foreach=True),
    "lmsys": AdamW,
    "lmsys-unplanned": UnplannedAdamW,
}


@dataclasses.dataclass(frozen=True)
class Variant:
    model: type
    attention: str
    optimizer: str
    options: dict = dataclasses.field(default_factory=dict)


VARIANTS = {
    "reference": Variant(ReferenceLM, "sdpa", "torch-fused"),
    "ours-torch-adamw": Variant(TransformerLM, "sdpa", "torch-fused"),
    "ours": Variant(TransformerLM, "sdpa", "lmsys"),
    "ours-unplanned": Variant(TransformerLM, "sdpa", "lmsys-unplanned"),
    "ours-compile-loss": Variant(TransformerLM, "sdpa", "lmsys", dict(compile_loss=True)),
    "ours-flash_triton-compile-loss": Variant(TransformerLM, "flash_triton", "lmsys", dict(compile_loss=True)),
    "ours-flash_triton": Variant(TransformerLM, "flash_triton", "lmsys"),
    "ours-compiled-foreach": Variant(TransformerLM, "sdpa", "torch-foreach", dict(compile_optimizer=True)),
    "ours-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys", dict(cuda_graphs=True)),
    "ours-flash_triton-cuda-graphs": Variant(TransformerLM, "flash_triton", "lmsys", dict(cuda_graphs=True)),
    "reference-cuda-graphs": Variant(ReferenceLM, "sdpa", "torch-fused", dict(cuda_graphs=True)),
    "ours-fused-loss": Variant(TransformerLM, "sdpa", "lmsys", dict(fused_loss=True)),
    "ours-fused-loss-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys", dict(fused_loss=True, cuda_graphs=True)),
    "ours-compile-loss-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys",
                                             dict(compile_loss=True, cuda_graphs=True)),
    "ours-bf16-weights": Variant(TransformerLM, "sdpa", "lmsys", dict(bf16_weights=True)),
    "ours-bf16-weights-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys", dict(bf16_weights=True,
                                                                                  cuda_graphs=True)),
    "ours-bf16-weights-fused-loss": Variant(TransformerLM, "sdpa", "lmsys", dict(bf16_weights=True, fused_loss=True)),
    "ours-bf16-weights-fused-loss-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys",
                                                        dict(bf16_weights=True, fused_loss=True, cuda_graphs=True)),
    "ours-bf16-weights-max-autotune-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys",
                                                          dict(bf16_weights=True, cuda_graphs=True, max_autotune=True)),
    "ours-bf16-weights-fused-loss-max-autotune-cuda-graphs": Variant(
        TransformerLM, "sdpa", "lmsys", dict(bf16_weights=True, fused_loss=True, cuda_graphs=True, max_autotune=True)),
    "reference-max-autotune-cuda-graphs": Variant(ReferenceLM, "sdpa", "torch-fused",
                                                  dict(cuda_graphs=True, max_autotune=True)),
    "reference-blocks": Variant(ReferenceLM, "sdpa", "torch-fused", dict(compile_blocks=True)),
    "reference-blocks-cuda-graphs": Variant(ReferenceLM, "sdpa", "torch-fused",
                                            dict(compile_blocks=True, cuda_graphs=True)),
    "ours-bf16-weights-fused-loss-blocks": Variant(TransformerLM, "sdpa", "lmsys",
                                                   dict(bf16_weights=True, fused_loss=True, compile_blocks=True)),
    "ours-bf16-weights-fused-loss-blocks-cuda-graphs": Variant(
        TransformerLM, "sdpa", "lmsys",
        dict(bf16_weights=True, fused_loss=True, compile_blocks=True, cuda_graphs=True)),
}
DEFAULT_VARIANTS = ["reference", "ours-torch-adamw", "ours", "ours-cuda-graphs", "ours-flash_triton-cuda-graphs",
                    "reference-cuda-graphs"]
COLUMNS = ["size", "variant", "median_ms", "min_ms", "max_ms", "loop_ms", "tokens_per_s", "tflops", "mfu", "peak_gib",
           "first_step_s", "error"]
PROFILE_COLUMNS = ["kernels", "gemm", "attention", "triton", "other_kernels", "copies", "launch_calls",
                   "device_busy_ms", "profiled_span_ms", "host_forward_ms", "host_backward_ms", "host_optimizer_ms",
                   "host_step_ms", "synced_step_ms"]


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_steps(step, batch, warmup: int, steps: int) -> tuple[list[float], float]:
    """Per-step times in ms, by the regression gate's clock (CUDA events around each step on a GPU, the wall clock
    on the CPU), and the first step's wall time in seconds (the compilation lands there)."""
    device = sweep.backend()
    start = time.perf_counter()
    step(*batch)
    device.synchronize()
    first = time.perf_counter() - start
    return [seconds * 1e3 for seconds in sweep.time_steps(device, lambda: step(*batch), warmup - 1, steps)], first


def loop_ms(step, batch, steps: int) -> float:
    """Milliseconds per step of `steps` steps issued back to back, timed as one call by the gate's clock (CUDA events
    around all of them on a GPU, the wall clock on the CPU)."""
    def loop():
        for _ in range(steps):
            step(*batch)

    return sweep.backend().time_call(loop) / steps * 1e3


def _kernel_kind(name: str) -> str:
    """The PROFILE_COLUMNS group of a device event, by its name."""
    lowered = name.lower()
    if lowered.startswith(("memcpy", "memset")):
        return "copies"
    if any(word in lowered for word in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    if any(word in lowered for word in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if lowered.startswith("triton"):
        return "triton"
    return "other_kernels"


def launch_profile(step, batch) -> dict:
    """What one step puts on the device: kernels by kind (PROFILE_COLUMNS), the host's launch calls, the union of
    the device events' intervals (busy) and their span, from one step under torch.profiler."""
    prof = profiling.profile(step, *batch, warmup=0)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = defaultdict(int)
    for event in events:
        counts[_kernel_kind(event.name)] += 1
    busy, reach = 0.0, None
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in events):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events) if events else 0.0
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
                   and e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                                  "cudaGraphLaunch"))
    return dict(kernels=sum(counts[k] for k in ("gemm", "attention", "triton", "other_kernels")),
                **{k: counts[k] for k in ("gemm", "attention", "triton", "other_kernels", "copies")},
                launch_calls=launches, device_busy_ms=round(busy / 1e3, 2), profiled_span_ms=round(span / 1e3, 2))


def host_phases(step, batch, steps: int) -> dict:
    """Medians of the host's time to issue the step's forward, backward and optimizer step (lmsys.train's
    ranges, timed by the host clock instead of marked), of its whole call, and of the step with the device's work,
    over `steps` steps each started on an idle device."""
    times = defaultdict(list)

    @contextlib.contextmanager
    def timed(name):
        start = time.perf_counter()
        yield
        times[name].append(time.perf_counter() - start)

    original = lmsys.train.profiling
    lmsys.train.profiling = types.SimpleNamespace(range=timed)
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(*batch)
            times["step"].append(time.perf_counter() - start)
            torch.cuda.synchronize()
            times["synced"].append(time.perf_counter() - start)
    finally:
        lmsys.train.profiling = original
    ms = {name: round(statistics.median(values) * 1e3, 2) for name, values in times.items()}
    return dict(host_forward_ms=ms["forward"], host_backward_ms=ms["backward"],
                host_optimizer_ms=ms["optimizer_step"], host_step_ms=ms["step"], synced_step_ms=ms["synced"])


def _make_step(name: str, model, args):
    """The variant's training step on `model`, with a fresh optimizer; and the optimizer."""
    variant = VARIANTS[name]
    optimizer = OPTIMIZERS[variant.optimizer](model.parameters())
    return make_train_step(model, optimizer, autocast_dtype=torch.bfloat16, compile=True,
                           compile_backend=args.compile_backend, **variant.options), optimizer


def _row(size, name, times, loop, first_step, work, peak, batch, peak_bytes) -> dict:
    median = statistics.median(times)
    tflops = work / (median * 1e-3) / 1e12
    row = dict(
        size=size, variant=name, median_ms=round(median, 2), min_ms=round(min(times), 2),
        max_ms=round(max(times), 2), loop_ms=round(loop, 2), tokens_per_s=round(batch[0].numel() / (median * 1e-3)),
        tflops=round(tflops, 1),
        mfu="" if peak is None else round(tflops / peak, 4),
        peak_gib="" if peak_bytes is None else round(peak_bytes / 2**30, 1),
        first_step_s=round(first_step, 1), error="",
    )
    print(f"  {size} {name}: {median:.2f} ms (back to back {loop:.2f} ms), {row['tflops']} TFLOP/s, MFU {row['mfu']}, "
          f"peak {row['peak_gib']} GiB (first step {first_step:.1f} s)", file=sys.stderr, flush=True)
    return row


def _look_closer(size, name, step, batch, row, args, device) -> None:
    """With --top, the profiler's tables of one more step; with --profile, the launch and host columns."""
    if args.top:
        prof = profiling.profile(step, *batch, warmup=0)
        print(f"\n### {size} {name}: one step's top {args.top} operators\n\n{profiling.table(prof, args.top)}\n",
              flush=True)
        averages = prof.key_averages()
        averages[:] = [event for event in averages if not event.is_user_annotation]
        print(f"\n### {size} {name}: the {args.top} operators with the most host time in one step\n\n"
              f"{averages.table(sort_by='self_cpu_time_total', row_limit=args.top)}\n", flush=True)
    if args.profile and device.type == "cuda":
        row.update(launch_profile(step, batch), **host_phases(step, batch, args.steps))
        print(f"  {size} {name}: " + ", ".join(f"{k} {row[k]}" for k in PROFILE_COLUMNS), file=sys.stderr,
              flush=True)


def _error_row(size: str, name: str, error: Exception) -> dict:
    """An out-of-memory case (or any failure) as a row, so that the sweep goes on."""
    out_of_memory = isinstance(error, torch.OutOfMemoryError)
    if not out_of_memory:
        traceback.print_exc()
    message = "out of memory" if out_of_memory else f"{type(error).__name__}: {error}".splitlines()[0]
    print(f"  {size} {name}: {message}", file=sys.stderr, flush=True)
    return dict(size=size, variant=name, error=message)


def _build(size: str, name: str, args, device: torch.device):
    """The model of a variant's group, a batch for it, its FLOPs per step and the device's bf16 peak."""
    variant = VARIANTS[name]
    config = dataclasses.replace(SIZES[size], context_length=args.context, attention=variant.attention)
    with torch.device(device):
        model = variant.model(config)
    batch = random_batch(args.batch, args.context, config.vocab_size, device)
    matmul_params = sum(p.numel() for p in model.parameters()) - model.embedding.weight.numel()
    work = flops.training_step_flops(matmul_params, args.batch, args.context, config.num_layers, config.d_model)
    peak = flops.peak_tflops(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    return model, batch, work, peak


def run_group(size: str, names: list[str], args, device: torch.device, on_row) -> None:
    """Time the variants `names`, which share one model, on a model of `size`, one after the other; `on_row(row)`
    with each row (an error, such as running out of memory, is a row with `error` set)."""
    model, batch, work, peak = _build(size, names[0], args, device)
    for name in names:
        try:
            step, _ = _make_step(name, model, args)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, first_step = time_steps(step, batch, args.warmup, args.steps)
            peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            row = _row(size, name, times, loop_ms(step, batch, args.steps), first_step, work, peak, batch, peak_bytes)
            _look_closer(size, name, step, batch, row, args, device)
        except Exception as error:
            row = _error_row(size, name, error)
        on_row(row)
        model.zero_grad(set_to_none=True)
        _release_memory()
    del model
    torch.compiler.reset()
    _release_memory()


def _resident_bytes(model, optimizer) -> int:
    """Bytes of the parameters and of the optimizer's state tensors."""
    tensors = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values()
                                      if isinstance(t, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_interleaved(size: str, groups: list[list[str]], args, device: torch.device, on_row) -> None:
    """Time the variants of `groups` (each a list of names sharing one model) with every model held at once: after
    each variant's compilation and warmup, --rounds rounds in which each variant in turn runs --steps timed steps.
    A drift of the host's speed during the run then lands on every variant alike. A variant's peak memory is its
    peak above what was allocated before its steps, plus its own model's parameters and optimizer state."""
    entries, rows = [], {}
    for names in groups:
        try:
            model, batch, work, peak = _build(size, names[0], args, device)
        except Exception as error:
            rows.update({name: _error_row(size, name, error) for name in names})
            continue
        for name in names:
            try:
                step, optimizer = _make_step(name, model, args)
                _, first_step = time_steps(step, batch, args.warmup, 1)
                entries.append(dict(name=name, model=model, step=step, optimizer=optimizer, batch=batch, work=work,
                                    peak=peak, first_step=first_step, times=[], loops=[], peak_bytes=None))
            except Exception as error:
                rows[name] = _error_row(size, name, error)
            model.zero_grad(set_to_none=True)
    backend = sweep.backend()
    for round_index in range(args.rounds):
        for entry in entries:
            if entry["name"] in rows:
                continue
            step, batch = entry["step"], entry["batch"]
            try:
                if device.type == "cuda" and round_index == 0:
                    held = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                entry["times"] += [s * 1e3 for s in sweep.time_steps(backend, lambda: step(*batch), 0, args.steps)]
                entry["loops"].append(loop_ms(step, batch, args.steps))
                if device.type == "cuda" and round_index == 0:
                    entry["peak_bytes"] = (torch.cuda.max_memory_allocated(device) - held
                                           + _resident_bytes(entry["model"], entry["optimizer"]))
            except Exception as error:
                rows[entry["name"]] = _error_row(size, entry["name"], error)
            entry["model"].zero_grad(set_to_none=True)
    for entry in entries:
        name = entry["name"]
        if name not in rows:
            row = rows[name] = _row(size, name, entry["times"], statistics.median(entry["loops"]),
                                    entry["first_step"], entry["work"], entry["peak"], entry["batch"],
                                    entry["peak_bytes"])
            try:
                _look_closer(size, name, entry["step"], entry["batch"], row, args, device)
            except Exception as error:
                rows[name] = _error_row(size, name, error)
    for names in groups:
        for name in names:
            on_row(rows[name])
    entries.clear()
    torch.compiler.reset()
    _release_memory()


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table, MFU as a percentage."""
    shown = pd.DataFrame([{
        "size": r["size"], "variant": r["variant"], "median ms": f"{r['median_ms']:.2f}",
        "min-max ms": f"{r['min_ms']:.2f}-{r['max_ms']:.2f}", "loop ms": f"{r['loop_ms']:.2f}",
        "tokens/s": f"{r['tokens_per_s']:,}",
        "TFLOP/s": f"{r['tflops']:.1f}",
        "MFU": "" if r["mfu"] == "" else f"{r['mfu']:.1%}", "peak GiB": r["peak_gib"],
        "first step s": f"{r['first_step_s']:.1f}",
    } if not r.get("error") else {"size": r["size"], "variant": r["variant"], "median ms": r["error"]} for r in rows])
    return markdown_table(shown)


def profile_markdown(rows: list[dict]) -> str:
    """The --profile columns of the rows that have them, as a markdown table."""
    profiled = [r for r in rows if not r.get("error") and "kernels" in r]
    if not profiled:
        return ""
    return markdown_table(pd.DataFrame([{"size": r["size"], "variant": r["variant"],
                                         **{k: r[k] for k in PROFILE_COLUMNS}} for r in profiled]))


def _is_reference(name: str) -> bool:
    return VARIANTS[name].model is ReferenceLM


def _graphs(name: str) -> bool:
    return VARIANTS[name].options.get("cuda_graphs", False)


def _compiled_alike(name: str) -> tuple[bool, bool, bool]:
    """What a variant shares with the plain step it is printed beside: CUDA graphs, inductor's max-autotune, and
    whether the blocks are compiled one by one."""
    options = VARIANTS[name].options
    return _graphs(name), options.get("max_autotune", False), options.get("compile_blocks", False)


def beside_reference(rows: list[dict]) -> str:
    """Each of our variants beside the plain-PyTorch step of the same size and compile settings (`_compiled_alike`),
    from the same run: both medians, ours over plain, tokens/s and MFU of each. Empty when the run has no
    plain step to compare."""
    ok = [r for r in rows if not r.get("error")]
    plain = {(r["size"], *_compiled_alike(r["variant"])): r for r in ok if _is_reference(r["variant"])}
    lines = []
    for r in ok:
        reference = plain.get((r["size"], *_compiled_alike(r["variant"])))
        if _is_reference(r["variant"]) or reference is None:
            continue
        mfu = (lambda row: "" if row["mfu"] == "" else f"{row['mfu']:.1%}")
        lines.append({
            "size": r["size"], "ours": r["variant"], "plain PyTorch": reference["variant"],
            "plain ms": f"{reference['median_ms']:.2f}", "ours ms": f"{r['median_ms']:.2f}",
            "ours / plain": f"{r['median_ms'] / reference['median_ms']:.3f}",
            "plain loop ms": f"{reference['loop_ms']:.2f}", "ours loop ms": f"{r['loop_ms']:.2f}",
            "plain tokens/s": f"{reference['tokens_per_s']:,}", "ours tokens/s": f"{r['tokens_per_s']:,}",
            "plain MFU": mfu(reference), "ours MFU": mfu(r),
        })
    return markdown_table(pd.DataFrame(lines)) if lines else ""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="where to write the table as CSV")
    parser.add_argument("--sizes", nargs="+", default=["large", "2.7B"], choices=list(SIZES))
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps, the first one compiling (>= 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="after timing a variant, profile one more step and print its N costliest operators")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with R > 1, the variants without CUDA graphs of a size are timed with all their models "
                        "held at once, in R interleaved rounds of --steps steps each (a drifting host speed lands on "
                        "all of them alike); CUDA-graph variants are timed one model after the other as with R = 1")
    parser.add_argument("--profile", action="store_true",
                        help="kernels per step, the device's busy time and the host's time per phase (CUDA only)")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Variants that share a model class and attention run on one model, in the order given; each variant recorded
    # as CUDA graphs gets a model of its own, so that the graphs' memory pool goes with it, and so does each one
    # that converts the model's weights to bf16 (the others must find them fp32) or compiles its blocks in place.
    groups = {}
    for name in args.variants:
        variant = VARIANTS[name]
        own = any(variant.options.get(option, False) for option in ("cuda_graphs", "bf16_weights", "compile_blocks"))
        key = variant.model, variant.attention, name if own else False
        groups.setdefault(key, []).append(name)
    order = {name: index for index, name in enumerate(args.variants)}
    rows = []

    def add(row):  # the CSV is rewritten after every variant, so an interrupted sweep keeps its rows
        rows.append(row)
        rows.sort(key=lambda r: (args.sizes.index(r["size"]), order[r["variant"]]))
        pd.DataFrame(rows, columns=COLUMNS + (PROFILE_COLUMNS if args.profile else [])).to_csv(args.csv, index=False)

    for size in args.sizes:
        eager = [names for names in groups.values() if not _graphs(names[0])]
        if args.rounds > 1 and eager:
            run_interleaved(size, eager, args, device, on_row=add)
        for names in groups.values():
            if _graphs(names[0]) or args.rounds == 1:
                run_group(size, names, args, device, on_row=add)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{device_name}, torch {torch.__version__}, bf16 autocast + torch.compile, batch {args.batch}, context "
          f"{args.context}; median of {args.steps} steps after {args.warmup} warmup steps"
          + (f" in each of {args.rounds} interleaved rounds (variants without CUDA graphs)" if args.rounds > 1 else "")
          + "\n")
    print(markdown(rows))
    for title, text in (("ours beside plain PyTorch, same settings, same run", beside_reference(rows)),
                        ("what one step launches, and the host's time to issue it", profile_markdown(rows))):
        if text:
            print(f"\n{title}:\n\n{text}")
    failed = [r for r in rows if r.get("error") and r["error"] != "out of memory"]
    if failed:
        sys.exit(f"{len(failed)} variant(s) failed: " + ", ".join(f"{r['size']} {r['variant']}" for r in failed))


if __name__ == "__main__":
    main()
