"""What every other package builds on: errors, files written safely, signals, devices and precision, distributed ranks, the run directory's paths."""
