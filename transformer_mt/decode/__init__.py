"""Translation with a trained model: the search algorithms, their driver and CUDA-graph replay, inference engines, scoring and export."""
