"""Benchmarks, baselines and the soak: tools around the trainer."""
