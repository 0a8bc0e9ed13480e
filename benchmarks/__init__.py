"""Benchmarks: `make bench` / `tessera bench`."""
