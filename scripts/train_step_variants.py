"""Variants of the training step, timed side by side in one process: which of them pays? (issue 11)

For each size (large and 2.7B by default): bf16 autocast + torch.compile, batch 4, context 512, random tokens;
CUDA events around each step, the median of 20 steps after 8 warmup steps (how the plain-PyTorch reference numbers
were taken). Prints a markdown table (ms, TFLOP/s, MFU, peak memory, the first step's wall time, which holds
the compilation) and writes every row to the CSV file named on the command line.

    PYTHONPATH=. python scripts/train_step_variants.py variants.csv          (from the repository root)
    PYTHONPATH=. python scripts/train_step_variants.py variants.csv --sizes large --variants ours ours-compile-loss

Variants (model, attention, optimizer, make_train_step options):
    reference                     the plain-PyTorch model (lmsys.reference_model), SDPA, torch's fused AdamW
    ours-torch-adamw              lmsys.model, SDPA, torch's fused AdamW
    ours                          lmsys.model, SDPA, lmsys AdamW (the fused Triton kernel)
    ours-cuda-graphs              lmsys.model, SDPA, lmsys AdamW, forward and backward replayed as CUDA graphs
    ours-flash_triton-cuda-graphs ... with our Triton FlashAttention as the attention
    reference-cuda-graphs         the plain-PyTorch model and torch's fused AdamW, with the same CUDA graphs
  not in the default set (each adds a compilation; run them with --variants):
    ours-compile-loss             lmsys.model, SDPA, lmsys AdamW, the cross-entropy compiled with the model
    ours-flash_triton-compile-loss  ... with our Triton FlashAttention as the attention
    ours-flash_triton             lmsys.model, flash_triton, lmsys AdamW, the loss outside the compiled model
    ours-compiled-foreach         lmsys.model, SDPA, torch's foreach AdamW with its step compiled (compile_optimizer)

With `--top N`, each variant's timing is followed by the torch.profiler table of one more step (the N operators
with the most device time), to see where two variants differ.

Variants that share a model (class and attention) run on one model object, one after the other, each with a fresh
optimizer; dynamo reuses the model's compiled graph where it can. Models are freed between groups and sizes. Without
CUDA the script runs on the CPU (wall-clock timing, no MFU), for a smoke test with `--sizes tiny`.
"""

import argparse
import dataclasses
import functools
import gc
import statistics
import sys
import time
import traceback

import pandas as pd
import torch

from lmsys import flops, profiling
from lmsys.bench import sweep
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.perf.report import markdown_table
from lmsys.reference_model import ReferenceLM
from lmsys.train import make_train_step, random_batch

OPTIMIZERS = {
    "torch-fused": functools.partial(torch.optim.AdamW, fused=True),
    "torch-foreach": functools.partial(torch.optim.AdamW, foreach=True),
    "lmsys": AdamW,
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
    "ours-compile-loss": Variant(TransformerLM, "sdpa", "lmsys", dict(compile_loss=True)),
    "ours-flash_triton-compile-loss": Variant(TransformerLM, "flash_triton", "lmsys", dict(compile_loss=True)),
    "ours-flash_triton": Variant(TransformerLM, "flash_triton", "lmsys"),
    "ours-compiled-foreach": Variant(TransformerLM, "sdpa", "torch-foreach", dict(compile_optimizer=True)),
    "ours-cuda-graphs": Variant(TransformerLM, "sdpa", "lmsys", dict(cuda_graphs=True)),
    "ours-flash_triton-cuda-graphs": Variant(TransformerLM, "flash_triton", "lmsys", dict(cuda_graphs=True)),
    "reference-cuda-graphs": Variant(ReferenceLM, "sdpa", "torch-fused", dict(cuda_graphs=True)),
}
DEFAULT_VARIANTS = ["reference", "ours-torch-adamw", "ours", "ours-cuda-graphs", "ours-flash_triton-cuda-graphs",
                    "reference-cuda-graphs"]
COLUMNS = ["size", "variant", "median_ms", "min_ms", "max_ms", "tflops", "mfu", "peak_gib", "first_step_s", "error"]


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


