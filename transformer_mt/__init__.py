"""tmt: a command-line trainer for Transformer translation models."""

__version__ = "0.1.0"
