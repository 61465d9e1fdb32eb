"""Benchmarks and probes kept beside the product but not installed with it (pyproject.toml
packages only tandem.*). Run them from the repository root, e.g.
`python -m benchmarks.probes.tune_kernels`."""
