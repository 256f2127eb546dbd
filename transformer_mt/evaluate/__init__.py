"""Scoring translations against references: sacreBLEU metrics, significance, diagnostics, COMET and a test-set evaluation."""
