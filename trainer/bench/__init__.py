"""The benchmark's machinery: its runs (runs), the baselines, the report
and the HParams dashboard, and simulated hosts (simhosts). The commands are
trainer/benchmark.py and trainer/soak.py. Nothing in training imports it."""
