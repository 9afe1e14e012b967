"""rlblocks.kernels (being written)."""
