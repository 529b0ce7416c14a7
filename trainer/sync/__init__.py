"""The synchronous protocol on the ps tasks, knowing no roles: averaging,
the run's coordination, pull turns, queues and the wire format. Imports
trainer.common and trainer.learning."""
