"""rlblocks.sched (being written)."""
