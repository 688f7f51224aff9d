"""Utilities to run and fault-inject real torchrun jobs (used by the tests, the benchmarks and the chaos suite)."""
