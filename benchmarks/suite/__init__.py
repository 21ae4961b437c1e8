"""The benchmark suite: series run in fresh processes, aggregated to JSON, rendered to docs."""
