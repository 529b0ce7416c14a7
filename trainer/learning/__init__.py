"""Learning, with no knowledge of roles, devices or the cluster: the data,
the models, the optimizer and schedule, the flat parameters, which examples
each replica computes, and one replica's computation. Imports only
trainer.common."""
