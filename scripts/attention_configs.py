"""The attention kernels at the training grid's short sequences: every route and every Triton config, beside cuDNN.

At each point (bf16, the training grid's batch x heads for each length; causal by default), one process, for the
pass asked for (`--pass forward` or `backward`; the backward's time is one `autograd.grad` from a kept forward):
- `default`: flash_triton as shipped (this GPU's measured choice of kernel, and the pinned configs);
- the Gluon routes where they take the shape (forward: `gluon`, with three consumer warpgroups `gluon-3wg` at d=64;
  backward: `gluon`, `gluon-concurrent`, `gluon-fused`);
- `triton <config>`: the Triton kernel with each config of flash_triton's candidate list and the extra ones below,
  timed by triton's autotuner (pins off, no small-problem pruning): what a wider search would pick;
- `sdpa_cudnn` and `sdpa_flash`: SDPA restricted to cuDNN and to FlashAttention-2.
`triton.testing.do_bench` medians in ms, except the autotuner's own timings of the Triton configs (its do_bench
median; the backward's exclude its preprocess kernel). Prints a markdown table per point and writes every row to
the CSV named.

    PYTHONPATH=. python scripts/attention_configs.py fwd.csv [--pass forward] [--seqs 512 1024 2048] [--dims 64 128]
        [--full]
"""

import argparse
import contextlib
import os

import pandas as pd
import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lmsys.attention import flash_triton, tuned
from lmsys.bench.attention import TRAINING_HEADS, TRAINING_TOKENS

# Tried beside flash_triton's own candidates. Forward, per head dim (the tiles' width, up to): (BLOCK_M, BLOCK_N,
# num_warps, num_stages, USE_TMA[, maxnreg]); backward: (BLOCK_BIG, BLOCK_M1, BLOCK_N2, num_warps, num_stages).
EXTRA_FORWARD = {
    64: [(64, 64, 4, 2, False), (64, 128, 4, 3, False), (128, 32, 4, 3, False), (64, 64, 2, 3, False),
         (128, 64, 4, 4, False), (64, 64, 4, 3, True), (128, 128, 8, 3, False)],
    128: [(64, 64, 4, 2, True), (64, 128, 4, 3, False), (64, 64, 4, 3, True), (128, 32, 4, 3, False),
          (128, 64, 4, 3, False), (128, 128, 8, 2, True), (64, 32, 4, 3, False), (128, 64, 8, 3, True, 128)],
}
EXTRA_BACKWARD = [(64, 32, 64, 4, 3), (64, 64, 32, 4, 3), (64, 64, 64, 8, 2), (128, 64, 32, 4, 3),
                  (128, 16, 32, 4, 3), (64, 32, 16, 4, 3), (128, 32, 128, 8, 2), (64, 16, 32, 4, 2)]
ROUTES = {"forward": ("gluon", "gluon-3wg"), "backward": ("gluon", "gluon-concurrent", "gluon-fused")}


def describe(config: triton.Config) -> str:
    kw, tail = config.kwargs, f" r{config.maxnreg}" if config.maxnreg else ""
    if "BLOCK_BIG" in kw:
        tiles = f"{kw['BLOCK_BIG']}/{kw['BLOCK_M1']}/{kw['BLOCK_N2']}"
    else:
        tiles = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}{' tma' if kw['USE_TMA'] else ''}"
    return f"{tiles} w{config.num_warps} s{config.num_stages}{tail}"


@contextlib.contextmanager
def wider_search(part: str):
    """The Triton kernel of `part` alone, autotuning afresh (pins off, no small-problem pruning) over its candidates
    and the extra ones; yields the kernel's autotuner. After the block the shipped lists are back: the shipped route's
    pins are fingerprinted with them."""
    if part == "forward":
        kernel, lists = flash_triton._flash_fwd_kernel, flash_triton._FWD_CONFIGS  # lists: bound into the pruning
        shipped = dict(lists), list(kernel.configs)
        lists.update({d: list(dict.fromkeys(c + [flash_triton._fwd_config(*t) for t in EXTRA_FORWARD.get(d, ())]))
                      for d, c in shipped[0].items()})
        kernel.configs = list(dict.fromkeys(c for configs in lists.values() for c in configs))
    else:
        kernel, lists = flash_triton._flash_bwd_kernel, {}
        shipped = {}, list(kernel.configs)
        kernel.configs = list(dict.fromkeys(shipped[1] + [
            triton.Config({"BLOCK_BIG": big, "BLOCK_M1": m1, "BLOCK_N2": n2}, num_warps=w, num_stages=s)
            for big, m1, n2, w, s in EXTRA_BACKWARD]))
    setting = "HOPPER_FORWARD" if part == "forward" else "HOPPER_BACKWARD"
    os.environ[tuned.ENV] = "0"
    try:
        with tuned._settings({flash_triton: {setting: False, "_SMALL_PROBLEM": 0}}):
            kernel.cache.clear()
            yield kernel
            kernel.cache.clear()
    finally:
        lists.update(shipped[0])
        kernel.configs = shipped[1]
        os.environ[tuned.ENV] = "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--pass", dest="part", choices=list(ROUTES), default="forward")
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128], choices=sorted(TRAINING_HEADS))
    parser.add_argument("--full", action="store_true", help="the unmasked points too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    rows = []
    for d in args.dims:
        for seq in args.seqs:
            for causal in (True, False) if args.full else (True,):
                shape = (TRAINING_TOKENS // seq, TRAINING_HEADS[d], seq, d)
                q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                point = dict(shape=str(shape), causal=causal, part=args.part)

                def record(what, ms):
                    rows.append(dict(**point, what=what, ms=ms))

                def ours():
                    if args.part == "forward":
                        return lambda: flash_triton.forward(q, k, v, causal)
                    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
                    o = flash_triton.FlashAttentionTriton.apply(*inputs, causal)
                    return lambda: torch.autograd.grad(o, inputs, do, retain_graph=True)

                def sdpa(backend):
                    with sdpa_kernel(backend):
                        if args.part == "forward":
                            return do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=causal), warmup=25, rep=100)
                        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
                        o = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=causal)
                        return do_bench(lambda: torch.autograd.grad(o, inputs, do, retain_graph=True), warmup=25,
                                        rep=100)

                record("default", do_bench(ours(), warmup=25, rep=100))
                for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                                      ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        record(name, sdpa(backend))
                    except RuntimeError as error:  # a backend that does not take the shape
                        print(f"{shape} {name}: {error}"[:200], flush=True)
                for route in ROUTES[args.part]:
                    if route == "gluon-3wg" and d != 64:
                        continue
                    with tuned._settings(tuned._choice_settings(args.part, route)):
                        try:
                            record(route, do_bench(ours(), warmup=25, rep=100))
                        except Exception as error:  # noqa: BLE001 - a route that does not take the shape
                            print(f"{shape} {route}: {type(error).__name__}: {error}"[:200], flush=True)
                with wider_search(args.part) as kernel:
                    call = ours()
                    call()
                    for config, timing in sorted(kernel.configs_timings.items(), key=lambda item: item[1][0]):
                        record(f"triton {describe(config)}", timing[0])
                    record("triton (the best config, do_bench)", do_bench(call, warmup=25, rep=100))
                table = pd.DataFrame([r for r in rows if r["shape"] == point["shape"] and r["causal"] == causal])
                print(f"\n{args.part} {shape} causal={causal}\n" + table[["what", "ms"]].sort_values("ms").to_markdown(
                    index=False, floatfmt=".4f"), flush=True)
    pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
