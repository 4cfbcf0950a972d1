"""FlashAttention backward for Hopper (sm_90) in Gluon: two warp-specialized kernels in the style of FA3.

The Triton backward (flash_triton) waits for every tensor-core product right after issuing it. Here, as in the Gluon
forward (flash_hopper), a one-warp producer streams the tiles with TMA through rings of shared buffers guarded by
mbarriers, and two consumer warpgroups issue the warpgroup MMAs asynchronously, waiting only for the product the
next step needs:

* `_dkdv_kernel`: a program owns 128 keys (64 per consumer warpgroup), holds their K and V in shared memory (with
  FUSED_DQ at d=64 K in registers too, S^T's A operand: K_IN_REGISTERS) and dK, dV in registers, and visits the query
  tiles (TILES: rows of Q and dO, with their log-sum-exp and delta). On transposed scores: S^T = K Q^T and dP^T = V
  dO^T are issued together; the probabilities P^T = exp2(S^T - lse) are computed while dP^T is still on the tensor
  cores; dV += P^T dO is issued before dS^T = P^T (dP^T - delta) is formed, and dK += dS^T Q after it, both with their
  A operand from registers (dK's from shared memory where `ds_from_shared` says so).
* `_dq_kernel`: a program owns 128 query rows (64 per warpgroup) and visits the key tiles (TILES: rows of K and V):
  S = Q K^T and dP = dO V^T, then dQ += dS K.

Like the Triton backward (and unlike FA3, which accumulates dQ with atomics) the scores are computed twice, once per
kernel: no atomics and no fp32 dQ buffer. FUSED_DQ (by default on long causal problems, at d=64 and 128, measured
below) takes FA3's way: the dK/dV kernel also forms each query tile's dQ = dS K over its keys and adds it into an fp32
buffer with TMA's bulk reduction, and the dQ kernel does not run. delta = rowsum(dO * O) comes from the Triton
preprocessing kernel. The two kernels share only their inputs: on problems of few programs (CONCURRENT_DQ, `plan`)
the dQ kernel runs on a side stream beside the other, except under CUDA-graph capture.

Scope: what the Gluon forward takes (`flash_hopper.views`: sm_90, bf16 or fp16, lengths multiples of 128, q, k, v
and dO contiguous or the (B, H, T, D) views of (B, T, H, D) tensors), head dims 64 and 128, problems of at least
MIN_PROGRAMS_PER_SM programs per multiprocessor (MIN_PROGRAMS_PER_SM_CONCURRENT with the kernels side by side).
`flash_triton` runs it for such inputs unless `flash_triton.HOPPER_BACKWARD` is off (LMSYS_HOPPER_BACKWARD=0 at
import). tests/test_attention.py compiles both kernels for sm_90 on any machine (no spilled register) and checks them
against float64 on a Hopper GPU.

Measured on the H100 (2026-11-23, scripts/attention_backward_variants.py, causal bf16 backward, median of 30 calls):
at the CS336 leaderboard's (16, 16384, 64) 3.456 ms against the Triton backward's 3.542 (cuDNN 3.041); on the causal
grid (batch 1, one head) from 32768 tokens 0.854-5.53 ms against 1.052-6.344 (13-19% faster; cuDNN 0.795-4.871), but
at 8192 and 16384 tokens (64 and 128 programs for 132 multiprocessors) up to 1.8x slower at d=128 (0.320 against
0.178 ms at 8192). Recomputing the scores costs 7 tensor-core products against cuDNN's 5. FA3's dQ, formed in the
dK/dV kernel from dS^T staged in shared memory and reduce-added into an fp32 dQ by TMA (through the Gluon builder's
create_async_tma_reduce, which hopper.tma does not expose), saves two of them; it was built and passed the float64
tests on the H100 but measured 3-26% slower at the leaderboard and every grid point from 8192 tokens (3.615 against
3.513 ms at the leaderboard, 6.421 against 5.536 at 65536 tokens and d=128: the fp32 reduce traffic and the staged
dS^T cost more than the products saved), and was removed (its code: commit 5a184b2). A second one, both warpgroups'
dS^T staged in one buffer so that each query tile's dQ is reduce-added once per program (half that traffic), passed
the float64 tests on the H100 and was slower still (2026-11-24, same run: 5.023 ms at the leaderboard against this
backward's 3.565 and cuDNN's 3.019, with the 128-row query tiles it needs there, themselves 5.729 ms; at d=128
0.336-5.63 ms against 0.319-5.52 from 8192 to 65536 tokens): removed (its code: commit 2cb9bc4). So were query
tiles of 128 rows at d=64 (FA3's tile there), and PIPELINED, a dK/dV loop that issued the next query tile's S^T and
dP^T before waiting for this tile's dK and dV: right, and slower at every point (4.285 ms at the leaderboard; its
code: commit e944207). Why, read later from its sm_90 build (2026-11-25): ptxas serialized its warpgroup MMAs (C7511,
"insufficient register resources for the wgmma pipeline": each k-step of 16 waited for as soon as issued); there the
next tile's S^T and dP^T need registers of their own while dV and dK still read P^T and dS^T. The compile tests now fail
on it (and on C7514). The loop here drains its MMAs at the end of every step (`warpgroup_mma_wait(0)` after dK), and the
next S^T and dP^T take the registers that P^T and dS^T held. A second PIPELINED (2026-11-25, session 49; its code:
commit b56a94c) fit the registers. ptxas serialized every loop tried that issued the next tile's S^T and dP^T in one
step and read them in the next (message C7514, "non wgmma instructions reading accumulator registers": with the last
tile peeled, with the products issued past the last tile on whatever its slot held, even with each step ending in a wait
for every product), so it issued each tile's dK product in the next tile's step, behind that tile's S^T and dP^T and
under its softmax, each step still ending with nothing in flight, and a ring of 3 stages (a slot is released a step
later). It compiled at d=64 without a spill or a serialized product and passed the float64 GPU tests, and was slower in
each of 4 repeats at the leaderboard (the H100, `scripts/attention_backward_variants.py --points leaderboard --modes bwd
--repeats 4 --variants default pipelined sdpa_cudnn`: 3.644 ms, repeats 3.462-3.685, against this backward's 3.419,
3.392-3.468, and cuDNN's 3.022, 3.003-3.041): removed.

The kernels side by side (2026-11-24, session 44, the H100, `scripts/attention_backward_variants.py --points
leaderboard grid --modes bwd --repeats 2`, causal bf16, medians of 2 repeats of 30 calls, same run): on the causal
grid (batch 1, one head: 64 to 512 dQ programs for 132 multiprocessors) the backward with its dQ kernel on a side
stream took, from 8192 to 65536 tokens, 0.148, 0.263, 0.826 and 3.305 ms at d=64 (one after the other: 0.218, 0.419,
0.844, 3.325; the Triton backward 0.126 at 8192, 0.418 at 16384; cuDNN 0.198, 0.386, 0.793, 3.079) and 0.203, 0.404,
1.301 and 5.488 ms at d=128 (one after the other 0.321, 0.644, 1.427, 5.509; Triton 0.179 at 8192, 0.474 at 16384;
cuDNN 0.296, 0.585, 1.181, 4.945). At the leaderboard (2048 programs) 3.439 ms against 3.408 one after the other
(cuDNN 3.037). Hence `plan`: from 16384 keys, side by side below 8 programs per multiprocessor and from 0.75, the
Triton backward below that; shorter problems (the model's, among them) were not timed side by side and keep the
kernels one after the other from 1.5, as does CUDA-graph capture (side by side there: untried). The default as `plan`
has it, in a later run (2026-11-24, session 45, the same command with `--modes bwd fwd_bwd --variants default hopper
hopper-concurrent sdpa_cudnn`; its GPU tests, capture included, passed the same start): at 16384 tokens 0.264 ms at
d=64 and 0.403 at d=128 (side by side 0.262 and 0.404; cuDNN 0.383 and 0.589), at 8192 the Triton backward's 0.124
and 0.174 (cuDNN 0.196 and 0.293); from 32768 still behind cuDNN (0.826 against 0.794 ms at d=64, 1.328 against
1.178 at d=128), as at the leaderboard (3.383 against 3.015).

Where the time goes (2026-11-24, the H100, `scripts/attention_backward_variants.py --points leaderboard --modes bwd
--kernels 10`, the leaderboard's backward, one product being 16 * 16384^2 * 64 * 2 / 2 FLOPs): this backward 3.494 ms
(cuDNN 3.049 in the same run), of which the dK/dV kernel 2.112 ms (4 products: 521 TFLOPS), the dQ kernel 1.323 ms
(3 products: 623 TFLOPS) and the delta kernel 0.026 ms; cuDNN's is one kernel of 2.913 ms (5 products: 472 TFLOPS)
and 0.085 ms for its delta and its dQ's conversion from fp32. Both kernels here already run faster per product than
cuDNN's: with 7 products, matching cuDNN needs 642 TFLOPS over both, so the dK/dV kernel is the one to speed up.

Two tries at that (2026-11-24, the H100, `scripts/attention_backward_variants.py --points leaderboard grid --modes bwd
fwd_bwd --repeats 3 --kernels 5`, causal bf16, medians of 3 repeats of 30 calls, kernels from 5 profiled calls):
* PREFETCH_STATS, each query tile's log-sum-exp and delta loaded a step ahead, is the default at d=64: causal, the
  dK/dV kernel 0.6-5.0% faster (at the leaderboard 2.004 against 2.110 ms; on the grid from 8192 to 65536 tokens 123.9,
  252.5, 498.5 and 2033 us against 129.2, 256.4, 518.3 and 2046), the backward 3.395 ms at the leaderboard against
  3.470 (cuDNN 3.029; forward and backward 4.654 against 4.720, cuDNN 4.333) and 0.213-3.33 ms on the grid against
  0.218-3.48 (cuDNN 0.195-3.04). At d=128, where it spills 256 bytes of registers, it gained nothing (0.322-5.55 ms
  against 0.322-5.54). Without the mask (the same command with --not-causal, the same day) the dK/dV kernel ran
  4.5-14% faster at d=64 (the leaderboard's shape 3.805 against 3.983 ms; on the grid 115.1, 235.7, 905.9 and 3612 us
  against 125.4, 252.7, 1001 and 4211), the backward 6.656 ms at the leaderboard's shape against 6.854 (cuDNN 5.861;
  forward and backward 9.085 against 9.363, cuDNN 8.314) and 0.203-6.56 ms on the grid against 0.213-6.94 (cuDNN
  0.187-5.81).
* A_IN_REGISTERS, the operands each kernel keeps for its whole loop (K and V in the dK/dV kernel, Q and dO in the dQ
  kernel) loaded once into registers as the A operand of the S and dP products, instead of both operands of each
  read from shared memory: slower at every point, in both kernels (the backward 3.530 ms at the leaderboard; the dK/dV
  kernel at d=64 3-8% slower, the dQ kernel at d=128 3-11% slower; the dQ kernel's alone, at d=64, no faster).
  Removed (its code: commit d988373).

GROUPED_ORDER, the forwards' launch order (2026-11-25, session 46, the H100, `scripts/attention_backward_variants.py
--points leaderboard grid --modes bwd fwd_bwd --repeats 2 --variants default grouped sdpa_cudnn`; its GPU test passed
the same start): at the leaderboard the backward 3.478 ms against 3.553 (cuDNN 3.016), forward and backward 4.626
against 4.663 (cuDNN 4.285). Not taken: on the grid's one-head points, where both orders launch the same programs in
the same order, the variant timed second in each turn was up to 3.8% faster too (3.554 against 3.695 ms at 65536
tokens and d=64), so the leaderboard's 2.1% is within the position's bias; the script now reverses the turn on odd
repeats. A list-scheduling model of the leaderboard's 2048 programs on 132 multiprocessors puts the gain of the order
at 0.8% per kernel. Measured again with the turns reversed (2026-11-25, session 47, the H100, `--points leaderboard
--modes bwd --repeats 4 --variants default grouped sdpa_cudnn` at da83f0b, its GPU test passed the same start): the
backward 3.400 ms against 3.436 (cuDNN 3.018), faster in each of the 4 repeats (by 0.4-1.9%), timed first or
second: the default since. In the run after (2026-11-25, session 47, at e6f22bc, `--points leaderboard --modes bwd
fwd_bwd --repeats 2 --variants default ungrouped sdpa_cudnn --power 3`): the backward 3.404 ms against 3.476
ungrouped (cuDNN 3.008), forward and backward 4.710 against 4.774 (cuDNN 4.346).

Power (the same run's --power 3: each variant back to back for 3 s, twice): under that sustained load the H100 ran
every backward at 1440-1545 MHz (1980 MHz idle) and 555-655 W, seldom at its power cap (this backward's first window
36% of its readings, no other); this backward 4.03 ms and 2.45 J per call, cuDNN's 3.64 ms and 2.24 J, ungrouped 4.12
ms and 2.42 J. Per call it takes 9% more energy than cuDNN's (with 40% more tensor-core products), and its 11% more
time is not the power cap's doing: both ran at about the same clock and power. On another machine start (2026-11-25,
session 48, at 738ee3e, `--points leaderboard --modes bwd --repeats 2 --variants default ungrouped sdpa_cudnn --power
3`) every window was at the power cap for all its readings, at 1665-1710 MHz and 692-719 W: this backward 3.70 ms and
2.62 J per call, ungrouped 3.72 ms and 2.59 J, cuDNN's 3.32 ms and 2.34 J (the short timings: 3.478, 3.530 and 3.043
ms). Capped or not, the gap is the same: 11% more time and 9-12% more energy per call than cuDNN's.

The causal grid, forward and backward, by default (2026-11-25, session 49, the H100, at 1170f44,
`scripts/attention_backward_variants.py --points grid --modes fwd_bwd --repeats 2 --variants default sdpa_cudnn`,
medians of the 2 repeats' medians, cuDNN's in brackets): at d=64, from 8192 to 65536 tokens, 0.195 (0.272), 0.613
(0.530), 1.195 (1.194) and 4.524 (4.451) ms; at d=128 0.315 (0.418), 0.661 (0.782), 1.718 (1.771) and 7.143 (6.920).
Behind at d=64 from 16384 tokens and at d=128 at 65536. At d=64 and 16384 tokens both repeats were behind (0.598 and
0.628 ms, cuDNN 0.528 and 0.532), where the gate's baseline of 2026-11-23 (0021_h100-gluon-bwd) had 0.526 against
cuDNN's 0.535, with the Triton backward. This backward, its dQ kernel beside the dK/dV one, has taken that point since
2026-11-24 (`plan`), for its backward alone timed faster (0.264 ms against the Triton one's 0.418, above): forward
and backward together are slower there all the same. Not yet split into its kernels. At d=64 and 32768
tokens the default read 1.266 ms timed first and 1.125 timed second: these one-head points need more than 2 repeats.

That point split (2026-11-26, session 50, the H100, at ac0a9e8, `scripts/attention_backward_variants.py --points grid
--seqs 16384 --head-dims 64 --modes fwd bwd fwd_bwd --repeats 4 --variants default hopper hopper-concurrent triton
sdpa_cudnn --kernels 5`): forward + backward by default 0.428 ms (the kernels side by side 0.428, one after the other
0.599, the Triton backward 0.478, cuDNN 0.533), the backward 0.269 (0.267, 0.428, 0.320; cuDNN 0.387), the forward
0.162 (cuDNN 0.149); profiled, the dK/dV kernel 264 us, the dQ kernel 168 and the Triton forward 160, as before. The
kernels had not slowed down. What most likely moved is the CPU: the script's clock (the gate's eager one,
`CudaBackend.time_call`) queues a 0.5 ms device-side sleep ahead of each call, and a call whose backward the CPU
issues later than that sleep and the forward take on the GPU leaves the GPU waiting. Issued behind a longer sleep in
batches of 20, a forward + backward here took the CPU 0.42-0.99 ms per call on this session's two machine starts (the
Triton backward 0.39-0.50, cuDNN 0.18-0.34; the same launches read 0.92 and 0.46 in one run: the CPU's time is that
noisy) against 0.42 ms of GPU work, so a slower or busier CPU reads more; session 49's CPU was not measured. The perf
suite times the causal grid eagerly from 8192 tokens (GRAPH_MAX_SEQ), so its verdict there can move with the CPU too.
The grid again at 14be70a, on the next machine start (`--points grid --modes fwd_bwd --repeats 4 --variants default
triton sdpa_cudnn`; medians of 4, cuDNN in brackets): at d=64 from 8192 to 65536 tokens 0.201 (0.272), 0.427 (0.539),
1.162 (1.197) and 4.462 (4.448) ms; at d=128 0.295 (0.396), 0.620 (0.794), 1.703 (1.775) and 6.949 (6.932). Behind
cuDNN at 65536 tokens alone, by 0.3% at d=64 and 0.2% at d=128.

FUSED_DQ on the H100 (2026-11-26, session 52; its float64 GPU tests, `pytest tests/test_attention.py -k fused`, passed
first in the same start; `scripts/attention_backward_variants.py --points leaderboard --modes bwd fwd_bwd --repeats 2
--variants default hopper hopper-fused sdpa_cudnn --kernels 5`, then `--points grid --modes bwd --repeats 2 --variants
hopper hopper-fused sdpa_cudnn`; causal bf16, medians of 30 calls, same run). At the leaderboard the backward took 3.167
and 3.629 ms (the second repeat noisy: std 1.85 ms) against 3.337/3.435 by default (the two kernels), 3.399/3.402 with
them one after the other, and cuDNN's 3.012/3.055; forward and backward 4.532/4.558 ms against 4.709/4.740 by default
and cuDNN's 4.302/4.270. Per call under the profiler: the dK/dV kernel with dQ 3.179 ms, the buffer's zeroing 0.020 and
its cast 0.034, against 2.002 + 1.316 ms for the two kernels, and cuDNN's one kernel of 2.909 (with 0.046 and 0.039 for
its delta and dQ cast). On the grid at d=64 (batch 1, one head; "hopper": the two kernels one after the other), from
8192 to 65536 tokens: 0.209, 0.406, 0.811-0.839 and 3.077-3.134 ms against 0.220, 0.427, 0.847-1.008 and 3.283-3.545
(cuDNN 0.199, 0.385-0.387, 0.784-0.793 and 3.004-3.030; by default, measured in session 45, 0.124 (Triton), 0.264 (side
by side), 0.826 and 3.305). So it is faster than the two kernels one after the other at every point (7% at the
leaderboard in the quiet repeat, 6-12% at 65536 tokens: 3.9 dK/dV programs per multiprocessor), slower than them side by
side at 16384 tokens, and still 2-5% behind cuDNN; its fp32 buffer raises the peak memory by 4 bytes per dQ element (161
against 97 MiB at the leaderboard's backward, cuDNN's 162): not the default yet, which would change the committed
attention baselines' memory. Each consumer warpgroup reduce-adds its own dQ tile there, so a query tile's dQ goes
through L2 twice per program (about 8 GiB of fp32 reductions at the leaderboard); FUSED_SPLIT, built next, halves that.

FUSED_SPLIT on the H100 (2026-11-26, session 53, the kernels as at b66b722, one machine start; its float64 GPU tests,
`pytest tests/test_attention.py -k fused`, passed first: 26 passed, 20 skipped for d=128). At the leaderboard
(`--points leaderboard --modes bwd fwd_bwd --repeats 2 --variants hopper-fused hopper-fused-split sdpa_cudnn --kernels
5`) the backward took 3.181/3.178 ms against FUSED_DQ's 3.173/3.226 and cuDNN's 3.048/3.014, forward and backward
4.491/4.443 against 4.594/4.518 and cuDNN's 4.287/4.304; under the profiler its dK/dV kernel 3.146 ms against FUSED_DQ's
3.106 (cuDNN's kernel 2.932). No faster there. On the grid at d=64 (`--points grid leaderboard --head-dims 64 --seqs
16384 32768 65536 --modes bwd --repeats 3 --variants default hopper-fused hopper-fused-split sdpa_cudnn`, medians of 3,
the same start) it is: from 16384 to 65536 tokens 0.385, 0.765 and 2.910 ms against FUSED_DQ's 0.407, 0.811 and 3.101,
the default's 0.266, 0.828 and 3.269, and cuDNN's 0.385, 0.770 and 3.013, so faster than cuDNN at 65536 tokens (by
3.4%) and level at 32768; at the leaderboard in that run 3.342 ms (FUSED_DQ 3.251, the default 3.489, cuDNN 3.007).
The leaderboard (16 heads of 16384) and 65536 tokens (one head) take the same products; at the leaderboard FUSED_DQ took
5% more time (3.251 against 3.101 ms) and FUSED_SPLIT 15% more (3.342 against 2.910), cuDNN the same. The dK/dV kernel's
launch order puts 6 heads in a group (by q's and dO's bytes, `launch_order.group_heads`), whose fp32 dQ brings the
group's streamed and reduced tiles to about 48 MB, L2's size, against 32 MB for the one head of 65536 tokens, whose 3.9
programs per multiprocessor (15.5 at the leaderboard) come back to a query tile in fewer waves: FUSED_GROUP_HEADS (the
variants "-g1", "-g2" and "-g4": 1, 2 and 4 heads a group) is built to test that.

FUSED_GROUP_HEADS on the H100 (2026-11-26, session 54, the kernels as at fdb3e28, one machine start; `pytest
tests/test_attention.py -k "variants_gpu and fused"` first: 12 passed). At the leaderboard's backward (`--points
leaderboard --modes bwd --repeats 3`, medians of each repeat's 30 calls), FUSED_SPLIT with groups of 1, 2, 4 and the
default 6 heads: 3.117/3.195/3.127, 3.182/3.304/3.202, 3.381/3.317/3.257 and 3.243/3.342/3.314 ms; FUSED_DQ with 1, 2
and 6: 3.523/3.290/3.274, 3.216/3.244/3.206 and 3.246/3.228/3.166; cuDNN 3.011/3.004/3.011. Groups of one head take
FUSED_SPLIT's penalty down by about 0.15 ms (half of it: 2.910 ms at one head of 65536 tokens) and do nothing for
FUSED_DQ, so the L2 working set explains part of it; still 4% behind cuDNN at the leaderboard, so both stayed off.

The default since session 55 (2026-11-26, the H100, the kernels as at df10891, one machine start; `pytest
tests/test_attention.py -k "fused or accumulates_dq"` first: 41 passed, 20 skipped for d=128): FUSED_DQ by size with
FUSED_SPLIT and groups of one head (`--points leaderboard grid --head-dims 64 --seqs 16384 32768 65536 --modes bwd
fwd_bwd --repeats 2 --variants default fused-plan fused-plan-fwd64 sdpa_cudnn`, medians of 2 repeats of 30 calls;
"default" the two kernels as before). At the leaderboard the backward 3.146 ms against 3.551 (cuDNN 3.040), forward
and backward 4.386 against 4.774 (cuDNN 4.306); at one head of 32768 and 65536 tokens forward and backward 1.097 and
4.072 ms against 1.110 and 4.520 (cuDNN 1.182, 4.499); at 16384 tokens (not fused: the two kernels side by side)
0.424 against 0.458 (cuDNN 0.532). Under Nsight Compute at the leaderboard (one backward, clocks left alone) its dK/dV
kernel took 3.007 ms against cuDNN's one kernel's 2.925, with the same L2 traffic (11.07 against 11.01 GB, both 135M
sectors of fp32 reductions) and tensor pipes 46.9% against 48.2% busy; the buffer's zeroing, its cast and delta 0.077
ms against cuDNN's 0.082. On the device's time alone (`--clock queued`, same start as below) the leaderboard's forward
and backward is 4.278 ms against cuDNN's 4.190, the backward 3.070 against 2.999: the dK/dV kernel is the gap.

Tried for it and slower (session 55, the same start; `--points leaderboard grid --head-dims 64 --seqs 16384 32768 65536
--modes bwd fwd_bwd --repeats 3 --clock queued`, medians of 3): 3 stages of Q and dO tiles (NUM_STAGES, the variant
"fused-3stages"), at the leaderboard's backward 3.057 ms against 3.070, at 32768 and 65536 tokens 0.794 and 3.014
against 0.765 and 2.888; and each tile's dQ product issued in the next tile's step, behind its S^T and dP^T and under
its softmax, from three dS^T buffers (without PREFETCH_STATS: with both it spilled 132 bytes), 3.371, 0.836 and 3.197
ms: 10% slower, removed (its code: commit 4a2d9b0).

FUSED_DQ at d=128 (session 55, with FUSED_SPLIT; `--points grid leaderboard-d128 --head-dims 128 --seqs 16384 32768
65536 --modes bwd fwd_bwd --repeats 2 --clock queued --variants default fused-64 sdpa_cudnn`, "fused-64" the two
kernels at d=128; medians of 2, the H100, one start): forward and backward at one head of 32768 and 65536 tokens 1.615
and 6.333 ms against the two kernels' 1.666 and 6.501 (cuDNN 1.734 and 6.409), the backward 1.244 and 4.817 against
1.284 and 5.028 (cuDNN 1.153 and 4.466); at the leaderboard's shape at d=128, (16, 16384, 128), 6.613 against 7.013
(cuDNN 6.354), the backward 4.928 against 5.406 (cuDNN 4.670). With dS^T in registers for dK too (72 bytes spilled)
it was 1% slower (6.403 ms at 65536 tokens, 6.669 at the leaderboard's shape), and with P^T also through shared memory
for dV (44 bytes spilled, its dS^T stored once dV had read P^T) slower than the two kernels (6.748 against 6.602 ms at
65536 tokens, an earlier start).

dS^T from shared memory at d=64 (FUSED_DS_SMEM; session 55, `--points leaderboard grid --head-dims 64 --seqs 16384
32768 65536 --modes bwd fwd_bwd --repeats 3 --clock queued --variants default fused-ds-smem sdpa_cudnn`, medians of 3,
the H100, one start; "default" then dS^T from registers at every size): at the leaderboard the backward 3.011 ms
against 3.060 (cuDNN 3.006), forward and backward 4.214 against 4.288 (cuDNN 4.194); at one head of 32768 and 65536
tokens forward and backward 1.049 and 4.004 ms against 1.034 and 3.981 (cuDNN 1.181, 4.397). Hence `ds_from_shared`.

K from registers (K_IN_REGISTERS; session 56, the H100, `--points leaderboard --modes bwd fwd_bwd --repeats 4 --clock
queued`, then `--points grid --head-dims 64 --seqs 32768 65536 --modes bwd --repeats 2 --clock queued`, one start,
medians; "default" then K from shared memory). Each 64 x 64 product with both operands in shared memory reads 4 KB
per 32 clocks, the multiprocessor's whole 128 bytes a clock; a step of a warpgroup reads about 112 KB of shared memory
(its S^T, dP^T, dK and dQ operands, dV's dO, dS^T and dQ stored, the reduction's read, its share of the Q and dO
tiles). With K in registers and dK's dS^T in registers too ("k-registers-ds-registers") the leaderboard's backward took
2.985 ms against 3.013 (cuDNN 3.002), forward and backward 4.202 against 4.241 (cuDNN 4.192); with dS^T still from
shared memory 3.019 (and 3.020 against 3.012 in an earlier start: no gain). On one head of 32768 and 65536 tokens
0.7429 and 2.838 ms against 0.7536 and 2.885 (cuDNN 0.786 and 3.014; the earlier start: 0.738 and 2.838 against
0.751 and 2.885). K and V both in registers spilled 196 bytes. Tried the same session and slower, removed: each tile's
dQ stored and reduce-added in the next step, under its S^T and dP^T (3.384 ms against 3.011 at the leaderboard; ptxas
waits for the reduction's shared-memory read between the two products there, and it spilled 76 bytes); one of every
2 or 4 exponentials by a polynomial on the FMA pipes (as FlashAttention 4 does; 16 ex2 a clock per multiprocessor
take 512 clocks a step for both warpgroups): 3.010 and 3.043 ms against 3.011, and in the Triton forward at d=64 1.401
and 1.289 ms against 1.201 (cuDNN 1.194), so the exponentials are not what bounds either kernel; dQ's softmax scale
applied in the fp32 buffer's cast instead of to each tile (16 fewer multiplies a step): 3.019 against 3.013 ms at the
leaderboard, 0.774 and 2.962 against 0.754 and 2.885 on one head. Under a sustained load (`--power 4`, forward and
backward back to back for 4 s, every reading at the power cap, 1680-1725 MHz) forward and backward took 4.642 ms and
3.23 J per call, cuDNN 4.594 ms and 3.21 J (K from shared memory; K from registers with dS^T from shared memory
4.651 ms and 3.23 J there).

The warpgroups taking turns to form each step's dQ (FUSED_TURNS, session 59, commit c9a6feb): in a step one of them
formed the query tile's whole dQ over the program's 128 keys (one dQ product reading dS^T once, where FUSED_SPLIT's two
each read it whole) and reduce-added it, while the other went on to the next step, waiting only before it overwrote
its rows of a dS^T buffer not yet read (a second mbarrier per buffer). It compiled at d=64 without a spill and passed
the float64 GPU test, and was 8-11% slower (2026-11-26, the H100, `--points leaderboard grid --head-dims 64 --seqs
16384 32768 65536 --modes bwd fwd_bwd --repeats 3 --clock queued --variants default fused-turns sdpa_cudnn`, medians
of 3): at the leaderboard the backward 3.242 ms against 2.982 (cuDNN 3.001), forward and backward 4.432 against 4.172
(cuDNN 4.191); at one head of 32768 and 65536 tokens the backward 0.820 and 3.141 ms against 0.747 and 2.836. The
warpgroup forming dQ holds the step's Q and dO tiles until its longer product is done, so the other waits for the
ring's next tile all the same. Removed.
"""

