"""Benchmarks: decode throughput and memory (``generate``), kernels (``kernels``)."""
