"""Kernels. ``tree_attention/``: attention over a token tree (Pallas / jax-triton); ``cpu/``: the float32
matmul and attention of the CPU step programs (C++ through the XLA FFI)."""