import contextlib
import functools
import math

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lmsys.attention import flash_hopper, launch_order, launcher, plans
from lmsys.attention.checks import check_causal
from lmsys.attention.flash_hopper import ring, stream_kv

BLOCK_KEYS = 128  # keys per _dkdv_kernel program: two consumer warpgroups of 64
BLOCK_ROWS = 128  # query rows per _dq_kernel program: two consumer warpgroups of 64
# The tiles the kernels visit, per head dim: (query rows of a _dkdv_kernel tile, keys of a _dq_kernel tile). Each
# compiles for sm_90 without a spilled register (tests/test_attention.py); so does a dQ tile of 128 keys, at either
# head dim, and 3 stages with tiles of 64 (scripts/attention_backward_variants.py times them).
TILES = {64: (64, 64), 128: (64, 64)}
NUM_STAGES = 2
HEAD_DIMS = (64, 128)
# Programs (of the dQ kernel: 128 query rows each) per multiprocessor from which flash_triton takes this backward, its
# two kernels one after the other: on the H100 it was faster than the Triton backward at 256 programs (1.9 per
# multiprocessor) and more, slower at 128 and fewer, where the Triton backward's smaller blocks fill more of the GPU
# (measured: module docstring). With the dQ kernel beside the dK/dV one (CONCURRENT_DQ), from
# MIN_PROGRAMS_PER_SM_CONCURRENT: at 128 programs it was faster than the Triton backward, at 64 slower.
MIN_PROGRAMS_PER_SM = 1.5
MIN_PROGRAMS_PER_SM_CONCURRENT = 0.75
CONSUMER_REGS = 240
PRODUCER_REGS = 24
# Whether the dQ kernel runs on a side stream beside the dK/dV kernel (they share only their inputs), so that a
# problem of few programs, whose two grids each leave multiprocessors idle, fills the GPU with both: None, by the
# problem's size (below CONCURRENT_BELOW_PROGRAMS_PER_SM programs per multiprocessor and from CONCURRENT_MIN_KEYS
# keys, where it was measured faster; at 2048 programs, 15.5 per multiprocessor, it was 0.9% slower; shorter problems,
# such as the model's 512-token heads, were not measured that way and keep the kernels one after the other), True or
# False, always or never. Never while a CUDA graph is captured: there the kernels run one after the other, from
# MIN_PROGRAMS_PER_SM.
CONCURRENT_DQ: bool | None = None
CONCURRENT_BELOW_PROGRAMS_PER_SM = 8
CONCURRENT_MIN_KEYS = 16384
# The problems, as (is_causal, head dim), for which the dK/dV kernel loads each query tile's log-sum-exp and delta
# (from global memory: one latency per step, the step's S^T and softmax waiting on the first, its dS^T on the second)
# one step ahead, into registers kept across the step. It compiles for sm_90 without a spill at d=64 alone (256 bytes
# spill at d=128), and there it made the dK/dV kernel 0.6-5.0% faster with the mask and 4.5-14% without it on the H100
# (module docstring).
PREFETCH_STATS = {(True, 64), (False, 64)}
# Whether both kernels take the forwards' launch order (`launch_order.program_position`: heads in groups whose
# streamed tiles share L2, the heaviest block of every head in the group first) instead of a grid of (blocks, heads),
# which runs the heads one after the other, each from its heaviest block down to its lightest. About 1% faster at the
# leaderboard on the H100 (module docstring); on one head the two orders launch the same programs.
GROUPED_ORDER = True
# Whether the dK/dV kernel also accumulates dQ, as FA3 does (for head dims in FUSED_HEAD_DIMS; the others keep the dQ
# kernel): each step's dQ tile = dS K over the warpgroup's 64 keys, computed from dS^T written to shared memory, is
# added into an fp32 buffer by TMA's bulk reduction, so the scores are computed once (5 products per step instead of the
# two kernels' 7), at the cost of that traffic (per query tile, an fp32 tile per 64 keys) and of the buffer, cast into
# dq at the end. True or False: always or never (at FUSED_HEAD_DIMS); None, the default: by the problem's size
# (`fused`), causal problems from FUSED_MIN_KEYS keys and FUSED_MIN_PROGRAMS_PER_SM programs per multiprocessor. On the
# H100 (causal, d=64), with FUSED_SPLIT and groups of one head, it was faster than the two kernels at one head of 32768
# and 65536 tokens (1.9 and 3.9 programs per multiprocessor) and at the leaderboard (16 heads of 16384: 15.5), 1-11%
# for forward and backward in the same run, slower at one head of 16384 (0.97), where the two kernels run side by
# side (module docstring); the sizes between, and problems without the mask, were not timed. Its fp32 buffer adds 4
# bytes per dQ element to the backward's peak memory.
FUSED_DQ: bool | None = None
FUSED_MIN_KEYS = 16384
FUSED_MIN_PROGRAMS_PER_SM = 1.9
# With FUSED_DQ, whether each consumer warpgroup forms half of a query tile's dQ columns over all the program's 128
# keys instead of all its columns over its own 64: both warpgroups' dS^T in one shared buffer (two, in turns), an
# mbarrier between them, and K loaded once more as two tiles of half its columns (the B operands). One fp32 reduction
# per query tile and program instead of two (half that traffic), and a dQ tile of half the registers. On the H100
# as fast as FUSED_DQ at the leaderboard and 6% faster on one head from 32768 tokens (module docstring): on.
FUSED_SPLIT = True
# With FUSED_DQ and GROUPED_ORDER, heads per group of the dK/dV kernel's launch order (None: as without FUSED_DQ, by
# the bytes of q and dO alone, 6 heads at the leaderboard, whose fp32 dQ then makes the group's streamed and reduced
# tiles about 48 MB, L2's size). One head a group took FUSED_SPLIT's leaderboard backward from 3.24-3.34 ms to
# 3.12-3.20 on the H100 (module docstring): the default.
FUSED_GROUP_HEADS: int | None = 1
# The head dims at which the dK/dV kernel accumulates dQ: 64, and 128 with FUSED_SPLIT and 2 stages only. At d=128 dK
# and dV take 64 fp32 registers each, and a whole dQ tile would take 64 more (formed in two halves of 64 columns it
# spilled 72-84 bytes, 2026-11-26); with FUSED_SPLIT (half its columns: 32 registers) dK's A operand dS^T is read from
# the shared buffer dQ's takes anyway, and dQ has one buffer (two do not fit shared memory). Its causal sm_90 build
# still spills 104 bytes (tests/test_attention.py bounds it), and was measured faster than the two kernels at every
# size the rule takes, and than cuDNN on one head from 32768 tokens (module docstring).
FUSED_HEAD_DIMS = (64, 128)
# With FUSED_SPLIT, whether dK's A operand dS^T is read from the shared buffer dQ's is stored in (at d=128 always),
# instead of from registers: None, by the problem's size (`ds_from_shared`: from FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM),
# True or False, always or never at d=64. With K from shared memory (K_IN_REGISTERS off) it made the leaderboard's
# backward 1.6% faster on the H100 (16 heads of 16384: 15.5 programs per multiprocessor) and one head of 32768 or 65536
# tokens (1.9, 3.9) about 1% slower (module docstring); the sizes between were not timed. With K from registers (the
# default) never: from registers it was faster at each of those sizes.
FUSED_DS_SMEM: bool | None = None
FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM = 8
# With FUSED_DQ at d=64, whether the dK/dV kernel reads K, the A operand of S^T = K Q^T, from registers (loaded once
# per program) instead of from shared memory at every step (at d=128 its 32 more registers do not fit): a warpgroup MMA
# of 64 x 64 with both operands in shared memory reads 4 KB per 32 clocks, all of the multiprocessor's 128 bytes a
# clock. Then dK's dS^T comes from registers too (`ds_from_shared`). On the H100 the backward was 0.9% faster at the
# leaderboard (2.985 ms against 3.013, cuDNN 3.002) and 1.5% on one head of 32768 and 65536 tokens (module docstring).
K_IN_REGISTERS = True
# The fp32 dQ tiles' shared buffers and the dQ buffer's TMA descriptor. A row of 64 fp32 (256 bytes) is wider than
# the 128-byte swizzle: triton keeps the tile as two of 32 columns and two warps each issue one's reduction (the
# compiled kernel's descriptor boxes are 64 x 32). Unswizzled, the rows of a warp's stores would fall in the same banks.
DQ_ACC_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA's bulk reduction (cp.reduce.async.bulk.tensor, add) of the shared tile src into tensor_desc's global tile
    at coord, completed like a TMA store (tma.store_wait): Gluon 3.6 builds it (create_async_tma_reduce) but exposes
    no function for it on Hopper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