def _time_variant(size, name, model, batch, work, peak, args, device) -> dict:
    """One variant's row: its step built on `model`, timed, and with `--top`, profiled."""
    variant = VARIANTS[name]
    optimizer = OPTIMIZERS[variant.optimizer](model.parameters())
    step = make_train_step(model, optimizer, autocast_dtype=torch.bfloat16, compile=True,
                           compile_backend=args.compile_backend, **variant.options)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, first_step = time_steps(step, batch, args.warmup, args.steps)
    median = statistics.median(times)
    tflops = work / (median * 1e-3) / 1e12
    row = dict(
        size=size, variant=name, median_ms=round(median, 2), min_ms=round(min(times), 2),
        max_ms=round(max(times), 2), tflops=round(tflops, 1),
        mfu="" if peak is None else round(tflops / peak, 4),
        peak_gib="" if device.type != "cuda" else round(torch.cuda.max_memory_allocated(device) / 2**30, 1),
        first_step_s=round(first_step, 1), error="",
    )
    print(f"  {size} {name}: {median:.2f} ms, {row['tflops']} TFLOP/s, MFU {row['mfu']}, peak {row['peak_gib']} GiB "
          f"(first step {first_step:.1f} s)", file=sys.stderr, flush=True)
    if args.top:
        prof = profiling.profile(step, *batch, warmup=0)
        print(f"\n### {size} {name}: one step's top {args.top} operators\n\n{profiling.table(prof, args.top)}\n",
              flush=True)
    return row


def run_group(size: str, names: list[str], args, device: torch.device, on_row) -> None:
    """Time the variants `names`, which share one model, on a model of `size`; `on_row(row)` with each row (an
    error, such as running out of memory, is a row with `error` set)."""
    first = VARIANTS[names[0]]
    config = dataclasses.replace(SIZES[size], context_length=args.context, attention=first.attention)
    with torch.device(device):
        model = first.model(config)
    batch = random_batch(args.batch, args.context, config.vocab_size, device)
    matmul_params = sum(p.numel() for p in model.parameters()) - model.embedding.weight.numel()
    work = flops.training_step_flops(matmul_params, args.batch, args.context, config.num_layers, config.d_model)
    peak = flops.peak_tflops(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    for name in names:
        try:
            row = _time_variant(size, name, model, batch, work, peak, args, device)
        except Exception as error:  # an out-of-memory case (or any failure) is a row, and the sweep goes on
            out_of_memory = isinstance(error, torch.OutOfMemoryError)
            if not out_of_memory:
                traceback.print_exc()
            message = "out of memory" if out_of_memory else f"{type(error).__name__}: {error}".splitlines()[0]
            row = dict(size=size, variant=name, error=message)
            print(f"  {size} {name}: {message}", file=sys.stderr, flush=True)
        on_row(row)
        model.zero_grad(set_to_none=True)
        _release_memory()
    del model
    torch.compiler.reset()
    _release_memory()


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table, MFU as a percentage."""
    shown = pd.DataFrame([{
        "size": r["size"], "variant": r["variant"], "median ms": f"{r['median_ms']:.2f}",
        "min-max ms": f"{r['min_ms']:.2f}-{r['max_ms']:.2f}", "TFLOP/s": f"{r['tflops']:.1f}",
        "MFU": "" if r["mfu"] == "" else f"{r['mfu']:.1%}", "peak GiB": r["peak_gib"],
        "first step s": f"{r['first_step_s']:.1f}",
    } if not r.get("error") else {"size": r["size"], "variant": r["variant"], "median ms": r["error"]} for r in rows])
    return markdown_table(shown)


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
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Variants that share a model class and attention run on one model, in the order given; those recorded as CUDA
    # graphs get a model of their own, so that the graphs' memory pool goes with it.
    groups = {}
    for name in args.variants:
        variant = VARIANTS[name]
        key = variant.model, variant.attention, variant.options.get("cuda_graphs", False)
        groups.setdefault(key, []).append(name)
    order = {name: index for index, name in enumerate(args.variants)}
    rows = []

    def add(row):  # the CSV is rewritten after every variant, so an interrupted sweep keeps its rows
        rows.append(row)
        rows.sort(key=lambda r: (args.sizes.index(r["size"]), order[r["variant"]]))
        pd.DataFrame(rows, columns=COLUMNS).to_csv(args.csv, index=False)

    for size in args.sizes:
        for names in groups.values():
            run_group(size, names, args, device, on_row=add)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{device_name}, torch {torch.__version__}, bf16 autocast + torch.compile, batch {args.batch}, context "
          f"{args.context}; median of {args.steps} steps after {args.warmup} warmup steps\n")
    print(markdown(rows))
    failed = [r for r in rows if r.get("error") and r["error"] != "out of memory"]
    if failed:
        sys.exit(f"{len(failed)} variant(s) failed: " + ", ".join(f"{r['size']} {r['variant']}" for r in failed))


if __name__ == "__main__":
    main()
