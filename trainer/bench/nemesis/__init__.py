"""The nemesis: training under a random fault schedule, judged against
the 1-worker run (python -m trainer.nemesis; docs/nemesis.md)."""