def plan(programs_per_sm: float, keys: int, capturing: bool) -> bool | None:
    """How this backward runs a problem of `programs_per_sm` dQ programs per multiprocessor and `keys` keys: True, its
    dQ kernel on a side stream beside the dK/dV kernel; False, one after the other; None, not at all (the Triton
    backward runs it). `capturing`: whether a CUDA graph is being captured (then never side by side)."""
    if capturing:
        concurrent = False
    elif CONCURRENT_DQ is None:
        concurrent = programs_per_sm < CONCURRENT_BELOW_PROGRAMS_PER_SM and keys >= CONCURRENT_MIN_KEYS
    else:
        concurrent = CONCURRENT_DQ
    floor = min(MIN_PROGRAMS_PER_SM, MIN_PROGRAMS_PER_SM_CONCURRENT) if concurrent else MIN_PROGRAMS_PER_SM
    return concurrent if programs_per_sm >= floor else None


def fused(head_dim: int, programs_per_sm: float, keys: int, is_causal: bool) -> bool:
    """Whether the dK/dV kernel accumulates dQ (FUSED_DQ) for a problem of this head dim, `programs_per_sm` programs
    per multiprocessor and `keys` keys, causal or not."""
    if head_dim not in FUSED_HEAD_DIMS or (head_dim > 64 and (not FUSED_SPLIT or NUM_STAGES > 2)):
        return False
    if FUSED_DQ is not None:
        return FUSED_DQ
    return is_causal and keys >= FUSED_MIN_KEYS and programs_per_sm >= FUSED_MIN_PROGRAMS_PER_SM


