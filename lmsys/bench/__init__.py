"""`lmsys-bench` (python -m lmsys.bench): the profiling workflow as one command-line tool.

    lmsys-bench model       LM forward / forward+backward / training-step times over sizes, context lengths,
                            fp32/bf16 and eager/compiled; --profile, --nvtx and --memory-snapshot per case
    lmsys-bench attention   attention providers over sequence length x head dim: table, time and memory plots
    lmsys-bench ncu         Nsight Compute on one training step: per kernel, per kernel family and per phase
    lmsys-bench allreduce   all-reduce time, algorithm and bus bandwidth over the ranks, per tensor size
    lmsys-bench ddp         one training step under each data-parallel wrapper: step time, communication wait,
                            memory per rank, weak-scaling efficiency, MFU

Every command prints its tables and writes them as files (--output FILE.csv or .json; ncu: --out DIR); each runs on
the CPU too, with small defaults there. allreduce and ddp run under torchrun or spawn their ranks themselves. The
modules: sweep.py (what the commands share: the clock, progress, out-of-memory rows, output files), ranks.py (what
the distributed commands share), model.py, attention.py, ncu.py, allreduce.py, ddp.py, memory.py (memory snapshots).
"""
