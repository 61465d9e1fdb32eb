"""Our Triton kernels for the aiter-triton backend (imported only where triton is installed).

Each is checked against the torch reference op in tests/gpu/ and timed against the torch and
AITER alternatives by bench/engine.py, which prints the per-op choice.
"""