def ds_from_shared(head_dim: int, programs_per_sm: float) -> bool:
    """With FUSED_SPLIT, whether dK's A operand dS^T is read from shared memory (FUSED_DS_SMEM) for a problem of this
    head dim and `programs_per_sm` programs per multiprocessor: at d=128 always (from registers it spilled more and was
    slower there, FUSED_HEAD_DIMS); at d=64 never with K_IN_REGISTERS (measured faster at every size timed), else from
    FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM."""
    if head_dim > 64:
        return True
    if FUSED_DS_SMEM is not None:
        return FUSED_DS_SMEM
    return not K_IN_REGISTERS and programs_per_sm >= FUSED_DS_SMEM_MIN_PROGRAMS_PER_SM


class BackwardPlan:
    """How these kernels run a backward (`views`): the 2-D views (`flash_hopper._view`) of q, k, v and do, whether
    the dK/dV kernel reads dK's dS^T from shared memory (`ds_smem`), accumulates dQ (`fused_dq`), and whether the dQ
    kernel runs beside it (`concurrent`); and once `backward` has launched them, the launches (`launcher.Launch`) and
    their arguments that are not tensors. A caller keeps it for later inputs of the same signature (shapes, strides,
    dtype, device, alignment, capture state): lmsys.attention.plans."""

    __slots__ = ("qv", "kv", "vv", "dov", "ds_smem", "fused_dq", "concurrent", "is_causal", "split", "dkdv", "dq",
                 "dkdv_scalars", "dq_scalars")

    def __init__(self, qv, kv, vv, dov, ds_smem, fused_dq, concurrent):
        self.qv, self.kv, self.vv, self.dov = qv, kv, vv, dov
        self.ds_smem, self.fused_dq, self.concurrent = ds_smem, fused_dq, concurrent
        self.is_causal = self.split = self.dkdv = self.dq = self.dkdv_scalars = self.dq_scalars = None


