"""Benchmarks of ktae_kernels against the scipy reference and an upstream-style loop."""
