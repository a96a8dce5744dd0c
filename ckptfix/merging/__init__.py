"""``merge``: per-rank checkpoints merged into one, by a policy, rank files told apart."""
