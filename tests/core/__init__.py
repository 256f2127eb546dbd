"""Tests of transformer_mt.core."""
