"""Shared by tests, the demo and launch scripts: fp64 reference, workloads, a gloo rank pool."""
