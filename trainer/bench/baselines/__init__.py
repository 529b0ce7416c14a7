"""The trainer's peers, each run by the benchmark in processes of its own:

single: the trainer's model, batches, loss, update rule and in-graph step
  loop in one process, no cluster (single.py): the ceiling.
mwms: TensorFlow's MultiWorkerMirroredStrategy, ring all-reduce (mwms.py).
sro: the classic recipe, SyncReplicasOptimizer with replica_device_setter
  and MonitoredTrainingSession (sro.py).
async, async_split: TF2's ParameterServerStrategy with a
  ClusterCoordinator, asynchronous updates (async_ps.py, async_split.py).

Every peer trains the trainer's model (trainer/learning) from the same
initial parameters on the same global batches, so accuracies compare.
Each peer is one module that declares what its runs need (peer.py says
how); `python -m trainer.bench.baselines.<module> ...` runs one process.
Adding a peer means adding its module here and its row to docs/peers.md.
"""

import os

# Before any peer module imports TensorFlow: its C++ logging is noise in
# the benchmark's logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
