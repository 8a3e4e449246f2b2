"""Tiny tokenizers and randomly initialised pairs for tests, demos and benchmarks."""
