"""Tests of transformer_mt.train."""
