"""Tests of transformer_mt.cli."""
