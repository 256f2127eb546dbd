"""A run directory: its lock, checkpoints, summary, and the files a run is started or continued from."""
