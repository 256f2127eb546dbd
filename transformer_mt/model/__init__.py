"""The encoder-decoder Transformer with its static key/value cache, and the one place a model is built."""
