"""The attention forward at the training grid's short sequences: every route and every Triton config, beside cuDNN.

At each point (bf16, the training grid's batch x heads for each length; causal by default), one process:
- `default`: flash_triton's forward as shipped (the GPU's measured choice of kernel and pinned config);
- `gluon`, `gluon-3wg` (d=64): the Gluon kernel with two or three consumer warpgroups, where it takes the shape;
- `triton <config>`: the Triton kernel with each config of flash_triton's candidate list for the head dim and the
  extra ones below, timed by triton's autotuner (pins off, no small-problem pruning): what a wider search would pick;
- `sdpa_cudnn`: SDPA restricted to cuDNN.
`triton.testing.do_bench` medians in ms, except the autotuner's own timings of the Triton configs (its do_bench
median). Prints a markdown table per point and writes every row to the CSV named.

    PYTHONPATH=. python scripts/attention_forward_configs.py fwd.csv [--seqs 512 1024 2048] [--dims 64 128] [--full]
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

# (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA[, maxnreg]) tried beside flash_triton._FWD_TILES.
EXTRA_TILES = {
    64: [(64, 64, 4, 2, False), (64, 128, 4, 3, False), (128, 32, 4, 3, False), (64, 64, 2, 3, False),
         (128, 64, 4, 4, False), (64, 64, 4, 3, True), (128, 128, 8, 3, False)],
    128: [(64, 64, 4, 2, True), (64, 128, 4, 3, False), (64, 64, 4, 3, True), (128, 32, 4, 3, False),
          (128, 64, 4, 3, False), (128, 128, 8, 2, True), (64, 32, 4, 3, False), (128, 64, 8, 3, True, 128)],
}


def describe(config: triton.Config) -> str:
    kw = config.kwargs
    tail = f" r{config.maxnreg}" if config.maxnreg else ""
    tma = " tma" if kw["USE_TMA"] else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages}{tma}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128], choices=sorted(TRAINING_HEADS))
    parser.add_argument("--full", action="store_true", help="the unmasked points too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    kernel = flash_triton._flash_fwd_kernel
    shipped = {d: list(configs) for d, configs in flash_triton._FWD_CONFIGS.items()}, list(kernel.configs)
    widened = {d: list(dict.fromkeys(configs + [flash_triton._fwd_config(*t) for t in EXTRA_TILES.get(d, ())]))
               for d, configs in shipped[0].items()}
    rows = []
    for d in args.dims:
        for seq in args.seqs:
            for causal in (True, False) if args.full else (True,):
                shape = (TRAINING_TOKENS // seq, TRAINING_HEADS[d], seq, d)
                q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                point = dict(shape=str(shape), causal=causal)

                def record(what, ms):
                    rows.append(dict(**point, what=what, ms=ms))

                record("default", do_bench(lambda: flash_triton.forward(q, k, v, causal), warmup=25, rep=100))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa
                    record("sdpa_cudnn", do_bench(f, warmup=25, rep=100))
                for choice in ("gluon", "gluon-3wg") if d == 64 else ("gluon",):
                    with tuned._settings(tuned._choice_settings("forward", choice)):
                        try:
                            record(choice, do_bench(lambda: flash_triton.forward(q, k, v, causal), warmup=25, rep=100))
                        except Exception as error:  # noqa: BLE001 - a route that does not take the shape
                            print(f"{shape} {choice}: {type(error).__name__}: {error}"[:200], flush=True)
                # The wider search: pins off, every candidate (the candidate lists are put back after it, so the
                # shipped route's pins, fingerprinted with its own list, apply at the next point).
                os.environ[tuned.ENV] = "0"
                flash_triton._FWD_CONFIGS.update(widened)
                kernel.configs = list(dict.fromkeys(c for configs in widened.values() for c in configs))
                settings = {flash_triton: {"HOPPER_FORWARD": False, "_SMALL_PROBLEM": 0}}
                with tuned._settings(settings):
                    kernel.cache.clear()
                    flash_triton.forward(q, k, v, causal)
                    for config, timing in sorted(kernel.configs_timings.items(), key=lambda item: item[1][0]):
                        record(f"triton {describe(config)}", timing[0])
                    record("triton (best config, do_bench)",
                           do_bench(lambda: flash_triton.forward(q, k, v, causal), warmup=25, rep=100))
                    kernel.cache.clear()
                flash_triton._FWD_CONFIGS.update(shipped[0])
                kernel.configs = shipped[1]
                os.environ[tuned.ENV] = "1"
                table = pd.DataFrame([r for r in rows if r["shape"] == point["shape"] and r["causal"] == causal])
                print(f"\n{shape} causal={causal}\n" + table[["what", "ms"]].sort_values("ms").to_markdown(
                    index=False, floatfmt=".4f"), flush=True)
    pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
