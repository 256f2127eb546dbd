"""Tests of transformer_mt.decode."""
