"""Kernels. ``tree_attention/``: attention over a token tree (Pallas / jax-triton); ``cpu_matmul/``: the
float32 matmul of the CPU step programs over weights packed once (C++ through the XLA FFI)."""
