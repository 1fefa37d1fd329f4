"""The peers of experiments/fixed_bench.py: servers of the fixed-batch reference worker (200 ms a call
at any size, each input answered reversed), each run by its own virtualenv's Python (never imported by
ferry)."""
