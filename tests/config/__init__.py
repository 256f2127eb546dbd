"""Tests of transformer_mt.config."""
