"""Benchmark suites for kvstore, run as `kvstore-bench SUITE` or `python -m bench SUITE`."""
