"""Training a model: one update (eager or captured), its batches, validation, and the loop of a run."""
