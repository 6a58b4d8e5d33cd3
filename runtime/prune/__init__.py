"""A3B gated-FFN pruning (needs the `prune` extra: torch)."""