def views(q, k, v, do, is_causal) -> BackwardPlan | None:
    """A `BackwardPlan` when these kernels run this backward, else None."""
    if q.shape[-1] not in HEAD_DIMS or do.shape != q.shape or not q.is_cuda:
        return None
    # The plan before the views: a problem that runs on the Triton backward (the launch-bound ones) leaves without them.
    per_sm = flash_hopper.blocks_per_sm(q, BLOCK_ROWS)
    concurrent = plan(per_sm, k.shape[-2], torch.cuda.is_current_stream_capturing())
    found = None if concurrent is None else flash_hopper.views(q, k, v, head_dims=HEAD_DIMS)
    dov = flash_hopper._view(do) if found is not None else None
    if dov is None:
        return None
    fused_dq = fused(q.shape[-1], per_sm, k.shape[-2], is_causal)
    ds_smem = fused_dq and FUSED_SPLIT and ds_from_shared(q.shape[-1], per_sm)
    return BackwardPlan(*found, dov, ds_smem, fused_dq, concurrent and not fused_dq)


@gluon.constexpr_function
def _mma_layout(cols):
    """The layout of a consumer warpgroup's MMA result with `cols` columns (its 4 warps along the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _a_layout(cols):
    """The layout of a 16-bit A operand from registers for an MMA whose result has `cols` columns."""
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(cols), k_width=2)


# ------------------------------------------------------------------------------------------------ dK, dV


@gluon.jit
def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, kc_desc, k_smem, v_smem, q_smem, do_smem, kc_smem, kv_bar, ready,
                   empty, k_row, k_col, v_row, v_col, q_row, q_col, do_row, do_col, n_tiles,
                   BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr):
    half: gl.constexpr = k_desc.block_type.shape[0]
    if SPLIT:  # and K's columns in two halves, each over the program's keys
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes
                        + 2 * kc_desc.block_type.nbytes)
        for c in gl.static_range(2):
            tma.async_copy_global_to_shared(kc_desc, [k_row, k_col + c * kc_desc.block_type.shape[1]], kv_bar,
                                            kc_smem.index(c))
    else:
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [k_row + w * half, k_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [v_row + w * half, v_col], kv_bar, v_smem.index(w))
    for j in range(n_tiles):
        slot = j % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase of parity 1: the first round passes at once.
        mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + j * BLOCK_M, q_col], ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [do_row + j * BLOCK_M, do_col], ready.index(slot),
                                        do_smem.index(slot))


@gluon.jit
def _issue_dv_dk(p, dp_token, dv, dk, q_tile, do_tile, DELTA, stat_row, cols, delta_ahead, ds_w,
                 a_layout: gl.constexpr, PREFETCH: gl.constexpr, DS_SMEM: gl.constexpr):
    """A query tile's dV += P^T dO issued, then (once dP^T is in, while dV is on the tensor cores) dS^T = P^T (dP^T -
    delta) formed and dK += dS^T Q issued: their tokens, the register operands they read, to keep until waited, and
    dS^T (16-bit, in the MMA layout). delta is loaded here, or with PREFETCH it is delta_ahead, loaded a step
    earlier. With DS_SMEM dS^T is stored into ds_w first and dK's A operand read from there (no register
    operand: the one returned is p_op again)."""
    p_op = gl.convert_layout(p.to(q_tile.dtype), a_layout)
    dv_token = warpgroup_mma(p_op, do_tile, dv, is_async=True)
    if PREFETCH:
        delta = delta_ahead
    else:
        delta = gl.load(DELTA + stat_row + cols)
    dp = warpgroup_mma_wait(1, deps=[dp_token])
    ds = (p * (dp - gl.expand_dims(delta, 0))).to(q_tile.dtype)
    if DS_SMEM:
        ds_w.store(ds)
        fence_async_shared()
        gl.thread_barrier()  # every thread's rows stored before the product reads them
        ds_op = p_op
        dk_token = warpgroup_mma(ds_w, q_tile, dk, is_async=True)
    else:
        ds_op = gl.convert_layout(ds, a_layout)
        dk_token = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
    return dv_token, dk_token, p_op, ds_op, ds


@gluon.jit
def _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys, lo, hi,
               qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M: gl.constexpr,
               NUM_STAGES: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr,
               PREFETCH: gl.constexpr, FUSED: gl.constexpr, SPLIT: gl.constexpr, WG: gl.constexpr,
               DS_SMEM: gl.constexpr):
    """Query tiles [lo, hi) (counted from the first one the program visits, m_first) into dK, dV. Each tile's
    log-sum-exp and delta are loaded from global memory in its step, or with PREFETCH one step ahead
    (PREFETCH_STATS). With FUSED (FUSED_DQ) each tile's dQ = dS K over these keys too, through ds_smem (dS^T) and
    one of the two buffers of dq_smem, added into dq_desc's rows by TMA; with SPLIT (FUSED_SPLIT) the columns of dQ
    in kc_w's (this warpgroup's, WG, half of them) over both warpgroups' keys, their dS^T in one of ds_smem's two
    buffers, each filled once both have arrived on its ds_bar. k_op: S^T's A operand, k_w or its registers
    (K_IN_REGISTERS)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    half: gl.constexpr = k_w.shape[0]
    # With DS_SMEM (SPLIT, `ds_from_shared`) dK's A operand dS^T is read from shared memory (where dQ's is stored
    # anyway), which leaves the registers of its 16-bit copy free; at d=128 dQ has one buffer (two do not fit shared
    # memory there).
    N_DQ: gl.constexpr = dq_smem.shape[0]
    s_zero = gl.zeros([half, BLOCK_M], gl.float32, s_layout)
    if FUSED:
        dq_cols: gl.constexpr = dq_desc.block_type.shape[1]
        dq_zero = gl.zeros([BLOCK_M, dq_cols], gl.float32, _mma_layout(dq_cols))
    if PREFETCH:
        end = (m_first + hi) * BLOCK_M
        ahead = (m_first + lo) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_layout)
        lse_ahead = gl.load(LSE + stat_row + ahead, mask=ahead < end, other=0.0)
        delta_ahead = gl.load(DELTA + stat_row + ahead, mask=ahead < end, other=0.0)
    for j in range(lo, hi):
        slot = j % NUM_STAGES
        cols = (m_first + j) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_layout)
        if PREFETCH:
            lse2 = lse_ahead * LOG2E
            delta = delta_ahead
            ahead = cols + BLOCK_M
            lse_ahead = gl.load(LSE + stat_row + ahead, mask=ahead < end, other=0.0)
            delta_ahead = gl.load(DELTA + stat_row + ahead, mask=ahead < end, other=0.0)
        else:
            lse2 = gl.load(LSE + stat_row + cols) * LOG2E
            delta = 0.0  # _issue_dv_dk loads it
        mbarrier.wait(ready.index(slot), (j // NUM_STAGES) & 1)
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        s_token = warpgroup_mma(k_op, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_token = warpgroup_mma(v_w, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # MMA groups complete in order: waiting for all but the newest waits for S^T alone.
        s = warpgroup_mma_wait(1, deps=[s_token])
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))
        if MASK:
            p = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), p, 0.0)
        if DS_SMEM:  # this warpgroup's rows of the step's dS^T buffer (SPLIT: below)
            ds_w = ds_smem.index(j % 2).slice(WG * half, half)
        else:
            ds_w = ds_smem
        dv_token, dk_token, p_op, ds_op, ds = _issue_dv_dk(p, dp_token, dv, dk, q_tile, do_tile, DELTA, stat_row,
                                                           cols, delta, ds_w, a_layout, PREFETCH, DS_SMEM)
        if FUSED:
            # dQ = dS K, its A operand dS^T from shared memory, transposed.
            if SPLIT:
                # This warpgroup's rows of the step's buffer: the other warpgroup last read it two steps ago, and
                # has since arrived on the other buffer's barrier, after waiting for that product.
                ds_all = ds_smem.index(j % 2)
                if not DS_SMEM:  # else stored for dK already
                    ds_all.slice(WG * half, half).store(ds)
                    fence_async_shared()
                    gl.thread_barrier()  # every thread's rows stored before the warpgroup's one arrival
                mbarrier.arrive(ds_bar.index(j % 2))
                mbarrier.wait(ds_bar.index(j % 2), (j // 2) & 1)
                dq_token = warpgroup_mma(ds_all.permute((1, 0)), kc_w, dq_zero, use_acc=False, is_async=True)
            else:  # the buffer is free: last step's product was waited for
                ds_smem.store(ds)
                fence_async_shared()
                dq_token = warpgroup_mma(ds_smem.permute((1, 0)), k_w, dq_zero, use_acc=False, is_async=True)
            dv, dk, p_op, ds_op, dq = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op, dq_token])
            mbarrier.arrive(empty.index(slot))
            # The reduction issued from this buffer (one of two; at d=128 the only one) two steps (one) ago has read
            # it.
            dq_buffer = dq_smem.index(j % N_DQ)
            tma.store_wait(N_DQ - 1)
            dq_buffer.store(dq * sm_scale)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [stat_row + (m_first + j) * BLOCK_M, WG * dq_cols if SPLIT else 0], dq_buffer)
        else:
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op])
            mbarrier.arrive(empty.index(slot))
    return dk, dv


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, dq_desc, LSE, DELTA, k_w, v_w, q_smem, do_smem, ds_smem, dq_smem, kc_w, ds_bar,
                   kv_bar, ready, empty, out_row, stat_row, key0, m_first, n_masked, n_tiles, qk_scale, sm_scale,
                   CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                   PREFETCH: gl.constexpr, FUSED: gl.constexpr, SPLIT: gl.constexpr, WG: gl.constexpr,
                   DS_SMEM: gl.constexpr, K_REGS: gl.constexpr):
    half: gl.constexpr = k_w.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    a_layout: gl.constexpr = _a_layout(HEAD_DIM)
    keys = key0 + gl.arange(0, half, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([half, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([half, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    if K_REGS:  # K_IN_REGISTERS
        k_op = k_w.load(_a_layout(BLOCK_M))
    else:
        k_op = k_w
    if CAUSAL:
        # The query tiles that overlap the program's keys need the mask; those after them do not.
        dk, dv = _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys,
                            0, n_masked, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M,
                            NUM_STAGES, True, s_layout, a_layout, PREFETCH, FUSED, SPLIT, WG, DS_SMEM)
        dk, dv = _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys,
                            n_masked, n_tiles, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M,
                            NUM_STAGES, False, s_layout, a_layout, PREFETCH, FUSED, SPLIT, WG, DS_SMEM)
    else:
        dk, dv = _dkdv_loop(dk, dv, k_w, k_op, v_w, q_smem, do_smem, ready, empty, LSE, DELTA, stat_row, m_first, keys,
                            0, n_tiles, qk_scale, sm_scale, ds_smem, dq_smem, dq_desc, kc_w, ds_bar, BLOCK_M,
                            NUM_STAGES, False, s_layout, a_layout, PREFETCH, FUSED, SPLIT, WG, DS_SMEM)
    # Epilogue: through this warpgroup's K and V buffers (no longer read) and TMA stores; the wait covers the dQ
    # reductions too.
    k_w.store((dk * sm_scale).to(dk_desc.dtype))
    v_w.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [out_row, 0], k_w)
    tma.async_copy_shared_to_global(dv_desc, [out_row, 0], v_w)
    tma.store_wait(0)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, kc_desc, LSE, DELTA, N_Q, N_K, H, BH,
                 GROUP_HEADS, qk_scale, sm_scale,
                 Q_RB, Q_RH, Q_CB, Q_CH, K_RB, K_RH, K_CB, K_CH, V_RB, V_RH, V_CB, V_CH,
                 DO_RB, DO_RH, DO_CB, DO_CH,
                 HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PREFETCH: gl.constexpr,
                 GROUPED: gl.constexpr, FUSED: gl.constexpr, SPLIT: gl.constexpr,
                 DS_SMEM: gl.constexpr, K_REGS: gl.constexpr):
    HALF: gl.constexpr = k_desc.block_type.shape[0]  # keys per consumer warpgroup
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # The heaviest (causal: the first keys, which every later query sees) first.
    if GROUPED:  # in program_position's order without the mask: the first blocks first
        off_bh, block = launch_order.program_position(N_K, BH, GROUP_HEADS, 2 * HALF, False)
    else:
        block = gl.program_id(0)
        off_bh = gl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    key0 = block * 2 * HALF
    if CAUSAL:
        m_first = key0 // BLOCK_M  # earlier queries see none of these keys
        n_masked = 2 * HALF // BLOCK_M
    else:
        m_first = 0
        n_masked = 0
    n_tiles = N_Q // BLOCK_M - m_first

    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # Q and dO tiles share a ring's barriers: a tile's pair arrives, and is released, together.
    q_smem, ready, empty = ring(q_desc, NUM_STAGES, HEAD_DIM, 2)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    # Not read unless FUSED (and SPLIT):
    ds_0, ds_1, dq_0, dq_1, kc_0, kc_1, kc_smem, ds_bar = k_smem, k_smem, k_smem, k_smem, k_smem, k_smem, k_smem, kv_bar
    if FUSED:  # per consumer warpgroup two fp32 dQ tiles (one may still be read by its reduction; d=128: one)
        dq_cols: gl.constexpr = dq_desc.block_type.shape[1]
        N_DQ: gl.constexpr = 1 if HEAD_DIM > 64 else 2
        dq_0 = gl.allocate_shared_memory(gl.float32, [N_DQ, BLOCK_M, dq_cols], dq_desc.layout)
        dq_1 = gl.allocate_shared_memory(gl.float32, [N_DQ, BLOCK_M, dq_cols], dq_desc.layout)
        if SPLIT:  # two buffers of both warpgroups' dS^T, their barriers (an arrival each), K's two column halves
            ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF, BLOCK_M], q_desc.layout)
            ds_0, ds_1 = ds_smem, ds_smem
            ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(ds_bar.index(i), count=2)
            kc_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF, dq_cols], kc_desc.layout)
            kc_0, kc_1 = kc_smem.index(0), kc_smem.index(1)
        else:  # per consumer warpgroup, dS^T
            ds_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_M], q_desc.layout)
            ds_0, ds_1 = ds_smem.index(0), ds_smem.index(1)

    stat_row = off_bh * N_Q  # lse and delta (and the fp32 dQ): contiguous, one row per head
    out_row = off_bh * N_K + key0  # dK and dV are contiguous: (B*H*N_K, D) views
    gl.warp_specialize([
        (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, LSE, DELTA, k_smem.index(0), v_smem.index(0), q_smem, do_smem,
                          ds_0, dq_0, kc_0, ds_bar, kv_bar, ready, empty, out_row, stat_row, key0, m_first, n_masked,
                          n_tiles, qk_scale, sm_scale, CAUSAL, BLOCK_M, HEAD_DIM, NUM_STAGES, PREFETCH, FUSED, SPLIT,
                          0, DS_SMEM, K_REGS)),
        (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, LSE, DELTA, k_smem.index(1), v_smem.index(1), q_smem, do_smem,
                          ds_1, dq_1, kc_1, ds_bar, kv_bar, ready, empty, out_row + HALF, stat_row, key0 + HALF,
                          m_first, n_masked, n_tiles, qk_scale, sm_scale, CAUSAL, BLOCK_M, HEAD_DIM, NUM_STAGES,
                          PREFETCH, FUSED, SPLIT, 1, DS_SMEM, K_REGS)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, kc_desc, k_smem, v_smem, q_smem, do_smem, kc_smem, kv_bar,
                          ready, empty, b * K_RB + h * K_RH + key0, b * K_CB + h * K_CH, b * V_RB + h * V_RH + key0,
                          b * V_CB + h * V_CH, b * Q_RB + h * Q_RH + m_first * BLOCK_M, b * Q_CB + h * Q_CH,
                          b * DO_RB + h * DO_RH + m_first * BLOCK_M, b * DO_CB + h * DO_CH, n_tiles, BLOCK_M,
                          NUM_STAGES, SPLIT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------ dQ


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                 v_ready, v_empty, q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col, n_tiles,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    half: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row + w * half, q_col], q_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [do_row + w * half, do_col], q_bar, do_smem.index(w))
    stream_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, k_col, v_row, v_col, n_tiles,
              BLOCK_N, NUM_STAGES)


