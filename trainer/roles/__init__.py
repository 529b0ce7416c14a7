"""The roles a process plays: ps, chief and worker, the session life cycle
they share (connect, reconnect after a lost ps), the watchdog, the graph a
worker builds and the step it runs (step.py). `run.run(config, task)` is the
library entry point. Imports every layer but the benchmark."""
