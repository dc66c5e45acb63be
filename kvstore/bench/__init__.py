"""Benchmark suites for kvstore, run as `kvstore-bench SUITE` or `python -m kvstore.bench SUITE`."""
