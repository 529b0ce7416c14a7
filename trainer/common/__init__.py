"""What every layer shares: the run's settings (config), the errors that
reach the user as one line, TensorFlow session helpers and the supervisor
of child processes. Imports nothing else of the trainer."""
