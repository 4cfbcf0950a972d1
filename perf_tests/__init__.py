"""Performance tests (run with `pytest perf_tests`); a package so their module names do not clash with tests/."""
