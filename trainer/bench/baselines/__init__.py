"""The trainer's peers, each run by the benchmark in processes of its own:

single: the trainer's model, batches, loss, update rule and in-graph step
  loop in one process, no cluster (single.py): the ceiling.
mwms: TensorFlow's MultiWorkerMirroredStrategy, ring all-reduce (mwms.py).
sro: the classic recipe, SyncReplicasOptimizer with replica_device_setter
  and MonitoredTrainingSession (sro.py).
async: TF2's ParameterServerStrategy with a ClusterCoordinator,
  asynchronous updates (async_ps.py).

Every peer trains the trainer's model (trainer/learning) from the same
initial parameters on the same global batches, so accuracies compare.
`python -m trainer.bench.baselines KIND CONFIG.json OUT.json ...` runs one
process of one kind (__main__.py says the arguments).
"""
