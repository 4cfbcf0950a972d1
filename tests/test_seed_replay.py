"""The root conftest's `seed` fixture: a failing test prints the seed it drew, and --seed replays it."""

import re
from pathlib import Path

pytest_plugins = ["pytester"]

SUITE = """
import torch

def test_draws(seed):
    print("drawn", torch.rand(1).item())
    assert False
"""


def test_a_failing_test_prints_its_seed_and_seed_replays_it(pytester):
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_draws=SUITE)
    first = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")
    first.assert_outcomes(failed=1)
    value = int(re.search(r"seed (\d+); replay: pytest 'test_draws.py::test_draws' --seed=\1", first.stdout.str())[1])
    drawn = re.search(r"drawn (\S+)", first.stdout.str())[1]
    again = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark",
                                         f"--seed={value}")
    again.stdout.fnmatch_lines([f"drawn {drawn}", f"seed {value}; replay:*"])
