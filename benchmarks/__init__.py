"""Benchmarks of cp_attention: each module writes results/<name>.json and results/<name>.png."""
