"""rlblocks.losses (being written)."""
