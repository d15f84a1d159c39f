"""Benchmarks (not tests): ``python -m dsv4_cupy bench``."""
