"""Training a model: the loss, schedules, one update (eager or captured), validation, and the loop that ties a run together."""
