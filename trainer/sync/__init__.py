"""The synchronous protocol on the ps tasks, knowing no roles: averaging
(one gradient per replica per step), the run's coordination (handshake,
stop, end reports, shutdown), ordered pull turns, the queues and the wire
format. Imports trainer.common and trainer.learning."""
