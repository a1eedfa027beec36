"""Benchmarks (run as root; everything happens in network namespaces the benchmark creates and deletes)."""
