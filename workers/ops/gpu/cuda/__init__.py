"""CUDA sources (.cu, .cuh) that cuda_build.py compiles with nvcc on first use; no Python."""
