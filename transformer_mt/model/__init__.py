"""The encoder-decoder Transformer, its static key/value cache, and the one place a model is built from a config."""
