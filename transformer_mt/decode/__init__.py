"""Translation with a trained model: search, its driver and CUDA-graph replay, engines, scoring, export."""
