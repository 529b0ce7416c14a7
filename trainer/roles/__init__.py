"""The roles a process plays (ps, chief, worker) and what they share;
`run.run(config, task)` is the library entry point. Imports every layer
but the benchmark."""
