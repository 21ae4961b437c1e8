"""rlcollect's benchmarks: standalone scripts, and the suite behind ``python -m benchmarks``."""