@gluon.jit
def _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, lo, hi,
             qk_scale, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
             s_layout: gl.constexpr, a_layout: gl.constexpr):
    """Key tiles [lo, hi) into dQ."""
    half: gl.constexpr = q_w.shape[0]
    s_zero = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    for j in range(lo, hi):
        slot = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        k_tile = k_smem.index(slot)
        s_token = warpgroup_mma(q_w, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp_token = warpgroup_mma(do_w, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_token])
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if MASK:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp_token])
        mbarrier.arrive(v_empty.index(slot))
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(k_tile.dtype), a_layout)
        dq_token = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=[dq_token, ds_op])
        mbarrier.arrive(k_empty.index(slot))
    return dq


@gluon.jit
def _dq_consumer(dq_desc, LSE, DELTA, q_w, do_w, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                 out_row, row0, stat_row, n_full, n_tiles, qk_scale, sm_scale,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    half: gl.constexpr = q_w.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    a_layout: gl.constexpr = _a_layout(HEAD_DIM)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = row0 + gl.arange(0, half, layout=row_layout)
    lse2 = gl.load(LSE + stat_row + rows) * LOG2E
    delta = gl.load(DELTA + stat_row + rows)
    dq = gl.zeros([half, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(q_bar, 0)
    if CAUSAL:
        # Key tiles wholly before the program's first row unmasked, then those that overlap its rows masked.
        dq = _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, 0,
                      n_full, qk_scale, BLOCK_N, NUM_STAGES, False, s_layout, a_layout)
        dq = _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, n_full,
                      n_tiles, qk_scale, BLOCK_N, NUM_STAGES, True, s_layout, a_layout)
    else:
        dq = _dq_loop(dq, q_w, do_w, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, lse2, delta, rows, 0,
                      n_tiles, qk_scale, BLOCK_N, NUM_STAGES, False, s_layout, a_layout)
    q_w.store((dq * sm_scale).to(dq_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [out_row, 0], q_w)
    tma.store_wait(0)


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, N_Q, N_K, H, BH, GROUP_HEADS, qk_scale, sm_scale,
               Q_RB, Q_RH, Q_CB, Q_CH, K_RB, K_RH, K_CB, K_CH, V_RB, V_RH, V_CB, V_CH, DO_RB, DO_RH, DO_CB, DO_CH,
               HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, GROUPED: gl.constexpr):
    HALF: gl.constexpr = q_desc.block_type.shape[0]  # query rows per consumer warpgroup
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # The heaviest (causal: the last rows, which see every key) first.
    if GROUPED:
        off_bh, block = launch_order.program_position(N_Q, BH, GROUP_HEADS, 2 * HALF, CAUSAL)
    else:
        block = gl.program_id(0)
        if CAUSAL:
            block = N_Q // (2 * HALF) - 1 - block
        off_bh = gl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    row0 = block * 2 * HALF
    if CAUSAL:
        n_full = row0 // BLOCK_N
        n_tiles = (row0 + 2 * HALF) // BLOCK_N
    else:
        n_full = N_K // BLOCK_N
        n_tiles = N_K // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], do_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, k_ready, k_empty = ring(k_desc, NUM_STAGES, HEAD_DIM, 2)
    v_smem, v_ready, v_empty = ring(v_desc, NUM_STAGES, HEAD_DIM, 2)

    stat_row = off_bh * N_Q
    out_row = off_bh * N_Q + row0  # dQ is contiguous: a (B*H*N_Q, D) view
    gl.warp_specialize([
        (_dq_consumer, (dq_desc, LSE, DELTA, q_smem.index(0), do_smem.index(0), k_smem, v_smem, q_bar, k_ready,
                        k_empty, v_ready, v_empty, out_row, row0, stat_row, n_full, n_tiles, qk_scale, sm_scale,
                        CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES)),
        (_dq_consumer, (dq_desc, LSE, DELTA, q_smem.index(1), do_smem.index(1), k_smem, v_smem, q_bar, k_ready,
                        k_empty, v_ready, v_empty, out_row + HALF, row0 + HALF, stat_row, n_full, n_tiles, qk_scale,
                        sm_scale, CAUSAL, BLOCK_N, HEAD_DIM, NUM_STAGES)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                        v_ready, v_empty, b * Q_RB + h * Q_RH + row0, b * Q_CB + h * Q_CH,
                        b * DO_RB + h * DO_RH + row0, b * DO_CB + h * DO_CH, b * K_RB + h * K_RH,
                        b * K_CB + h * K_CH, b * V_RB + h * V_RH, b * V_CB + h * V_CH, n_tiles, BLOCK_N,
                        NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------ wrapper


def backward(q, k, v, do, lse, delta, dk, dv, dq_acc, is_causal, backward_plan: BackwardPlan) -> torch.Tensor:
    """Writes dK and dV into dk, dv (new, contiguous, of q's dtype) and returns dQ (new, contiguous) for inputs these
    kernels take (`backward_plan`: what `views()` returned for inputs of this signature, under the same capture
    state), given the forward's natural-log log-sum-exp and delta = rowsum(dO * O), both fp32 and contiguous, one row
    per head, and with `fused_dq` the fp32 buffer in which the dK/dV kernel accumulates dQ, (rows of q, d), zeroed
    (else None). dQ is allocated after the dK/dV kernel's launch: the device may be waiting for it, and an allocation
    costs the CPU tens of microseconds on the lent H100.
    The first call for a plan works out its launches' arguments that are not tensors and launches through triton;
    later ones pass the tensors to the kept launches (`launcher.Launch`: in the descriptors' places, the first launch's
    descriptors over them)."""
    check_causal(is_causal, impl="hopper")
    p = backward_plan
    first = p.is_causal != is_causal
    if first:
        dkdv, dq_launch = _launches(q, k, v, do, dk, dv, dq_acc, is_causal, p)
    if p.concurrent:
        current, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(current)  # the inputs, delta included, are ready on it
    if first:
        p.dkdv = dkdv(lse, delta)
    else:  # with FUSED_SPLIT, K's halves are the eighth descriptor, over k
        p.dkdv((q, k, v, do, dk, dv, dq_acc, k if p.split else None, lse, delta, *p.dkdv_scalars))
    if p.fused_dq:
        dq = dq_acc.to(q.dtype).view(q.shape)
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        with torch.cuda.stream(side) if p.concurrent else contextlib.nullcontext():
            if first:
                p.dq = dq_launch(dq, lse, delta)
            else:
                p.dq((q, k, v, do, dq, lse, delta, *p.dq_scalars))
        if p.concurrent:
            # dq, allocated on the current stream, is written on the side one: the current stream waits for it
            # before anything there (a free by the caching allocator included) can touch it.
            current.wait_stream(side)
    if first:  # later calls take the kept launches (none without the launcher's DIRECT: then every call is a first)
        kept = p.dkdv is not None and (p.fused_dq or p.dq is not None)
        p.is_causal = is_causal if kept else None
    return dq


def _launches(q, k, v, do, dk, dv, dq_acc, is_causal, p: BackwardPlan):
    """Works out the launches of plan `p` for these inputs, storing their arguments that are not tensors in `p`;
    returns functions that make them through `launcher.launch`, with descriptors: dkdv(lse, delta) and
    dq(dq, lse, delta), each returning the `launcher.Launch` for later calls (None when there is none)."""
    d, n_q, n_k = q.shape[-1], q.shape[-2], k.shape[-2]
    bh = q.numel() // (n_q * d)
    heads = q.shape[1] if q.dim() == 4 else 1
    qv, kv, vv, dov, fused_dq = p.qv, p.kv, p.vv, p.dov, p.fused_dq
    strides = (*qv[2:], *kv[2:], *vv[2:], *dov[2:])
    sm_scale = 1.0 / math.sqrt(d)
    qk_scale = sm_scale * LOG2E.value
    desc = flash_hopper._descriptor
    half = BLOCK_KEYS // 2
    block_m, block_n = TILES[d]
    common = dict(HEAD_DIM=d, CAUSAL=is_causal, NUM_STAGES=NUM_STAGES, CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS, GROUPED=GROUPED_ORDER, num_warps=4)
    # With GROUPED_ORDER, heads per group: the dK/dV kernel streams q and dO, the dQ kernel k and v.
    groups = (launch_order.group_heads(q, bh), launch_order.group_heads(k, bh)) if GROUPED_ORDER else (1, 1)
    # dq, dk, dv are new; lse and delta contiguous. The tiles are the descriptors' block shapes, not constexprs; the
    # views fix the descriptors' shapes and strides.
    key = (q.device, q.dtype, q.shape, k.shape, block_m, block_n, qv, kv, vv, dov)
    split = fused_dq and FUSED_SPLIT
    if fused_dq and GROUPED_ORDER and FUSED_GROUP_HEADS is not None:  # in the launch's key: not set by the shapes
        groups = (max(1, min(bh, FUSED_GROUP_HEADS)), groups[1])
        key += (groups,)
    dq_desc = kc_desc = None
    if fused_dq:
        dq_desc = flash_hopper.tma_descriptor(dq_acc, [bh * n_q, d], [d, 1], [block_m, d // 2 if split else d],
                                              DQ_ACC_LAYOUT)
    if split:  # K's tiles of the program's keys and half of d, in the layout their MMA reads
        (n_rows, n_cols), stride = kv[:2]
        layout = flash_hopper._smem_layout(BLOCK_KEYS, d // 2, flash_hopper._gl_dtype(k.dtype))
        kc_desc = flash_hopper.tma_descriptor(k, [n_rows, n_cols], [stride, 1], [BLOCK_KEYS, d // 2], layout)
    p.split = split
    p.dkdv_scalars = (n_q, n_k, heads, bh, groups[0], qk_scale, sm_scale, *strides)
    p.dq_scalars = (n_q, n_k, heads, bh, groups[1], qk_scale, sm_scale, *strides)

    def dkdv(lse, delta):
        return launcher.launch(
            _dkdv_kernel, (n_k // BLOCK_KEYS * bh,) if GROUPED_ORDER else (n_k // BLOCK_KEYS, bh),
            (desc(q, qv, block_m), desc(k, kv, half), desc(v, vv, half), desc(do, dov, block_m),
             desc(dk, flash_hopper._view(dk), half), desc(dv, flash_hopper._view(dv), half), dq_desc, kc_desc, lse,
             delta, *p.dkdv_scalars),
            ("dkdv", *key), PREFETCH=(is_causal, d) in PREFETCH_STATS, FUSED=fused_dq, SPLIT=split,
            DS_SMEM=p.ds_smem, K_REGS=fused_dq and K_IN_REGISTERS and d == 64, **common,
        )

    def dq_launch(dq, lse, delta):
        rows = BLOCK_ROWS // 2
        return launcher.launch(
            _dq_kernel, (n_q // BLOCK_ROWS * bh,) if GROUPED_ORDER else (n_q // BLOCK_ROWS, bh),
            (desc(q, qv, rows), desc(k, kv, block_n), desc(v, vv, block_n), desc(do, dov, rows),
             desc(dq, flash_hopper._view(dq), rows), lse, delta, *p.dq_scalars),
            ("dq", *key), **common,
        )

    return dkdv, dq_launch


@functools.cache
def _side_stream(device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


plans.watch(__name__)
