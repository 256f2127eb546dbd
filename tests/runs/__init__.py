"""Tests of transformer_mt.runs."""
