"""The synchronous protocol on the ps tasks, knowing no roles: it imports
only trainer.common and trainer.learning."""
