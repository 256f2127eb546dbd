"""Translation with a trained model: the search, its driver and CUDA-graph replay, the engines that run them,
and what cross-attention shows (pictures, word alignments)."""
