"""Runs started from others' pretrained models: OPUS-MT (Marian) folders read into tmt's format."""
