"""Kernels (Pallas / jax-triton). ``tree_attention/``: attention over a token tree."""
