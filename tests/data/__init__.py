"""Tests of transformer_mt.data."""
