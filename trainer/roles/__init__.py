"""The roles a process plays (ps, chief, worker); entry point: run.run."""
