"""Parallel corpora to batches: sources (local files, the Hugging Face Hub), filtering and splits, BPE tokenizers, token caches and batching."""
