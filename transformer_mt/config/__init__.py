"""The YAML configuration: one typed section per concern, its checks, loading and `--set` overrides."""
