"""Parallel corpora to batches: sources, filters and splits, BPE tokenizers, token caches, batching."""
