"""What the timing itself costs: the per-round time of a function that does nothing.

On a GPU this is the span between two CUDA events recorded back to back (plus the Python call between them);
on the CPU it is two reads of the clock. Every other benchmark's samples include it once per round.
A sub-microsecond number moves a lot between processes (docs/profiling.md, "The perf suite's smallest
benchmarks"), so its comparison only catches a change past four times.
"""

import pytest


@pytest.mark.perf_tolerance(time=3.0)
def test_empty_function(gpu_benchmark):
    assert gpu_benchmark(lambda: None) is None
