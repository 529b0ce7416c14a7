"""Watching a run: the step-loop driver with its logs, summaries and
evaluations (progress), --trace_steps (tracing) and the step timeline
(timeline). Imports trainer.common, trainer.cluster and trainer.learning."""
