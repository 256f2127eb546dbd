"""Tests of the scripts in scripts/ (users run them on their data), benchmarks/ and tools/."""
